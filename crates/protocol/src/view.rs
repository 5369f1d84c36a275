//! The request-body view: the body is parsed exactly once into the few fields the gateway
//! needs (model, stream, token limits, stream_options, n, approximate prompt size). The
//! original bytes are forwarded; the only rewrite is a byte splice of the `model` value.
//! Tokenizer bodies (`/tokenize`, `/detokenize`) give only the model and the prompt size: their
//! generation fields are not read, so nothing is ever injected into them.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::Endpoint;
use super::endpoint::Family;

/// Why a body was refused; every message names the field and says what to send instead.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ViewError {
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    #[error("{message}")]
    InvalidRequest {
        param: Option<Cow<'static, str>>,
        message: String,
    },
    /// A field the parser accepted could not be found in the bytes again (a bug, not the
    /// client's fault).
    #[error("a parsed field could not be located in the body")]
    Unlocatable,
}

#[derive(Debug)]
pub struct RequestView<'a> {
    pub model: Cow<'a, str>,
    /// Byte range of the `model` JSON value (quotes included) in the body.
    pub model_span: Range<usize>,
    pub stream: bool,
    /// `max_completion_tokens` if given, else `max_tokens`.
    pub max_tokens: Option<u64>,
    pub n: u32,
    pub include_usage: Option<bool>,
    /// Byte range of the `stream_options` value, when present (`null` included).
    pub stream_options_span: Option<Range<usize>>,
    /// Characters of prompt text (messages' content or prompt), a cheap size estimate.
    pub prompt_chars: usize,
    /// The `user` field's raw JSON text, when given (backend affinity).
    pub user: Option<&'a str>,
    /// Responses: the stored response this one continues (it lives on one backend).
    pub previous_response_id: Option<Cow<'a, str>>,
    /// Responses: `background: true` (the POST answers while the backend still generates).
    pub background: bool,
    /// Responses: `store` (vLLM's default is true): a `store: false` answer is kept nowhere,
    /// so nothing is pinned for it.
    pub store: bool,
    /// Responses: the byte range of the client's `request_id` value (a JSON string), from
    /// which vLLM makes the response's id.
    pub request_id_span: Option<Range<usize>>,
    /// vLLM's scheduling `priority` the client sent (chat, completions, Responses), and where
    /// its value is.
    pub priority: Option<(i64, Range<usize>)>,
}

#[derive(Deserialize)]
struct RawBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    /// The Responses API's output limit.
    #[serde(borrow)]
    max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    n: Option<&'a RawValue>,
    /// Kept even when it is `null` (a plain `Option` would read `null` as absent): a stream
    /// that gets `include_usage` injected must replace that `null`, not add a second key.
    #[serde(borrow, default, deserialize_with = "present_raw")]
    stream_options: Option<&'a RawValue>,
    messages: Option<Messages>,
    prompt: Option<CompletionPrompts>,
    /// The Responses API's prompt: a string or a list of input items.
    input: Option<Input>,
    /// The Responses API's system text.
    instructions: Option<Content>,
    /// Anthropic's system prompt: a string or text blocks.
    system: Option<Content>,
    #[serde(borrow)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow)]
    background: Option<&'a RawValue>,
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    #[serde(borrow)]
    request_id: Option<&'a RawValue>,
    #[serde(borrow)]
    priority: Option<&'a RawValue>,
    /// `/detokenize`'s token ids; read only there (another endpoint's body may carry a field of
    /// that name in any shape).
    #[serde(borrow)]
    tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
}

/// A field's raw value whenever the field is present, `null` included.
fn present_raw<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

fn invalid(param: &'static str, message: impl Into<String>) -> ViewError {
    ViewError::InvalidRequest {
        param: Some(Cow::Borrowed(param)),
        message: message.into(),
    }
}

