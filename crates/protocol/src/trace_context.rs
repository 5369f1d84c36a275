//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` and
//! `tracestate` headers a client sends to join its trace.
//!
//! Parsed strictly, as the recommendation says a receiver must: a `traceparent` that is not
//! exactly right is ignored (the request starts a new trace), never refused; a `tracestate`
//! that is not well formed is dropped, and so is any `tracestate` without a valid
//! `traceparent`. A version above `00` is read by its first four fields (a later version may
//! append fields after a `-`).

use std::fmt;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// A trace's id: 16 bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// A span's id: 8 bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

/// A valid `traceparent`: the trace, the caller's span, and its flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    /// The caller's span: the parent of the receiver's.
    pub parent_id: SpanId,
    /// Only the `sampled` bit (bit 0) is defined; the others are kept as they came only for
    /// version 00 and cleared otherwise, as the recommendation says.
    pub flags: u8,
}

/// What a request brings: its `traceparent`, and its `tracestate` when that is well formed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    pub parent: TraceParent,
    pub state: Option<HeaderValue>,
}

/// Most list members a `tracestate` may carry.
const MAX_STATE_MEMBERS: usize = 32;

impl TraceParent {
    /// The header's value, or `None` when it is not a valid `traceparent`.
    pub fn parse(value: &[u8]) -> Option<TraceParent> {
        // version "-" trace-id "-" parent-id "-" trace-flags: 2 + 1 + 32 + 1 + 16 + 1 + 2.
        if value.len() < 55 {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        if version == 0xff {
            return None;
        }
        // Version 00 is exactly 55 bytes; a later one may go on, after a `-`.
        match (version, value.get(55)) {
            (0, None) => {}
            (0, Some(_)) => return None,
            (_, None | Some(b'-')) => {}
            (_, Some(_)) => return None,
        }
        if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, b) in trace_id.iter_mut().enumerate() {
            *b = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
        }
        let mut parent_id = [0u8; 8];
        for (i, b) in parent_id.iter_mut().enumerate() {
            *b = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
        }
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        let flags = hex_byte(&value[53..55])?;
        Some(TraceParent {
            trace_id: TraceId(trace_id),
            parent_id: SpanId(parent_id),
            flags: if version == 0 { flags } else { flags & 1 },
        })
    }

    /// The caller decided to record the trace.
    #[cfg(test)]
    pub(crate) fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The `traceparent` (version 00) of a child of this trace whose span is `span`.
    pub fn child_header(&self, span: SpanId) -> HeaderValue {
        let mut out = [0u8; 55];
        out[0..3].copy_from_slice(b"00-");
        hex_into(&mut out[3..35], &self.trace_id.0);
        out[35] = b'-';
        hex_into(&mut out[36..52], &span.0);
        out[52] = b'-';
        hex_into(&mut out[53..55], &[self.flags]);
        // Lowercase hex and dashes only: always a valid header value.
        HeaderValue::from_bytes(&out).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

/// The trace a request joins: its one valid `traceparent` (two of them are ambiguous, so
/// neither is taken), and its `tracestate` (every `tracestate` header, joined) when that is
/// well formed.
pub fn extract(headers: &HeaderMap) -> Option<Incoming> {
    Some(Incoming {
        parent: parent_of(headers)?,
        state: state_of(headers),
    })
}

/// The request's one valid `traceparent` (the `tracestate` left unread).
pub fn parent_of(headers: &HeaderMap) -> Option<TraceParent> {
    let mut parents = headers.get_all(&TRACEPARENT).iter();
    let parent = TraceParent::parse(parents.next()?.as_bytes())?;
    if parents.next().is_some() {
        return None;
    }
    Some(parent)
}

/// The `tracestate` headers as one value, when every list member is `key=value` with a key
/// and a value of the allowed characters and there are at most 32 of them; `None` otherwise
/// (and when there is none).
fn state_of(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut values = headers.get_all(&TRACESTATE).iter().peekable();
    values.peek()?;
    let mut members = 0usize;
    let mut joined: Vec<u8> = Vec::new();
    for v in values {
        for member in v.as_bytes().split(|b| *b == b',') {
            let member = member.trim_ascii();
            // Empty members (`a=1,,b=2`) are allowed and skipped.
            if member.is_empty() {
                continue;
            }
            let (key, value) = member.split_at(member.iter().position(|b| *b == b'=')?);
            let value = &value[1..];
            if !valid_key(key) || !valid_value(value) {
                return None;
            }
            members += 1;
            if members > MAX_STATE_MEMBERS {
                return None;
            }
            if !joined.is_empty() {
                joined.push(b',');
            }
            joined.extend_from_slice(member);
        }
    }
    if joined.is_empty() {
        return None;
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// `simple-key` (`lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")`) or
/// `tenant-id "@" system-id`.
fn valid_key(key: &[u8]) -> bool {
    let part = |p: &[u8], max: usize, first_digit: bool| {
        !p.is_empty()
            && p.len() <= max
            && (p[0].is_ascii_lowercase() || (first_digit && p[0].is_ascii_digit()))
            && p.iter().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'*' | b'/')
            })
    };
    match key.iter().position(|b| *b == b'@') {
        None => part(key, 256, false),
        Some(at) => part(&key[..at], 241, true) && part(&key[at + 1..], 14, false),
    }
}

/// 1 to 256 printable ASCII characters but `,` and `=`, not ending in a space.
fn valid_value(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && value.last() != Some(&b' ')
        && value
            .iter()
            .all(|b| (0x20..=0x7e).contains(b) && *b != b',' && *b != b'=')
}

/// Two lowercase hex digits.
fn hex_byte(two: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(two[0])? << 4 | digit(two[1])?)
}

