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

/// What a token event streamed, as the delta parse that classified it saw it (nothing more is
/// read for it): what a resumable stream keeps of its answer so far (`resume::AnswerSoFar`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Streamed {
    /// Not read: a completions chunk (its `text` is read only where it is kept), another
    /// dialect's event, or no token.
    #[default]
    Unread,
    /// The first choice's `content`: where the inside of its JSON string (escapes kept) lies in
    /// the payload.
    Text { start: u32, end: u32 },
    /// A tool call (`tool_calls`, `function_call`): a parser's split of the raw text.
    ToolCall,
    /// Reasoning text: a reasoning parser's split of the raw text.
    Reasoning,
}

/// Classify a chat or completions payload without parsing the JSON: look for the top-level
/// markers only.
pub(crate) fn classify(payload: &[u8]) -> DataKind {
    classify_streamed(payload).0
}

/// `classify`, and what a token event streamed (`Streamed`), from the same reading.
pub(crate) fn classify_streamed(payload: &[u8]) -> (DataKind, Streamed) {
    let p = trim_ascii(payload);
    if p == b"[DONE]" {
        return (DataKind::Done, Streamed::Unread);
    }
    if let Some(at) = CHOICES.find(p) {
        let after = skip_ws(&p[at + 9..]);
        let after = match after.split_first() {
            Some((b':', r)) => skip_ws(r),
            _ => after,
        };
        let kind = match after.split_first() {
            Some((b'[', r)) if skip_ws(r).first() == Some(&b']') => DataKind::NoChoices,
            Some((b'[', r)) => match streams_output(r) {
                Some(streamed) => return (DataKind::Content, within(payload, streamed)),
                None => DataKind::NoOutput,
            },
            _ => DataKind::NoChoices,
        };
        return (kind, Streamed::Unread);
    }
    if ERROR.find(p).is_some() {
        return (DataKind::Error, Streamed::Unread);
    }
    (DataKind::NoChoices, Streamed::Unread)
}

/// A text span found in a borrowed slice of `payload`, as offsets into `payload`.
fn within(payload: &[u8], streamed: Output<'_>) -> Streamed {
    match streamed {
        Output::Text(inside) => {
            let start = (inside.as_ptr() as usize).wrapping_sub(payload.as_ptr() as usize);
            let end = start + inside.len();
            match (u32::try_from(start), u32::try_from(end)) {
                (Ok(start), Ok(end)) if end as usize <= payload.len() => {
                    Streamed::Text { start, end }
                }
                _ => Streamed::Unread,
            }
        }
        Output::Other(s) => s,
    }
}

/// What `streams_output` saw of a token event, borrowed from the payload.
enum Output<'a> {
    Text(&'a [u8]),
    Other(Streamed),
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

/// Does the first choice (`choices` starts just after its `[`) stream output, and what? A
/// choice without a `delta` (completions' `text`) does (unread). A chat delta does when one of
/// its output fields is non-empty, or it has `content: ""` and no `role`. Only the delta object
/// is parsed (serde stops at its end, the values stay borrowed): this runs on every relayed
/// event. `None`: no output.
fn streams_output(choices: &[u8]) -> Option<Output<'_>> {
    let Some(at) = DELTA.find(choices) else {
        return Some(Output::Other(Streamed::Unread));
    };
    let rest = skip_ws(&choices[at + 7..]);
    let Some((b':', rest)) = rest.split_first() else {
        return None;
    };
    let d = serde_json::Deserializer::from_slice(rest)
        .into_iter::<Delta<'_>>()
        .next()?
        .ok()?;
    let full = |v: Option<&RawValue>| v.is_some_and(|v| !is_empty_value(v.get().as_bytes()));
    if full(d.tool_calls) || full(d.function_call) {
        return Some(Output::Other(Streamed::ToolCall));
    }
    if full(d.reasoning) {
        return Some(Output::Other(Streamed::Reasoning));
    }
    let text = || {
        let inside = d.content?.get().as_bytes();
        let inside = inside.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        Some(Output::Text(inside))
    };
    if full(d.content) {
        return Some(text().unwrap_or(Output::Other(Streamed::Unread)));
    }
    let role = d.role.is_some_and(|r| r.get() != "null");
    (!role && d.content.is_some_and(|c| c.get() == "\"\""))
        .then(|| text().unwrap_or(Output::Other(Streamed::Unread)))
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
