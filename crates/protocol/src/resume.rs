//! Continuing a streamed answer on another backend when the first one dies mid-answer
//! (issue 60), in the terms vLLM 0.32 takes: what a request and its answer so far must not be
//! for the continuation to be exact (`NotResumable`), the answer so far read from the events a
//! client was sent (`AnswerSoFar`), the request that continues it (`continuation`), and a
//! continuation's events made the first answer's own (`Seam`).
//!
//! vLLM continues a chat answer given as a final assistant message with
//! `continue_final_message: true` and `add_generation_prompt: false` (without the second it
//! refuses), streaming only the new text after its usual opening `role` chunk; a completion is
//! continued by its prompt plus the text so far. `/v1/messages` and `/v1/responses` take no
//! prefill (a final assistant message is a closed turn there): tests/it/real_vllm/continuation.rs.
//!
//! None of this runs on a stream that never fails but `AnswerSoFar::observe`; everything else
//! runs once, when a stream is to be resumed.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::Endpoint;
use crate::event::{Delta, Streamed};

/// Why an answer cannot be continued exactly, each counted and named in the error event that
/// ends the stream instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotResumable {
    /// An endpoint vLLM continues no answer on (`/v1/messages`, `/v1/responses`, ...).
    Endpoint,
    /// `n` (or `best_of`) above 1: several answers interleaved in one stream.
    SeveralChoices,
    /// Log probabilities were asked for: the continuation's would be of another prompt.
    Logprobs,
    /// Guided decoding (`response_format` with a schema, `guided_*`, `structured_outputs`, a
    /// required or named tool): the grammar's state at the seam cannot be handed over.
    GuidedDecoding,
    /// `echo`, or a prompt that is not one text (token ids, several prompts).
    PromptNotText,
    /// A tool call was being streamed: its arguments are a parser's split of the raw text.
    ToolCall,
    /// Reasoning text was streamed: a reasoning parser split the raw text.
    Reasoning,
    /// The answer so far ends with the start of a stop sequence: the engine would not see the
    /// stop straddling the seam.
    StopAtSeam,
    /// The request body is not the JSON object it was when forwarded.
    Body,
}

impl NotResumable {
    /// The label of the metric and the error event.
    pub fn as_str(self) -> &'static str {
        match self {
            NotResumable::Endpoint => "endpoint",
            NotResumable::SeveralChoices => "several_choices",
            NotResumable::Logprobs => "logprobs",
            NotResumable::GuidedDecoding => "guided_decoding",
            NotResumable::PromptNotText => "prompt_not_text",
            NotResumable::ToolCall => "tool_call",
            NotResumable::Reasoning => "reasoning",
            NotResumable::StopAtSeam => "stop_at_seam",
            NotResumable::Body => "body",
        }
    }
}

/// Why a stream is to be resumed: the metric's `cause` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The backend's connection was reset or closed before the answer's terminal event.
    Closed,
    /// The backend said its engine died (vLLM's `EngineDeadError` event).
    EngineDead,
    /// The backend said the request failed and may be retried (vLLM's `RetryableRequestError`).
    Retryable,
    /// No token within the inter-token limit.
    Stalled,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Closed => "closed",
            Cause::EngineDead => "engine_dead",
            Cause::Retryable => "retryable",
            Cause::Stalled => "stalled",
        }
    }
}

/// vLLM 0.32's words when its engine core dies (`vllm.v1.engine.exceptions.EngineDeadError`).
pub const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// An in-stream error event that calls for resuming elsewhere: the engine died, or the request
/// failed in a way vLLM says a client may retry (`ServiceUnavailableError`, 503). Any other
/// error event (a bad request, a failed generation) is the answer, and is relayed as it is.
pub fn failure_in(payload: &[u8]) -> Option<Cause> {
    let event: Value = serde_json::from_slice(payload).ok()?;
    let error = event.get("error")?;
    if error.get("message").and_then(Value::as_str) == Some(ENGINE_DEAD) {
        return Some(Cause::EngineDead);
    }
    (error.get("type").and_then(Value::as_str) == Some("ServiceUnavailableError")
        || error.get("code").and_then(Value::as_u64) == Some(503))
    .then_some(Cause::Retryable)
}