/// Parse a request body into its view. Errors name the field and say what to send instead.
pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, ViewError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => {
            return Err(ViewError::InvalidJson(
                "the body is empty; send a JSON object such as {\"model\": \"...\", \"messages\": [...]}".into(),
            ));
        }
        Some(b'{') => {}
        Some(_) => {
            // Tell "not JSON" apart from "JSON but not an object".
            return Err(match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => invalid_body_shape(),
                Err(e) => ViewError::InvalidJson(e.to_string()),
            });
        }
    }
    match endpoint {
        Endpoint::ChatBatch => return parse_batch(body),
        e if e.family().pools() => return parse_pooling(body, e),
        _ => {}
    }
    let raw: RawBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;

    let generation = if endpoint.needs().generates {
        generation_fields(&raw, body, endpoint)?
    } else {
        GenerationFields::NONE
    };
    let mut previous_response_id = None;
    let mut background = false;
    let mut store = true;
    let mut request_id_span = None;
    // Completions: `n` answers for each prompt of a list.
    let mut prompts = 1u32;
    let prompt_chars = match endpoint {
        Endpoint::Chat => {
            let Some(Messages(chars)) = raw.messages else {
                return Err(invalid(
                    "messages",
                    "`messages` is required on /v1/chat/completions (an array of {\"role\", \"content\"}); for a plain `prompt` use /v1/completions.",
                ));
            };
            chars
        }
        Endpoint::Completions => {
            let Some(CompletionPrompts { chars, count }) = raw.prompt else {
                return Err(invalid(
                    "prompt",
                    "`prompt` is required on /v1/completions; for chat `messages` use /v1/chat/completions.",
                ));
            };
            prompts = count.max(1);
            chars
        }
        Endpoint::Tokenize => match (raw.prompt, raw.messages) {
            (Some(CompletionPrompts { chars, .. }), _) | (None, Some(Messages(chars))) => chars,
            (None, None) => {
                return Err(invalid(
                    "prompt",
                    "`prompt` (a string) or `messages` (chat messages, tokenized through the model's chat template) is required on /tokenize.",
                ));
            }
        },
        Endpoint::Detokenize => {
            let Some(tokens) = raw.tokens.filter(|t| t.get() != "null") else {
                return Err(invalid(
                    "tokens",
                    "`tokens` (an array of token ids, as /tokenize returns them) is required on /detokenize.",
                ));
            };
            let ids: Vec<IgnoredAny> = serde_json::from_str(tokens.get()).map_err(|_| {
                invalid(
                    "tokens",
                    format!(
                        "`tokens` must be an array of token ids, got `{}`.",
                        short(tokens.get())
                    ),
                )
            })?;
            // Sized like a completions prompt of token ids.
            ids.len() * 4
        }
        Endpoint::Responses => {
            let Some(Input(chars)) = raw.input else {
                return Err(invalid(
                    "input",
                    "`input` is required on /v1/responses (a string, or a list of input items such as {\"role\": \"user\", \"content\": \"...\"}); for chat `messages` use /v1/chat/completions.",
                ));
            };
            previous_response_id = match raw.previous_response_id.map(RawValue::get) {
                None | Some("null") => None,
                Some(text) => {
                    let id: Cow<'_, str> = serde_json::from_str(text).map_err(|_| {
                        invalid(
                            "previous_response_id",
                            format!(
                                "`previous_response_id` must be the id of an earlier response (a string such as \"resp_...\"), got `{}`.",
                                short(text)
                            ),
                        )
                    })?;
                    Some(id)
                }
            };
            background = match raw.background.map(RawValue::get) {
                None | Some("null") | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(invalid(
                        "background",
                        format!("`background` must be a boolean, got `{}`.", short(other)),
                    ));
                }
            };
            store = match raw.store.map(RawValue::get) {
                None | Some("null") | Some("true") => true,
                Some("false") => false,
                Some(other) => {
                    return Err(invalid(
                        "store",
                        format!("`store` must be a boolean, got `{}`.", short(other)),
                    ));
                }
            };
            request_id_span = match raw.request_id {
                None => None,
                Some(r) if r.get() == "null" => None,
                Some(r) if r.get().starts_with('"') => {
                    Some(span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?)
                }
                Some(r) => {
                    return Err(invalid(
                        "request_id",
                        format!("`request_id` must be a string, got `{}`.", short(r.get())),
                    ));
                }
            };
            chars + raw.instructions.map_or(0, |c| c.0)
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            let Some(Messages(chars)) = raw.messages else {
                return Err(invalid(
                    "messages",
                    format!(
                        "`messages` is required on {} (an array of {{\"role\", \"content\"}}).",
                        endpoint.path()
                    ),
                ));
            };
            chars + raw.system.map_or(0, |c| c.0)
        }
        // No body is read for these; the others have their own parsers.
        Endpoint::ResponseGet
        | Endpoint::ResponseCancel
        | Endpoint::ChatBatch
        | Endpoint::Embeddings
        | Endpoint::CohereEmbed
        | Endpoint::Rerank
        | Endpoint::RerankV1
        | Endpoint::RerankV2
        | Endpoint::Score
        | Endpoint::ScoreV1
        | Endpoint::Classify
        | Endpoint::Pooling
        | Endpoint::Transcriptions
        | Endpoint::Translations => 0,
    };
    let priority = match (endpoint, raw.priority) {
        (Endpoint::Chat | Endpoint::Completions | Endpoint::Responses, Some(r))
            if r.get() != "null" =>
        {
            let value = r.get().parse::<i64>().map_err(|_| {
                invalid(
                    "priority",
                    format!(
                        "`priority` must be an integer (lower is served first), got `{}`.",
                        short(r.get())
                    ),
                )
            })?;
            Some((
                value,
                span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?,
            ))
        }
        _ => None,
    };
    let GenerationFields {
        stream,
        max_tokens,
        n,
        include_usage,
        stream_options_span,
    } = generation;
    Ok(RequestView {
        model,
        model_span,
        stream,
        max_tokens,
        n: n.saturating_mul(prompts),
        include_usage,
        stream_options_span,
        prompt_chars,
        user: raw.user.map(RawValue::get).filter(|u| *u != "null"),
        previous_response_id,
        background,
        store,
        request_id_span,
        priority,
    })
}

/// A `multipart/form-data` body (the audio routes): the `model` form field (its bytes' span,
/// for a rename), `stream`, and the presence of `file`. The audio itself is the backend's.
pub async fn parse_form<'a>(
    body: &'a Bytes,
    content_type: &str,
    endpoint: Endpoint,
) -> Result<RequestView<'a>, ViewError> {
    let path = endpoint.path();
    // A parameter named twice is read differently by different parsers (the first
    // `boundary` here, the last in Starlette, vLLM's): the backend would read another body.
    if let Some(name) = repeated_parameter(content_type) {
        return Err(ViewError::InvalidRequest {
            param: None,
            message: format!(
                "The Content-Type names its `{name}` parameter more than once; send it once (`multipart/form-data; boundary=...`)."
            ),
        });
    }
    let Ok(boundary) = multer::parse_boundary(content_type) else {
        return Err(ViewError::InvalidRequest {
            param: None,
            message: format!(
                "{path} takes `multipart/form-data` (an audio `file` and a `model` field, e.g. curl -F file=@speech.wav -F model=...); got `Content-Type: {content_type}`."
            ),
        });
    };
    let whole = body.clone();
    let stream =
        futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(whole) });
    let mut form = multer::Multipart::new(stream, boundary.clone());
    let malformed = |e: multer::Error| ViewError::InvalidRequest {
        param: None,
        message: format!("The multipart/form-data body cannot be read: {e}."),
    };
    let (mut model, mut stream_flag, mut file) = (None, None, false);
    // A field the gateway reads, given twice, is read differently by different parsers (the
    // backend's takes the last): it is refused, not guessed.
    let twice = |name: &'static str| {
        invalid(
            name,
            format!("The form field `{name}` is given more than once on {path}; send it once."),
        )
    };
    while let Some(field) = form.next_field().await.map_err(malformed)? {
        match field.name() {
            Some("model") if model.is_some() => return Err(twice("model")),
            Some("stream") if stream_flag.is_some() => return Err(twice("stream")),
            Some("model") => model = Some(field.text().await.map_err(malformed)?),
            Some("stream") => stream_flag = Some(field.text().await.map_err(malformed)?),
            // The audio is not read here: it goes to the backend as it came.
            Some("file") => file = true,
            _ => {}
        }
    }
    let model = model.map(|m| m.trim().to_owned()).unwrap_or_default();
    if model.is_empty() {
        return Err(invalid(
            "model",
            format!(
                "`model` is required on {path}: a form field naming one of the models listed by GET /v1/models (curl -F model=...)."
            ),
        ));
    }
    if !file {
        return Err(invalid(
            "file",
            format!(
                "`file` is required on {path}: the audio, as a multipart file field (curl -F file=@speech.wav)."
            ),
        ));
    }
    let stream = match stream_flag.as_deref().map(str::trim) {
        None | Some("false" | "False" | "0") => false,
        Some("true" | "True" | "1") => true,
        Some(other) => {
            return Err(invalid(
                "stream",
                format!("`stream` must be true or false, got `{}`.", short(other)),
            ));
        }
    };
    // The field's bytes are found as `name="model"` (the form every client writes); a part
    // named otherwise (unquoted, escaped) is refused rather than forwarded unchecked.
    let unlocatable = || {
        invalid(
            "model",
            format!(
                "The `model` form field on {path} must be named as `Content-Disposition: form-data; name=\"model\"` with its value as plain text."
            ),
        )
    };
    let model_span =
        form_field_span(body, boundary.as_bytes(), b"model").ok_or_else(unlocatable)?;
    if body[model_span.clone()].trim_ascii() != model.as_bytes() {
        return Err(unlocatable());
    }
    Ok(RequestView {
        model: Cow::Owned(model),
        model_span,
        ..RequestView::whole(GenerationFields {
            stream,
            ..GenerationFields::NONE
        })
    })
}

