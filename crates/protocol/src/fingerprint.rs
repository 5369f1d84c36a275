//! `system_fingerprint` on streams whose usage chunk the gateway removes.
//!
//! vLLM stamps its fingerprint on a stream's terminal chunks (those with a `finish_reason`) when
//! the client asked for no usage, and on the usage chunk instead when it did. The gateway asks
//! for usage on every stream and removes the usage chunk the client did not ask for, so the
//! fingerprint would be lost with it. It is put back into each finish chunk: from the usage
//! chunk when both came in one read, else from the value this backend sent last (learned from
//! every usage chunk it sends, removed or not). The finish chunk is never held back: it carries the last token.

use std::ops::Range;
use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem;

static FINISH: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"finish_reason\":\""));
static FINGERPRINT: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"system_fingerprint\":"));

/// What is put before and after the value in a finish chunk.
const BEFORE: &[u8] = b",\"system_fingerprint\":\"";
const AFTER: &[u8] = b"\"";

/// The value of a usage chunk's `system_fingerprint` (the JSON string's content, escapes
/// kept); `None` when it has none (or `null`, vLLM's `--fingerprint-mode none`).
pub fn value_of(payload: &[u8]) -> Option<&[u8]> {
    let at = FINGERPRINT.find(payload)?;
    let value = &payload[at + b"\"system_fingerprint\":".len()..];
    let rest = value.trim_ascii_start().strip_prefix(b"\"")?;
    // The closing quote: the first one not escaped.
    let mut i = 0;
    while i < rest.len() {
        match rest[i] {
            b'\\' => i += 2,
            b'"' => return Some(&rest[..i]),
            _ => i += 1,
        }
    }
    None
}

/// Where a fingerprint goes in `frame` when `payload` (a data line inside it) is a finish chunk
/// without one: just before the payload's closing `}`. `None` for any other chunk.
pub fn wanted_at(frame: &[u8], payload: &[u8]) -> Option<usize> {
    FINISH.find(payload)?;
    if FINGERPRINT.find(payload).is_some() {
        return None;
    }
    let close = payload.trim_ascii_end();
    if close.last() != Some(&b'}') {
        return None;
    }
    let offset = (payload.as_ptr() as usize).checked_sub(frame.as_ptr() as usize)?;
    let at = offset + close.len() - 1;
    (at < frame.len()).then_some(at)
}

/// `frame` with the fingerprint `value` put in at each of `inserts` (ascending) and without the
/// bytes in `cut`; `None` when nothing is left.
pub fn edit(
    frame: Bytes,
    inserts: &[usize],
    value: Option<&[u8]>,
    cut: Option<Range<usize>>,
) -> Option<Bytes> {
    let value = match value {
        Some(v) if !inserts.is_empty() => v,
        _ => {
            return match cut {
                Some(c) => without(frame, c),
                None => Some(frame),
            };
        }
    };
    let fragment = BEFORE.len() + value.len() + AFTER.len();
    let mut out = BytesMut::with_capacity(frame.len() + fragment * inserts.len());
    let mut pos = 0;
    let mut cut = cut;
    let len = frame.len();
    for &at in inserts {
        if let Some(c) = cut.take_if(|c| c.start <= at) {
            out.extend_from_slice(&frame[pos..c.start.clamp(pos, len)]);
            pos = c.end.clamp(pos, len);
        }
        let at = at.clamp(pos, len);
        out.extend_from_slice(&frame[pos..at]);
        out.extend_from_slice(BEFORE);
        out.extend_from_slice(value);
        out.extend_from_slice(AFTER);
        pos = at;
    }
    if let Some(c) = cut {
        out.extend_from_slice(&frame[pos..c.start.clamp(pos, len)]);
        pos = c.end.clamp(pos, len);
    }
    out.extend_from_slice(&frame[pos..]);
    (!out.is_empty()).then(|| out.freeze())
}

