//! The body sent upstream: the client's bytes, with splices only.

use std::ops::Range;

use bytes::Bytes;

use super::RequestView;

/// What becomes of the body's `priority` field upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityEdit {
    /// As the client sent it, or absent.
    Keep,
    /// This value: the client's replaced in place (`null` included), or the field added.
    Write(i64),
    /// The client's field taken out, on a route whose engine reads none.
    Remove,
}

/// The body to send upstream: the original bytes, with the `model` value replaced when the
/// pool renames it, and `stream_options.include_usage: true` added when a stream did not ask
/// for usage (the relay then removes that extra usage event from what the client receives).
/// Splices only; re-serialises nothing but an existing `stream_options` object.
pub fn upstream_body(
    body: &Bytes,
    view: &RequestView<'_>,
    rename: Option<&[u8]>,
    inject_usage: bool,
) -> Bytes {
    upstream_body_owned(body, view, rename, inject_usage, None, PriorityEdit::Keep)
}

/// `upstream_body`, with a Responses `request_id` put in `owner`'s namespace
/// (`<owner>-<the client's id>`): vLLM makes the stored response's id from it, and one key's
/// chosen id must never name another key's response; and with the `priority` field edited
/// as `priority` says.
pub fn upstream_body_owned(
    body: &Bytes,
    view: &RequestView<'_>,
    rename: Option<&[u8]>,
    inject_usage: bool,
    owner: Option<&str>,
    priority: PriorityEdit,
) -> Bytes {
    // Edits from the end of the body backwards, so earlier offsets stay valid.
    let mut edits: Vec<(Range<usize>, Vec<u8>)> = Vec::with_capacity(2);
    if let Some(name) = rename {
        edits.push((view.model_span.clone(), name.to_vec()));
    }
    if let (Some(owner), Some(span)) = (owner, &view.request_id_span) {
        // The value is a JSON string: its escaped content stays as it came.
        let inner = &body[span.start + 1..span.end - 1];
        let mut id = Vec::with_capacity(owner.len() + inner.len() + 3);
        id.push(b'"');
        id.extend_from_slice(owner.as_bytes());
        id.push(b'-');
        id.extend_from_slice(inner);
        id.push(b'"');
        edits.push((span.clone(), id));
    }
    match (priority, &view.priority) {
        (PriorityEdit::Keep, _) | (PriorityEdit::Remove, None) => {}
        (PriorityEdit::Write(p), client) => {
            let mut buf = itoa::Buffer::new();
            let value = buf.format(p).as_bytes();
            match client {
                Some(c) => edits.push((c.span.clone(), value.to_vec())),
                None => {
                    let at = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
                    let mut field = Vec::with_capacity(value.len() + 12);
                    field.extend_from_slice(b"\"priority\":");
                    field.extend_from_slice(value);
                    field.push(b',');
                    edits.push((at..at, field));
                }
            }
        }
        (PriorityEdit::Remove, Some(c)) => match member_of(body, c.span.clone()) {
            Some(member) => edits.push((member, Vec::new())),
            // Not reached for a body the view parsed; the value then goes as `null`.
            None => edits.push((c.span.clone(), b"null".to_vec())),
        },
    }
    if inject_usage {
        match &view.stream_options_span {
            Some(span) => {
                let mut obj: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&body[span.clone()]).unwrap_or_default();
                obj.insert("include_usage".into(), serde_json::Value::Bool(true));
                // vLLM reports no usage at all for `continuous_usage_stats` without
                // `include_usage`; with the injected `include_usage` it would put usage on
                // every chunk, and only the final usage chunk is cut out. Asked for the final
                // one only, the client's stream is what it would get directly.
                if let Some(c) = obj.get_mut("continuous_usage_stats") {
                    *c = serde_json::Value::Bool(false);
                }
                let text = serde_json::to_vec(&obj)
                    .unwrap_or_else(|_| b"{\"include_usage\":true}".to_vec());
                edits.push((span.clone(), text));
            }
            None => {
                // Right after the opening brace of the body.
                let at = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
                edits.push((
                    at..at,
                    b"\"stream_options\":{\"include_usage\":true},".to_vec(),
                ));
            }
        }
    }
    if edits.is_empty() {
        return body.clone();
    }
    // From the end backwards; at one offset a removal goes before an insertion, which must
    // not fall inside what is removed.
    edits.sort_by_key(|(r, _)| std::cmp::Reverse((r.start, r.end)));
    let extra: usize = edits.iter().map(|(_, v)| v.len()).sum();
    let mut out = body.to_vec();
    out.reserve(extra);
    for (range, with) in edits {
        out.splice(range, with);
    }
    Bytes::from(out)
}

/// The bytes of the object member whose value is `value` (its key, the colon, the value, and
/// one comma beside it), so that removing them leaves valid JSON. Reads backwards from the
/// value over the colon and the key string (whose escapes may hide a `"`), then takes the
/// comma after it, or else the one before it.
fn member_of(body: &[u8], value: Range<usize>) -> Option<Range<usize>> {
    let ws = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut i = value.start;
    while i > 0 && ws(body[i - 1]) {
        i -= 1;
    }
    if i == 0 || body[i - 1] != b':' {
        return None;
    }
    i -= 1;
    while i > 0 && ws(body[i - 1]) {
        i -= 1;
    }
    if i == 0 || body[i - 1] != b'"' {
        return None;
    }
    // `i - 1` closes the key; its opening quote is the first `"` before it that an even
    // number of backslashes precedes.
    let mut q = i - 1;
    let start = loop {
        q = body[..q].iter().rposition(|b| *b == b'"')?;
        let backslashes = body[..q].iter().rev().take_while(|b| **b == b'\\').count();
        if backslashes % 2 == 0 {
            break q;
        }
    };
    let mut end = value.end;
    while end < body.len() && ws(body[end]) {
        end += 1;
    }
    if body.get(end) == Some(&b',') {
        return Some(start..end + 1);
    }
    let mut before = start;
    while before > 0 && ws(body[before - 1]) {
        before -= 1;
    }
    match body[..before].last() {
        Some(b',') => Some(before - 1..value.end),
        Some(b'{') => Some(start..value.end),
        _ => None,
    }
}
