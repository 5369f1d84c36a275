//! The generation requests (chat, completions, Responses and Anthropic messages) and their
//! validation into a `GenRequest`, in the order vLLM checks them: JSON, model, parameters,
//! lengths.

use std::sync::Arc;

use serde::Deserialize;

use crate::args::SimConfig;
use crate::frames::Endpoint;
use crate::lora::{Adapters, LoraAdapter};
use crate::prefix_cache::{PromptBlocks, blocks, text_blocks};
use crate::tokens::{fnv1a, mix64};

use super::anthropic::{MessagesRequest, anthropic_prompt, auto_tool_choice};
use super::error::ApiError;
use super::{ChatMessage, bad, chat_texts, prompt_tokens, validate};

#[derive(Deserialize)]
pub(super) struct StreamOptions {
    include_usage: Option<bool>,
    continuous_usage_stats: Option<bool>,
}

/// Parameters both endpoints share. Fields not listed (ignore_eos, temperature, stop, ...) are
/// accepted and ignored: the sim always generates exactly max_tokens, which is what ignore_eos
/// asks for anyway.
#[derive(Deserialize)]
pub(super) struct SamplingParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// Chat's newer name for max_tokens; wins when both are given, as in vLLM.
    pub max_completion_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub seed: Option<i64>,
    /// vLLM's scheduling priority (lower first; read with `--scheduling-policy priority`).
    pub priority: Option<i64>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
    /// vLLM's chat template switches: `true` by default; a continuation sets it `false`.
    add_generation_prompt: Option<bool>,
    /// The final message is the start of the answer, to be continued (vLLM's extension).
    continue_final_message: Option<bool>,
    #[serde(flatten)]
    params: SamplingParams,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: serde_json::Value,
    #[serde(flatten)]
    params: SamplingParams,
}

