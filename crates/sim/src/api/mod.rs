//! The OpenAI-compatible request bodies the sim accepts and the vLLM-shaped JSON it answers
//! with. This module holds what every route's parsing shares: the chat messages and the sim's
//! chat template, FastAPI-style body validation, prompt counting by the sim's tokenizer and
//! the served-model check. The routes' own shapes are in the submodules:
//! - `error`: every error the sim answers with, in vLLM's body shapes.
//! - `generation`: chat, completions and Responses requests, validated into a `GenRequest`.
//! - `anthropic`: `/v1/messages` requests and `/v1/messages/count_tokens`.
//! - `batch`: the chat batch (`/v1/chat/completions/batch`), parsed and answered.
//! - `answer`: the non-streaming `chat.completion` and `text_completion` objects.
//! - `tokenizer`: `/tokenize` and `/detokenize`.
//! - `models`: `GET /v1/models`.

pub(crate) mod answer;
pub(crate) mod anthropic;
pub(crate) mod batch;
pub(crate) mod error;
pub(crate) mod generation;
pub(crate) mod models;
pub(crate) mod tokenizer;

use std::sync::Arc;

use serde::Deserialize;

use super::args::SimConfig;
use super::lora::{Adapters, LoraAdapter};
use super::tokens;
use error::ApiError;

#[derive(Deserialize)]
pub(crate) struct ChatMessage {
    #[serde(default)]
    content: Option<MessageContent>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// Only text parts count towards the prompt; images and audio are accepted and ignored.
#[derive(Deserialize)]
struct ContentPart {
    #[serde(default)]
    text: Option<String>,
}

/// The sim's chat template: the text of every message, in order, with nothing around it.
pub(crate) fn chat_texts(messages: &[ChatMessage]) -> impl Iterator<Item = &str> {
    messages.iter().flat_map(|m| {
        let parts: Box<dyn Iterator<Item = &str>> = match &m.content {
            Some(MessageContent::Text(t)) => Box::new(std::iter::once(t.as_str())),
            Some(MessageContent::Parts(parts)) => {
                Box::new(parts.iter().filter_map(|p| p.text.as_deref()))
            }
            None => Box::new(std::iter::empty()),
        };
        parts
    })
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// A request body as FastAPI and pydantic take it: malformed JSON is refused at its byte
/// offset (`body.31`), a missing or mistyped field at its path (`body.messages`), as vLLM's
/// `Bad Request` errors.
pub(crate) fn validate<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        // Python's decoder names the 0-based index of the offending character (the end of the
        // body when it ends too soon); serde_json its 1-based line and column.
        let offset = if e.is_eof() {
            body.len()
        } else {
            byte_offset(body, e.line(), e.column()).saturating_sub(1)
        };
        let loc = format!("body.{offset}");
        return Err(ApiError::Validation {
            message: format!(
                "1 validation error:\n  {{'type': 'json_invalid', 'loc': '{loc}', 'msg': 'JSON decode error', 'input': {{}}, 'ctx': {{'error': '{e}'}}}}"
            ),
            loc,
        });
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize::<_, T>(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let text = inner.to_string();
        // A missing field is reported at its parent; pydantic names the field itself.
        let missing = text
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next());
        let mut loc = String::from("body");
        // serde names list items `messages[0]`, pydantic `messages.0`.
        for part in path
            .split(['.', '['])
            .map(|p| p.trim_end_matches(']'))
            .filter(|p| !p.is_empty() && *p != "?")
        {
            loc.push('.');
            loc.push_str(part);
        }
        let kind = match missing {
            Some(field) => {
                loc.push('.');
                loc.push_str(field);
                "missing"
            }
            None => "invalid",
        };
        ApiError::Validation {
            message: format!(
                "1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{text}'}}"
            ),
            loc,
        }
    })
}

/// The byte offset of serde_json's 1-based line and column in `body`.
fn byte_offset(body: &[u8], line: usize, column: usize) -> usize {
    let start: usize = body
        .split_inclusive(|b| *b == b'\n')
        .take(line.saturating_sub(1))
        .map(<[u8]>::len)
        .sum();
    (start + column).min(body.len())
}

/// Prompt tokens of `text` by the sim's tokenizer (about four characters per token for English
/// text), at least one.
pub(crate) fn prompt_tokens(text: &str) -> u32 {
    u32::try_from(tokens::count(text))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The model a request names: the base model (`None`: no name, or a served one) or a LoRA
/// adapter loaded now; any other name is vLLM's 404, which lists the served names only.
pub(crate) fn check_model(
    model: Option<&str>,
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
    match model {
        Some(m) if !cfg.serves(m) => adapters
            .find(m)
            .map(Some)
            .ok_or_else(|| ApiError::ModelNotFound(m.to_owned(), cfg.served_names.join(", "))),
        _ => Ok(None),
    }
}
