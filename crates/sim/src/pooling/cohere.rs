//! Cohere's `/v2/embed` on an embedding model: texts (or text-only inputs) in, the embedding
//! types asked for out.

use serde::{Deserialize, Serialize};

use crate::api::{self, error::ApiError};
use crate::args::{PoolingTask, SimConfig};
use crate::lora::Adapters;

use super::model::{base64_f32, embedding, pack_bits, widen};
use super::{
    Pooled, PoolingCall, Prompt, answer_id, check_dimensions, check_length, check_model, refuse,
    text_prompt, total_tokens,
};

/// Cohere's `/v2/embed`.
#[derive(Deserialize)]
struct CohereEmbedRequest {
    model: Option<String>,
    input_type: Option<String>,
    texts: Option<Vec<String>>,
    images: Option<Vec<String>>,
    inputs: Option<Vec<CohereInput>>,
    output_dimension: Option<i64>,
    embedding_types: Option<Vec<CohereType>>,
}

#[derive(Deserialize)]
struct CohereInput {
    content: Vec<CohereContent>,
}

#[derive(Deserialize)]
struct CohereContent {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum CohereType {
    Float,
    Binary,
    Ubinary,
    Base64,
}

#[derive(Serialize)]
struct CohereEmbedResponse<'a> {
    id: &'a str,
    embeddings: CohereEmbeddings,
    #[serde(skip_serializing_if = "Option::is_none")]
    texts: Option<Vec<String>>,
    meta: CohereMeta,
    response_type: &'static str,
}

/// Only the types asked for are written (vLLM dumps with `exclude_none`).
#[derive(Serialize, Default)]
struct CohereEmbeddings {
    #[serde(skip_serializing_if = "Option::is_none")]
    float: Option<Vec<Vec<f64>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    binary: Option<Vec<Vec<i16>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ubinary: Option<Vec<Vec<u8>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    base64: Option<Vec<String>>,
}

#[derive(Serialize)]
struct CohereMeta {
    api_version: CohereApiVersion,
    billed_units: CohereBilledUnits,
}

#[derive(Serialize)]
struct CohereApiVersion {
    version: &'static str,
}

#[derive(Serialize)]
struct CohereBilledUnits {
    input_tokens: u64,
    image_tokens: u64,
}

/// Cohere's `/v2/embed` (embedding models only).
pub(super) fn cohere_embed(
    call: &PoolingCall,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Pooled, ApiError> {
    let r: CohereEmbedRequest = api::validate(body)?;
    let given = [
        r.texts.as_ref().map(Vec::len),
        r.images.as_ref().map(Vec::len),
        r.inputs.as_ref().map(Vec::len),
    ];
    let present: Vec<usize> = given.iter().flatten().copied().collect();
    if present.len() != 1 || present[0] == 0 {
        let text =
            "Exactly one of texts, images, or inputs must be provided, and it must be non-empty";
        return Err(ApiError::Validation {
            message: format!(
                "1 validation error:\n  {{'type': 'value_error', 'loc': 'body', 'msg': 'Value error, {text}'}}"
            ),
            loc: "body".into(),
        });
    }
    let adapter = check_model(r.model.as_deref(), cfg, adapters)?;
    // The sim's model, like the captured one, has no task instructions.
    if let Some(t) = &r.input_type {
        return Err(refuse(format!(
            "Unsupported input_type '{t}'. This model does not define any input_type task instructions."
        )));
    }
    let texts: Vec<String> = match (&r.texts, &r.inputs) {
        (Some(texts), _) => texts.clone(),
        (None, Some(inputs)) => inputs
            .iter()
            .map(|i| {
                if i.content.iter().any(|c| c.kind != "text") {
                    return Err(refuse("the simulator embeds text only"));
                }
                Ok(i.content.iter().filter_map(|c| c.text.as_deref()).collect())
            })
            .collect::<Result<_, _>>()?,
        (None, None) => return Err(refuse("the simulator embeds text only")),
    };
    let prompts: Vec<Prompt> = texts.iter().map(|t| text_prompt(cfg.seed, t)).collect();
    check_length(&prompts, cfg)?;
    check_dimensions(r.output_dimension, cfg)?;
    let dims = match call.task {
        PoolingTask::Embed { dims } => dims,
        PoolingTask::Classify { .. } => 1,
    };
    let vectors: Vec<Vec<f32>> = prompts.iter().map(|p| embedding(*p, dims)).collect();
    let types = r.embedding_types.unwrap_or_else(|| vec![CohereType::Float]);
    let mut out = CohereEmbeddings::default();
    for t in types {
        match t {
            CohereType::Float => out.float = Some(vectors.iter().map(|v| widen(v)).collect()),
            CohereType::Base64 => {
                out.base64 = Some(vectors.iter().map(|v| base64_f32(v)).collect())
            }
            CohereType::Binary | CohereType::Ubinary => {
                if dims % 8 != 0 {
                    return Err(refuse(format!(
                        "Embedding dimension must be a multiple of 8 for binary embedding types, but got {dims}."
                    )));
                }
                let packed: Vec<Vec<u8>> = vectors.iter().map(|v| pack_bits(v)).collect();
                if t == CohereType::Binary {
                    out.binary = Some(
                        packed
                            .iter()
                            .map(|v| v.iter().map(|b| i16::from(*b) - 128).collect())
                            .collect(),
                    );
                } else {
                    out.ubinary = Some(packed);
                }
            }
        }
    }
    let id = answer_id(call, None);
    let tokens = total_tokens(&prompts);
    let json = serde_json::to_vec(&CohereEmbedResponse {
        id: &id,
        embeddings: out,
        texts: r.texts,
        meta: CohereMeta {
            api_version: CohereApiVersion { version: "2" },
            billed_units: CohereBilledUnits {
                input_tokens: tokens,
                image_tokens: 0,
            },
        },
        response_type: "embeddings_by_type",
    });
    Ok(Pooled {
        prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        body: json.unwrap_or_default(),
        adapter,
    })
}
