//! Why an answer ended, as its backend said it: `finish_reason` of each chat or completions
//! choice, Anthropic's `stop_reason`, a Responses answer's `status` (or its
//! `incomplete_details.reason`). Read from the bytes (the key and its string value), without
//! parsing the JSON; only a traced request asks (`gen_ai.response.finish_reasons`).

use std::sync::LazyLock;

use memchr::memmem;

use crate::Dialect;

static FINISH_REASON: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"finish_reason\""));
static STOP_REASON: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"stop_reason\""));
static STATUS: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"status\""));
static INCOMPLETE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"incomplete_details\""));
static REASON: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"reason\""));

/// Call `f` with each finish reason `payload` (an SSE event's data, or a whole answer) gives.
/// A `null` reason (a chunk that does not finish) is none.
pub fn reasons_in(dialect: Dialect, payload: &[u8], mut f: impl FnMut(&str)) {
    match dialect {
        Dialect::Chat => each_string_value(&FINISH_REASON, payload, f),
        Dialect::Anthropic => each_string_value(&STOP_REASON, payload, f),
        Dialect::Responses => {
            // An incomplete answer says why; a finished one, its status (the answer's own
            // `status` is its last: its output items' come before it).
            if let Some(at) = INCOMPLETE.find(payload)
                && let Some(reason) = incomplete_reason(&payload[at + 20..])
            {
                f(reason);
                return;
            }
            if payload.windows(9).any(|w| w == b"\"output\":")
                || payload.starts_with(b"{\"type\":\"response.")
            {
                let mut last = None;
                each_string_value(&STATUS, payload, |s| last = Some(s.to_owned()));
                if let Some(s) = last.filter(|s| s != "in_progress" && s != "queued") {
                    f(&s);
                }
            }
        }
        Dialect::Json => {}
    }
}

/// The `reason` of an `incomplete_details` object (`rest` starts after its key); none when
/// it is `null`.
fn incomplete_reason(rest: &[u8]) -> Option<&str> {
    let rest = trim(trim(rest).strip_prefix(b":")?);
    let object = rest.strip_prefix(b"{")?;
    let object = &object[..object.iter().position(|b| *b == b'}')?];
    let at = REASON.find(object)?;
    string_after(&object[at + 8..])
}

/// Each string value of the key `finder` finds.
fn each_string_value(finder: &memmem::Finder<'_>, payload: &[u8], mut f: impl FnMut(&str)) {
    let key = finder.needle().len();
    let mut from = 0;
    while let Some(at) = finder.find(&payload[from..]) {
        let after = from + at + key;
        if let Some(v) = string_after(&payload[after..]) {
            f(v);
        }
        from = after;
    }
}

/// `: "value"` at the start of `rest` (whitespace allowed): the value, when it is a plain
/// string of the characters a reason has.
fn string_after(rest: &[u8]) -> Option<&str> {
    let rest = trim(rest);
    let rest = trim(rest.strip_prefix(b":")?);
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    let v = &rest[..end];
    if v.is_empty()
        || v.len() > 64
        || !v
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return None;
    }
    std::str::from_utf8(v).ok()
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    &b[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(dialect: Dialect, payload: &str) -> Vec<String> {
        let mut out = Vec::new();
        reasons_in(dialect, payload.as_bytes(), |r| out.push(r.to_owned()));
        out
    }

    #[test]
    fn each_protocol_says_why_it_ended_in_its_own_words() {
        assert_eq!(
            all(
                Dialect::Chat,
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"},{"index":1,"delta":{},"finish_reason" : "length"}]}"#
            ),
            ["stop", "length"]
        );
        assert!(
            all(
                Dialect::Chat,
                r#"{"choices":[{"delta":{"content":"a"},"finish_reason":null}]}"#
            )
            .is_empty()
        );
        // A content string that mentions the key is not a reason.
        assert!(all(Dialect::Chat, r#"{"choices":[{"delta":{"content":"\"finish_reason\" is a key"},"finish_reason":null}]}"#).is_empty());
        assert_eq!(
            all(
                Dialect::Anthropic,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":5}}"#
            ),
            ["end_turn"]
        );
        assert!(
            all(
                Dialect::Anthropic,
                r#"{"type":"message_start","message":{"stop_reason":null}}"#
            )
            .is_empty()
        );
        assert_eq!(
            all(
                Dialect::Responses,
                r#"{"type":"response.completed","response":{"id":"r","output":[{"type":"message","status":"completed"}],"status":"completed"}}"#
            ),
            ["completed"]
        );
        assert_eq!(
            all(
                Dialect::Responses,
                r#"{"id":"r","incomplete_details":{"reason":"max_output_tokens"},"output":[],"status":"incomplete"}"#
            ),
            ["max_output_tokens"]
        );
        assert!(
            all(
                Dialect::Responses,
                r#"{"type":"response.output_text.delta","delta":"status"}"#
            )
            .is_empty()
        );
        // `incomplete_details: null` is a finished answer, whatever comes after it.
        assert_eq!(
            all(
                Dialect::Responses,
                r#"{"type":"response.completed","response":{"incomplete_details":null,"output":[],"reasoning":{"reason":"x"},"status":"completed"}}"#
            ),
            ["completed"]
        );
        assert!(all(Dialect::Json, r#"{"finish_reason":"stop"}"#).is_empty());
    }
}