/// The first parameter of a `Content-Type` value named more than once (names compare
/// without case; values may be quoted strings, with `;` and escapes inside).
fn repeated_parameter(content_type: &str) -> Option<String> {
    let bytes = content_type.as_bytes();
    let mut names: Vec<String> = Vec::new();
    let mut i = memchr::memchr(b';', bytes)?;
    while i < bytes.len() {
        // At a `;`: the parameter's name runs to `=` (or the next `;`).
        i += 1;
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && bytes[i] != b';' {
            i += 1;
        }
        let name = content_type[start..i].trim().to_ascii_lowercase();
        if i < bytes.len() && bytes[i] == b'=' {
            i += 1;
            while i < bytes.len() && bytes[i] == b' ' {
                i += 1;
            }
            if i < bytes.len() && bytes[i] == b'"' {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            while i < bytes.len() && bytes[i] != b';' {
                i += 1;
            }
        }
        if name.is_empty() {
            continue;
        }
        if names.contains(&name) {
            return Some(name);
        }
        names.push(name);
    }
    None
}

/// Where the value of form field `name` is in a multipart body with `boundary`.
fn form_field_span(body: &[u8], boundary: &[u8], name: &[u8]) -> Option<Range<usize>> {
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let mut quoted = Vec::with_capacity(name.len() + 7);
    quoted.extend_from_slice(b"name=\"");
    quoted.extend_from_slice(name);
    quoted.push(b'"');
    // The first delimiter may open the body without the line break before it.
    let mut at = memchr::memmem::find(body, &delimiter[2..])? + delimiter.len() - 2;
    loop {
        let headers_end = at + memchr::memmem::find(&body[at..], b"\r\n\r\n")?;
        let start = headers_end + 4;
        let end = start + memchr::memmem::find(&body[start..], &delimiter)?;
        let headers = &body[at..headers_end];
        // `name="model"`, not `filename="model"`.
        let named = memchr::memmem::find_iter(headers, &quoted)
            .any(|p| p == 0 || matches!(headers[p - 1], b' ' | b';' | b'\t'));
        if named {
            return Some(start..end);
        }
        at = end + delimiter.len();
    }
}

/// The body as `T`, or the error that says what is wrong with it.
fn from_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ViewError> {
    match serde_json::from_slice(body) {
        Ok(raw) => Ok(raw),
        Err(e) if e.is_data() => Err(data_error::<T>(body, e)),
        Err(e) => Err(ViewError::InvalidJson(e.to_string())),
    }
}

/// The `model` named (required, a non-empty string), and where its value is in the body.
fn model_of<'a>(
    raw: Option<&'a RawValue>,
    body: &[u8],
) -> Result<(Cow<'a, str>, Range<usize>), ViewError> {
    let model_raw = raw.ok_or_else(|| {
        invalid(
            "model",
            "`model` is required: name one of the models listed by GET /v1/models.",
        )
    })?;
    let model: Cow<'_, str> = serde_json::from_str(model_raw.get()).map_err(|_| {
        invalid(
            "model",
            format!("`model` must be a string, got `{}`.", model_raw.get()),
        )
    })?;
    if model.is_empty() {
        return Err(invalid("model", "`model` must not be empty."));
    }
    let model_span = span_of(body, model_raw.get().as_bytes()).ok_or(ViewError::Unlocatable)?;
    Ok((model, model_span))
}

/// A pooling body (embeddings, rerank, score, classify, pooling): what routes and sizes it.
/// Every other field is the backend's to read.
#[derive(Deserialize)]
struct PoolingBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
    /// Text, texts or token ids (`/v1/embeddings`, `/classify`, `/pooling`).
    input: Option<Input>,
    /// Chat messages, embedded or classified through the chat template.
    messages: Option<Input>,
    /// `/pooling`'s IO-processor input.
    data: Option<Text>,
    /// Cohere's `/v2/embed`: texts, or inputs of content parts (its `images` are data URLs,
    /// not text: they are not counted).
    texts: Option<Text>,
    inputs: Option<Text>,
    #[serde(borrow)]
    images: Option<&'a RawValue>,
    query: Option<Text>,
    documents: Option<Text>,
    queries: Option<Text>,
    items: Option<Text>,
    text_1: Option<Text>,
    text_2: Option<Text>,
    data_1: Option<Text>,
    data_2: Option<Text>,
}

fn parse_pooling(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, ViewError> {
    let raw: PoolingBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;
    let size = |t: Option<Text>| t.map(|t| t.0);
    let inputs = size(raw.input.map(|i| Text(i.0))).or(size(raw.messages.map(|m| Text(m.0))));
    let path = endpoint.path();
    let prompt_chars = match endpoint.family() {
        Family::Embeddings if endpoint == Endpoint::CohereEmbed => {
            match (size(raw.texts), size(raw.inputs), raw.images) {
                (None, None, None) => {
                    return Err(invalid(
                        "texts",
                        "`texts` (a list of strings), `inputs` (a list of {\"content\": [...]}) or `images` is required on /v2/embed.",
                    ));
                }
                (texts, inputs, _) => texts.unwrap_or(0) + inputs.unwrap_or(0),
            }
        }
        Family::Embeddings | Family::Classify => inputs.ok_or_else(|| {
            invalid(
                "input",
                format!("`input` is required on {path}: a string, a list of strings, or token ids (chat `messages` are accepted instead)."),
            )
        })?,
        Family::Pooling => inputs.or(size(raw.data)).ok_or_else(|| {
            invalid(
                "input",
                "`input` is required on /pooling: a string, a list of strings, or token ids (or chat `messages`, or `data` for an IO-processor plugin).",
            )
        })?,
        Family::Rerank => {
            let Some(query) = size(raw.query) else {
                return Err(invalid(
                    "query",
                    format!("`query` (the text the documents are ranked against) is required on {path}."),
                ));
            };
            let Some(documents) = size(raw.documents) else {
                return Err(invalid(
                    "documents",
                    format!("`documents` (a list of texts to rank) is required on {path}."),
                ));
            };
            query + documents
        }
        _ => {
            let pairs = [
                (size(raw.queries), size(raw.documents)),
                (size(raw.queries), size(raw.items)),
                (size(raw.text_1), size(raw.text_2)),
                (size(raw.data_1), size(raw.data_2)),
            ];
            let Some((a, b)) = pairs.into_iter().find_map(|(a, b)| a.zip(b)) else {
                return Err(invalid(
                    "queries",
                    format!("`queries` and `documents` are required on {path} (or `queries` and `items`, `text_1` and `text_2`, `data_1` and `data_2`): the texts scored against each other."),
                ));
            };
            a + b
        }
    };
    Ok(RequestView {
        model,
        model_span,
        prompt_chars,
        user: raw.user.map(RawValue::get).filter(|u| *u != "null"),
        ..RequestView::whole(GenerationFields::NONE)
    })
}

/// `/v1/chat/completions/batch`: `messages` is a list of conversations, each answered.
#[derive(Deserialize)]
struct BatchBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    messages: Option<Conversations>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
}

