//! The endpoint table: the only routes the gateway forwards (method + path → endpoint), and
//! what each endpoint asks of the request path. A route not in the table is never forwarded
//! (vLLM's security guide asks for an allow-listing proxy in front of it).

use http::Method;

use super::Dialect;

/// One row of the endpoint table.
#[derive(Debug)]
pub struct Row {
    pub method: Method,
    /// The path, the same on the gateway and on the backend.
    pub path: &'static str,
    pub endpoint: Endpoint,
}

/// Every forwarded route. vLLM serves its tokenizer at the server root, not under `/v1`
/// (`vllm bench serve` aligns its prompts with `<base>/tokenize`). `{id}` stands for one path
/// segment naming a stored response (`ID_CHARS`).
pub static TABLE: [Row; 21] = [
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
    Row {
        method: Method::POST,
        path: "/v1/responses",
        endpoint: Endpoint::Responses,
    },
    Row {
        method: Method::GET,
        path: "/v1/responses/{id}",
        endpoint: Endpoint::ResponseGet,
    },
    Row {
        method: Method::POST,
        path: "/v1/responses/{id}/cancel",
        endpoint: Endpoint::ResponseCancel,
    },
    Row {
        method: Method::POST,
        path: "/v1/messages",
        endpoint: Endpoint::Messages,
    },
    Row {
        method: Method::POST,
        path: "/v1/messages/count_tokens",
        endpoint: Endpoint::CountTokens,
    },
    Row {
        method: Method::POST,
        path: "/v1/embeddings",
        endpoint: Endpoint::Embeddings,
    },
    Row {
        method: Method::POST,
        path: "/v2/embed",
        endpoint: Endpoint::CohereEmbed,
    },
    Row {
        method: Method::POST,
        path: "/rerank",
        endpoint: Endpoint::Rerank,
    },
    Row {
        method: Method::POST,
        path: "/v1/rerank",
        endpoint: Endpoint::RerankV1,
    },
    Row {
        method: Method::POST,
        path: "/v2/rerank",
        endpoint: Endpoint::RerankV2,
    },
    Row {
        method: Method::POST,
        path: "/score",
        endpoint: Endpoint::Score,
    },
    Row {
        method: Method::POST,
        path: "/v1/score",
        endpoint: Endpoint::ScoreV1,
    },
    Row {
        method: Method::POST,
        path: "/classify",
        endpoint: Endpoint::Classify,
    },
    Row {
        method: Method::POST,
        path: "/pooling",
        endpoint: Endpoint::Pooling,
    },
    Row {
        method: Method::POST,
        path: "/v1/chat/completions/batch",
        endpoint: Endpoint::ChatBatch,
    },
    Row {
        method: Method::POST,
        path: "/v1/audio/transcriptions",
        endpoint: Endpoint::Transcriptions,
    },
    Row {
        method: Method::POST,
        path: "/v1/audio/translations",
        endpoint: Endpoint::Translations,
    },
];

/// The most characters of a response id in a path.
pub const MAX_ID: usize = 128;

/// A response id in a path: letters, digits, `_` and `-` (vLLM's `resp_<hex>`, OpenAI's
/// `resp_<alnum>`); anything else (`.`, `%`, `/`) never names one.
fn is_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A route found in the table, with the id its path names (for `{id}` rows).
#[derive(Debug, Clone, Copy)]
pub struct Found<'p> {
    pub row: &'static Row,
    pub id: Option<&'p str>,
}

/// The row of `path`, whatever the method (the router answers 405 for another method).
pub fn lookup(path: &str) -> Option<Found<'_>> {
    if let Some(row) = TABLE.iter().find(|r| r.path == path) {
        return Some(Found { row, id: None });
    }
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, row) = match rest.strip_suffix("/cancel") {
        Some(id) => (id, &TABLE[6]),
        None => (rest, &TABLE[5]),
    };
    is_id(id).then_some(Found { row, id: Some(id) })
}

/// How an endpoint's request body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// One JSON object, read whole (within `server.max_body_bytes`) and viewed once.
    Json,
    /// None is needed (a GET, a cancel): whatever comes is read within the limit and not
    /// forwarded.
    None,
    /// `multipart/form-data` (an audio file and its form fields, `model` among them), read
    /// whole within `server.max_audio_body_bytes`.
    Multipart,
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
    /// Its reservation includes an output limit (`max_tokens`, else
    /// `limits.default_max_tokens`); otherwise it reserves its input only.
    pub reserves_output: bool,
    pub body: BodyKind,
    /// It must reach the backend that holds what it names (a stored response): always for a
    /// GET or cancel by id, and for a new response that continues one
    /// (`previous_response_id`).
    pub pinned: bool,
    /// A stream that did not ask for usage gets it upstream, hidden from the client.
    pub injects_usage: bool,
}

