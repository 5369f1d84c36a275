//! The non-streaming answers of chat and completions: one `chat.completion` or
//! `text_completion` object in vLLM 0.32's shape, with its usage.

use serde::Serialize;

use crate::frames::Endpoint;

/// The `system_fingerprint` the sim reports (vLLM's is `vllm-<version>-<hash>`).
pub(crate) const SYSTEM_FINGERPRINT: &str = "vllm-0.32.0-fleetgatesim";

#[derive(Serialize)]
pub(super) struct Usage {
    prompt_tokens: u32,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: Option<PromptTokensDetails>,
    completion_tokens_details: Option<()>,
}

/// vLLM's `PromptTokenUsageInfo`, written only with `--enable-prompt-tokens-details`.
#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
    created_cache_tokens: Option<()>,
    multimodal_tokens: Option<()>,
}

impl Usage {
    pub(super) fn new(prompt: u32, completion: u32) -> Self {
        Self {
            prompt_tokens: prompt,
            total_tokens: u64::from(prompt) + u64::from(completion),
            completion_tokens: completion,
            prompt_tokens_details: None,
            completion_tokens_details: None,
        }
    }

    fn cached(mut self, cached: Option<u32>) -> Self {
        self.prompt_tokens_details = cached.map(|cached_tokens| PromptTokensDetails {
            cached_tokens,
            created_cache_tokens: None,
            multimodal_tokens: None,
        });
        self
    }
}

/// vLLM 0.32's assistant message, every optional field present as `null`.
#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'static str,
    content: &'a str,
    refusal: Option<()>,
    annotations: Option<()>,
    audio: Option<()>,
    function_call: Option<()>,
    reasoning: Option<()>,
}

#[derive(Serialize)]
pub(super) struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    logprobs: Option<()>,
    finish_reason: &'a str,
    stop_reason: Option<()>,
    token_ids: Option<()>,
    routed_experts: Option<()>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: &'a str,
    stop_reason: Option<()>,
    token_ids: Option<()>,
    prompt_logprobs: Option<()>,
    prompt_token_ids: Option<()>,
    routed_experts: Option<()>,
}

/// The fields after `usage` that only chat answers carry.
#[derive(Serialize)]
struct ChatExtras {
    prompt_logprobs: Option<()>,
    prompt_token_ids: Option<()>,
    prompt_text: Option<()>,
}

#[derive(Serialize)]
struct Completion<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    service_tier: Option<()>,
    system_fingerprint: &'static str,
    usage: Usage,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    chat: Option<ChatExtras>,
    kv_transfer_params: Option<()>,
    ec_transfer_params: Option<()>,
    metrics: Option<()>,
}

pub(super) fn chat_choice<'a>(index: u32, text: &'a str, finish_reason: &'a str) -> ChatChoice<'a> {
    ChatChoice {
        index,
        message: ChatMessageOut {
            role: "assistant",
            content: text,
            refusal: None,
            annotations: None,
            audio: None,
            function_call: None,
            reasoning: None,
        },
        logprobs: None,
        finish_reason,
        stop_reason: None,
        token_ids: None,
        routed_experts: None,
    }
}

pub(super) fn chat_completion_json(
    id: &str,
    created: u64,
    model: &str,
    choices: Vec<ChatChoice<'_>>,
    usage: Usage,
) -> Vec<u8> {
    serde_json::to_vec(&Completion {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        service_tier: None,
        system_fingerprint: SYSTEM_FINGERPRINT,
        usage,
        chat: Some(ChatExtras {
            prompt_logprobs: None,
            prompt_token_ids: None,
            prompt_text: None,
        }),
        kv_transfer_params: None,
        ec_transfer_params: None,
        metrics: None,
    })
    .unwrap_or_default()
}

/// The non-streaming answer: one `chat.completion` or `text_completion` object.
pub(crate) struct FinalAnswer<'a> {
    pub endpoint: Endpoint,
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    pub text: &'a str,
    pub finish_reason: &'a str,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// `Some` with `--enable-prompt-tokens-details`: `usage.prompt_tokens_details`.
    pub cached_tokens: Option<u32>,
}

impl FinalAnswer<'_> {
    pub(crate) fn to_json(&self) -> Vec<u8> {
        let usage =
            Usage::new(self.prompt_tokens, self.completion_tokens).cached(self.cached_tokens);
        let out = match self.endpoint {
            Endpoint::Chat => {
                return chat_completion_json(
                    self.id,
                    self.created,
                    self.model,
                    vec![chat_choice(0, self.text, self.finish_reason)],
                    usage,
                );
            }
            // (Their whole answers are `sim::agents`'.)
            Endpoint::Completions | Endpoint::Responses | Endpoint::Messages => {
                serde_json::to_vec(&Completion {
                    id: self.id,
                    object: "text_completion",
                    created: self.created,
                    model: self.model,
                    choices: vec![TextChoice {
                        index: 0,
                        text: self.text,
                        logprobs: None,
                        finish_reason: self.finish_reason,
                        stop_reason: None,
                        token_ids: None,
                        prompt_logprobs: None,
                        prompt_token_ids: None,
                        routed_experts: None,
                    }],
                    service_tier: None,
                    system_fingerprint: SYSTEM_FINGERPRINT,
                    usage,
                    chat: None,
                    kv_transfer_params: None,
                    ec_transfer_params: None,
                    metrics: None,
                })
            }
        };
        out.unwrap_or_default()
    }
}
