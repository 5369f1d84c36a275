//! vLLM's pooling API on the sim (`--runner pooling`): embeddings (OpenAI's `/v1/embeddings` and
//! Cohere's `/v2/embed`), `/pooling`, `/score`, `/rerank` and `/classify`, in vLLM 0.32's shapes
//! and with its refusals. The numbers are deterministic: an input's vector is a function of the
//! sim seed and the input alone, so equal texts score 1.0 against each other, as on a real model.
//!
//! This module holds the routes, the dispatch of a call to its route and what the routes share
//! (prompts, the checks vLLM makes on every pooling request, the list answer); the submodules:
//! - `model`: the sim model's numbers (embeddings, class probabilities) and their encodings.
//! - `pooled_list`: `/v1/embeddings`, `/pooling` and `/classify`.
//! - `cohere`: Cohere's `/v2/embed`.
//! - `score`: `/score` and `/rerank`.

mod cohere;
mod model;
mod pooled_list;
mod score;

use std::sync::Arc;

use serde::Serialize;

use super::api::{self, error::ApiError};
use super::args::{PoolingTask, SimConfig};
use super::lora::{Adapters, LoraAdapter, answer_model};
use super::tokens::fnv1a;

/// A pooling route of vLLM 0.32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolingRoute {
    Embeddings,
    CohereEmbed,
    Pooling,
    Score,
    Rerank,
    Classify,
}

impl PoolingRoute {
    /// Any pooling route's path, whether or not a model serves it.
    pub(crate) fn named(path: &str) -> Option<Self> {
        Some(match path {
            "/v1/embeddings" => Self::Embeddings,
            "/v2/embed" => Self::CohereEmbed,
            "/pooling" => Self::Pooling,
            "/score" | "/v1/score" => Self::Score,
            "/rerank" | "/v1/rerank" | "/v2/rerank" => Self::Rerank,
            "/classify" => Self::Classify,
            _ => return None,
        })
    }

    /// Whether vLLM registers this route for a model of `task` (it registers none of them for
    /// a generative model).
    pub(crate) fn served_by(self, task: PoolingTask) -> bool {
        match (self, task) {
            (Self::Pooling, _) => true,
            (Self::Embeddings | Self::CohereEmbed, PoolingTask::Embed { .. }) => true,
            (Self::Classify, PoolingTask::Classify { .. }) => true,
            (Self::Score | Self::Rerank, t) => t.scores(),
            (Self::Embeddings | Self::CohereEmbed, PoolingTask::Classify { .. })
            | (Self::Classify, PoolingTask::Embed { .. }) => false,
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Self::Embeddings | Self::CohereEmbed => "embd-",
            Self::Pooling => "pooling-",
            Self::Score | Self::Rerank => "score-",
            Self::Classify => "classify-",
        }
    }
}

/// One input as the engine sees it: its length and what its numbers derive from.
#[derive(Clone, Copy)]
struct Prompt {
    tokens: u32,
    hash: u64,
}

fn text_prompt(seed: u64, text: &str) -> Prompt {
    Prompt {
        tokens: api::prompt_tokens(text),
        hash: fnv1a(seed, text.as_bytes()),
    }
}

fn ids_prompt(seed: u64, ids: &[u64]) -> Prompt {
    let hash = ids
        .iter()
        .fold(seed ^ 0x1d5, |h, id| fnv1a(h, &id.to_le_bytes()));
    Prompt {
        tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
        hash,
    }
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: Option<()>,
    completion_tokens_details: Option<()>,
}

impl Usage {
    fn prompt(tokens: u64) -> Self {
        Self {
            prompt_tokens: tokens,
            total_tokens: tokens,
            completion_tokens: 0,
            prompt_tokens_details: None,
            completion_tokens_details: None,
        }
    }
}

/// `{"id","object":"list","created","model","data","usage"}`: every pooling answer but
/// rerank's and Cohere's.
#[derive(Serialize)]
struct ListResponse<'a, T> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    data: Vec<T>,
    usage: Usage,
}

/// A pooling request's answer, computed up front (it is deterministic); the server holds it
/// back for the engine time its `prompt_tokens` cost.
pub(crate) struct Pooled {
    pub prompt_tokens: u32,
    pub body: Vec<u8>,
    /// The LoRA adapter the request named: the engine pass runs on it.
    pub adapter: Option<Arc<LoraAdapter>>,
}