fn hex_into(out: &mut [u8], bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
}

impl TraceId {
    /// 32 lowercase hex digits, as in `traceparent` (and the request log).
    pub fn hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        hex_into(&mut out, &self.0);
        out
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(std::str::from_utf8(&self.hex()).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for SpanId {
    /// 16 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; 16];
        hex_into(&mut out, &self.0);
        f.write_str(std::str::from_utf8(&out).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_recommendations_example_is_read_and_written_back() {
        let p = TraceParent::parse(VALID.as_bytes()).unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.parent_id.to_string(), "00f067aa0ba902b7");
        assert!(p.sampled());
        let child = p.child_header(SpanId([0xab; 8]));
        assert_eq!(
            child,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-abababababababab-01"
        );
        assert_eq!(
            TraceParent::parse(child.as_bytes()).unwrap().trace_id,
            p.trace_id
        );
    }

    #[test]
    fn anything_not_exactly_right_is_ignored() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // Uppercase, short ids, all-zero ids, version ff, a v00 with more after it.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-abc-def-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "+0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert_eq!(TraceParent::parse(bad.as_bytes()), None, "{bad}");
        }
        // A later version: its first four fields, its unknown flags cleared.
        let later = TraceParent::parse(
            b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-what-comes-next",
        )
        .unwrap();
        assert_eq!(later.flags, 1);
        assert!(
            TraceParent::parse(b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x")
                .is_none()
        );
    }

    #[test]
    fn two_traceparents_or_a_bad_one_take_the_tracestate_with_them() {
        let one = extract(&headers(&[
            ("traceparent", VALID),
            ("tracestate", "rojo=00f067aa0ba902b7"),
            ("tracestate", "congo=t61rcWkgMzE,,"),
        ]))
        .unwrap();
        assert_eq!(
            one.state.unwrap(),
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
        );
        assert!(extract(&headers(&[("traceparent", VALID), ("traceparent", VALID)])).is_none());
        assert!(extract(&headers(&[("traceparent", "00-x"), ("tracestate", "a=1")])).is_none());
        assert!(extract(&headers(&[("tracestate", "a=1")])).is_none());
        // A malformed tracestate is dropped; the traceparent stays.
        for bad in ["novalue", "UPPER=1", "a=b=c", "a=x\ty", "@x=1"] {
            let got = extract(&headers(&[("traceparent", VALID), ("tracestate", bad)])).unwrap();
            assert_eq!(got.state, None, "{bad}");
        }
        let many = (0..33)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join(",");
        let got = extract(&headers(&[("traceparent", VALID), ("tracestate", &many)])).unwrap();
        assert_eq!(got.state, None);
        let tenant = extract(&headers(&[
            ("traceparent", VALID),
            ("tracestate", "1tenant@sys=v"),
        ]))
        .unwrap();
        assert_eq!(tenant.state.unwrap(), "1tenant@sys=v");
    }
}