fn parse_batch(body: &[u8]) -> Result<RequestView<'_>, ViewError> {
    let raw: BatchBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;
    let Some(Conversations { count, chars }) = raw.messages.filter(|c| c.count > 0) else {
        return Err(invalid(
            "messages",
            "`messages` is required on /v1/chat/completions/batch: a list of conversations, each a list of {\"role\", \"content\"} messages.",
        ));
    };
    if !matches!(raw.stream.map(RawValue::get), None | Some("null" | "false")) {
        return Err(invalid(
            "stream",
            "`stream` is not supported on /v1/chat/completions/batch: each conversation's answer comes whole; stream one conversation at a time on /v1/chat/completions.",
        ));
    }
    let max_tokens = opt_u64(raw.max_tokens, "max_tokens")?;
    let max_completion_tokens = opt_u64(raw.max_completion_tokens, "max_completion_tokens")?;
    Ok(RequestView {
        model,
        model_span,
        prompt_chars: chars,
        user: raw.user.map(RawValue::get).filter(|u| *u != "null"),
        ..RequestView::whole(GenerationFields {
            max_tokens: output_limit(max_completion_tokens, max_tokens),
            // One answer per conversation, like `n` choices of one prompt.
            n: u32::try_from(count).unwrap_or(u32::MAX),
            ..GenerationFields::NONE
        })
    })
}

impl RequestView<'_> {
    /// A view with no model yet, of a body answered whole.
    fn whole(g: GenerationFields) -> Self {
        RequestView {
            model: Cow::Borrowed(""),
            model_span: 0..0,
            stream: g.stream,
            max_tokens: g.max_tokens,
            n: g.n,
            include_usage: g.include_usage,
            stream_options_span: g.stream_options_span,
            prompt_chars: 0,
            user: None,
            previous_response_id: None,
            background: false,
            store: true,
            request_id_span: None,
            priority: None,
        }
    }
}

/// The fields that steer generation (stream, token limits, n, stream_options).
struct GenerationFields {
    stream: bool,
    max_tokens: Option<u64>,
    n: u32,
    include_usage: Option<bool>,
    stream_options_span: Option<Range<usize>>,
}

impl GenerationFields {
    /// A body that generates nothing (the tokenizer endpoints).
    const NONE: GenerationFields = GenerationFields {
        stream: false,
        max_tokens: None,
        n: 1,
        include_usage: None,
        stream_options_span: None,
    };
}

fn generation_fields(
    raw: &RawBody<'_>,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<GenerationFields, ViewError> {
    let stream = match raw.stream.map(RawValue::get) {
        None | Some("null") | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(invalid(
                "stream",
                format!("`stream` must be a boolean (true or false), got `{other}`."),
            ));
        }
    };
    match endpoint {
        // The Responses API names its limit `max_output_tokens`, and has no `n`.
        Endpoint::Responses => {
            return Ok(GenerationFields {
                stream,
                max_tokens: opt_u64(raw.max_output_tokens, "max_output_tokens")?,
                ..GenerationFields::NONE
            });
        }
        // Anthropic requires `max_tokens` (its API refuses a request without it).
        Endpoint::Messages => {
            let Some(max_tokens) = opt_u64(raw.max_tokens, "max_tokens")? else {
                return Err(invalid(
                    "max_tokens",
                    "`max_tokens` is required on /v1/messages: the most tokens the answer may have, e.g. \"max_tokens\": 1024.",
                ));
            };
            return Ok(GenerationFields {
                stream,
                max_tokens: Some(max_tokens),
                ..GenerationFields::NONE
            });
        }
        _ => {}
    }
    let max_tokens = opt_u64(raw.max_tokens, "max_tokens")?;
    let max_completion_tokens = opt_u64(raw.max_completion_tokens, "max_completion_tokens")?;
    let n = match opt_u64(raw.n, "n")? {
        None => 1,
        Some(0) => return Err(invalid("n", "`n` must be at least 1.")),
        Some(n) => u32::try_from(n).map_err(|_| invalid("n", "`n` is too large."))?,
    };
    // The value's bytes, `null` included: an injected `include_usage` replaces them.
    let stream_options_span = match raw.stream_options {
        Some(r) => Some(span_of(body, r.get().as_bytes()).ok_or(ViewError::Unlocatable)?),
        None => None,
    };
    let include_usage = match raw.stream_options.map(RawValue::get) {
        None | Some("null") => None,
        Some(text) => {
            let so: StreamOptions = serde_json::from_str(text).map_err(|e| {
                invalid(
                    "stream_options",
                    format!(
                        "`stream_options` must be an object like {{\"include_usage\": true}}: {e}."
                    ),
                )
            })?;
            let _ = so.continuous_usage_stats;
            so.include_usage
        }
    };
    Ok(GenerationFields {
        stream,
        max_tokens: output_limit(max_completion_tokens, max_tokens),
        n,
        include_usage,
        stream_options_span,
    })
}

/// The output limit vLLM applies: `max_completion_tokens or max_tokens` (Python's `or`: a
/// `max_completion_tokens` of 0 falls back to `max_tokens`, as vLLM does).
fn output_limit(max_completion_tokens: Option<u64>, max_tokens: Option<u64>) -> Option<u64> {
    max_completion_tokens.filter(|t| *t != 0).or(max_tokens)
}