/// The answer a client has been sent so far: the text of the first choice's content (kept as
/// the JSON-escaped bytes the events carried, unescaped once if the stream is resumed), its
/// token events, and whether anything was streamed that cannot be continued as text.
#[derive(Debug, Default)]
pub struct AnswerSoFar {
    escaped: Vec<u8>,
    tokens: u32,
    blocked: Option<NotResumable>,
}

/// The first choice of a chat or completions chunk, borrowed.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow)]
    delta: Option<Delta<'a>>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
}

/// A JSON string's inside (its escapes kept), or `None` for anything but a string.
fn string_inside(v: &RawValue) -> Option<&[u8]> {
    let b = v.get().as_bytes();
    match b {
        [b'"', inside @ .., b'"'] => Some(inside),
        _ => None,
    }
}

fn present(v: Option<&RawValue>) -> bool {
    v.is_some_and(|v| !matches!(v.get(), "null" | "\"\"" | "[]"))
}

impl AnswerSoFar {
    pub fn new() -> Self {
        Self::default()
    }

    /// One token event's payload, as handed to the client: its first choice's content (chat)
    /// or text (completions) is appended.
    pub fn observe(&mut self, payload: &[u8]) {
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(payload) else {
            return;
        };
        let Some(choice) = chunk.choices.first() else {
            return;
        };
        let text = match &choice.delta {
            // The opening chunk names the role and streams nothing.
            Some(d) if present(d.role) && !present(d.content) => return,
            Some(d) => {
                if present(d.tool_calls) || present(d.function_call) {
                    self.blocked = Some(NotResumable::ToolCall);
                    self.tokens += 1;
                    return;
                }
                if present(d.reasoning) {
                    self.blocked.get_or_insert(NotResumable::Reasoning);
                    self.tokens += 1;
                    return;
                }
                d.content
            }
            None => choice.text,
        };
        if let Some(inside) = text.and_then(string_inside) {
            self.escaped.extend_from_slice(inside);
            self.tokens += 1;
        }
    }

    /// One token event as the relay read it: the content span its classification found
    /// (nothing parsed again), or a completions chunk's `text` read here. This is all a stream
    /// that never fails pays for being resumable: a copy of the escaped bytes.
    pub fn push(&mut self, payload: &[u8], streamed: Streamed) {
        if self.escaped.capacity() == 0 {
            // One allocation for an answer's first tens of tokens, not one per doubling (and
            // no more: 5 000 open streams each hold theirs).
            self.escaped.reserve(128);
        }
        match streamed {
            Streamed::Text { start, end } => {
                if let Some(inside) = payload.get(start as usize..end as usize) {
                    self.escaped.extend_from_slice(inside);
                    self.tokens += 1;
                }
            }
            Streamed::ToolCall => {
                self.blocked = Some(NotResumable::ToolCall);
                self.tokens += 1;
            }
            Streamed::Reasoning => {
                self.blocked.get_or_insert(NotResumable::Reasoning);
                self.tokens += 1;
            }
            Streamed::Unread => match text_field(payload) {
                Some(inside) => {
                    self.escaped.extend_from_slice(inside);
                    self.tokens += 1;
                }
                None => self.observe(payload),
            },
        }
    }

    /// The token events seen.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The text so far, unescaped.
    pub fn text(&self) -> String {
        let mut quoted = Vec::with_capacity(self.escaped.len() + 2);
        quoted.push(b'"');
        quoted.extend_from_slice(&self.escaped);
        quoted.push(b'"');
        serde_json::from_slice(&quoted).unwrap_or_default()
    }

    /// Why the answer cannot be continued, from what was streamed.
    pub fn blocked(&self) -> Option<NotResumable> {
        self.blocked
    }
}

static TEXT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"text\""));

/// A completions chunk's `"text": "..."` inside (escapes kept), found without parsing the
/// chunk: the first `"text"` followed by a colon is the key (a string holding the sequence
/// would have it escaped).
fn text_field(payload: &[u8]) -> Option<&[u8]> {
    for at in TEXT.find_iter(payload) {
        let rest = payload[at + 6..].trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let value = serde_json::Deserializer::from_slice(rest.trim_ascii_start())
            .into_iter::<&RawValue>()
            .next()?
            .ok()?;
        return string_inside(value);
    }
    None
}

