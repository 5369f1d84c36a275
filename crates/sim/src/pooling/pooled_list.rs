//! `/v1/embeddings`, `/pooling` and `/classify`: one vector (or class probabilities) per input,
//! answered as a list.

use serde::{Deserialize, Serialize};

use crate::api::{self, ChatMessage, error::ApiError};
use crate::args::{PoolingTask, SimConfig};
use crate::lora::Adapters;

use super::model::{base64_f32, class_probs, embedding, widen};
use super::{
    Pooled, PoolingCall, PoolingRoute, Prompt, answer_id, check_dimensions, check_length,
    check_model, ids_prompt, list_json, missing, model_of, refuse, text_prompt, total_tokens,
};

/// `input` of the completion-style requests: `list[int] | list[list[int]] | str | list[str]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u64>),
    IdLists(Vec<Vec<u64>>),
}

/// `/v1/embeddings`, `/pooling` and `/classify`: `input`, or a chat conversation in
/// `messages` (vLLM's chat variants, rendered by the sim's chat template: the texts in order).
#[derive(Deserialize)]
struct PoolingRequest {
    model: Option<String>,
    input: Option<Input>,
    messages: Option<Vec<ChatMessage>>,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    request_id: Option<String>,
    task: Option<String>,
}

#[derive(Serialize)]
struct EmbeddingData {
    index: usize,
    object: &'static str,
    embedding: Vector,
}

#[derive(Serialize)]
struct PoolingData {
    index: usize,
    object: &'static str,
    data: Vector,
}

#[derive(Serialize)]
struct ClassificationData {
    index: usize,
    label: String,
    probs: Vec<f64>,
    num_classes: usize,
}

/// Numbers as JSON floats or base64 of little-endian f32, as `encoding_format` asks.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f64>),
    Base64(String),
}

fn encode(v: &[f32], base64: bool) -> Vector {
    if base64 {
        Vector::Base64(base64_f32(v))
    } else {
        Vector::Float(widen(v))
    }
}

fn prompts_of(r: &PoolingRequest, seed: u64) -> Result<Vec<Prompt>, ApiError> {
    let prompts = match (&r.input, &r.messages) {
        (Some(Input::Text(t)), _) => vec![text_prompt(seed, t)],
        (Some(Input::Texts(ts)), _) => ts.iter().map(|t| text_prompt(seed, t)).collect(),
        (Some(Input::Ids(ids)), _) => vec![ids_prompt(seed, ids)],
        (Some(Input::IdLists(lists)), _) => lists.iter().map(|l| ids_prompt(seed, l)).collect(),
        (None, Some(messages)) => {
            let text: String = api::chat_texts(messages).collect();
            vec![text_prompt(seed, &text)]
        }
        (None, None) => return Err(missing("input")),
    };
    if prompts.is_empty() {
        return Err(refuse("You must pass at least one prompt"));
    }
    Ok(prompts)
}

fn base64_format(format: Option<&str>) -> Result<bool, ApiError> {
    match format {
        None | Some("float") => Ok(false),
        Some("base64") => Ok(true),
        Some("bytes" | "bytes_only") => Err(refuse(
            "encoding_format bytes is not simulated; use float or base64",
        )),
        Some(other) => Err(ApiError::Validation {
            message: format!(
                "1 validation error:\n  {{'type': 'literal_error', 'loc': 'body.encoding_format', 'msg': \"Input should be 'float', 'base64', 'bytes' or 'bytes_only'\", 'input': '{other}'}}"
            ),
            loc: "body.encoding_format".into(),
        }),
    }
}

/// `/v1/embeddings`, `/pooling` and `/classify`.
pub(super) fn pooled_list(
    call: &PoolingCall,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Pooled, ApiError> {
    let r: PoolingRequest = api::validate(body)?;
    let adapter = check_model(r.model.as_deref(), cfg, adapters)?;
    let model = model_of(cfg, &adapter);
    if call.route == PoolingRoute::Pooling
        && let Some(task) = r.task.as_deref()
    {
        let own = match call.task {
            PoolingTask::Embed { .. } => "embed",
            PoolingTask::Classify { .. } => "classify",
        };
        if task != own {
            return Err(ApiError::BadParam {
                message: format!(
                    "Unsupported task: '{task}' Supported tasks: ('{own}',) (parameter=task, value={task})"
                ),
                param: "task",
            });
        }
    }
    let base64 = base64_format(r.encoding_format.as_deref())?;
    let prompts = prompts_of(&r, cfg.seed)?;
    check_length(&prompts, cfg)?;
    if matches!(call.task, PoolingTask::Embed { .. }) {
        check_dimensions(r.dimensions, cfg)?;
    }
    let id = answer_id(call, r.request_id.as_deref());
    let tokens = total_tokens(&prompts);
    let vectors = prompts.iter().map(|p| match call.task {
        PoolingTask::Embed { dims } => embedding(*p, dims),
        PoolingTask::Classify { labels } => class_probs(p.hash, labels),
    });
    let list = |data| list_json(&id, call.created, model, data, tokens);
    let json = match call.route {
        PoolingRoute::Embeddings => list(
            vectors
                .enumerate()
                .map(|(index, v)| EmbeddingData {
                    index,
                    object: "embedding",
                    embedding: encode(&v, base64),
                })
                .collect(),
        ),
        PoolingRoute::Classify => {
            let data = vectors
                .enumerate()
                .map(|(index, probs)| {
                    let best = probs
                        .iter()
                        .enumerate()
                        .fold(0, |b, (i, p)| if *p > probs[b] { i } else { b });
                    ClassificationData {
                        index,
                        label: format!("LABEL_{best}"),
                        num_classes: probs.len(),
                        probs: widen(&probs),
                    }
                })
                .collect();
            list_json(&id, call.created, model, data, tokens)
        }
        _ => list_json(
            &id,
            call.created,
            model,
            vectors
                .enumerate()
                .map(|(index, v)| PoolingData {
                    index,
                    object: "pooling",
                    data: encode(&v, base64),
                })
                .collect::<Vec<_>>(),
            tokens,
        ),
    };
    Ok(Pooled {
        prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        body: json,
        adapter,
    })
}
