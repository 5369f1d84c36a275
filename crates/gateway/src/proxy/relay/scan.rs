//! What one upstream frame tells the relay: its SSE events fed to the Timeline and the ITL
//! histogram, the first token stamped, an in-stream error flagged, a stored response's id
//! learned, and the usage chunk the gateway asked for cut out.

use std::time::Instant;

use bytes::Bytes;

use crate::pool::connector::UpstreamRx;
use crate::pool::{Backend, InFlight};
use crate::proxy::pins;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Dialect;
use fleetgate_protocol::error::ErrorKind;
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::fingerprint;
use fleetgate_protocol::sse::SseScanner;

/// Account for one upstream frame of an SSE stream: feed the Timeline's stream figures and the
/// ITL histogram, stamp the upstream first token, flag an in-stream error, and cut out the
/// usage event the gateway asked for (`strip_usage`), keeping its `system_fingerprint` on the
/// finish chunks (see `fingerprint`). Returns what to hand on (`None`: nothing).
pub(super) fn scan_frame(
    scanner: &mut SseScanner,
    record: &mut RequestRecord,
    data: Bytes,
    now: Instant,
    scan: Scan<'_>,
) -> Option<Bytes> {
    let Scan {
        strip_usage,
        itl,
        backend,
        pin,
        mut learned,
        mut capture,
    } = scan;
    let tl = &mut record.timeline;
    // The stream already ended at its terminal event: a backend's bytes after it are not part
    // of the answer, and are neither relayed nor counted.
    if tl.stream().done {
        return None;
    }
    let at = tl.offset(now);
    let mut cut = None;
    // Where the terminal event ends in this frame: the frame is cut there.
    let mut end = None;
    // Finish chunks in this frame that want the fingerprint.
    let mut finish_at = Vec::new();
    // (Only chat chunks have a usage chunk to cut or a fingerprint to learn.)
    let dialect = scanner.dialect();
    let chat = dialect == Dialect::Chat;
    // A traced request's finish reasons, for its span.
    let mut traced = record.otel.as_deref_mut().filter(|s| s.sampled());
    // Where a failure event (an engine that died) begins in this frame: cut there.
    let mut failed_at = None;
    scanner.feed(&data, |line| {
        if tl.stream().done {
            return;
        }
        // A resumable stream keeps its text; an event saying the engine died ends the part
        // (neither it nor what follows is relayed or counted).
        if let Some(c) = capture.as_deref_mut()
            && !c.see(&line)
        {
            if failed_at.is_none() {
                failed_at = Some(line.event_span.as_ref().map_or(0, |span| span.start));
            }
            return;
        }
        if line.kind == DataKind::Done {
            end = line.event_span.as_ref().map(|span| span.end);
        }
        if pin.is_some()
            && line.kind == DataKind::NoOutput
            && let Some(id) = fleetgate_protocol::dialect::response_id(line.payload)
            && let Some(learn) = pin.take()
        {
            if let Some(keep) = learned.as_deref_mut() {
                *keep = Some(id.clone());
            }
            learn.learned(id);
        }
        if chat && is_usage(&line) {
            // Every usage chunk says what the backend's fingerprint is now.
            backend.learn_fingerprint(fingerprint::value_of(line.payload));
            if strip_usage {
                cut = line.event_span.clone();
            }
        } else if strip_usage
            && line.event_span.is_some()
            && matches!(line.kind, DataKind::Content | DataKind::NoOutput)
            && let Some(at) = fingerprint::wanted_at(&data, line.payload)
        {
            finish_at.push(at);
        }
        if let Some(scope) = traced.as_deref_mut() {
            fleetgate_protocol::finish::reasons_in(dialect, line.payload, |r| {
                scope.finish_reason(r);
            });
        }
        if let Some(gap) = tl.on_upstream_event(line.kind, line.usage, now, at)
            && let Some(h) = itl
        {
            h.observe(gap.as_secs_f64());
        }
    });
    if tl.stream().error && record.error.is_none() {
        record.error = Some(ErrorKind::UpstreamStreamError);
    }
    let mut data = data;
    if let Some(end) = end.into_iter().chain(failed_at).min()
        && end < data.len()
    {
        data.truncate(end);
    }
    if cut.is_none() && finish_at.is_empty() {
        return Some(data);
    }
    // The usage chunk of this very frame, if it came with the finish chunk, was learned above.
    let value = if finish_at.is_empty() {
        None
    } else {
        backend.fingerprint()
    };
    fingerprint::edit(data, &finish_at, value.as_deref(), cut)
}

/// What scanning a frame uses besides the scanner and the record.
pub(super) struct Scan<'a> {
    pub(super) strip_usage: bool,
    pub(super) itl: Option<&'a prometheus::Histogram>,
    pub(super) backend: &'a Backend,
    pub(super) pin: &'a mut Option<pins::Learn>,
    /// Where the learned id is kept too (a streamed background response).
    pub(super) learned: Option<&'a mut Option<String>>,
    /// A resumable stream's answer so far (`resume`).
    pub(super) capture: Option<&'a mut super::resume::Capture>,
}

/// The usage chunk of a chat stream: `choices: []` with a `usage` object.
fn is_usage(line: &fleetgate_protocol::sse::DataLine<'_>) -> bool {
    line.kind == DataKind::NoChoices && line.usage.is_some()
}

/// A whole answer that creates a stored response names it first (`{"id":"resp_...",...`):
/// learned from the frame that holds the id.
pub(super) fn learn_whole(pin: &mut Option<pins::Learn>, data: &[u8]) {
    if pin.is_some()
        && let Some(id) = pins::leading_id(data)
        && let Some(learn) = pin.take()
    {
        learn.learned(id);
    }
}

/// The `Server-Timing` trailer of a finished stream, when the client accepts one.
pub(super) fn timing_trailer(wanted: bool, record: &RequestRecord) -> Option<http::HeaderMap> {
    if wanted {
        crate::proxy::timing::stream_timing(record)
    } else {
        None
    }
}

/// Once the first token has been seen: take the upstream socket's stamps (the kernel's arrival
/// of the bytes that carried it) and feed the backend's mean TTFT.
pub(super) fn observe_first_token(
    slot: &mut InFlight,
    record: &mut RequestRecord,
    rx: Option<&UpstreamRx>,
) {
    let t = &mut record.timeline;
    if t.upstream_first_token().is_none() {
        return;
    }
    slot.prefilled();
    if let Some(rx) = rx {
        let (written, arrived) = rx.0.first_token_arrival();
        t.stamp_upstream_wire(written, arrived);
    }
    if let (Some(first), Some(sent)) = (t.upstream_first_token(), t.upstream_sent()) {
        slot.backend()
            .observe_ttft(first.saturating_duration_since(sent));
    }
}
