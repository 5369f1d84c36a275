//! The request-body view: the body is parsed exactly once into the few fields the gateway
//! needs (model, stream, token limits, stream_options, n, approximate prompt size). The
//! original bytes are forwarded; the only rewrite is a byte splice (`splice`).
//!
//! - `generation`: chat, completions, Responses, Messages and the tokenizer routes. Tokenizer
//!   bodies (`/tokenize`, `/detokenize`) give only the model and the prompt size: their
//!   generation fields are not read, so nothing is ever injected into them.
//! - `pooling`, `batch`: the pooling routes and the chat batch.
//! - `form`: the audio routes' `multipart/form-data`.
//! - `prompt`: the prompt's size, counted while parsing, without building a tree.
//! - `splice`: the body sent upstream.

pub mod form;
pub mod splice;

mod batch;
mod generation;
mod pooling;
mod prompt;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use super::Endpoint;

/// Why a body was refused; every message names the field and says what to send instead.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ViewError {
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    #[error("{message}")]
    InvalidRequest {
        param: Option<Cow<'static, str>>,
        message: String,
    },
    /// A field the parser accepted could not be found in the bytes again (a bug, not the
    /// client's fault).
    #[error("a parsed field could not be located in the body")]
    Unlocatable,
}

#[derive(Debug)]
pub struct RequestView<'a> {
    pub model: Cow<'a, str>,
    /// Byte range of the `model` JSON value (quotes included) in the body.
    pub model_span: Range<usize>,
    pub stream: bool,
    /// `max_completion_tokens` if given, else `max_tokens`.
    pub max_tokens: Option<u64>,
    pub n: u32,
    pub include_usage: Option<bool>,
    /// Byte range of the `stream_options` value, when present (`null` included).
    pub stream_options_span: Option<Range<usize>>,
    /// Characters of prompt text (messages' content or prompt), a cheap size estimate.
    pub prompt_chars: usize,
    /// The `user` field's raw JSON text, when given (backend affinity).
    pub user: Option<&'a str>,
    /// Responses: the stored response this one continues (it lives on one backend).
    pub previous_response_id: Option<Cow<'a, str>>,
    /// Responses: `background: true` (the POST answers while the backend still generates).
    pub background: bool,
    /// Responses: `store` (vLLM's default is true): a `store: false` answer is kept nowhere,
    /// so nothing is pinned for it.
    pub store: bool,
    /// Responses: the byte range of the client's `request_id` value (a JSON string), from
    /// which vLLM makes the response's id.
    pub(crate) request_id_span: Option<Range<usize>>,
    /// The `priority` field the client sent, on any route (`null` included).
    pub priority: Option<ClientPriority>,
}

/// A client's `priority` field: vLLM's place in its waiting queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientPriority {
    /// Its value where vLLM reads one (`Needs::engine_priority`); `None` for `null`, and on
    /// the routes that read none (the field is taken out there, whatever it holds).
    pub value: Option<i64>,
    /// The byte range of its value in the body.
    pub(crate) span: Range<usize>,
}

/// The `priority` field (raw, `null` included), read as the route's engine reads it: an
/// integer (or `null`) where vLLM orders by it, anything elsewhere.
fn client_priority(
    raw: Option<&RawValue>,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<Option<ClientPriority>, ViewError> {
    let Some(r) = raw else {
        return Ok(None);
    };
    let value = match r.get() {
        "null" => None,
        _ if !endpoint.needs().engine_priority => None,
        text => Some(text.parse::<i64>().map_err(|_| {
            invalid(
                "priority",
                format!(
                    "`priority` must be an integer (lower is served first), got `{}`.",
                    short(text)
                ),
            )
        })?),
    };
    let span = span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?;
    Ok(Some(ClientPriority { value, span }))
}

/// A field's raw value whenever the field is present, `null` included (a plain `Option`
/// reads `null` as absent, and the body's field would then be added a second time).
fn present_raw<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}
fn invalid(param: &'static str, message: impl Into<String>) -> ViewError {
    ViewError::InvalidRequest {
        param: Some(Cow::Borrowed(param)),
        message: message.into(),
    }
}

/// Parse a request body into its view. Errors name the field and say what to send instead.
pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, ViewError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => {
            return Err(ViewError::InvalidJson(
                "the body is empty; send a JSON object such as {\"model\": \"...\", \"messages\": [...]}".into(),
            ));
        }
        Some(b'{') => {}
        Some(_) => {
            // Tell "not JSON" apart from "JSON but not an object".
            return Err(match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => invalid_body_shape(),
                Err(e) => ViewError::InvalidJson(e.to_string()),
            });
        }
    }
    match endpoint {
        Endpoint::ChatBatch => batch::parse(body),
        e if e.family().pools() => pooling::parse(body, e),
        e => generation::parse(body, e),
    }
}