/// A client's value quoted in a message, cut to a readable length.
fn short(text: &str) -> String {
    let mut out: String = text.chars().take(40).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

/// The body to send upstream: the original bytes, with the `model` value replaced when the
/// pool renames it, and `stream_options.include_usage: true` added when a stream did not ask
/// for usage (the relay then removes that extra usage event from what the client receives).
/// Splices only; re-serialises nothing but an existing `stream_options` object.
pub fn upstream_body(
    body: &Bytes,
    view: &RequestView<'_>,
    rename: Option<&[u8]>,
    inject_usage: bool,
) -> Bytes {
    upstream_body_owned(body, view, rename, inject_usage, None, None)
}

/// `upstream_body`, with a Responses `request_id` put in `owner`'s namespace
/// (`<owner>-<the client's id>`): vLLM makes the stored response's id from it, and one key's
/// chosen id must never name another key's response; and with `priority` written as the
/// request's vLLM `priority` (the client's value replaced, or the field added).
pub fn upstream_body_owned(
    body: &Bytes,
    view: &RequestView<'_>,
    rename: Option<&[u8]>,
    inject_usage: bool,
    owner: Option<&str>,
    priority: Option<i64>,
) -> Bytes {
    // Edits from the end of the body backwards, so earlier offsets stay valid.
    let mut edits: Vec<(Range<usize>, Vec<u8>)> = Vec::with_capacity(2);
    if let Some(name) = rename {
        edits.push((view.model_span.clone(), name.to_vec()));
    }
    if let (Some(owner), Some(span)) = (owner, &view.request_id_span) {
        // The value is a JSON string: its escaped content stays as it came.
        let inner = &body[span.start + 1..span.end - 1];
        let mut id = Vec::with_capacity(owner.len() + inner.len() + 3);
        id.push(b'"');
        id.extend_from_slice(owner.as_bytes());
        id.push(b'-');
        id.extend_from_slice(inner);
        id.push(b'"');
        edits.push((span.clone(), id));
    }
    if let Some(p) = priority {
        let mut buf = itoa::Buffer::new();
        let value = buf.format(p).as_bytes();
        match &view.priority {
            Some((_, span)) => edits.push((span.clone(), value.to_vec())),
            None => {
                let at = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
                let mut field = Vec::with_capacity(value.len() + 12);
                field.extend_from_slice(b"\"priority\":");
                field.extend_from_slice(value);
                field.push(b',');
                edits.push((at..at, field));
            }
        }
    }
    if inject_usage {
        match &view.stream_options_span {
            Some(span) => {
                let mut obj: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&body[span.clone()]).unwrap_or_default();
                obj.insert("include_usage".into(), serde_json::Value::Bool(true));
                // vLLM reports no usage at all for `continuous_usage_stats` without
                // `include_usage`; with the injected `include_usage` it would put usage on
                // every chunk, and only the final usage chunk is cut out. Asked for the final
                // one only, the client's stream is what it would get directly.
                if let Some(c) = obj.get_mut("continuous_usage_stats") {
                    *c = serde_json::Value::Bool(false);
                }
                let text = serde_json::to_vec(&obj)
                    .unwrap_or_else(|_| b"{\"include_usage\":true}".to_vec());
                edits.push((span.clone(), text));
            }
            None => {
                // Right after the opening brace of the body.
                let at = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
                edits.push((
                    at..at,
                    b"\"stream_options\":{\"include_usage\":true},".to_vec(),
                ));
            }
        }
    }
    if edits.is_empty() {
        return body.clone();
    }
    edits.sort_by_key(|(r, _)| std::cmp::Reverse(r.start));
    let extra: usize = edits.iter().map(|(_, v)| v.len()).sum();
    let mut out = body.to_vec();
    out.reserve(extra);
    for (range, with) in edits {
        out.splice(range, with);
    }
    Bytes::from(out)
}

fn invalid_body_shape() -> ViewError {
    ViewError::InvalidRequest {
        param: None,
        message: "The request body must be a JSON object such as {\"model\": \"...\", \"messages\": [...]}.".into(),
    }
}

/// A type mismatch deep in the body: find which field (cold path, parses again with paths).
fn data_error<'a, T: Deserialize<'a>>(body: &'a [u8], e: serde_json::Error) -> ViewError {
    let mut de = serde_json::Deserializer::from_slice(body);
    let path = match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Err(pe) => pe.path().to_string(),
        Ok(_) => String::new(),
    };
    let param = if path.is_empty() || path == "." {
        None
    } else {
        Some(Cow::Owned(path))
    };
    let message = match &param {
        Some(p) => format!("Invalid value for `{p}`: {e}."),
        None => format!("Invalid request body: {e}."),
    };
    ViewError::InvalidRequest { param, message }
}

fn opt_u64(raw: Option<&RawValue>, name: &'static str) -> Result<Option<u64>, ViewError> {
    match raw.map(RawValue::get) {
        None | Some("null") => Ok(None),
        Some(text) => text.parse::<u64>().map(Some).map_err(|_| {
            invalid(
                name,
                format!("`{name}` must be a non-negative integer, got `{text}`."),
            )
        }),
    }
}

/// Where `part` (a sub-slice of `body` handed out by the borrowing parser) sits in `body`.
fn span_of(body: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (body.get(start..end)? == part).then_some(start..end)
}

// ---- prompt size estimation without building a tree ------------------------------------

