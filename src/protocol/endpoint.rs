//! The endpoints the gateway forwards: OpenAI's completions and vLLM's tokenizer.

/// Which endpoint a body was sent to: decides the required prompt field, and whether the
/// request is inference (limits, queue, latency figures) or only uses the model's tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// vLLM's `POST /tokenize`: text or chat messages → token ids.
    Tokenize,
    /// vLLM's `POST /detokenize`: token ids → text.
    Detokenize,
}

impl Endpoint {
    /// The path, the same on the gateway and on the backend (vLLM serves its tokenizer at the
    /// server root, not under `/v1`).
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
        }
    }

    /// The request generates tokens: it takes a backend slot, may wait in the queue, spends
    /// the key's token budget and has a first token. The tokenizer endpoints do none of that.
    pub fn is_inference(self) -> bool {
        match self {
            Endpoint::Chat | Endpoint::Completions => true,
            Endpoint::Tokenize | Endpoint::Detokenize => false,
        }
    }
}