/// A family of endpoints: what the metrics label a request with (a fixed set, so a series
/// per family stays bounded whatever clients send).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Chat,
    Completions,
    /// Created, read back and cancelled stored responses alike.
    Responses,
    Messages,
    /// The tokenizer routes and Anthropic's `count_tokens`: no generation.
    Tokenize,
    /// OpenAI's `/v1/embeddings` and Cohere's `/v2/embed`.
    Embeddings,
    /// `/rerank`, `/v1/rerank` (Jina's shape) and `/v2/rerank` (Cohere's).
    Rerank,
    /// `/score` and `/v1/score`.
    Score,
    Classify,
    /// vLLM's raw `/pooling`.
    Pooling,
    /// Speech to text: `/v1/audio/transcriptions` and `/v1/audio/translations`.
    Audio,
}

impl Family {
    pub const ALL: [Family; 11] = [
        Family::Chat,
        Family::Completions,
        Family::Responses,
        Family::Messages,
        Family::Tokenize,
        Family::Embeddings,
        Family::Rerank,
        Family::Score,
        Family::Classify,
        Family::Pooling,
        Family::Audio,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Family::Chat => "chat",
            Family::Completions => "completions",
            Family::Responses => "responses",
            Family::Messages => "messages",
            Family::Tokenize => "tokenize",
            Family::Embeddings => "embeddings",
            Family::Rerank => "rerank",
            Family::Score => "score",
            Family::Classify => "classify",
            Family::Pooling => "pooling",
            Family::Audio => "audio",
        }
    }

    /// The family named `name` (its label), if any.
    pub fn parse(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.as_str() == name)
    }

    /// Its endpoints run a pooling model (an embedding, reranking, scoring or classifying
    /// one): they take a slot, generate nothing, and spend only their input's tokens.
    pub const fn pools(self) -> bool {
        matches!(
            self,
            Family::Embeddings
                | Family::Rerank
                | Family::Score
                | Family::Classify
                | Family::Pooling
        )
    }

    /// Its position in `ALL`.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// A set of endpoint families: what a key may call (`None` on the key: every family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Families(u16);

impl Families {
    pub const fn contains(self, f: Family) -> bool {
        self.0 & (1 << f.index()) != 0
    }

    pub fn insert(&mut self, f: Family) {
        self.0 |= 1 << f.index();
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The families named (their labels), or what is wrong with a name.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<Families, String> {
        let mut set = Families::default();
        for name in names {
            let name = name.as_ref().trim();
            match Family::parse(name) {
                Some(f) => set.insert(f),
                None => {
                    return Err(format!(
                        "unknown endpoint family `{name}`: the families are {}",
                        Family::ALL.map(Family::as_str).join(", ")
                    ));
                }
            }
        }
        Ok(set)
    }

    /// Their labels, in `Family::ALL`'s order.
    pub fn names(self) -> Vec<&'static str> {
        Family::ALL
            .into_iter()
            .filter(|f| self.contains(*f))
            .map(Family::as_str)
            .collect()
    }
}

/// Which endpoint a request was sent to: decides the body's required fields, the dialect of
/// its answer and errors, and whether it is inference (limits, queue, latency figures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// vLLM's `POST /tokenize`: text or chat messages → token ids.
    Tokenize,
    /// vLLM's `POST /detokenize`: token ids → text.
    Detokenize,
    /// OpenAI's Responses API: `POST /v1/responses`.
    Responses,
    /// `GET /v1/responses/{id}`: a stored response, from the backend that holds it.
    ResponseGet,
    /// `POST /v1/responses/{id}/cancel`: a background response stopped, on its backend.
    ResponseCancel,
    /// Anthropic's Messages API: `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// OpenAI's `POST /v1/embeddings`.
    Embeddings,
    /// Cohere's `POST /v2/embed`.
    CohereEmbed,
    /// `POST /rerank`, `/v1/rerank` (Jina's API) and `/v2/rerank` (Cohere's): one route each,
    /// each forwarded to its own path.
    Rerank,
    RerankV1,
    RerankV2,
    /// `POST /score` and `/v1/score`: pairs of texts scored.
    Score,
    ScoreV1,
    /// `POST /classify`.
    Classify,
    /// `POST /pooling`: the pooler's raw output.
    Pooling,
    /// `POST /v1/chat/completions/batch`: several conversations in one request, one choice
    /// each (no stream).
    ChatBatch,
    /// `POST /v1/audio/transcriptions`: speech to text, multipart, streamed with `stream=true`.
    Transcriptions,
    /// `POST /v1/audio/translations`: speech to English text.
    Translations,
}