/// `data` without the bytes in `cut`; `None` when nothing is left.
fn without(data: Bytes, cut: Range<usize>) -> Option<Bytes> {
    if cut.start == 0 && cut.end >= data.len() {
        return None;
    }
    if cut.start == 0 {
        return Some(data.slice(cut.end..));
    }
    if cut.end >= data.len() {
        return Some(data.slice(..cut.start));
    }
    let mut out = BytesMut::with_capacity(data.len() - cut.len());
    out.extend_from_slice(&data[..cut.start]);
    out.extend_from_slice(&data[cut.end..]);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FINISH_CHUNK: &str = r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":" x"},"finish_reason":"length","stop_reason":null}]}"#;
    const USAGE_CHUNK: &str = r#"data: {"id":"c","choices":[],"usage":{"prompt_tokens":3},"system_fingerprint":"vllm-0.32.0-2048"}"#;

    fn payload_of<'a>(frame: &'a [u8], line: &str) -> &'a [u8] {
        let at = memmem::find(frame, line.as_bytes()).unwrap();
        &frame[at + 6..at + line.len()]
    }

    #[test]
    fn the_value_in_a_usage_chunk() {
        let v = value_of(&USAGE_CHUNK.as_bytes()[6..]).unwrap();
        assert_eq!(v, b"vllm-0.32.0-2048");
        assert_eq!(
            value_of(br#"{"system_fingerprint": "a\"b"}"#).unwrap(),
            br#"a\"b"#
        );
        assert!(value_of(br#"{"choices":[],"usage":{}}"#).is_none());
        assert!(value_of(br#"{"system_fingerprint":null}"#).is_none());
        assert!(value_of(br#"{"system_fingerprint":"cut"#).is_none());
    }

    #[test]
    fn only_finish_chunks_without_one_take_it() {
        let frame = format!("{FINISH_CHUNK}\n\n");
        let at = wanted_at(frame.as_bytes(), payload_of(frame.as_bytes(), FINISH_CHUNK)).unwrap();
        assert_eq!(frame.as_bytes()[at], b'}');
        assert_eq!(at, FINISH_CHUNK.len() - 1);
        let token = r#"data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}"#;
        let frame = format!("{token}\n\n");
        assert!(wanted_at(frame.as_bytes(), payload_of(frame.as_bytes(), token)).is_none());
        let stamped = r#"data: {"choices":[{"finish_reason":"stop"}],"system_fingerprint":"x"}"#;
        let frame = format!("{stamped}\n\n");
        assert!(wanted_at(frame.as_bytes(), payload_of(frame.as_bytes(), stamped)).is_none());
    }

    #[test]
    fn edits_put_in_and_cut_out() {
        let frame = Bytes::from(format!(
            "{FINISH_CHUNK}\n\n{USAGE_CHUNK}\n\ndata: [DONE]\n\n"
        ));
        let at = wanted_at(&frame, payload_of(&frame, FINISH_CHUNK)).unwrap();
        let usage_start = FINISH_CHUNK.len() + 2;
        let cut = usage_start..usage_start + USAGE_CHUNK.len() + 2;
        let value = value_of(payload_of(&frame, USAGE_CHUNK)).unwrap();
        let out = edit(frame.clone(), &[at], Some(value), Some(cut.clone())).unwrap();
        let want = format!(
            "{},\"system_fingerprint\":\"vllm-0.32.0-2048\"}}\n\ndata: [DONE]\n\n",
            &FINISH_CHUNK[..FINISH_CHUNK.len() - 1]
        );
        assert_eq!(String::from_utf8_lossy(&out), want);
        // No fingerprint known: only the cut.
        let out = edit(frame.clone(), &[at], None, Some(cut.clone())).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{FINISH_CHUNK}\n\ndata: [DONE]\n\n")
        );
        // Nothing to do: the same bytes, not copied.
        let same = edit(frame.clone(), &[], Some(value), None).unwrap();
        assert_eq!(same.as_ptr(), frame.as_ptr());
        // Only the usage chunk: nothing left.
        let alone = Bytes::from(format!("{USAGE_CHUNK}\n\n"));
        assert!(edit(alone.clone(), &[], None, Some(0..alone.len())).is_none());
    }

    #[test]
    fn cutting_an_event_out_of_a_frame() {
        let d = Bytes::from_static(b"aaXXbb");
        assert_eq!(
            without(d.clone(), 2..4).unwrap(),
            Bytes::from_static(b"aabb")
        );
        assert_eq!(
            without(d.clone(), 0..2).unwrap(),
            Bytes::from_static(b"XXbb")
        );
        assert_eq!(
            without(d.clone(), 4..6).unwrap(),
            Bytes::from_static(b"aaXX")
        );
        assert!(without(d, 0..6).is_none());
    }
}
