//! `Server-Timing`: the gateway's own time and the hop cost it recorded, formatted into a stack
//! buffer (this runs on every request): on the response head of a whole answer, as a trailer
//! at the end of a stream.

use std::time::{Duration, Instant};

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::telemetry::RequestRecord;

pub(super) static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");
/// `Trailer: server-timing`.
pub(super) static SERVER_TIMING_VALUE: HeaderValue = HeaderValue::from_static("server-timing");

/// `Server-Timing: gw;dur=<pre-overhead ms>, upstream;dur=<head wait ms>, hop;dur=<ms>`;
/// streaming responses carry only `gw` (their upstream time is still running; the whole
/// figure comes as a trailer, `stream_timing`). Formatted into a stack buffer: this runs on
/// every request.
pub(super) fn server_timing(
    record: &RequestRecord,
    head_at: Instant,
    sse: bool,
) -> Option<HeaderValue> {
    let t = &record.timeline;
    let gw = t.overhead_pre()? + Instant::now().saturating_duration_since(head_at);
    let mut buf = [0u8; 96];
    let mut n = put(&mut buf, 0, b"gw;dur=");
    n = put_ms(&mut buf, n, gw);
    if !sse {
        n = put(&mut buf, n, b", upstream;dur=");
        n = put_ms(
            &mut buf,
            n,
            head_at.saturating_duration_since(t.upstream_sent()?),
        );
        n = put_hop(&mut buf, n, t);
    }
    HeaderValue::from_bytes(&buf[..n]).ok()
}

/// A stream's `Server-Timing` trailer: `gw;dur=<pre + relay ms>, upstream;dur=<backend's
/// TTFT ms>, hop;dur=<ms>` — `upstream` being what a direct call would have seen (request
/// written → first token), which `fleetgate bench --compare` sets beside its direct TTFTs to
/// tell whether the two sides reached comparable backends.
pub(super) fn stream_timing(record: &RequestRecord) -> Option<HeaderMap> {
    let t = &record.timeline;
    let mut buf = [0u8; 96];
    let mut n = put(&mut buf, 0, b"gw;dur=");
    n = put_ms(&mut buf, n, t.overhead_total()?);
    if let Some(up) = t.upstream_ttft() {
        n = put(&mut buf, n, b", upstream;dur=");
        n = put_ms(&mut buf, n, up);
    }
    n = put_hop(&mut buf, n, t);
    let mut h = HeaderMap::with_capacity(1);
    h.insert(
        SERVER_TIMING.clone(),
        HeaderValue::from_bytes(&buf[..n]).ok()?,
    );
    Some(h)
}

/// `, hop;dur=<ms>` when the Timeline has the hop cost.
fn put_hop(buf: &mut [u8], at: usize, t: &crate::telemetry::Timeline) -> usize {
    match t.hop() {
        Some(hop) => {
            let n = put(buf, at, b", hop;dur=");
            put_ms(buf, n, hop)
        }
        None => at,
    }
}

fn put(buf: &mut [u8], at: usize, s: &[u8]) -> usize {
    buf[at..at + s.len()].copy_from_slice(s);
    at + s.len()
}

/// Milliseconds with three decimals (microsecond resolution), e.g. `0.041`.
fn put_ms(buf: &mut [u8], at: usize, d: Duration) -> usize {
    let us = d.as_micros().min(u128::from(u64::MAX / 2)) as u64;
    let mut ib = itoa::Buffer::new();
    let mut n = put(buf, at, ib.format(us / 1000).as_bytes());
    let frac = us % 1000;
    buf[n] = b'.';
    buf[n + 1] = b'0' + (frac / 100) as u8;
    buf[n + 2] = b'0' + (frac / 10 % 10) as u8;
    buf[n + 3] = b'0' + (frac % 10) as u8;
    n += 4;
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_millis() {
        let mut buf = [0u8; 40];
        let n = put_ms(&mut buf, 0, Duration::from_micros(41));
        assert_eq!(&buf[..n], b"0.041");
        let n = put_ms(&mut buf, 0, Duration::from_micros(812_305));
        assert_eq!(&buf[..n], b"812.305");
    }
}