/// What the request carries besides its body.
pub(crate) struct PoolingCall<'a> {
    pub route: PoolingRoute,
    pub task: PoolingTask,
    /// The `X-Request-Id` header: the answer's id is built from it (before the body's
    /// `request_id`, as vLLM does).
    pub request_id: Option<&'a str>,
    pub created: u64,
}

/// Answers one pooling request of a route `call.task`'s model serves.
pub(crate) fn answer(
    call: &PoolingCall,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Pooled, ApiError> {
    match call.route {
        PoolingRoute::Embeddings | PoolingRoute::Pooling | PoolingRoute::Classify => {
            pooled_list::pooled_list(call, body, cfg, adapters)
        }
        PoolingRoute::CohereEmbed => cohere::cohere_embed(call, body, cfg, adapters),
        PoolingRoute::Score => score::score(call, body, cfg, adapters),
        PoolingRoute::Rerank => score::rerank(call, body, cfg, adapters),
    }
}

fn answer_id(call: &PoolingCall, body_id: Option<&str>) -> String {
    let base = match call.request_id.or(body_id) {
        Some(id) => id.to_owned(),
        None => format!("{:016x}", rand::random::<u64>()),
    };
    format!("{}{base}", call.route.id_prefix())
}

/// vLLM's pooling routes accept a served name or a loaded LoRA adapter (returned); any other
/// name is a 404 (`param` null, no list of aliases, unlike the generative routes).
fn check_model(
    model: Option<&str>,
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
    match model {
        Some(m) if !cfg.serves(m) => adapters.find(m).map(Some).ok_or_else(|| ApiError::Flat {
            status: http::StatusCode::NOT_FOUND,
            message: format!("The model `{m}` does not exist."),
            kind: "NotFoundError",
            param: None,
        }),
        _ => Ok(None),
    }
}

/// The `model` of a pooling answer: the adapter the request named, else the served name.
fn model_of<'a>(cfg: &'a SimConfig, adapter: &'a Option<Arc<LoraAdapter>>) -> &'a str {
    answer_model(cfg, adapter.as_deref())
}

fn missing(field: &str) -> ApiError {
    let loc = format!("body.{field}");
    ApiError::Validation {
        message: format!(
            "1 validation error:\n  {{'type': 'missing', 'loc': '{loc}', 'msg': 'Field required'}}"
        ),
        loc,
    }
}

fn refuse(message: impl Into<String>) -> ApiError {
    ApiError::Flat {
        status: http::StatusCode::BAD_REQUEST,
        message: message.into(),
        kind: "BadRequestError",
        param: None,
    }
}

/// The sim's model is not a Matryoshka model: vLLM refuses `dimensions` on it whatever the value.
fn check_dimensions(dimensions: Option<i64>, cfg: &SimConfig) -> Result<(), ApiError> {
    match dimensions {
        Some(d) => Err(refuse(format!(
            "Model '{}' does not support Matryoshka embeddings; dimensions must be unset \
             (received dimensions={d}).",
            cfg.model_name()
        ))),
        None => Ok(()),
    }
}

/// A pooling model takes no output tokens: a prompt may fill the context, not exceed it.
/// (vLLM tokenizes one token past the limit, so that is the most it reports.)
fn check_length(prompts: &[Prompt], cfg: &SimConfig) -> Result<(), ApiError> {
    let limit = cfg.max_model_len;
    match prompts.iter().find(|p| p.tokens > limit) {
        Some(p) => {
            let n = p.tokens.min(limit.saturating_add(1));
            Err(ApiError::BadParam {
                message: format!(
                    "This model's maximum context length is {limit} tokens. However, your \
                     prompt contains at least {n} input tokens, which exceeds this limit even \
                     without any output tokens. Please reduce the length of the input prompt. \
                     (parameter=input_tokens, value={n})"
                ),
                param: "input_tokens",
            })
        }
        None => Ok(()),
    }
}

fn total_tokens(prompts: &[Prompt]) -> u64 {
    prompts.iter().map(|p| u64::from(p.tokens)).sum()
}

fn list_json<T: Serialize>(
    id: &str,
    created: u64,
    model: &str,
    data: Vec<T>,
    tokens: u64,
) -> Vec<u8> {
    serde_json::to_vec(&ListResponse {
        id,
        object: "list",
        created,
        model,
        data,
        usage: Usage::prompt(tokens),
    })
    .unwrap_or_default()
}
