//! vLLM's pooling API on the sim (`--runner pooling`): embeddings (OpenAI's `/v1/embeddings` and
//! Cohere's `/v2/embed`), `/pooling`, `/score`, `/rerank` and `/classify`, in vLLM 0.32's shapes
//! and with its refusals. The numbers are deterministic: an input's vector is a function of the
//! sim seed and the input alone, so equal texts score 1.0 against each other, as on a real model.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::api::{self, ApiError, ChatMessage};
use super::args::{PoolingTask, SimConfig};
use super::tokens::{fnv1a, mix64};

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
    pub fn named(path: &str) -> Option<Self> {
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
    pub fn served_by(self, task: PoolingTask) -> bool {
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

#[derive(Serialize)]
struct ScoreData {
    index: usize,
    object: &'static str,
    score: f64,
}

/// Numbers as JSON floats or base64 of little-endian f32, as `encoding_format` asks.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f64>),
    Base64(String),
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

/// A pooling request's answer, computed up front (it is deterministic); the server holds it
/// back for the engine time its `prompt_tokens` cost.
pub(crate) struct Pooled {
    pub prompt_tokens: u32,
    pub body: Vec<u8>,
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
pub(crate) fn answer(call: &PoolingCall, body: &[u8], cfg: &SimConfig) -> Result<Pooled, ApiError> {
    match call.route {
        PoolingRoute::Embeddings | PoolingRoute::Pooling | PoolingRoute::Classify => {
            pooled_list(call, body, cfg)
        }
        PoolingRoute::CohereEmbed => cohere_embed(call, body, cfg),
        PoolingRoute::Score => score(call, body, cfg),
        PoolingRoute::Rerank => rerank(call, body, cfg),
    }
}

fn answer_id(call: &PoolingCall, body_id: Option<&str>) -> String {
    let base = match call.request_id.or(body_id) {
        Some(id) => id.to_owned(),
        None => format!("{:016x}", rand::random::<u64>()),
    };
    format!("{}{base}", call.route.id_prefix())
}

/// vLLM's pooling routes accept any model name the LoRA resolver does not refuse, but an
/// unknown one is still a 404 (`param` null, no list of aliases, unlike the generative routes).
fn check_model(model: Option<&str>, cfg: &SimConfig) -> Result<(), ApiError> {
    match model {
        Some(m) if !cfg.serves(m) => Err(ApiError::Flat {
            status: http::StatusCode::NOT_FOUND,
            message: format!("The model `{m}` does not exist."),
            kind: "NotFoundError",
            param: None,
        }),
        _ => Ok(()),
    }
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

/// The sim model's embedding of one input: `dims` numbers drawn from its hash, at unit length
/// (vLLM normalises by default).
fn embedding(p: Prompt, dims: u32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..u64::from(dims))
        .map(|i| {
            let u = mix64(p.hash ^ mix64(i));
            (u >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    for x in &mut v {
        *x /= norm;
    }
    v
}

/// Class probabilities of one input: a softmax over `labels` logits drawn from its hash (a
/// sigmoid for one label, as vLLM's classifier activation).
fn class_probs(hash: u64, labels: u32) -> Vec<f32> {
    let logit = |i: u64| (mix64(hash ^ mix64(i ^ 0xc1a5)) >> 40) as f32 / (1u64 << 22) as f32 - 2.0;
    if labels == 1 {
        return vec![1.0 / (1.0 + (-logit(0)).exp())];
    }
    let logits: Vec<f32> = (0..u64::from(labels)).map(logit).collect();
    let max = logits.iter().copied().fold(f32::MIN, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// f32 results printed as vLLM prints them: the f32 widened to a Python float.
fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().copied().map(f64::from).collect()
}

fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
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
fn pooled_list(call: &PoolingCall, body: &[u8], cfg: &SimConfig) -> Result<Pooled, ApiError> {
    let r: PoolingRequest = api::validate(body)?;
    check_model(r.model.as_deref(), cfg)?;
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
    let list = |data| list_json(&id, call.created, cfg.model_name(), data, tokens);
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
            list_json(&id, call.created, cfg.model_name(), data, tokens)
        }
        _ => list_json(
            &id,
            call.created,
            cfg.model_name(),
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
    })
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

/// Cohere's `/v2/embed` (embedding models only).
fn cohere_embed(call: &PoolingCall, body: &[u8], cfg: &SimConfig) -> Result<Pooled, ApiError> {
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
    check_model(r.model.as_deref(), cfg)?;
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
    })
}

/// One bit a dimension (non-negative → 1), most significant first, as numpy's `packbits`.
fn pack_bits(v: &[f32]) -> Vec<u8> {
    v.chunks(8)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u8, |b, (i, x)| if *x >= 0.0 { b | (0x80 >> i) } else { b })
        })
        .collect()
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

fn score(call: &PoolingCall, body: &[u8], cfg: &SimConfig) -> Result<Pooled, ApiError> {
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
    check_model(r.model.as_deref(), cfg)?;
    let (scores, tokens) = pair_scores(&a.into_list(), &b.into_list(), cfg, call.task)?;
    let id = answer_id(call, r.request_id.as_deref());
    let json = serde_json::to_vec(&ListResponse {
        id: &id,
        object: "list",
        created: call.created,
        model: cfg.model_name(),
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
    })
}

/// `/rerank`: the documents by relevance to the query, best first, the first `top_n` (all of
/// them when 0).
fn rerank(call: &PoolingCall, body: &[u8], cfg: &SimConfig) -> Result<Pooled, ApiError> {
    let r: RerankRequest = api::validate(body)?;
    check_model(r.model.as_deref(), cfg)?;
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
        model: cfg.model_name(),
        usage: RerankUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
        results,
    });
    Ok(Pooled {
        prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        body: json.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_unit_length_and_a_function_of_the_input() {
        let p = text_prompt(3, "hello there");
        let a = embedding(p, 64);
        assert_eq!(a.len(), 64);
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert_eq!(a, embedding(text_prompt(3, "hello there"), 64));
        assert_ne!(
            a,
            embedding(text_prompt(4, "hello there"), 64),
            "the seed counts"
        );
        assert_ne!(
            a,
            embedding(text_prompt(3, "hello therE"), 64),
            "the text counts"
        );
    }

    #[test]
    fn base64_is_little_endian_f32() {
        let v = [1.0f32, -2.5];
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(base64_f32(&v))
            .unwrap();
        assert_eq!(bytes, [0, 0, 0x80, 0x3f, 0, 0, 0x20, 0xc0]);
    }

    #[test]
    fn packbits_is_most_significant_bit_first() {
        let v = [1.0f32, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.0];
        assert_eq!(pack_bits(&v), [0b1000_0001]);
    }

    #[test]
    fn class_probabilities_sum_to_one() {
        for labels in [2, 3, 7] {
            let p = class_probs(42, labels);
            assert_eq!(p.len(), labels as usize);
            assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        let one = class_probs(42, 1);
        assert!(one[0] > 0.0 && one[0] < 1.0);
    }
}