impl Endpoint {
    /// The path, the same on the gateway and on the backend (vLLM serves its tokenizer at the
    /// server root, not under `/v1`); `{id}` for the routes that name a response.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
            Endpoint::Responses => "/v1/responses",
            Endpoint::ResponseGet => "/v1/responses/{id}",
            Endpoint::ResponseCancel => "/v1/responses/{id}/cancel",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::CohereEmbed => "/v2/embed",
            Endpoint::Rerank => "/rerank",
            Endpoint::RerankV1 => "/v1/rerank",
            Endpoint::RerankV2 => "/v2/rerank",
            Endpoint::Score => "/score",
            Endpoint::ScoreV1 => "/v1/score",
            Endpoint::Classify => "/classify",
            Endpoint::Pooling => "/pooling",
            Endpoint::ChatBatch => "/v1/chat/completions/batch",
            Endpoint::Transcriptions => "/v1/audio/transcriptions",
            Endpoint::Translations => "/v1/audio/translations",
        }
    }

    /// Its row's position in `TABLE` (the rows follow the variants' order).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The request log's name of the endpoint.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
            Endpoint::Responses => "responses",
            Endpoint::ResponseGet => "responses_get",
            Endpoint::ResponseCancel => "responses_cancel",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "messages_count_tokens",
            Endpoint::Embeddings => "embeddings",
            Endpoint::CohereEmbed => "embed_v2",
            Endpoint::Rerank => "rerank",
            Endpoint::RerankV1 => "rerank_v1",
            Endpoint::RerankV2 => "rerank_v2",
            Endpoint::Score => "score",
            Endpoint::ScoreV1 => "score_v1",
            Endpoint::Classify => "classify",
            Endpoint::Pooling => "pooling",
            Endpoint::ChatBatch => "chat_batch",
            Endpoint::Transcriptions => "transcriptions",
            Endpoint::Translations => "translations",
        }
    }

    /// The endpoint's family: the metrics' `endpoint` label (never the path).
    pub const fn family(self) -> Family {
        match self {
            Endpoint::Chat | Endpoint::ChatBatch => Family::Chat,
            Endpoint::Completions => Family::Completions,
            Endpoint::Tokenize | Endpoint::Detokenize | Endpoint::CountTokens => Family::Tokenize,
            Endpoint::Responses | Endpoint::ResponseGet | Endpoint::ResponseCancel => {
                Family::Responses
            }
            Endpoint::Messages => Family::Messages,
            Endpoint::Embeddings | Endpoint::CohereEmbed => Family::Embeddings,
            Endpoint::Rerank | Endpoint::RerankV1 | Endpoint::RerankV2 => Family::Rerank,
            Endpoint::Score | Endpoint::ScoreV1 => Family::Score,
            Endpoint::Classify => Family::Classify,
            Endpoint::Pooling => Family::Pooling,
            Endpoint::Transcriptions | Endpoint::Translations => Family::Audio,
        }
    }

    /// The wire protocol of its answers and of the gateway's errors on it.
    pub const fn dialect(self) -> Dialect {
        match self {
            // A transcription's stream chunks are chat-shaped (`choices[].delta.content`).
            Endpoint::Chat
            | Endpoint::Completions
            | Endpoint::ChatBatch
            | Endpoint::Transcriptions
            | Endpoint::Translations => Dialect::Chat,
            Endpoint::Tokenize
            | Endpoint::Detokenize
            | Endpoint::Embeddings
            | Endpoint::CohereEmbed
            | Endpoint::Rerank
            | Endpoint::RerankV1
            | Endpoint::RerankV2
            | Endpoint::Score
            | Endpoint::ScoreV1
            | Endpoint::Classify
            | Endpoint::Pooling => Dialect::Json,
            Endpoint::Responses | Endpoint::ResponseGet | Endpoint::ResponseCancel => {
                Dialect::Responses
            }
            Endpoint::Messages | Endpoint::CountTokens => Dialect::Anthropic,
        }
    }

    /// What it asks of the request path. The generating endpoints take a slot and spend
    /// tokens; the pooling endpoints (embeddings, rerank, score, classify, pooling) too, but
    /// reserve only their input (they generate nothing); the tokenizer endpoints and the
    /// routes by response id do neither (they count against the key's requests per minute
    /// only, and never wait for a slot).
    pub const fn needs(self) -> Needs {
        const GENERATES: Needs = Needs {
            generates: true,
            takes_slot: true,
            spends_tokens: true,
            reserves_output: true,
            body: BodyKind::Json,
            pinned: false,
            injects_usage: false,
        };
        const TOKENIZES: Needs = Needs {
            generates: false,
            takes_slot: false,
            spends_tokens: false,
            reserves_output: false,
            body: BodyKind::Json,
            pinned: false,
            injects_usage: false,
        };
        match self {
            // Chat chunks report usage only when asked: the gateway asks.
            Endpoint::Chat | Endpoint::Completions => Needs {
                injects_usage: true,
                ..GENERATES
            },
            // Their final events always carry usage.
            Endpoint::Messages => GENERATES,
            Endpoint::Responses => Needs {
                pinned: true,
                ..GENERATES
            },
            // A batch answers whole, and always with usage.
            Endpoint::ChatBatch => GENERATES,
            Endpoint::Embeddings
            | Endpoint::CohereEmbed
            | Endpoint::Rerank
            | Endpoint::RerankV1
            | Endpoint::RerankV2
            | Endpoint::Score
            | Endpoint::ScoreV1
            | Endpoint::Classify
            | Endpoint::Pooling => Needs {
                generates: false,
                reserves_output: false,
                ..GENERATES
            },
            // Speech to text generates, but its form names no output limit, and a whole
            // answer's usage counts seconds of audio, not tokens: it reserves nothing and
            // spends what its stream reports.
            Endpoint::Transcriptions | Endpoint::Translations => Needs {
                reserves_output: false,
                body: BodyKind::Multipart,
                ..GENERATES
            },
            Endpoint::Tokenize | Endpoint::Detokenize | Endpoint::CountTokens => TOKENIZES,
            Endpoint::ResponseGet | Endpoint::ResponseCancel => Needs {
                body: BodyKind::None,
                pinned: true,
                ..TOKENIZES
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every endpoint belongs to a family listed in `Family::ALL` at its own index (the
    /// metrics index their series by it), and the labels are distinct.
    #[test]
    fn families_are_indexed_as_listed() {
        for (i, f) in Family::ALL.iter().enumerate() {
            assert_eq!(f.index(), i);
        }
        for row in &TABLE {
            let f = row.endpoint.family();
            assert_eq!(Family::ALL[f.index()], f);
        }
        let mut labels: Vec<_> = Family::ALL.iter().map(|f| f.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Family::ALL.len());
    }

    /// The rows follow the variants' order (`Endpoint::index`, the backends' URIs).
    #[test]
    fn rows_are_indexed_by_endpoint() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(row.endpoint.index(), i, "{}", row.path);
        }
    }

    #[test]
    fn family_sets_parse_and_name() {
        let set = Families::parse(&["chat", " embeddings"]).unwrap();
        assert!(set.contains(Family::Chat) && set.contains(Family::Embeddings));
        assert!(!set.contains(Family::Messages));
        assert_eq!(set.names(), ["chat", "embeddings"]);
        let e = Families::parse(&["chat", "embedding"]).unwrap_err();
        assert!(
            e.contains("`embedding`") && e.contains("embeddings, rerank"),
            "{e}"
        );
        assert!(Families::parse::<&str>(&[]).unwrap().is_empty());
    }

    /// Each endpoint has one row, under its own path; nothing else is found.
    #[test]
    fn the_table_routes_each_endpoint_by_its_path() {
        for row in &TABLE {
            assert_eq!(row.path, row.endpoint.path());
            if !row.path.contains("{id}") {
                assert_eq!(lookup(row.path).map(|f| f.row.endpoint), Some(row.endpoint));
            }
        }
        for path in [
            "/v1/chat/completions/",
            "/v1/v1/completions",
            "/pause",
            "/v1/tokenize",
            "",
            "/v1/responses/",
            "/v1/responses//cancel",
            "/v1/responses/../pause",
            "/v1/responses/resp_1/../../pause",
            "/v1/responses/resp%2e1",
            "/v1/responses/resp_1/cancel/",
            "/v1/responses/resp_1/input_items",
            "/v1/messages/",
            "/v1/messages/batches",
        ] {
            assert!(lookup(path).is_none(), "{path}");
        }
        let f = lookup("/v1/responses/resp_0a1B-c").unwrap();
        assert_eq!(
            (f.row.endpoint, f.id),
            (Endpoint::ResponseGet, Some("resp_0a1B-c"))
        );
        let f = lookup("/v1/responses/resp_9/cancel").unwrap();
        assert_eq!(
            (f.row.endpoint, f.id),
            (Endpoint::ResponseCancel, Some("resp_9"))
        );
        let long = format!("/v1/responses/{}", "a".repeat(MAX_ID + 1));
        assert!(lookup(&long).is_none());
    }
}