/// Sum of the `content` text lengths of chat messages.
struct Messages(usize);
/// Length of a completions prompt (string, strings, or token ids ≈ 4 characters each).
struct Prompt(usize);
/// Length of a Responses or pooling `input`: a string, or the content text of its items
/// (input items or messages, strings, token ids ≈ 4 characters each, lists of them).
struct Input(usize);

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Input;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of input items")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Input, E> {
                Ok(Input(s.chars().count()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Input, A::Error> {
                let mut total = 0;
                while let Some(Item(n)) = seq.next_element()? {
                    total += n;
                }
                Ok(Input(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// One element of an `input` list: an item or message (its content counted), a string, a
/// token id, or a list of token ids.
struct Item(usize);

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an input item, a string, or token ids")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
                let Message(n) = Message::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Item(n))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
                Ok(Item(s.chars().count()))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Item, E> {
                Ok(Item(4))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
                let Prompt(n) = Prompt::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(Item(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// Length of pooling text of any shape: strings, token ids (≈ 4 characters each), lists of
/// them, and objects' `text` and `content` (multimodal parts: their other fields, such as
/// image URLs, are not text).
#[derive(Clone, Copy)]
struct Text(usize);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a list of strings, token ids, or content parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text, E> {
                Ok(Text(s.chars().count()))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Text, E> {
                Ok(Text(4))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Text, E> {
                Ok(Text(4))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Text, E> {
                Ok(Text(4))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Text, E> {
                Ok(Text(0))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Text, E> {
                Ok(Text(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Text, A::Error> {
                let mut total = 0;
                while let Some(Text(n)) = seq.next_element()? {
                    total += n;
                }
                Ok(Text(total))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Text, A::Error> {
                let mut total = 0;
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    if key == "text" || key == "content" {
                        total += map.next_value::<Text>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Text(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// A batch's conversations: how many, and the content text of all their messages.
struct Conversations {
    count: usize,
    chars: usize,
}

impl<'de> Deserialize<'de> for Conversations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Conversations;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of conversations, each an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Conversations, A::Error> {
                let (mut count, mut chars) = (0, 0);
                while let Some(Messages(n)) = seq.next_element()? {
                    count += 1;
                    chars += n;
                }
                Ok(Conversations { count, chars })
            }
        }
        d.deserialize_seq(V)
    }
}

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
                let mut total = 0;
                while let Some(Message(n)) = seq.next_element()? {
                    total += n;
                }
                Ok(Messages(total))
            }
        }
        d.deserialize_seq(V)
    }
}

struct Message(usize);

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message object with `role` and `content`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message, A::Error> {
                let mut total = 0;
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    // (`output` and `arguments`: a Responses function call's result and call.)
                    if matches!(&*key, "content" | "output" | "arguments") {
                        total += map.next_value::<Content>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Message(total))
            }
        }
        d.deserialize_map(V)
    }
}

/// A message's content: a string, an array of parts (`{"type":"text","text":...}`), or null.
struct Content(usize);

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Content, E> {
                Ok(Content(s.chars().count()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Content, E> {
                Ok(Content(0))
            }
            fn visit_none<E: de::Error>(self) -> Result<Content, E> {
                Ok(Content(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut total = 0;
                while let Some(Part(n)) = seq.next_element()? {
                    total += n;
                }
                Ok(Content(total))
            }
        }
        d.deserialize_any(V)
    }
}

struct Part(usize);

impl<'de> Deserialize<'de> for Part {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Part;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part object such as {\"type\":\"text\",\"text\":\"...\"}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Part, A::Error> {
                let mut total = 0;
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    // (`content`: an Anthropic `tool_result` block's own blocks or text.)
                    if key == "text" || key == "content" {
                        total += map.next_value::<Content>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Part(total))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, an array of strings, or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
                Ok(Prompt(s.chars().count()))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Prompt, E> {
                Ok(Prompt(4))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut total = 0;
                while let Some(Prompt(n)) = seq.next_element()? {
                    total += n;
                }
                Ok(Prompt(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// A completions `prompt`: its length (as `Prompt`) and how many prompts it holds (vLLM
/// answers each of a list: a string, a list of strings, token ids, or a list of them).
struct CompletionPrompts {
    chars: usize,
    count: u32,
}

impl<'de> Deserialize<'de> for CompletionPrompts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CompletionPrompts;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, an array of strings, or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<CompletionPrompts, E> {
                Ok(CompletionPrompts {
                    chars: s.chars().count(),
                    count: 1,
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<CompletionPrompts, A::Error> {
                // Token ids alone are one prompt; each string or list of ids is one.
                let (mut chars, mut count) = (0usize, 0u32);
                while let Some(PromptElement { chars: n, whole }) = seq.next_element()? {
                    chars += n;
                    count = count.saturating_add(u32::from(whole));
                }
                Ok(CompletionPrompts {
                    chars,
                    count: count.max(1),
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// One element of a completions `prompt` list: a whole prompt (a string, a list of token ids)
/// or one token id of a single prompt.
struct PromptElement {
    chars: usize,
    whole: bool,
}

impl<'de> Deserialize<'de> for PromptElement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptElement;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id, or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptElement, E> {
                Ok(PromptElement {
                    chars: s.chars().count(),
                    whole: true,
                })
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<PromptElement, E> {
                Ok(PromptElement {
                    chars: 4,
                    whole: false,
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PromptElement, A::Error> {
                let Prompt(n) = Prompt::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(PromptElement {
                    chars: n,
                    whole: true,
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, ep: Endpoint) -> (Option<String>, String) {
        match parse(body.as_bytes(), ep).unwrap_err() {
            ViewError::InvalidRequest { param, message } => {
                (param.map(|p| p.into_owned()), message)
            }
            ViewError::InvalidJson(m) => (Some("<json>".into()), m),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn reads_the_fields() {
        let body = br#"{"model":"qwen32b","stream":true,"max_tokens":64,"stream_options":{"include_usage":false},"messages":[{"role":"user","content":"hello"},{"role":"user","content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"data:xyz"}}]}]}"#;
        let v = parse(body, Endpoint::Chat).unwrap();
        assert_eq!(v.model, "qwen32b");
        assert_eq!(&body[v.model_span.clone()], b"\"qwen32b\"");
        assert!(v.stream);
        assert_eq!(v.max_tokens, Some(64));
        assert_eq!(v.include_usage, Some(false));
        assert_eq!(v.prompt_chars, 8);
        assert_eq!(v.n, 1);
    }

    #[test]
    fn max_completion_tokens_wins_and_prompt_forms() {
        let v = parse(
            br#"{"model":"m","max_tokens":5,"max_completion_tokens":7,"prompt":["ab","c"]}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(v.max_tokens, Some(7));
        assert_eq!(v.prompt_chars, 3);
        let v = parse(br#"{"model":"m","prompt":[1,2,3]}"#, Endpoint::Completions).unwrap();
        assert_eq!(v.prompt_chars, 12);
        assert_eq!(v.n, 1, "token ids are one prompt");
    }

    /// The vLLM `priority` is spliced: a client's value replaced in place, or the field added
    /// after the opening brace; the rest of the body is the client's bytes.
    #[test]
    fn priority_is_spliced() {
        let body = Bytes::from_static(br#"{"model":"m","priority": -5,"messages":[]}"#);
        let v = parse(&body, Endpoint::Chat).unwrap();
        assert_eq!(v.priority.as_ref().map(|p| p.0), Some(-5));
        let out = upstream_body_owned(&body, &v, None, false, None, Some(20));
        assert_eq!(&out[..], br#"{"model":"m","priority": 20,"messages":[]}"#);
        let body = Bytes::from_static(br#"{"model":"m","input":"hi"}"#);
        let v = parse(&body, Endpoint::Responses).unwrap();
        let out = upstream_body_owned(&body, &v, None, false, None, Some(0));
        assert_eq!(&out[..], br#"{"priority":0,"model":"m","input":"hi"}"#);
        let (p, _) = err(
            r#"{"model":"m","priority":"high","messages":[]}"#,
            Endpoint::Chat,
        );
        assert_eq!(p.as_deref(), Some("priority"));
    }

    /// A `Content-Type` parameter named twice is found whatever its case or quoting, and a
    /// `;` inside a quoted value does not start a parameter.
    #[test]
    fn repeated_content_type_parameters() {
        let twice = |ct: &str| repeated_parameter(ct);
        assert_eq!(twice("multipart/form-data; boundary=AAA"), None);
        assert_eq!(
            twice("multipart/form-data; boundary=AAA; boundary=BBB").as_deref(),
            Some("boundary")
        );
        assert_eq!(
            twice("multipart/form-data; Boundary=\"A\"; BOUNDARY=B").as_deref(),
            Some("boundary")
        );
        assert_eq!(
            twice("multipart/form-data; boundary=\"a; boundary=b\"; charset=utf-8"),
            None
        );
        assert_eq!(
            twice("multipart/form-data; boundary=\"a\\\" x\"; boundary=c").as_deref(),
            Some("boundary")
        );
        assert_eq!(twice("multipart/form-data"), None);
    }

    /// What vLLM would generate at most, read as it reads it: `max_completion_tokens or
    /// max_tokens` (a 0 falls back), and `n` answers for each prompt of a completions list.
    #[test]
    fn the_output_limit_is_read_as_vllm_reads_it() {
        let v = parse(
            br#"{"model":"m","max_completion_tokens":0,"max_tokens":100000,"messages":[]}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(v.max_tokens, Some(100_000));
        let body = format!(
            r#"{{"model":"m","max_tokens":1000,"n":2,"prompt":[{}]}}"#,
            vec!["\"p\""; 100].join(",")
        );
        let v = parse(body.as_bytes(), Endpoint::Completions).unwrap();
        assert_eq!((v.n, v.max_tokens), (200, Some(1000)));
        let v = parse(
            br#"{"model":"m","prompt":[[1,2],[3],[4,5,6]]}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((v.n, v.prompt_chars), (3, 24));
    }

    /// The pooling bodies are sized by their texts in every shape vLLM takes (token ids ≈ 4
    /// characters each; image URLs are not text), and need no generation fields.
    #[test]
    fn pooling_bodies() {
        let size = |body: &str, ep: Endpoint| parse(body.as_bytes(), ep).unwrap().prompt_chars;
        assert_eq!(
            size(r#"{"model":"m","input":"abcd"}"#, Endpoint::Embeddings),
            4
        );
        assert_eq!(
            size(r#"{"model":"m","input":["ab","c"]}"#, Endpoint::Embeddings),
            3
        );
        assert_eq!(
            size(r#"{"model":"m","input":[1,2,3]}"#, Endpoint::Embeddings),
            12
        );
        assert_eq!(
            size(r#"{"model":"m","input":[[1,2],[3]]}"#, Endpoint::Classify),
            12
        );
        assert_eq!(
            size(
                r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#,
                Endpoint::Pooling
            ),
            5
        );
        assert_eq!(
            size(
                r#"{"model":"m","inputs":[{"content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#,
                Endpoint::CohereEmbed
            ),
            3
        );
        assert_eq!(
            size(
                r#"{"model":"m","query":"ab","documents":["cd",{"content":[{"type":"text","text":"e"}]}],"top_n":1}"#,
                Endpoint::RerankV2
            ),
            5
        );
        assert_eq!(
            size(
                r#"{"model":"m","text_1":"ab","text_2":["c","d"]}"#,
                Endpoint::ScoreV1
            ),
            4
        );
        let v = parse(
            br#"{"model":"m","input":"x","max_tokens":9,"stream":true}"#,
            Endpoint::Embeddings,
        )
        .unwrap();
        assert!(
            !v.stream && v.max_tokens.is_none(),
            "no generation fields read"
        );
        // A batch: one answer per conversation.
        let v = parse(
            br#"{"model":"m","max_tokens":7,"messages":[[{"role":"user","content":"ab"}],[{"role":"user","content":"c"}]]}"#,
            Endpoint::ChatBatch,
        )
        .unwrap();
        assert_eq!((v.n, v.max_tokens, v.prompt_chars), (2, Some(7), 3));
        let (p, _) = err(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
            Endpoint::ChatBatch,
        );
        assert_eq!(p.as_deref(), Some("messages[0]"));
    }

    /// The `model` form field is found wherever it comes, never in a file named `model`, and
    /// its span holds its bare value (a rename splices it).
    #[test]
    fn the_model_form_field() {
        let body = Bytes::from_static(
            b"--b1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n\r\nname=\"model\"\r\n\r\nRIFF\r\n--b1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b1\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--b1--\r\n",
        );
        let v = futures_util::FutureExt::now_or_never(parse_form(
            &body,
            "multipart/form-data; boundary=b1",
            Endpoint::Transcriptions,
        ))
        .unwrap()
        .unwrap();
        assert_eq!(v.model, "whisper");
        assert_eq!(&body[v.model_span.clone()], b"whisper");
        assert!(v.stream);
        let renamed = upstream_body(&body, &v, Some(b"openai/whisper-large-v3"), false);
        assert!(
            memchr::memmem::find(
                &renamed,
                b"name=\"model\"\r\n\r\nopenai/whisper-large-v3\r\n"
            )
            .is_some()
        );
        let refused = futures_util::FutureExt::now_or_never(parse_form(
            &body,
            "application/json",
            Endpoint::Transcriptions,
        ))
        .unwrap();
        assert!(matches!(refused, Err(ViewError::InvalidRequest { .. })));
    }

    #[test]
    fn specific_errors() {
        let (p, m) = err(r#"{"messages":[]}"#, Endpoint::Chat);
        assert_eq!(p.as_deref(), Some("model"));
        assert!(m.contains("required"));
        let (p, _) = err(r#"{"model":5,"messages":[]}"#, Endpoint::Chat);
        assert_eq!(p.as_deref(), Some("model"));
        let (p, m) = err(
            r#"{"model":"m","stream":"yes","messages":[]}"#,
            Endpoint::Chat,
        );
        assert_eq!(p.as_deref(), Some("stream"));
        assert!(m.contains("boolean"), "{m}");
        let (p, _) = err(r#"{"model":"m","prompt":"x"}"#, Endpoint::Chat);
        assert_eq!(p.as_deref(), Some("messages"));
        let (p, _) = err(r#"{"model":"m","messages":[]"#, Endpoint::Chat);
        assert_eq!(p.as_deref(), Some("<json>"));
        let (p, m) = err(r#"[1,2]"#, Endpoint::Chat);
        assert_eq!(p, None);
        assert!(m.contains("JSON object"));
        let (p, _) = err(
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            Endpoint::Chat,
        );
        assert!(p.unwrap().starts_with("messages"));
        let (p, _) = err(
            r#"{"model":"m","max_tokens":-1,"messages":[]}"#,
            Endpoint::Chat,
        );
        assert_eq!(p.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn tokenizer_bodies() {
        // Generation fields mean nothing here: not read, so never injected into.
        let body =
            br#"{"model":"m","prompt":"abcd","stream":"yes","n":0,"add_special_tokens":false}"#;
        let v = parse(body, Endpoint::Tokenize).unwrap();
        assert_eq!((v.model.as_ref(), v.prompt_chars), ("m", 4));
        assert!(!v.stream && v.stream_options_span.is_none() && v.max_tokens.is_none());
        let v = parse(
            br#"{"model":"m","messages":[{"role":"user","content":"abc"}]}"#,
            Endpoint::Tokenize,
        )
        .unwrap();
        assert_eq!(v.prompt_chars, 3);
        let (p, m) = err(r#"{"model":"m"}"#, Endpoint::Tokenize);
        assert_eq!(p.as_deref(), Some("prompt"));
        assert!(m.contains("`messages`"), "{m}");
        let v = parse(br#"{"model":"m","tokens":[1,2,3]}"#, Endpoint::Detokenize).unwrap();
        assert_eq!(v.prompt_chars, 12);
        let (p, _) = err(r#"{"model":"m","tokens":null}"#, Endpoint::Detokenize);
        assert_eq!(p.as_deref(), Some("tokens"));
        let (p, m) = err(r#"{"model":"m","tokens":"1 2 3"}"#, Endpoint::Detokenize);
        assert_eq!(p.as_deref(), Some("tokens"));
        assert!(m.contains("array of token ids"), "{m}");
        // A `tokens` field of any shape in a chat body is none of the view's business.
        assert!(
            parse(
                br#"{"model":"m","messages":[],"tokens":"x"}"#,
                Endpoint::Chat
            )
            .is_ok()
        );
        let (p, _) = err(r#"{"prompt":"x"}"#, Endpoint::Tokenize);
        assert_eq!(p.as_deref(), Some("model"));
    }

    #[test]
    fn usage_is_added_to_streams_that_did_not_ask() {
        let body = Bytes::from_static(br#" {"model":"m","stream":true,"messages":[]}"#);
        let v = parse(&body, Endpoint::Chat).unwrap();
        let out = upstream_body(&body, &v, Some(br#""served""#), true);
        assert_eq!(
            &out[..],
            br#" {"stream_options":{"include_usage":true},"model":"served","stream":true,"messages":[]}"#
        );
        let v2 = parse(&out, Endpoint::Chat).unwrap();
        assert_eq!(v2.include_usage, Some(true));
        assert_eq!(v2.model, "served");

        let body = Bytes::from_static(br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"messages":[]}"#);
        let v = parse(&body, Endpoint::Chat).unwrap();
        let out = upstream_body(&body, &v, None, true);
        let v2 = parse(&out, Endpoint::Chat).unwrap();
        assert_eq!(v2.include_usage, Some(true));
        assert!(
            std::str::from_utf8(&out)
                .unwrap()
                .contains("continuous_usage_stats")
        );
        // Nothing to change: the very same bytes.
        let v = parse(&body, Endpoint::Chat).unwrap();
        assert_eq!(
            upstream_body(&body, &v, None, false).as_ptr(),
            body.as_ptr()
        );
    }

    /// `continuous_usage_stats` without `include_usage` gets no usage from vLLM: with the
    /// injected `include_usage` it must not turn into usage on every chunk.
    #[test]
    fn continuous_usage_without_include_usage_stays_without_usage() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true},"messages":[]}"#,
        );
        let v = parse(&body, Endpoint::Chat).unwrap();
        let out = upstream_body(&body, &v, None, true);
        let sent: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            sent["stream_options"],
            serde_json::json!({"include_usage": true, "continuous_usage_stats": false})
        );
        // Asked for by the client: nothing injected, nothing changed.
        let both = Bytes::from_static(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"messages":[]}"#,
        );
        let v = parse(&both, Endpoint::Chat).unwrap();
        assert_eq!(upstream_body(&both, &v, None, false), both);
    }

    /// `"stream_options": null` is replaced, never joined by a second `stream_options` key
    /// (duplicate keys: the sim refuses them, vLLM keeps the last, null, and reports no usage).
    #[test]
    fn a_null_stream_options_is_replaced() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"stream_options" : null,"messages":[]}"#,
        );
        let v = parse(&body, Endpoint::Chat).unwrap();
        assert_eq!(v.include_usage, None);
        let out = upstream_body(&body, &v, None, true);
        assert_eq!(
            &out[..],
            br#"{"model":"m","stream":true,"stream_options" : {"include_usage":true},"messages":[]}"#
        );
        assert_eq!(
            parse(&out, Endpoint::Chat).unwrap().include_usage,
            Some(true)
        );
        // Not a stream, nothing injected: the same bytes.
        let body = Bytes::from_static(br#"{"model":"m","stream_options":null,"messages":[]}"#);
        let v = parse(&body, Endpoint::Chat).unwrap();
        assert!(!v.stream);
        assert_eq!(upstream_body(&body, &v, None, false), body);
    }

    #[test]
    fn splice_rewrites_only_the_model() {
        let body = Bytes::from_static(br#"{"model" : "a\u0062", "messages":[]}"#);
        let v = parse(&body, Endpoint::Chat).unwrap();
        assert_eq!(v.model, "ab");
        let out = upstream_body(&body, &v, Some(br#""served/name""#), false);
        assert_eq!(&out[..], br#"{"model" : "served/name", "messages":[]}"#);
        assert_eq!(parse(&out, Endpoint::Chat).unwrap().model, "served/name");
    }
}
