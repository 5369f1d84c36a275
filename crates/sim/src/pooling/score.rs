//! `/score` and `/rerank`: (query, document) pairs scored by cosine similarity of embeddings,
//! or by a cross-encoder (a classifier with one label) reading each pair as one prompt.

use serde::{Deserialize, Serialize};

use crate::api::{self, error::ApiError};
use crate::args::{PoolingTask, SimConfig};
use crate::lora::Adapters;
use crate::tokens::mix64;

use super::model::{class_probs, embedding};
use super::{
    ListResponse, Pooled, PoolingCall, Prompt, Usage, answer_id, check_length, check_model,
    missing, model_of, refuse, text_prompt, total_tokens,
};

/// One side of a score request: a text or `{"content": [parts]}` (its text parts count).
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum ScoreInput {
    Text(String),
    Parts { content: Vec<ScorePart> },
}

#[derive(Deserialize, Clone)]
struct ScorePart {
    text: Option<String>,
}

impl ScoreInput {
    fn text(&self) -> String {
        match self {
            ScoreInput::Text(t) => t.clone(),
            ScoreInput::Parts { content } => {
                content.iter().filter_map(|p| p.text.as_deref()).collect()
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ScoreSide {
    One(ScoreInput),
    Many(Vec<ScoreInput>),
}

impl ScoreSide {
    fn into_list(self) -> Vec<ScoreInput> {
        match self {
            ScoreSide::One(x) => vec![x],
            ScoreSide::Many(v) => v,
        }
    }
}

/// `/score`: vLLM 0.32 takes the pairs as queries/documents, queries/items, data_1/data_2 or
/// text_1/text_2 (tried in that order).
#[derive(Deserialize)]
struct ScoreRequest {
    model: Option<String>,
    request_id: Option<String>,
    queries: Option<ScoreSide>,
    documents: Option<ScoreSide>,
    items: Option<ScoreSide>,
    data_1: Option<ScoreSide>,
    data_2: Option<ScoreSide>,
    text_1: Option<ScoreSide>,
    text_2: Option<ScoreSide>,
}

#[derive(Deserialize)]
struct RerankRequest {
    model: Option<String>,
    request_id: Option<String>,
    query: ScoreInput,
    documents: ScoreSide,
    #[serde(default)]
    top_n: u64,
}

#[derive(Serialize)]
struct ScoreData {
    index: usize,
    object: &'static str,
    score: f64,
}

#[derive(Serialize)]
struct RerankResponse<'a> {
    id: &'a str,
    model: &'a str,
    usage: RerankUsage,
    results: Vec<RerankResult>,
}

#[derive(Serialize)]
struct RerankUsage {
    prompt_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct RerankResult {
    index: usize,
    document: RerankDocument,
    relevance_score: f64,
}

#[derive(Serialize)]
struct RerankDocument {
    text: Option<String>,
    multi_modal: Option<()>,
}

/// Scores of (query, document) pairs, 1:1, 1:N or N:N, and the prompt tokens they cost: an
/// embedding model embeds each text once and compares by cosine similarity; a cross-encoder
/// (a classifier with one label) reads each pair as one prompt.
fn pair_scores(
    queries: &[ScoreInput],
    docs: &[ScoreInput],
    cfg: &SimConfig,
    task: PoolingTask,
) -> Result<(Vec<f64>, u64), ApiError> {
    if queries.len() > 1 && queries.len() != docs.len() {
        return Err(refuse("Input lengths must be either 1:1, 1:N or N:N"));
    }
    if queries.is_empty() {
        return Err(refuse("At least one text element must be given"));
    }
    if docs.is_empty() {
        return Err(refuse("At least one text_pair element must be given"));
    }
    let q: Vec<Prompt> = queries
        .iter()
        .map(|x| text_prompt(cfg.seed, &x.text()))
        .collect();
    let d: Vec<Prompt> = docs
        .iter()
        .map(|x| text_prompt(cfg.seed, &x.text()))
        .collect();
    let pairs = || {
        d.iter()
            .enumerate()
            .map(|(i, doc)| (q[if q.len() == 1 { 0 } else { i }], *doc))
    };
    match task {
        PoolingTask::Embed { dims } => {
            check_length(&q, cfg)?;
            check_length(&d, cfg)?;
            let scores = pairs()
                .map(|(a, b)| {
                    let (a, b) = (embedding(a, dims), embedding(b, dims));
                    f64::from(a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>())
                })
                .collect();
            Ok((scores, total_tokens(&q) + total_tokens(&d)))
        }
        PoolingTask::Classify { .. } => {
            let joined: Vec<Prompt> = pairs()
                .map(|(a, b)| Prompt {
                    tokens: a.tokens.saturating_add(b.tokens),
                    hash: mix64(a.hash ^ b.hash.rotate_left(17)),
                })
                .collect();
            check_length(&joined, cfg)?;
            let scores = joined
                .iter()
                .map(|p| f64::from(class_probs(p.hash, 1)[0]))
                .collect();
            Ok((scores, total_tokens(&joined)))
        }
    }
}

pub(super) fn score(
    call: &PoolingCall,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Pooled, ApiError> {
    let r: ScoreRequest = api::validate(body)?;
    // pydantic tries the variants in order and reports the first one's missing fields.
    let (a, b) = match (
        r.queries,
        r.documents,
        r.items,
        r.data_1,
        r.data_2,
        r.text_1,
        r.text_2,
    ) {
        (Some(q), Some(d), ..) | (Some(q), None, Some(d), ..) => (q, d),
        (None, _, _, Some(a), Some(b), ..) | (None, _, _, None, None, Some(a), Some(b)) => (a, b),
        (None, ..) => return Err(missing("queries")),
        (Some(_), None, None, ..) => return Err(missing("documents")),
    };
    let adapter = check_model(r.model.as_deref(), cfg, adapters)?;
    let (scores, tokens) = pair_scores(&a.into_list(), &b.into_list(), cfg, call.task)?;
    let id = answer_id(call, r.request_id.as_deref());
    let json = serde_json::to_vec(&ListResponse {
        id: &id,
        object: "list",
        created: call.created,
        model: model_of(cfg, &adapter),
        data: scores
            .into_iter()
            .enumerate()
            .map(|(index, score)| ScoreData {
                index,
                object: "score",
                score,
            })
            .collect(),
        usage: Usage::prompt(tokens),
    });
    Ok(Pooled {
        prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        body: json.unwrap_or_default(),
        adapter,
    })
}

/// `/rerank`: the documents by relevance to the query, best first, the first `top_n` (all of
/// them when 0).
pub(super) fn rerank(
    call: &PoolingCall,
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Pooled, ApiError> {
    let r: RerankRequest = api::validate(body)?;
    let adapter = check_model(r.model.as_deref(), cfg, adapters)?;
    let docs = r.documents.into_list();
    let (scores, tokens) = pair_scores(std::slice::from_ref(&r.query), &docs, cfg, call.task)?;
    let mut results: Vec<RerankResult> = docs
        .into_iter()
        .zip(scores)
        .enumerate()
        .map(|(index, (doc, relevance_score))| RerankResult {
            index,
            document: RerankDocument {
                text: match doc {
                    ScoreInput::Text(t) => Some(t),
                    ScoreInput::Parts { .. } => None,
                },
                multi_modal: None,
            },
            relevance_score,
        })
        .collect();
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    let top_n = usize::try_from(r.top_n).unwrap_or(usize::MAX);
    if top_n > 0 {
        results.truncate(top_n);
    }
    let id = answer_id(call, r.request_id.as_deref());
    let json = serde_json::to_vec(&RerankResponse {
        id: &id,
        model: model_of(cfg, &adapter),
        usage: RerankUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
        results,
    });
    Ok(Pooled {
        prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        body: json.unwrap_or_default(),
        adapter,
    })
}