/// Whether `body` (the request as forwarded) could be continued at all, before any answer.
pub fn check_request(endpoint: Endpoint, body: &[u8]) -> Result<(), NotResumable> {
    let req = object(body)?;
    check(endpoint, &req)
}

fn object(body: &[u8]) -> Result<Map<String, Value>, NotResumable> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(NotResumable::Body),
    }
}

fn check(endpoint: Endpoint, req: &Map<String, Value>) -> Result<(), NotResumable> {
    if !matches!(endpoint, Endpoint::Chat | Endpoint::Completions) {
        return Err(NotResumable::Endpoint);
    }
    let above_one = |k: &str| req.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if above_one("n") || above_one("best_of") {
        return Err(NotResumable::SeveralChoices);
    }
    let asked = |k: &str| {
        req.get(k)
            .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)))
    };
    if asked("logprobs") || asked("top_logprobs") || asked("prompt_logprobs") {
        return Err(NotResumable::Logprobs);
    }
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ]
    .into_iter()
    .chain(["structured_outputs", "structural_tag"])
    .any(asked)
        || req
            .get("response_format")
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t != "text")
        || req
            .get("tool_choice")
            .is_some_and(|c| c.as_str() == Some("required") || c.is_object());
    if guided {
        return Err(NotResumable::GuidedDecoding);
    }
    if endpoint == Endpoint::Completions {
        let one_text = match req.get("prompt") {
            Some(Value::String(_)) => true,
            Some(Value::Array(a)) => matches!(a.as_slice(), [Value::String(_)]),
            _ => false,
        };
        if !one_text || req.get("echo").is_some_and(|e| e == &Value::Bool(true)) {
            return Err(NotResumable::PromptNotText);
        }
    }
    Ok(())
}

/// Does `text` end with a proper start of one of the request's stop strings?
fn stop_at_seam(req: &Map<String, Value>, text: &str) -> bool {
    let stops: Vec<&str> = match req.get("stop") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    stops.iter().any(|stop| {
        (1..stop.len())
            .filter(|n| stop.is_char_boundary(*n))
            .any(|n| text.ends_with(&stop[..n]))
    })
}

/// The request that continues `body`'s answer from `so_far`: `None` when the answer's limit is
/// already reached (nothing is left to generate). The output limit is reduced by the tokens
/// sent; every other field (sampling, seed, the client's own options) is kept, and the
/// continuation always reports its usage.
pub fn continuation(
    endpoint: Endpoint,
    body: &[u8],
    so_far: &AnswerSoFar,
) -> Result<Option<Vec<u8>>, NotResumable> {
    let mut req = object(body)?;
    check(endpoint, &req)?;
    if let Some(why) = so_far.blocked() {
        return Err(why);
    }
    let text = so_far.text();
    if stop_at_seam(&req, &text) {
        return Err(NotResumable::StopAtSeam);
    }
    for limit in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = req.get(limit).and_then(Value::as_u64) {
            let left = n.saturating_sub(u64::from(so_far.tokens()));
            if left == 0 {
                return Ok(None);
            }
            req.insert(limit.into(), left.into());
        }
    }
    match endpoint {
        Endpoint::Chat => {
            let Some(Value::Array(messages)) = req.get_mut("messages") else {
                return Err(NotResumable::Body);
            };
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
            req.insert("continue_final_message".into(), true.into());
            req.insert("add_generation_prompt".into(), false.into());
        }
        Endpoint::Completions => {
            let prompt = match req.get("prompt") {
                Some(Value::String(p)) => p.clone(),
                Some(Value::Array(a)) => match a.as_slice() {
                    [Value::String(p)] => p.clone(),
                    _ => return Err(NotResumable::PromptNotText),
                },
                _ => return Err(NotResumable::PromptNotText),
            };
            req.insert("prompt".into(), Value::String(prompt + &text));
        }
        _ => return Err(NotResumable::Endpoint),
    }
    let options = req
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(o) = options {
        o.insert("include_usage".into(), true.into());
    }
    serde_json::to_vec(&Value::Object(req))
        .map(Some)
        .map_err(|_| NotResumable::Body)
}

