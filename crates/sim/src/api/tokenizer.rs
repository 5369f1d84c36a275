//! vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`) on the sim's own tokenizer
//! (`tokens::pieces`), which also counts the prompt tokens of every generation.

use serde::{Deserialize, Serialize};

use crate::args::SimConfig;
use crate::lora::Adapters;
use crate::tokens;

use super::error::ApiError;
use super::{ChatMessage, bad, chat_texts, check_model};

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

/// The answer to `POST /tokenize`, as vLLM gives it.
pub(crate) fn tokenize(
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Vec<u8>, ApiError> {
    let r: TokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("JSON decode error: {e}")))?;
    check_model(r.model.as_deref(), cfg, adapters)?;
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
pub(crate) fn detokenize(
    body: &[u8],
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<Vec<u8>, ApiError> {
    let r: DetokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("JSON decode error: {e}")))?;
    check_model(r.model.as_deref(), cfg, adapters)?;
    let mut prompt = String::new();
    for id in r.tokens {
        let text = tokens::token_text(id)
            .ok_or_else(|| bad(format!("token id {id} is out of vocabulary")))?;
        prompt.push_str(&text);
    }
    Ok(serde_json::to_vec(&DetokenizeResponse { prompt }).unwrap_or_default())
}
