//! The OpenAI request bodies the sim accepts and the vLLM-shaped JSON it answers with, and
//! vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`) on the sim's own tokenizer
//! (`tokens::pieces`), which also counts the prompt tokens of every generation.

use bytes::Bytes;
use http::StatusCode;
use serde::{Deserialize, Serialize};

use super::args::SimConfig;
use super::frames::Endpoint;
use super::prefix_cache::{block_hashes, text_block_hashes};
use super::tokens::{self, fnv1a, mix64};

/// Every error the sim answers with, in the body shape vLLM uses for it.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// `--api-key` set and the request lacks `Authorization: Bearer <key>`.
    Unauthorized,
    /// No such route (FastAPI's body).
    RouteNotFound,
    /// Known route, wrong method (FastAPI's body).
    MethodNotAllowed,
    /// The request names a model this sim does not serve: the model, and the names it does.
    ModelNotFound(String, String),
    /// Bad parameters, prompt too long: vLLM's `BadRequestError`, with the parameter it names.
    BadRequest(String),
    BadParam {
        message: String,
        param: &'static str,
    },
    /// A body FastAPI's validation refuses (malformed JSON, a missing or mistyped field):
    /// type `Bad Request`, `param` the pydantic location (`body.messages`, `body.31`).
    Validation { message: String, loc: String },
    /// Request body over the sim's limit.
    PayloadTooLarge,
    /// `--fail-rate` picked this request.
    InjectedFailure,
    /// Any other OpenAI-shaped error, as vLLM words it.
    Flat {
        status: StatusCode,
        message: String,
        kind: &'static str,
        param: Option<&'static str>,
    },
    /// An error of `/v1/messages` that vLLM's Anthropic layer shapes as Anthropic's
    /// (`{"type":"error","error":{"type":<its error class>,"message"}}`); request validation
    /// and auth keep their own shapes.
    Anthropic(Box<ApiError>),
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: u16,
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::RouteNotFound | ApiError::ModelNotFound(..) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BadRequest(_) | ApiError::BadParam { .. } | ApiError::Validation { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::InjectedFailure => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Flat { status, .. } => *status,
            ApiError::Anthropic(inner) => inner.status(),
        }
    }

    /// This error as `/v1/messages` answers it.
    pub fn anthropic(self) -> ApiError {
        match self {
            e @ (ApiError::Unauthorized
            | ApiError::Validation { .. }
            | ApiError::RouteNotFound
            | ApiError::MethodNotAllowed) => e,
            e => ApiError::Anthropic(Box::new(e)),
        }
    }

    pub fn body(&self) -> Bytes {
        let openai = |message: &str, kind: &str, param: Option<&str>| {
            let body = ErrorBody {
                error: ErrorInfo {
                    message,
                    kind,
                    param,
                    code: self.status().as_u16(),
                },
            };
            Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
        };
        match self {
            // vLLM's auth middleware and FastAPI's defaults answer in these bare shapes, not
            // the OpenAI error object; clients in the wild parse exactly these.
            ApiError::Unauthorized => Bytes::from_static(br#"{"error":"Unauthorized"}"#),
            ApiError::RouteNotFound => Bytes::from_static(br#"{"detail":"Not Found"}"#),
            ApiError::MethodNotAllowed => Bytes::from_static(br#"{"detail":"Method Not Allowed"}"#),
            ApiError::ModelNotFound(model, served) => openai(
                &format!("The model `{model}` does not exist. Valid aliases: {served}."),
                "NotFoundError",
                Some("model"),
            ),
            ApiError::BadRequest(msg) => openai(msg, "BadRequestError", None),
            ApiError::BadParam { message, param } => {
                openai(message, "BadRequestError", Some(param))
            }
            ApiError::Validation { message, loc } => openai(message, "Bad Request", Some(loc)),
            ApiError::PayloadTooLarge => openai(
                "Request body too large for the simulator.",
                "BadRequestError",
                None,
            ),
            ApiError::InjectedFailure => openai(
                "Simulated engine failure (--fail-rate)",
                "InternalServerError",
                None,
            ),
            ApiError::Flat {
                message,
                kind,
                param,
                ..
            } => openai(message, kind, *param),
            ApiError::Anthropic(inner) => {
                let v: serde_json::Value =
                    serde_json::from_slice(&inner.body()).unwrap_or_default();
                let body = serde_json::json!({
                    "type": "error",
                    "error": {"type": v["error"]["type"], "message": v["error"]["message"]},
                });
                Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
            }
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
    continuous_usage_stats: Option<bool>,
}

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

/// Parameters both endpoints share. Fields not listed (ignore_eos, temperature, stop, ...) are
/// accepted and ignored: the sim always generates exactly max_tokens, which is what ignore_eos
/// asks for anyway.
#[derive(Deserialize)]
struct SamplingParams {
    model: Option<String>,
    max_tokens: Option<i64>,
    /// Chat's newer name for max_tokens; wins when both are given, as in vLLM.
    max_completion_tokens: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    seed: Option<i64>,
    /// vLLM's scheduling priority (lower first; read with `--scheduling-policy priority`).
    priority: Option<i64>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
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

/// `POST /v1/messages` (and `count_tokens`, without `max_tokens`).
#[derive(Deserialize)]
struct MessagesRequest {
    /// What `count_tokens` reads too: the model, the conversation and its tools.
    #[serde(flatten)]
    conversation: CountTokensRequest,
    max_tokens: i64,
    stream: Option<bool>,
    thinking: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct CountTokensRequest {
    #[serde(default)]
    tools: Option<Vec<serde::de::IgnoredAny>>,
    #[serde(default)]
    tool_choice: Option<serde_json::Value>,
    model: String,
    messages: Vec<ChatMessage>,
    system: Option<MessageContent>,
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
    /// `/v1/responses` only.
    pub responses: ResponsesExtras,
    /// The answer ends at its end of sequence (`--output-tokens`), not at its limit.
    pub natural_end: bool,
    /// Hashes of the prompt's full KV blocks, for the prefix cache (empty when it is off).
    pub prompt_blocks: Vec<u64>,
    /// vLLM's `priority` (0 when not given).
    pub priority: i64,
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

/// Parses and validates a body in the order vLLM does: JSON, model, parameters, lengths.
pub(crate) fn parse_generation(
    endpoint: Endpoint,
    body: &[u8],
    cfg: &SimConfig,
) -> Result<GenRequest, ApiError> {
    let mut responses = ResponsesExtras::default();
    // How vLLM names the output limit in its refusal.
    let mut limit_name = "max_tokens";
    // The prompt as the engine sees it, cut into KV blocks for the prefix cache.
    let mut prompt_blocks = Vec::new();
    let caching = cfg.prefix_caching();
    let blocks_of = |text: &str| {
        if caching {
            text_block_hashes(text, cfg.block_size)
        } else {
            Vec::new()
        }
    };
    let (prompt_tokens, prompt_hash, params) = match endpoint {
        Endpoint::Chat => {
            let r: ChatRequest = validate(body)?;
            let mut prompt = String::new();
            let mut hash = cfg.seed;
            for t in chat_texts(&r.messages) {
                prompt.push_str(t);
                hash = fnv1a(hash, t.as_bytes());
            }
            prompt_blocks = blocks_of(&prompt);
            (prompt_tokens(&prompt), hash, r.params)
        }
        Endpoint::Completions => {
            let r: CompletionRequest = validate(body)?;
            let (tokens, hash) = prompt_size(&r.prompt, cfg.seed)?;
            if caching {
                prompt_blocks = completion_blocks(&r.prompt, cfg.block_size);
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
    )?;
    request.prompt_blocks = prompt_blocks;
    Ok(request)
}

/// The block hashes of a completions prompt `prompt_size` accepted: its text's tokens, or its
/// token ids.
fn completion_blocks(prompt: &serde_json::Value, block_size: u32) -> Vec<u64> {
    use serde_json::Value;
    let ids = |v: &[Value]| block_hashes(v.iter().filter_map(Value::as_u64), block_size);
    match prompt {
        Value::String(s) => text_block_hashes(s, block_size),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => text_block_hashes(s, block_size),
            [Value::Array(inner)] => ids(inner),
            all => ids(all),
        },
        _ => Vec::new(),
    }
}

/// The checks every generation shares, in vLLM's order (model, n, stream options, lengths),
/// on a prompt already counted.
fn sampling(
    prompt_tokens: u32,
    prompt_hash: u64,
    params: SamplingParams,
    limit_name: &'static str,
    responses: ResponsesExtras,
    cfg: &SimConfig,
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
    if let Some(m) = model.as_deref() {
        if !cfg.serves(m) {
            return Err(ApiError::ModelNotFound(
                m.to_owned(),
                cfg.served_names.join(", "),
            ));
        }
    }
    if let Some(n) = n {
        if n != 1 {
            return Err(bad(format!(
                "n={n} is not supported by the simulator; only n=1"
            )));
        }
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
    let token_seed = match seed {
        Some(s) => mix64(prompt_hash ^ mix64(s as u64)),
        None => prompt_hash,
    };
    Ok(GenRequest {
        prompt_tokens,
        max_tokens,
        stream,
        include_usage,
        continuous_usage,
        token_seed,
        responses,
        natural_end,
        prompt_blocks: Vec::new(),
        priority: priority.unwrap_or(0),
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

/// vLLM's Anthropic layer asks for `tool_choice: auto` when tools come without a choice, and
/// refuses it unless the server was started with a tool parser.
fn auto_tool_choice(
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
fn anthropic_prompt(messages: &[ChatMessage], system: Option<&MessageContent>) -> String {
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
pub(crate) fn count_tokens(body: &[u8], cfg: &SimConfig) -> Result<Vec<u8>, ApiError> {
    let r: CountTokensRequest = validate(body)?;
    check_model(Some(&r.model), cfg).map_err(ApiError::anthropic)?;
    auto_tool_choice(r.tools.as_deref(), r.tool_choice.as_ref(), cfg)
        .map_err(ApiError::anthropic)?;
    let n = prompt_tokens(&anthropic_prompt(&r.messages, r.system.as_ref()));
    Ok(serde_json::to_vec(&serde_json::json!({
        "input_tokens": n,
        "context_management": {"original_input_tokens": n},
    }))
    .unwrap_or_default())
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

/// `POST /tokenize`: a completion-style `prompt` (a string) or chat `messages` (through the
/// sim's chat template). The sim has no special tokens, so `add_special_tokens` and the chat
/// options change nothing; other fields are accepted and ignored, as vLLM does.
#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<serde_json::Value>,
    messages: Option<Vec<ChatMessage>>,
    return_token_strs: Option<bool>,
}

#[derive(Serialize)]
struct TokenizeResponse<'a> {
    count: usize,
    max_model_len: u32,
    tokens: Vec<u64>,
    token_strs: Option<Vec<&'a str>>,
}

/// `POST /detokenize`.
#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u64>,
}

#[derive(Serialize)]
struct DetokenizeResponse {
    prompt: String,
}

fn check_model(model: Option<&str>, cfg: &SimConfig) -> Result<(), ApiError> {
    match model {
        Some(m) if !cfg.serves(m) => Err(ApiError::ModelNotFound(
            m.to_owned(),
            cfg.served_names.join(", "),
        )),
        _ => Ok(()),
    }
}

/// The answer to `POST /tokenize`, as vLLM gives it.
pub(crate) fn tokenize(body: &[u8], cfg: &SimConfig) -> Result<Vec<u8>, ApiError> {
    let r: TokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("JSON decode error: {e}")))?;
    check_model(r.model.as_deref(), cfg)?;
    let text: String = match (&r.prompt, &r.messages) {
        (Some(serde_json::Value::String(p)), _) => p.clone(),
        (Some(_), _) => return Err(bad("prompt must be a string")),
        (None, Some(messages)) => chat_texts(messages).collect(),
        (None, None) => return Err(bad("either prompt or messages is required")),
    };
    let pieces: Vec<&str> = tokens::pieces(&text).collect();
    let answer = TokenizeResponse {
        count: pieces.len(),
        max_model_len: cfg.max_model_len,
        tokens: pieces.iter().map(|p| tokens::token_id(p)).collect(),
        token_strs: r.return_token_strs.unwrap_or(false).then_some(pieces),
    };
    Ok(serde_json::to_vec(&answer).unwrap_or_default())
}

/// The answer to `POST /detokenize`: the text of the ids, or a 400 naming the first id that
/// is not a token of the sim's tokenizer.
pub(crate) fn detokenize(body: &[u8], cfg: &SimConfig) -> Result<Vec<u8>, ApiError> {
    let r: DetokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("JSON decode error: {e}")))?;
    check_model(r.model.as_deref(), cfg)?;
    let mut prompt = String::new();
    for id in r.tokens {
        let text = tokens::token_text(id)
            .ok_or_else(|| bad(format!("token id {id} is out of vocabulary")))?;
        prompt.push_str(&text);
    }
    Ok(serde_json::to_vec(&DetokenizeResponse { prompt }).unwrap_or_default())
}

/// The `system_fingerprint` the sim reports (vLLM's is `vllm-<version>-<hash>`).
pub(crate) const SYSTEM_FINGERPRINT: &str = "vllm-0.32.0-fleetgatesim";

#[derive(Serialize)]
struct Usage {
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
    fn new(prompt: u32, completion: u32) -> Self {
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
struct ChatChoice<'a> {
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

fn chat_choice<'a>(index: u32, text: &'a str, finish_reason: &'a str) -> ChatChoice<'a> {
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

fn chat_completion_json(
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
pub(crate) fn parse_batch(body: &[u8], cfg: &SimConfig) -> Result<BatchRequest, ApiError> {
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
        )?);
    }
    Ok(BatchRequest {
        conversations,
        stream,
    })
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
    pub fn to_json(&self) -> Vec<u8> {
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

#[derive(Serialize)]
struct ModelPermission {
    id: String,
    object: &'static str,
    created: u64,
    allow_create_engine: bool,
    allow_sampling: bool,
    allow_logprobs: bool,
    allow_search_indices: bool,
    allow_view: bool,
    allow_fine_tuning: bool,
    organization: &'static str,
    group: Option<()>,
    is_blocking: bool,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<()>,
    max_model_len: u32,
    permission: [ModelPermission; 1],
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

/// `GET /v1/models`: one card per served name, as vLLM lists them. `root` is the model vLLM
/// loaded (its path), the same on every card: the sim's stand-in is its first served name.
pub(crate) fn model_list(cfg: &SimConfig, created: u64) -> Vec<u8> {
    let root = cfg.served_names.first().map_or("", String::as_str);
    let data = cfg
        .served_names
        .iter()
        .map(|name| ModelCard {
            id: name,
            object: "model",
            created,
            owned_by: "vllm",
            root,
            parent: None,
            max_model_len: cfg.max_model_len,
            permission: [ModelPermission {
                id: format!("modelperm-{:016x}", rand::random::<u64>()),
                object: "model_permission",
                created,
                allow_create_engine: false,
                allow_sampling: true,
                allow_logprobs: true,
                allow_search_indices: false,
                allow_view: true,
                allow_fine_tuning: false,
                organization: "*",
                group: None,
                is_blocking: false,
            }],
        })
        .collect();
    serde_json::to_vec(&ModelList {
        object: "list",
        data,
    })
    .unwrap_or_default()
}
