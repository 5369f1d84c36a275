//! Chat, completions, Responses, Messages and the tokenizer routes: one pass over the body
//! reads the fields that steer generation, the prompt's size, and the Responses API's own
//! fields; everything else is the backend's to read.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use super::prompt::{CompletionPrompts, Content, Count, Input, Messages};
use super::{
    GenerationFields, RequestView, ViewError, client_priority, from_body, invalid, model_of,
    opt_u64, output_limit, present_raw, short, span_of,
};
use crate::Endpoint;

#[derive(Deserialize)]
struct RawBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    /// The Responses API's output limit.
    #[serde(borrow)]
    max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    n: Option<&'a RawValue>,
    /// Kept even when it is `null` (a plain `Option` would read `null` as absent): a stream
    /// that gets `include_usage` injected must replace that `null`, not add a second key.
    #[serde(borrow, default, deserialize_with = "present_raw")]
    stream_options: Option<&'a RawValue>,
    messages: Option<Count<Messages>>,
    prompt: Option<Count<CompletionPrompts>>,
    /// The Responses API's prompt: a string or a list of input items.
    input: Option<Count<Input>>,
    /// The Responses API's system text.
    instructions: Option<Count<Content>>,
    /// Anthropic's system prompt: a string or text blocks.
    system: Option<Count<Content>>,
    #[serde(borrow)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow)]
    background: Option<&'a RawValue>,
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    #[serde(borrow)]
    request_id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present_raw")]
    priority: Option<&'a RawValue>,
    /// `/detokenize`'s token ids; read only there (another endpoint's body may carry a field of
    /// that name in any shape).
    #[serde(borrow)]
    tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// A body that generates (chat, completions, Responses, Messages) or is tokenized: the
/// fields that steer generation, the prompt's size, and the Responses API's own fields.
pub(super) fn parse(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, ViewError> {
    let raw: RawBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;

    let generation = if endpoint.needs().generates {
        generation_fields(&raw, body, endpoint)?
    } else {
        GenerationFields::NONE
    };
    let mut previous_response_id = None;
    let mut background = false;
    let mut store = true;
    let mut request_id_span = None;
    // Completions: `n` answers for each prompt of a list.
    let mut prompts = 1u32;
    let prompt_chars = match endpoint {
        Endpoint::Chat => {
            let Some(Count { chars, .. }) = raw.messages else {
                return Err(invalid(
                    "messages",
                    "`messages` is required on /v1/chat/completions (an array of {\"role\", \"content\"}); for a plain `prompt` use /v1/completions.",
                ));
            };
            chars
        }
        Endpoint::Completions => {
            let Some(Count {
                chars,
                prompts: count,
                ..
            }) = raw.prompt
            else {
                return Err(invalid(
                    "prompt",
                    "`prompt` is required on /v1/completions; for chat `messages` use /v1/chat/completions.",
                ));
            };
            prompts = count.max(1);
            chars
        }
        Endpoint::Tokenize => match (raw.prompt, raw.messages) {
            (Some(Count { chars, .. }), _) | (None, Some(Count { chars, .. })) => chars,
            (None, None) => {
                return Err(invalid(
                    "prompt",
                    "`prompt` (a string) or `messages` (chat messages, tokenized through the model's chat template) is required on /tokenize.",
                ));
            }
        },
        Endpoint::Detokenize => {
            let Some(tokens) = raw.tokens.filter(|t| t.get() != "null") else {
                return Err(invalid(
                    "tokens",
                    "`tokens` (an array of token ids, as /tokenize returns them) is required on /detokenize.",
                ));
            };
            let ids: Vec<IgnoredAny> = serde_json::from_str(tokens.get()).map_err(|_| {
                invalid(
                    "tokens",
                    format!(
                        "`tokens` must be an array of token ids, got `{}`.",
                        short(tokens.get())
                    ),
                )
            })?;
            // Sized like a completions prompt of token ids.
            ids.len() * 4
        }
        Endpoint::Responses => {
            let Some(Count { chars, .. }) = raw.input else {
                return Err(invalid(
                    "input",
                    "`input` is required on /v1/responses (a string, or a list of input items such as {\"role\": \"user\", \"content\": \"...\"}); for chat `messages` use /v1/chat/completions.",
                ));
            };
            previous_response_id = match raw.previous_response_id.map(RawValue::get) {
                None | Some("null") => None,
                Some(text) => {
                    let id: Cow<'_, str> = serde_json::from_str(text).map_err(|_| {
                        invalid(
                            "previous_response_id",
                            format!(
                                "`previous_response_id` must be the id of an earlier response (a string such as \"resp_...\"), got `{}`.",
                                short(text)
                            ),
                        )
                    })?;
                    Some(id)
                }
            };
            background = match raw.background.map(RawValue::get) {
                None | Some("null") | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(invalid(
                        "background",
                        format!("`background` must be a boolean, got `{}`.", short(other)),
                    ));
                }
            };
            store = match raw.store.map(RawValue::get) {
                None | Some("null") | Some("true") => true,
                Some("false") => false,
                Some(other) => {
                    return Err(invalid(
                        "store",
                        format!("`store` must be a boolean, got `{}`.", short(other)),
                    ));
                }
            };
            request_id_span = match raw.request_id {
                None => None,
                Some(r) if r.get() == "null" => None,
                Some(r) if r.get().starts_with('"') => {
                    Some(span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?)
                }
                Some(r) => {
                    return Err(invalid(
                        "request_id",
                        format!("`request_id` must be a string, got `{}`.", short(r.get())),
                    ));
                }
            };
            chars + raw.instructions.map_or(0, |c| c.chars)
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            let Some(Count { chars, .. }) = raw.messages else {
                return Err(invalid(
                    "messages",
                    format!(
                        "`messages` is required on {} (an array of {{\"role\", \"content\"}}).",
                        endpoint.path()
                    ),
                ));
            };
            chars + raw.system.map_or(0, |c| c.chars)
        }
        // No body is read for these; the others have their own parsers.
        Endpoint::ResponseGet
        | Endpoint::ResponseCancel
        | Endpoint::ChatBatch
        | Endpoint::Embeddings
        | Endpoint::CohereEmbed
        | Endpoint::Rerank
        | Endpoint::RerankV1
        | Endpoint::RerankV2
        | Endpoint::Score
        | Endpoint::ScoreV1
        | Endpoint::Classify
        | Endpoint::Pooling
        | Endpoint::Transcriptions
        | Endpoint::Translations => 0,
    };
    let priority = client_priority(raw.priority, body, endpoint)?;
    let GenerationFields {
        stream,
        max_tokens,
        n,
        include_usage,
        stream_options_span,
    } = generation;
    Ok(RequestView {
        model,
        model_span,
        stream,
        max_tokens,
        n: n.saturating_mul(prompts),
        include_usage,
        stream_options_span,
        prompt_chars,
        user: raw.user.map(RawValue::get).filter(|u| *u != "null"),
        previous_response_id,
        background,
        store,
        request_id_span,
        priority,
    })
}

