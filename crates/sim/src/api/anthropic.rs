//! What vLLM's Anthropic layer reads: the `/v1/messages` request (generated through
//! `generation`), its prompt and tool-choice check, and `/v1/messages/count_tokens`.

use serde::Deserialize;

use crate::args::SimConfig;
use crate::lora::Adapters;

use super::error::ApiError;
use super::{ChatMessage, MessageContent, bad, chat_texts, check_model, prompt_tokens, validate};

/// `POST /v1/messages` (and `count_tokens`, without `max_tokens`).
#[derive(Deserialize)]
pub(super) struct MessagesRequest {
    /// What `count_tokens` reads too: the model, the conversation and its tools.
    #[serde(flatten)]
    pub conversation: CountTokensRequest,
    pub max_tokens: i64,
    pub stream: Option<bool>,
    pub thinking: Option<serde_json::Value>,
}

#[derive(Deserialize)]
pub(super) struct CountTokensRequest {
    #[serde(default)]
    pub tools: Option<Vec<serde::de::IgnoredAny>>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub system: Option<MessageContent>,
}

/// vLLM's Anthropic layer asks for `tool_choice: auto` when tools come without a choice, and
/// refuses it unless the server was started with a tool parser.
pub(super) fn auto_tool_choice(
    tools: Option<&[serde::de::IgnoredAny]>,
    choice: Option<&serde_json::Value>,
    cfg: &SimConfig,
) -> Result<(), ApiError> {
    let auto = choice.is_none_or(|c| c["type"] == "auto");
    if tools.is_some_and(|t| !t.is_empty()) && auto && !cfg.auto_tool_choice {
        return Err(bad(
            "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
        ));
    }
    Ok(())
}

/// The text an Anthropic request's template reads: the system prompt, then each message's.
pub(super) fn anthropic_prompt(
    messages: &[ChatMessage],
    system: Option<&MessageContent>,
) -> String {
    let mut prompt = String::new();
    match system {
        Some(MessageContent::Text(t)) => prompt.push_str(t),
        Some(MessageContent::Parts(parts)) => {
            for p in parts.iter().filter_map(|p| p.text.as_deref()) {
                prompt.push_str(p);
            }
        }
        None => {}
    }
    for t in chat_texts(messages) {
        prompt.push_str(t);
    }
    prompt
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as vLLM answers.
pub(crate) fn count_tokens(
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Vec<u8>, ApiError> {
    let r: CountTokensRequest = validate(body)?;
    check_model(Some(&r.model), cfg, adapters).map_err(ApiError::anthropic)?;
    auto_tool_choice(r.tools.as_deref(), r.tool_choice.as_ref(), cfg)
        .map_err(ApiError::anthropic)?;
    let n = prompt_tokens(&anthropic_prompt(&r.messages, r.system.as_ref()));
    Ok(serde_json::to_vec(&serde_json::json!({
        "input_tokens": n,
        "context_management": {"original_input_tokens": n},
    }))
    .unwrap_or_default())
}
