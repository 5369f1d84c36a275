//! The body sent upstream: the client's bytes, with splices only.

use std::ops::Range;

use bytes::Bytes;

use super::RequestView;

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
    upstream_body_owned(body, view, rename, inject_usage, None, None)
}

/// `upstream_body`, with a Responses `request_id` put in `owner`'s namespace
/// (`<owner>-<the client's id>`): vLLM makes the stored response's id from it, and one key's
/// chosen id must never name another key's response; and with `priority` written as the
/// request's vLLM `priority` (the client's value replaced, or the field added).
pub fn upstream_body_owned(
    body: &Bytes,
    view: &RequestView<'_>,
    rename: Option<&[u8]>,
    inject_usage: bool,
    owner: Option<&str>,
    priority: Option<i64>,
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
    if let Some(p) = priority {
        let mut buf = itoa::Buffer::new();
        let value = buf.format(p).as_bytes();
        match &view.priority {
            Some((_, span)) => edits.push((span.clone(), value.to_vec())),
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
    edits.sort_by_key(|(r, _)| std::cmp::Reverse(r.start));
    let extra: usize = edits.iter().map(|(_, v)| v.len()).sum();
    let mut out = body.to_vec();
    out.reserve(extra);
    for (range, with) in edits {
        out.splice(range, with);
    }
    Bytes::from(out)
}
