//! The pooling routes (embeddings, rerank, score, classify, pooling): what routes and sizes
//! a body. Every other field is the backend's to read.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::prompt::{Count, Input, Text};
use super::{
    GenerationFields, RequestView, ViewError, client_priority, from_body, invalid, model_of,
    present_raw,
};
use crate::Endpoint;
use crate::endpoint::Family;

/// A pooling body (embeddings, rerank, score, classify, pooling): what routes and sizes it.
/// Every other field is the backend's to read.
#[derive(Deserialize)]
struct PoolingBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    user: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present_raw")]
    priority: Option<&'a RawValue>,
    /// Text, texts or token ids (`/v1/embeddings`, `/classify`, `/pooling`).
    input: Option<Count<Input>>,
    /// Chat messages, embedded or classified through the chat template.
    messages: Option<Count<Input>>,
    /// `/pooling`'s IO-processor input.
    data: Option<Count<Text>>,
    /// Cohere's `/v2/embed`: texts, or inputs of content parts (its `images` are data URLs,
    /// not text: they are not counted).
    texts: Option<Count<Text>>,
    inputs: Option<Count<Text>>,
    #[serde(borrow)]
    images: Option<&'a RawValue>,
    query: Option<Count<Text>>,
    documents: Option<Count<Text>>,
    queries: Option<Count<Text>>,
    items: Option<Count<Text>>,
    text_1: Option<Count<Text>>,
    text_2: Option<Count<Text>>,
    data_1: Option<Count<Text>>,
    data_2: Option<Count<Text>>,
}

pub(super) fn parse(body: &[u8], endpoint: Endpoint) -> Result<RequestView<'_>, ViewError> {
    let raw: PoolingBody<'_> = from_body(body)?;
    let (model, model_span) = model_of(raw.model, body)?;
    let inputs = size(raw.input).or(size(raw.messages));
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
        priority: client_priority(raw.priority, body, endpoint)?,
        ..RequestView::whole(GenerationFields::NONE)
    })
}

/// A field's characters, when it is present.
fn size<S>(field: Option<Count<S>>) -> Option<usize> {
    field.map(|c| c.chars)
}