/// The `/tokenize` request that counts `body`'s prompt as the backend renders it: a stream cut
/// before its usage chunk never said how long its prompt was, and the one usage a resumed
/// answer reports starts from it (the continuation's own prompt holds the answer so far too).
pub fn tokenize_body(endpoint: Endpoint, body: &[u8]) -> Result<Vec<u8>, NotResumable> {
    let req = object(body)?;
    let keys: &[&str] = match endpoint {
        Endpoint::Chat => &[
            "model",
            "messages",
            "tools",
            "chat_template",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
            "add_special_tokens",
            "mm_processor_kwargs",
        ],
        Endpoint::Completions => &["model", "prompt", "add_special_tokens"],
        _ => return Err(NotResumable::Endpoint),
    };
    let kept: Map<String, Value> = keys
        .iter()
        .filter_map(|k| req.get(*k).map(|v| ((*k).to_owned(), v.clone())))
        .collect();
    serde_json::to_vec(&Value::Object(kept)).map_err(|_| NotResumable::Body)
}

/// A continuation's chunk carrying usage, with the usage of the whole answer the client
/// received: the original prompt's tokens, and the completion tokens of both parts (the first
/// part's `first_part` and the continuation's own). The continuation's cached-token details
/// are of its own prompt, not the client's: they go. `None` when the chunk has no usage.
pub fn one_usage(chunk: &[u8], prompt_tokens: u64, first_part: u32) -> Option<Vec<u8>> {
    let Ok(Value::Object(mut chunk)) = serde_json::from_slice(chunk) else {
        return None;
    };
    let Some(Value::Object(usage)) = chunk.get_mut("usage") else {
        return None;
    };
    let completion = usage
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0)
        + u64::from(first_part);
    usage.insert("prompt_tokens".into(), prompt_tokens.into());
    usage.insert("completion_tokens".into(), completion.into());
    usage.insert("total_tokens".into(), (prompt_tokens + completion).into());
    if usage.contains_key("prompt_tokens_details") {
        usage.insert("prompt_tokens_details".into(), Value::Null);
    }
    serde_json::to_vec(&Value::Object(chunk)).ok()
}

/// What makes a continuation's events the first answer's own: its `id`, `created`, `model` and
/// `system_fingerprint`, learned from the first answer's first chunk.
#[derive(Debug, Clone, Default)]
pub struct Seam {
    fields: Vec<(&'static str, Value)>,
}

const SAME: [&str; 4] = ["id", "created", "model", "system_fingerprint"];

impl Seam {
    /// Learned from one of the first answer's chunks (the first that parses).
    pub fn learn(payload: &[u8]) -> Option<Self> {
        let Ok(Value::Object(chunk)) = serde_json::from_slice(payload) else {
            return None;
        };
        let fields = SAME
            .into_iter()
            .filter_map(|k| chunk.get(k).map(|v| (k, v.clone())))
            .collect();
        Some(Seam { fields })
    }

    /// A continuation's chunk as the first answer's: `None` for its opening `role` chunk (the
    /// client had one) and for what is not a chunk; `[DONE]` passes as it is.
    pub fn rewrite(&self, payload: &[u8]) -> Option<Vec<u8>> {
        if payload.trim_ascii() == b"[DONE]" {
            return Some(payload.to_vec());
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice(payload) else {
            return None;
        };
        let opening = chunk
            .get("choices")
            .and_then(|c| c.get(0))
            .and_then(|c| c.get("delta"))
            .is_some_and(|d| {
                d.get("role").is_some_and(|r| !r.is_null())
                    && d.get("content").is_none_or(|c| c == "")
                    && d.get("tool_calls").is_none_or(Value::is_null)
            });
        if opening {
            return None;
        }
        for (k, v) in &self.fields {
            if chunk.contains_key(*k) || *k != "system_fingerprint" {
                chunk.insert((*k).to_owned(), v.clone());
            }
        }
        serde_json::to_vec(&Value::Object(chunk)).ok()
    }
}

#[cfg(test)]
mod tests;