fn generation_fields(
    raw: &RawBody<'_>,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<GenerationFields, ViewError> {
    let stream = match raw.stream.map(RawValue::get) {
        None | Some("null") | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(invalid(
                "stream",
                format!("`stream` must be a boolean (true or false), got `{other}`."),
            ));
        }
    };
    match endpoint {
        // The Responses API names its limit `max_output_tokens`, and has no `n`.
        Endpoint::Responses => {
            return Ok(GenerationFields {
                stream,
                max_tokens: opt_u64(raw.max_output_tokens, "max_output_tokens")?,
                ..GenerationFields::NONE
            });
        }
        // Anthropic requires `max_tokens` (its API refuses a request without it).
        Endpoint::Messages => {
            let Some(max_tokens) = opt_u64(raw.max_tokens, "max_tokens")? else {
                return Err(invalid(
                    "max_tokens",
                    "`max_tokens` is required on /v1/messages: the most tokens the answer may have, e.g. \"max_tokens\": 1024.",
                ));
            };
            return Ok(GenerationFields {
                stream,
                max_tokens: Some(max_tokens),
                ..GenerationFields::NONE
            });
        }
        _ => {}
    }
    let max_tokens = opt_u64(raw.max_tokens, "max_tokens")?;
    let max_completion_tokens = opt_u64(raw.max_completion_tokens, "max_completion_tokens")?;
    let n = match opt_u64(raw.n, "n")? {
        None => 1,
        Some(0) => return Err(invalid("n", "`n` must be at least 1.")),
        Some(n) => u32::try_from(n).map_err(|_| invalid("n", "`n` is too large."))?,
    };
    // The value's bytes, `null` included: an injected `include_usage` replaces them.
    let stream_options_span = match raw.stream_options {
        Some(r) => Some(span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?),
        None => None,
    };
    let include_usage = match raw.stream_options.map(RawValue::get) {
        None | Some("null") => None,
        Some(text) => {
            let so: StreamOptions = serde_json::from_str(text).map_err(|e| {
                invalid(
                    "stream_options",
                    format!(
                        "`stream_options` must be an object like {{\"include_usage\": true}}: {e}."
                    ),
                )
            })?;
            let _ = so.continuous_usage_stats;
            so.include_usage
        }
    };
    Ok(GenerationFields {
        stream,
        max_tokens: output_limit(max_completion_tokens, max_tokens),
        n,
        include_usage,
        stream_options_span,
    })
}