/// `POST /v1/responses`: `input` is a string or a list of items (their `content` text counts).
#[derive(Deserialize)]
struct ResponsesRequest {
    input: ResponsesInput,
    instructions: Option<String>,
    model: Option<String>,
    max_output_tokens: Option<i64>,
    stream: Option<bool>,
    previous_response_id: Option<String>,
    background: Option<bool>,
    store: Option<bool>,
    seed: Option<i64>,
    priority: Option<i64>,
    #[serde(default)]
    tools: Vec<serde_json::Value>,
    tool_choice: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ResponsesInput {
    Text(String),
    Items(Vec<ChatMessage>),
}

/// What a Responses request asks besides generation.
#[derive(Debug, Default)]
pub(crate) struct ResponsesExtras {
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub background: bool,
    pub store: bool,
    pub max_output_tokens: Option<u32>,
    /// The request's tools as vLLM echoes them in the response object.
    pub tools: Vec<serde_json::Value>,
    pub tool_choice: &'static str,
}

/// A validated generation request.
#[derive(Debug)]
pub(crate) struct GenRequest {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// `continuous_usage_stats` with `include_usage`: usage on every chunk.
    pub continuous_usage: bool,
    /// Seed of the token texts: the sim seed folded with the prompt (and the request seed).
    pub token_seed: u64,
    /// Tokens of the seed's answer already given (`continue_final_message`): the answer goes on
    /// from there.
    pub token_skip: u32,
    /// `/v1/responses` only.
    pub responses: ResponsesExtras,
    /// The answer ends at its end of sequence (`--output-tokens`), not at its limit.
    pub natural_end: bool,
    /// Hashes of the prompt's full KV blocks, for the prefix cache (empty when it is off).
    pub prompt_blocks: PromptBlocks,
    /// vLLM's `priority` (0 when not given).
    pub priority: i64,
    /// The LoRA adapter the request names as its `model`.
    pub adapter: Option<Arc<LoraAdapter>>,
}

/// Parses and validates a body in the order vLLM does: JSON, model, parameters, lengths.
pub(crate) fn parse_generation(
    endpoint: Endpoint,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<GenRequest, ApiError> {
    let mut responses = ResponsesExtras::default();
    // How vLLM names the output limit in its refusal.
    let mut limit_name = "max_tokens";
    // The prompt as the engine sees it, cut into KV blocks for the prefix cache.
    let mut prompt_blocks = PromptBlocks::default();
    let caching = cfg.prefix_caching();
    let keep_tokens = cfg.kv_events.is_some();
    let blocks_of = |text: &str| {
        if caching {
            text_blocks(text, cfg.block_size, keep_tokens)
        } else {
            PromptBlocks::default()
        }
    };
    // A continued answer (chat's `continue_final_message`, a completion's prompt ending with
    // the sim's own words): the seed of the answer it continues, and the tokens given.
    let mut resumed: Option<(u64, u32)> = None;
    let (prompt_tokens, prompt_hash, params) = match endpoint {
        Endpoint::Chat => {
            let r: ChatRequest = validate(body)?;
            let continues = r.continue_final_message == Some(true);
            if continues && r.add_generation_prompt != Some(false) {
                return Err(bad(
                    "continue_final_message and add_generation_prompt are not compatible. Use \
                     continue_final_message when you want the model to continue the final \
                     message, and add_generation_prompt when you want to add a header that will \
                     prompt it to start a new assistant message instead.",
                ));
            }
            let mut prompt = String::new();
            let mut hash = cfg.seed;
            // A continuation's answer is seeded by the conversation before the message it
            // continues: the same answer as the request that began it.
            let (before, last) = match r.messages.split_last() {
                Some((last, before)) if continues => (before, Some(last)),
                _ => (r.messages.as_slice(), None),
            };
            for t in chat_texts(before) {
                prompt.push_str(t);
                hash = fnv1a(hash, t.as_bytes());
            }
            if let Some(last) = last {
                let text: String = chat_texts(std::slice::from_ref(last)).collect();
                prompt.push_str(&text);
                let seed = token_seed(hash, r.params.seed);
                resumed = Some((seed, own_tokens(seed, &text)));
            }
            let tokens = match &cfg.tokens {
                // The model's own tokens, as the template renders the request.
                Some(model) => {
                    let ids = model.chat(body).map_err(bad)?;
                    if caching {
                        prompt_blocks = model_blocks(&ids, cfg.block_size, keep_tokens);
                    }
                    u32::try_from(ids.len()).unwrap_or(u32::MAX)
                }
                None => {
                    prompt_blocks = blocks_of(&prompt);
                    prompt_tokens(&prompt)
                }
            };
            (tokens, hash, r.params)
        }
        Endpoint::Completions => {
            let r: CompletionRequest = validate(body)?;
            let (mut tokens, hash) = prompt_size(&r.prompt, cfg.seed)?;
            let text = match &r.prompt {
                serde_json::Value::String(s) => Some(s.as_str()),
                serde_json::Value::Array(one) => match one.as_slice() {
                    [serde_json::Value::String(s)] => Some(s.as_str()),
                    _ => None,
                },
                _ => None,
            };
            resumed = text.and_then(|t| continued_split(cfg.seed, r.params.seed, t));
            match (&cfg.tokens, text) {
                (Some(model), Some(text)) => {
                    let ids = model.completion(text).map_err(bad)?;
                    tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
                    if caching {
                        prompt_blocks = model_blocks(&ids, cfg.block_size, keep_tokens);
                    }
                }
                _ if caching => {
                    prompt_blocks = completion_blocks(&r.prompt, cfg.block_size, keep_tokens);
                }
                _ => {}
            }
            (tokens, hash, r.params)
        }
        Endpoint::Responses => {
            let r: ResponsesRequest = validate(body)?;
            let tools = response_tools(&r.tools)?;
            let tool_choice = match r.tool_choice.as_ref().and_then(|c| c.as_str()) {
                Some("none") => "none",
                Some("required") => "required",
                _ if tools.is_empty() => "none",
                _ => "auto",
            };
            let mut prompt = r.instructions.clone().unwrap_or_default();
            match &r.input {
                ResponsesInput::Text(t) => prompt.push_str(t),
                ResponsesInput::Items(items) => {
                    for t in chat_texts(items) {
                        prompt.push_str(t);
                    }
                }
            }
            prompt_blocks = blocks_of(&prompt);
            limit_name = "max_output_tokens";
            responses = ResponsesExtras {
                instructions: r.instructions,
                previous_response_id: r.previous_response_id,
                background: r.background.unwrap_or(false),
                store: r.store.unwrap_or(true),
                max_output_tokens: r.max_output_tokens.and_then(|m| u32::try_from(m).ok()),
                tools,
                tool_choice,
            };
            let params = SamplingParams {
                model: r.model,
                max_tokens: r.max_output_tokens,
                max_completion_tokens: None,
                stream: r.stream,
                stream_options: None,
                n: None,
                seed: r.seed,
                priority: r.priority,
            };
            (
                prompt_tokens(&prompt),
                fnv1a(cfg.seed, prompt.as_bytes()),
                params,
            )
        }
        Endpoint::Messages => {
            let r: MessagesRequest = validate(body)?;
            let c = r.conversation;
            auto_tool_choice(c.tools.as_deref(), c.tool_choice.as_ref(), cfg)?;
            // The sim has no reasoning parser, as vLLM started without `--reasoning-parser`.
            if r.thinking.as_ref().is_some_and(|t| t["type"] == "enabled") {
                return Err(bad(
                    "thinking_token_budget is set but reasoning_config is not configured. Please set --reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
                ));
            }
            let prompt = anthropic_prompt(&c.messages, c.system.as_ref());
            prompt_blocks = blocks_of(&prompt);
            if r.max_tokens < 1 {
                return Err(ApiError::Validation {
                    message: "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must be positive'}".into(),
                    loc: "body.max_tokens".into(),
                });
            }
            limit_name = "max_completion_tokens";
            let params = SamplingParams {
                model: Some(c.model),
                max_tokens: Some(r.max_tokens),
                max_completion_tokens: None,
                stream: r.stream,
                stream_options: None,
                n: None,
                seed: None,
                priority: None,
            };
            (
                prompt_tokens(&prompt),
                fnv1a(cfg.seed, prompt.as_bytes()),
                params,
            )
        }
    };
    let mut request = sampling(
        prompt_tokens,
        prompt_hash,
        params,
        limit_name,
        responses,
        cfg,
        adapters,
    )?;
    request.prompt_blocks = prompt_blocks;
    if let Some(a) = &request.adapter {
        a.key_blocks(&mut request.prompt_blocks);
    }
    if let Some((seed, skip)) = resumed {
        request.token_seed = seed;
        request.token_skip = skip;
        // An answer with a natural end ends where the one it continues would have.
        if let Some(n) = cfg.output_tokens {
            let left = n.saturating_sub(request.token_skip).max(1);
            if left < request.max_tokens || request.natural_end {
                request.max_tokens = left;
                request.natural_end = true;
            }
        }
    }
    Ok(request)
}

/// The seed of an answer's words: the prompt's hash, folded with the request's `seed`.
fn token_seed(prompt_hash: u64, seed: Option<i64>) -> u64 {
    match seed {
        Some(s) => mix64(prompt_hash ^ mix64(s as u64)),
        None => prompt_hash,
    }
}

/// A completion's prompt that ends with the start of the sim's own answer to the prompt before
/// it (a continuation, as a gateway resuming a cut stream sends): that answer's seed and the
/// tokens already given. Split points are looked for in the last 4 KiB, where a token of the
/// sim's vocabulary can start.
fn continued_split(sim_seed: u64, seed: Option<i64>, prompt: &str) -> Option<(u64, u32)> {
    let bytes = prompt.as_bytes();
    let from = bytes.len().saturating_sub(4096).max(1);
    // FNV-1a of each prefix, folded byte by byte as `fnv1a` does.
    let mut h = fnv1a(sim_seed, &bytes[..from]);
    for (p, &b) in bytes.iter().enumerate().skip(from) {
        if matches!(b, b' ' | b',' | b'.' | b'\n') && prompt.is_char_boundary(p) {
            let seed = token_seed(h, seed);
            let n = own_tokens(seed, &prompt[p..]);
            if n > 0 {
                return Some((seed, n));
            }
        }
        h = crate::tokens::fnv1a_step(h, b);
    }
    None
}

/// How many tokens of the answer seeded by `seed` `text` is, when it is exactly that answer's
/// start (a continuation of the sim's own words goes on where they stopped); 0 otherwise (the
/// answer starts afresh after the text, as a model continues any text).
fn own_tokens(seed: u64, text: &str) -> u32 {
    let mut source = crate::tokens::TokenSource::new(seed);
    let mut at = 0;
    let mut n = 0u32;
    while let Some(rest) = text.get(at..).filter(|r| !r.is_empty()) {
        let token = source.next_token();
        if !rest.starts_with(token) {
            return 0;
        }
        at += token.len();
        n += 1;
    }
    n
}

/// The blocks of a prompt in the model's own token ids (`--tokenizer`).
fn model_blocks(ids: &[u32], block_size: u32, keep: bool) -> PromptBlocks {
    blocks(ids.iter().map(|&id| u64::from(id)), block_size, keep)
}

/// The block hashes of a completions prompt `prompt_size` accepted: its text's tokens, or its
/// token ids.
fn completion_blocks(prompt: &serde_json::Value, block_size: u32, keep: bool) -> PromptBlocks {
    use serde_json::Value;
    let ids = |v: &[Value]| blocks(v.iter().filter_map(Value::as_u64), block_size, keep);
    match prompt {
        Value::String(s) => text_blocks(s, block_size, keep),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => text_blocks(s, block_size, keep),
            [Value::Array(inner)] => ids(inner),
            all => ids(all),
        },
        _ => PromptBlocks::default(),
    }
}

/// The checks every generation shares, in vLLM's order (model, n, stream options, lengths),
/// on a prompt already counted.
pub(super) fn sampling(
    prompt_tokens: u32,
    prompt_hash: u64,
    params: SamplingParams,
    limit_name: &'static str,
    responses: ResponsesExtras,
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<GenRequest, ApiError> {
    let SamplingParams {
        model,
        max_tokens,
        max_completion_tokens,
        stream,
        stream_options: opts,
        n,
        seed,
        priority,
    } = params;
    let max_tokens = max_completion_tokens.or(max_tokens);
    let adapter = super::check_model(model.as_deref(), cfg, adapters)?;
    if let Some(n) = n
        && n != 1
    {
        return Err(bad(format!(
            "n={n} is not supported by the simulator; only n=1"
        )));
    }
    let stream = stream.unwrap_or(false);
    if opts.is_some() && !stream {
        return Err(bad(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let include_usage = opts.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    // vLLM: without include_usage, continuous_usage_stats adds nothing.
    let continuous_usage =
        include_usage && opts.and_then(|o| o.continuous_usage_stats).unwrap_or(false);
    let limit = cfg.max_model_len;
    let max_tokens = match max_tokens {
        Some(m) if m < 1 => return Err(bad(format!("max_tokens must be at least 1, got {m}."))),
        Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
        // Like vLLM, an unset limit shrinks to what the context leaves.
        None => cfg
            .default_max_tokens
            .min(limit.saturating_sub(prompt_tokens))
            .max(1),
    };
    // vLLM 0.32: a prompt that leaves no room, or max_tokens alone over the context, is
    // refused naming the parameter; prompt + max_tokens over the context is clamped (the
    // answer ends with finish_reason "length").
    if prompt_tokens >= limit {
        return Err(ApiError::BadParam {
            message: format!(
                "This model's maximum context length is {limit} tokens. However, your prompt \
                 contains at least {prompt_tokens} input tokens, which exceeds this limit even \
                 without any output tokens. Please reduce the length of the input prompt. \
                 (parameter=input_tokens, value={prompt_tokens})"
            ),
            param: "input_tokens",
        });
    }
    if max_tokens > limit {
        return Err(ApiError::BadParam {
            message: format!(
                "{limit_name}={max_tokens} cannot be greater than max_model_len={limit}. Please \
                 request fewer output tokens. (parameter={limit_name}, value={max_tokens})"
            ),
            param: limit_name,
        });
    }
    let max_tokens = max_tokens.min(limit - prompt_tokens);
    let (max_tokens, natural_end) = match cfg.output_tokens {
        Some(n) if n < max_tokens => (n, true),
        _ => (max_tokens, false),
    };
    let token_seed = token_seed(prompt_hash, seed);
    Ok(GenRequest {
        prompt_tokens,
        max_tokens,
        stream,
        include_usage,
        continuous_usage,
        token_seed,
        token_skip: 0,
        responses,
        natural_end,
        prompt_blocks: PromptBlocks::default(),
        priority: priority.unwrap_or(0),
        adapter,
    })
}

/// A Responses request's tools as vLLM 0.32 echoes them: a function tool with its optional
/// fields written out as null; a custom tool with a grammar format refused, as vLLM does.
fn response_tools(tools: &[serde_json::Value]) -> Result<Vec<serde_json::Value>, ApiError> {
    tools
        .iter()
        .map(|t| match t["type"].as_str() {
            Some("function") => Ok(serde_json::json!({
                "name": t["name"],
                "parameters": t["parameters"],
                "strict": t["strict"],
                "type": "function",
                "allowed_callers": null,
                "async": null,
                "defer_loading": null,
                "description": t["description"],
                "output_schema": null,
            })),
            Some("custom") if t["format"]["type"] == "grammar" => Err(ApiError::BadParam {
                message: "Custom tools with a grammar format are not supported; only free-form text custom tools are accepted. (parameter=tools)".into(),
                param: "tools",
            }),
            _ => Ok(t.clone()),
        })
        .collect()
}

/// A completions prompt: a string, a one-element list of strings, or token ids.
fn prompt_size(prompt: &serde_json::Value, seed: u64) -> Result<(u32, u64), ApiError> {
    use serde_json::Value;
    let text = |s: &str| (prompt_tokens(s), fnv1a(seed, s.as_bytes()));
    let ids = |v: &[Value]| -> Result<(u32, u64), ApiError> {
        let mut hash = seed;
        for t in v {
            let id = t
                .as_u64()
                .ok_or_else(|| bad("prompt token ids must be non-negative integers"))?;
            hash = fnv1a(hash, &id.to_le_bytes());
        }
        Ok((u32::try_from(v.len()).unwrap_or(u32::MAX).max(1), hash))
    };
    match prompt {
        Value::String(s) => Ok(text(s)),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => Ok(text(s)),
            [Value::Array(inner)] => ids(inner),
            all @ [Value::Number(_), ..] => ids(all),
            _ => Err(bad(
                "the simulator accepts a single prompt: a string, [string] or token ids",
            )),
        },
        _ => Err(bad(
            "prompt must be a string, a list of strings or token ids",
        )),
    }
}
