//! What one `data:` payload of a stream is (`DataKind`), and the chat rule that tells it from the
//! bytes without parsing the JSON (`classify`): vLLM 0.33's `vllm bench serve` reading. The
//! dialects map their own event types onto the same kinds; the SSE scanner finds the payloads.

use std::sync::LazyLock;

use memchr::memmem;
use serde_json::value::RawValue;

/// Searchers built once: `memmem::find` would build one per call.
static CHOICES: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"choices\""));
static ERROR: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"error\""));
pub(crate) static USAGE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// What a `data:` payload is. For chat and completions, by vLLM 0.33's `vllm bench serve`
/// reading of a stream (`_choice_has_streamed_output` in
/// vllm/benchmarks/lib/endpoint_request_func.py); the other dialects map their event types onto
/// the same kinds (`protocol::dialect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// A token event: TTFT, ITL and E2EL are measured on these. Chat: the first choice's
    /// `delta` has non-empty `content`, `reasoning`, `tool_calls` or `function_call`, or
    /// `content: ""` without a `role`. Completions: any chunk with non-empty `choices`.
    Content,
    /// An event that streams nothing: the opening `role` chunk, an empty delta; a Responses
    /// `response.created`, an Anthropic `message_start` or `ping`.
    NoOutput,
    /// A chat chunk with `choices: []` (the usage chunk) or without choices.
    NoChoices,
    /// An error sent inside the stream (`{"error": ...}`, an `error` event, `response.failed`).
    Error,
    /// The stream's clean end: `[DONE]`, `response.completed` / `response.incomplete`,
    /// `message_stop`.
    Done,
}

/// Classify a chat or completions payload without parsing the JSON: look for the top-level
/// markers only.
pub(crate) fn classify(payload: &[u8]) -> DataKind {
    let p = trim_ascii(payload);
    if p == b"[DONE]" {
        return DataKind::Done;
    }
    if let Some(at) = CHOICES.find(p) {
        let after = skip_ws(&p[at + 9..]);
        let after = match after.split_first() {
            Some((b':', r)) => skip_ws(r),
            _ => after,
        };
        return match after.split_first() {
            Some((b'[', r)) if skip_ws(r).first() == Some(&b']') => DataKind::NoChoices,
            Some((b'[', r)) if streams_output(r) => DataKind::Content,
            Some((b'[', _)) => DataKind::NoOutput,
            _ => DataKind::NoChoices,
        };
    }
    if ERROR.find(p).is_some() {
        return DataKind::Error;
    }
    DataKind::NoChoices
}

static DELTA: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"delta\""));

/// The fields of a chat delta that decide whether it streams output, borrowed from the bytes
/// (also what a resumed stream reads of its answer so far: `resume`).
#[derive(serde::Deserialize)]
pub(crate) struct Delta<'a> {
    #[serde(borrow)]
    pub(crate) role: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) content: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) reasoning: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    pub(crate) function_call: Option<&'a RawValue>,
}

/// Does the first choice (`choices` starts just after its `[`) stream output? A choice without
/// a `delta` (completions' `text`) does. A chat delta does when one of its output fields is
/// non-empty, or it has `content: ""` and no `role`. Only the delta object is parsed (serde
/// stops at its end, the values stay borrowed): this runs on every relayed event.
fn streams_output(choices: &[u8]) -> bool {
    let Some(at) = DELTA.find(choices) else {
        return true;
    };
    let rest = skip_ws(&choices[at + 7..]);
    let Some((b':', rest)) = rest.split_first() else {
        return false;
    };
    let Some(Ok(d)) = serde_json::Deserializer::from_slice(rest)
        .into_iter::<Delta<'_>>()
        .next()
    else {
        return false;
    };
    let output = [d.content, d.reasoning, d.tool_calls, d.function_call]
        .into_iter()
        .flatten()
        .any(|v| !is_empty_value(v.get().as_bytes()));
    let role = d.role.is_some_and(|r| r.get() != "null");
    output || (!role && d.content.is_some_and(|c| c.get() == "\"\""))
}

/// `null`, `""`, `[]` or `{}` (with any whitespace inside the brackets).
fn is_empty_value(v: &[u8]) -> bool {
    match v {
        b"null" | b"\"\"" => true,
        [b'[', inner @ .., b']'] | [b'{', inner @ .., b'}'] => skip_ws(inner).is_empty(),
        _ => false,
    }
}

fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b
        .iter()
        .take_while(|c| matches!(c, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    &b[n..]
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.33's token events: output in the first choice's delta, or `content: ""` without a
    /// role; the opening role chunk and empty deltas are not tokens; completions chunks are.
    #[test]
    fn token_events_by_vllm_0_33() {
        let cases: &[(&str, DataKind)] = &[
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":null},"finish_reason":"stop"}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta":{"reasoning":"think"}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant","reasoning":"a \"q\" {x}","content":null}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[ ]}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta":{"function_call":{"name":"f"}}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"logprobs":{"content":[1]},"role":"assistant"}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta" : { "role" : "assistant" , "content" : "x" }}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#,
                DataKind::Content,
            ),
            (r#"{"choices":[{"index":0,"text":""}]}"#, DataKind::Content),
        ];
        for (payload, want) in cases {
            assert_eq!(classify(payload.as_bytes()), *want, "{payload}");
        }
    }
}
