//! `/v1/chat/completions/batch`: a list of conversations, each answered whole.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::prompt::{Conversations, Count};
use super::{
    GenerationFields, RequestView, ViewError, client_priority, from_body, invalid, model_of,
    opt_u64, output_limit, present_raw,
};
use crate::Endpoint;

/// `/v1/chat/completions/batch`: `messages` is a list of conversations, each answered.
#[derive(Deserialize)]
struct BatchBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    messages: Option<Count<Conversations>>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present_raw")]
    priority: Option<&'a RawValue>,
}

pub(super) fn parse(body: &[u8]) -> Result<RequestView<'_>, ViewError> {
    let raw: BatchBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;
    let Some(Count {
        chars,
        prompts: count,
        ..
    }) = raw.messages.filter(|c| c.prompts > 0)
    else {
        return Err(invalid(
            "messages",
            "`messages` is required on /v1/chat/completions/batch: a list of conversations, each a list of {\"role\", \"content\"} messages.",
        ));
    };
    if !matches!(raw.stream.map(RawValue::get), None | Some("null" | "false")) {
        return Err(invalid(
            "stream",
            "`stream` is not supported on /v1/chat/completions/batch: each conversation's answer comes whole; stream one conversation at a time on /v1/chat/completions.",
        ));
    }
    let max_tokens = opt_u64(raw.max_tokens, "max_tokens")?;
    let max_completion_tokens = opt_u64(raw.max_completion_tokens, "max_completion_tokens")?;
    Ok(RequestView {
        model,
        model_span,
        prompt_chars: chars,
        user: raw.user.map(RawValue::get).filter(|u| *u != "null"),
        priority: client_priority(raw.priority, body, Endpoint::ChatBatch)?,
        ..RequestView::whole(GenerationFields {
            max_tokens: output_limit(max_completion_tokens, max_tokens),
            // One answer per conversation, like `n` choices of one prompt.
            n: count,
            ..GenerationFields::NONE
        })
    })
}
