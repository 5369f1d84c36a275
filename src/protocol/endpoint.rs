//! The endpoint table: the only routes the gateway forwards (method + path → endpoint), and
//! what each endpoint asks of the request path. A route not in the table is never forwarded
//! (vLLM's security guide asks for an allow-listing proxy in front of it).

use http::Method;

/// One row of the endpoint table.
#[derive(Debug)]
pub struct Row {
    pub method: Method,
    /// The path, the same on the gateway and on the backend.
    pub path: &'static str,
    pub endpoint: Endpoint,
}

/// Every forwarded route. vLLM serves its tokenizer at the server root, not under `/v1`
/// (`vllm bench serve` aligns its prompts with `<base>/tokenize`).
pub static TABLE: [Row; 4] = [
    Row {
        method: Method::POST,
        path: "/v1/chat/completions",
        endpoint: Endpoint::Chat,
    },
    Row {
        method: Method::POST,
        path: "/v1/completions",
        endpoint: Endpoint::Completions,
    },
    Row {
        method: Method::POST,
        path: "/tokenize",
        endpoint: Endpoint::Tokenize,
    },
    Row {
        method: Method::POST,
        path: "/detokenize",
        endpoint: Endpoint::Detokenize,
    },
];

/// The row of `path`, whatever the method (the router answers 405 for another method).
pub fn lookup(path: &str) -> Option<&'static Row> {
    TABLE.iter().find(|r| r.path == path)
}

/// How an endpoint's request body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// One JSON object, read whole (within `server.max_body_bytes`) and viewed once.
    Json,
}

/// What an endpoint asks of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// It generates tokens: its body has generation fields (`max_tokens`, `n`), its answer a
    /// first token and the latency figures, and a backend's prefix cache is worth aiming at.
    pub generates: bool,
    /// It takes one of a backend's capacity slots, and may wait in the admission queue.
    pub takes_slot: bool,
    /// It reserves from the key's token budget (settled on the answer's usage).
    pub spends_tokens: bool,
    pub body: BodyKind,
    /// It must reach the backend that holds what it names (a stored response): none yet.
    pub pinned: bool,
    /// A stream that did not ask for usage gets it upstream, hidden from the client.
    pub injects_usage: bool,
}

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

    /// What it asks of the request path. The completions endpoints generate, take a slot and
    /// spend tokens; the tokenizer endpoints do none of that (they count against the key's
    /// requests per minute only, and never wait for a slot).
    pub const fn needs(self) -> Needs {
        match self {
            Endpoint::Chat | Endpoint::Completions => Needs {
                generates: true,
                takes_slot: true,
                spends_tokens: true,
                body: BodyKind::Json,
                pinned: false,
                injects_usage: true,
            },
            Endpoint::Tokenize | Endpoint::Detokenize => Needs {
                generates: false,
                takes_slot: false,
                spends_tokens: false,
                body: BodyKind::Json,
                pinned: false,
                injects_usage: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each endpoint has one row, under its own path; nothing else is found.
    #[test]
    fn the_table_routes_each_endpoint_by_its_path() {
        for row in &TABLE {
            assert_eq!(row.path, row.endpoint.path());
            assert_eq!(lookup(row.path).map(|r| r.endpoint), Some(row.endpoint));
        }
        for path in [
            "/v1/chat/completions/",
            "/v1/v1/completions",
            "/pause",
            "/v1/tokenize",
            "",
        ] {
            assert!(lookup(path).is_none(), "{path}");
        }
    }
}