/// The body as `T`, or the error that says what is wrong with it.
fn from_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ViewError> {
    match serde_json::from_slice(body) {
        Ok(raw) => Ok(raw),
        Err(e) if e.is_data() => Err(data_error::<T>(body, e)),
        Err(e) => Err(ViewError::InvalidJson(e.to_string())),
    }
}

/// The `model` named (required, a non-empty string), and where its value is in the body.
fn model_of<'a>(
    raw: Option<&'a RawValue>,
    body: &[u8],
) -> Result<(Cow<'a, str>, Range<usize>), ViewError> {
    let model_raw = raw.ok_or_else(|| {
        invalid(
            "model",
            "`model` is required: name one of the models listed by GET /v1/models.",
        )
    })?;
    let model: Cow<'_, str> = serde_json::from_str(model_raw.get()).map_err(|_| {
        invalid(
            "model",
            format!("`model` must be a string, got `{}`.", model_raw.get()),
        )
    })?;
    if model.is_empty() {
        return Err(invalid("model", "`model` must not be empty."));
    }
    let model_span = span_of(body, model_raw.get().as_bytes()).ok_or(ViewError::Unlocatable)?;
    Ok((model, model_span))
}
impl RequestView<'_> {
    /// A view with no model yet, of a body answered whole.
    fn whole(g: GenerationFields) -> Self {
        RequestView {
            model: Cow::Borrowed(""),
            model_span: 0..0,
            stream: g.stream,
            max_tokens: g.max_tokens,
            n: g.n,
            include_usage: g.include_usage,
            stream_options_span: g.stream_options_span,
            prompt_chars: 0,
            user: None,
            previous_response_id: None,
            background: false,
            store: true,
            request_id_span: None,
            priority: None,
        }
    }
}
/// The fields that steer generation (stream, token limits, n, stream_options).
struct GenerationFields {
    stream: bool,
    max_tokens: Option<u64>,
    n: u32,
    include_usage: Option<bool>,
    stream_options_span: Option<Range<usize>>,
}

impl GenerationFields {
    /// A body that generates nothing (the tokenizer endpoints).
    const NONE: GenerationFields = GenerationFields {
        stream: false,
        max_tokens: None,
        n: 1,
        include_usage: None,
        stream_options_span: None,
    };
}
/// The output limit vLLM applies: `max_completion_tokens or max_tokens` (Python's `or`: a
/// `max_completion_tokens` of 0 falls back to `max_tokens`, as vLLM does).
fn output_limit(max_completion_tokens: Option<u64>, max_tokens: Option<u64>) -> Option<u64> {
    max_completion_tokens.filter(|t| *t != 0).or(max_tokens)
}
/// A client's value quoted in a message, cut to a readable length.
fn short(text: &str) -> String {
    let mut out: String = text.chars().take(40).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}
fn invalid_body_shape() -> ViewError {
    ViewError::InvalidRequest {
        param: None,
        message: "The request body must be a JSON object such as {\"model\": \"...\", \"messages\": [...]}.".into(),
    }
}

/// A type mismatch deep in the body: find which field (cold path, parses again with paths).
fn data_error<'a, T: Deserialize<'a>>(body: &'a [u8], e: serde_json::Error) -> ViewError {
    let mut de = serde_json::Deserializer::from_slice(body);
    let path = match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Err(pe) => pe.path().to_string(),
        Ok(_) => String::new(),
    };
    let param = if path.is_empty() || path == "." {
        None
    } else {
        Some(Cow::Owned(path))
    };
    let message = match &param {
        Some(p) => format!("Invalid value for `{p}`: {e}."),
        None => format!("Invalid request body: {e}."),
    };
    ViewError::InvalidRequest { param, message }
}

fn opt_u64(raw: Option<&RawValue>, name: &'static str) -> Result<Option<u64>, ViewError> {
    match raw.map(RawValue::get) {
        None | Some("null") => Ok(None),
        Some(text) => text.parse::<u64>().map(Some).map_err(|_| {
            invalid(
                name,
                format!("`{name}` must be a non-negative integer, got `{text}`."),
            )
        }),
    }
}

/// Where `part` (a sub-slice of `body` handed out by the borrowing parser) sits in `body`.
fn span_of(body: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (body.get(start..end)? == part).then_some(start..end)
}
