//! The chat batch (`POST /v1/chat/completions/batch`): its request, checked conversation by
//! conversation like a chat request, and its one `chat.completion` answer.

use serde::Deserialize;

use crate::args::SimConfig;
use crate::lora::Adapters;
use crate::tokens::fnv1a;

use super::answer::{Usage, chat_choice, chat_completion_json};
use super::error::ApiError;
use super::generation::{GenRequest, ResponsesExtras, SamplingParams, sampling};
use super::{ChatMessage, chat_texts, prompt_tokens, validate};

/// One conversation's answer in a chat batch.
pub(crate) struct BatchAnswer {
    pub text: String,
    pub finish_reason: &'static str,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// The answer to `POST /v1/chat/completions/batch`: one `chat.completion` whose choices are the
/// conversations' answers, indexed in request order, and whose usage is their sum.
pub(crate) fn batch_chat_json(
    id: &str,
    created: u64,
    model: &str,
    answers: &[BatchAnswer],
) -> Vec<u8> {
    let prompt: u32 = answers
        .iter()
        .map(|a| a.prompt_tokens)
        .fold(0, u32::saturating_add);
    let completion: u32 = answers
        .iter()
        .map(|a| a.completion_tokens)
        .fold(0, u32::saturating_add);
    let choices = answers
        .iter()
        .zip(0u32..)
        .map(|(a, i)| chat_choice(i, &a.text, a.finish_reason))
        .collect();
    chat_completion_json(id, created, model, choices, Usage::new(prompt, completion))
}

/// `POST /v1/chat/completions/batch`: `messages` is a list of conversations, each answered
/// as a chat completion of its own with the request's sampling fields.
#[derive(Deserialize)]
struct BatchChatRequest {
    messages: Vec<Vec<ChatMessage>>,
    #[serde(flatten)]
    params: SamplingParams,
}

/// A validated chat batch: one generation per conversation, and whether it asked to stream.
pub(crate) struct BatchRequest {
    pub conversations: Vec<GenRequest>,
    pub stream: bool,
}

/// Parses a chat batch as vLLM 0.32 does: `n` other than 1 is refused, each conversation is
/// checked like a chat request. `stream: true` is not refused (vLLM's validator does not look
/// at it) and is reported back: vLLM then answers one JSON body anyway.
pub(crate) fn parse_batch(
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<BatchRequest, ApiError> {
    let mut r: BatchChatRequest = validate(body)?;
    if let Some(n) = r.params.n.filter(|n| *n != 1) {
        return Err(ApiError::BadParam {
            message: format!(
                "Batch chat completions do not support `n > 1`. Please set `n` to 1. (parameter=n, value={n})"
            ),
            param: "n",
        });
    }
    let too_short = |loc: String| ApiError::Validation {
        message: format!(
            "1 validation error:\n  {{'type': 'too_short', 'loc': '{loc}', 'msg': 'List should have at least 1 item after validation, not 0'}}"
        ),
        loc,
    };
    if r.messages.is_empty() {
        return Err(too_short("body.messages".into()));
    }
    if let Some(i) = r.messages.iter().position(Vec::is_empty) {
        return Err(too_short(format!("body.messages.{i}")));
    }
    let stream = r.params.stream.take().unwrap_or(false);
    r.params.stream_options = None;
    let mut conversations = Vec::with_capacity(r.messages.len());
    for conversation in &r.messages {
        let mut prompt = String::new();
        let mut hash = cfg.seed;
        for t in chat_texts(conversation) {
            prompt.push_str(t);
            hash = fnv1a(hash, t.as_bytes());
        }
        let params = SamplingParams {
            model: r.params.model.clone(),
            max_tokens: r.params.max_tokens,
            max_completion_tokens: r.params.max_completion_tokens,
            stream: None,
            stream_options: None,
            n: None,
            seed: r.params.seed,
            priority: r.params.priority,
        };
        conversations.push(sampling(
            prompt_tokens(&prompt),
            hash,
            params,
            "max_tokens",
            ResponsesExtras::default(),
            cfg,
            adapters,
        )?);
    }
    Ok(BatchRequest {
        conversations,
        stream,
    })
}
