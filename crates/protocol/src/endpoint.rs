//! The endpoint table: the only routes the gateway forwards (method + path → endpoint), and
//! what each endpoint asks of the request path. A route not in the table is never forwarded
//! (vLLM's security guide asks for an allow-listing proxy in front of it).

use http::Method;

use super::Dialect;

/// One row of the endpoint table: everything the gateway knows about an endpoint.
#[derive(Debug)]
pub struct Row {
    pub method: Method,
    /// The path, the same on the gateway and on the backend; `{id}` stands for one path segment
    /// naming a stored response (`ID_CHARS`).
    pub path: &'static str,
    pub endpoint: Endpoint,
    /// The request log's name of the endpoint.
    pub name: &'static str,
    /// A trace's `gen_ai.operation.name`: OpenTelemetry's GenAI name where one fits (`chat`,
    /// `text_completion`, `embeddings`), else the request log's name.
    pub operation: &'static str,
    /// The metrics' `endpoint` label and what a key's `allowed_endpoints` names.
    pub family: Family,
    /// The wire protocol of its answers and of the gateway's errors on it.
    pub dialect: Dialect,
    pub needs: Needs,
    /// The body's prompt fields (quoted JSON keys), in the order a chat template renders them:
    /// longest-prefix routing reads the prompt from the first one found, prefix affinity hashes
    /// the start of the last. Empty where there is no prompt worth a backend's prefix cache.
    pub prompt: &'static [&'static [u8]],
}

const TOOLS: &[u8] = b"\"tools\"";
const MESSAGES: &[u8] = b"\"messages\"";
const PROMPT: &[u8] = b"\"prompt\"";
const INSTRUCTIONS: &[u8] = b"\"instructions\"";
const INPUT: &[u8] = b"\"input\"";
const SYSTEM: &[u8] = b"\"system\"";

/// A generating endpoint: it takes a slot and spends tokens, its reservation including an
/// output limit.
const GENERATES: Needs = Needs {
    generates: true,
    takes_slot: true,
    spends_tokens: true,
    reserves_output: true,
    body: BodyKind::Json,
    pinned: false,
    stores: false,
    injects_usage: false,
    engine_priority: true,
};
/// Anthropic's Messages: vLLM's request model has no `priority` (it converts the request to
/// a chat completion without one), so its engine cannot order it.
const MESSAGES_API: Needs = Needs {
    engine_priority: false,
    ..GENERATES
};
/// Chat and completions: a stream that did not ask for usage gets it upstream.
const CHAT: Needs = Needs {
    injects_usage: true,
    ..GENERATES
};
/// A new response: it learns where it is stored, and a continuation goes there.
const RESPONDS: Needs = Needs {
    pinned: true,
    stores: true,
    ..GENERATES
};
/// A pooling model (embeddings, rerank, score, classify, pooling): a slot and tokens, but it
/// generates nothing and reserves its input only.
const POOLS: Needs = Needs {
    generates: false,
    reserves_output: false,
    ..GENERATES
};
/// Speech to text generates, but its form names no output limit, and a whole answer's usage
/// counts seconds of audio, not tokens: it reserves nothing and spends what its stream reports.
const TRANSCRIBES: Needs = Needs {
    reserves_output: false,
    body: BodyKind::Multipart,
    engine_priority: false,
    ..GENERATES
};
/// The tokenizer routes: they count against the key's requests per minute only, and never
/// wait for a slot.
const TOKENIZES: Needs = Needs {
    generates: false,
    takes_slot: false,
    spends_tokens: false,
    reserves_output: false,
    body: BodyKind::Json,
    pinned: false,
    stores: false,
    injects_usage: false,
    engine_priority: false,
};
/// A read or a cancel of a stored response: no body, on the backend that holds it.
const BY_ID: Needs = Needs {
    body: BodyKind::None,
    pinned: true,
    ..TOKENIZES
};

/// Every forwarded route, one row per endpoint, in the order of `Endpoint`'s variants.
pub static TABLE: [Row; 21] = [
    // Chat chunks report usage only when asked: the gateway asks.
    Row {
        method: Method::POST,
        path: "/v1/chat/completions",
        endpoint: Endpoint::Chat,
        name: "chat",
        operation: "chat",
        family: Family::Chat,
        dialect: Dialect::Chat,
        needs: CHAT,
        prompt: &[TOOLS, MESSAGES],
    },
    Row {
        method: Method::POST,
        path: "/v1/completions",
        endpoint: Endpoint::Completions,
        name: "completions",
        operation: "text_completion",
        family: Family::Completions,
        dialect: Dialect::Chat,
        needs: CHAT,
        prompt: &[PROMPT],
    },
    // vLLM serves its tokenizer at the server root, not under `/v1` (`vllm bench serve` aligns
    // its prompts with `<base>/tokenize`).
    Row {
        method: Method::POST,
        path: "/tokenize",
        endpoint: Endpoint::Tokenize,
        name: "tokenize",
        operation: "tokenize",
        family: Family::Tokenize,
        dialect: Dialect::Json,
        needs: TOKENIZES,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/detokenize",
        endpoint: Endpoint::Detokenize,
        name: "detokenize",
        operation: "detokenize",
        family: Family::Tokenize,
        dialect: Dialect::Json,
        needs: TOKENIZES,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/responses",
        endpoint: Endpoint::Responses,
        name: "responses",
        operation: "chat",
        family: Family::Responses,
        dialect: Dialect::Responses,
        needs: RESPONDS,
        prompt: &[INSTRUCTIONS, TOOLS, INPUT],
    },
    Row {
        method: Method::GET,
        path: "/v1/responses/{id}",
        endpoint: Endpoint::ResponseGet,
        name: "responses_get",
        operation: "responses_get",
        family: Family::Responses,
        dialect: Dialect::Responses,
        needs: BY_ID,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/responses/{id}/cancel",
        endpoint: Endpoint::ResponseCancel,
        name: "responses_cancel",
        operation: "responses_cancel",
        family: Family::Responses,
        dialect: Dialect::Responses,
        needs: BY_ID,
        prompt: &[],
    },
    // Its final events always carry usage.
    Row {
        method: Method::POST,
        path: "/v1/messages",
        endpoint: Endpoint::Messages,
        name: "messages",
        operation: "chat",
        family: Family::Messages,
        dialect: Dialect::Anthropic,
        needs: MESSAGES_API,
        prompt: &[SYSTEM, TOOLS, MESSAGES],
    },
    Row {
        method: Method::POST,
        path: "/v1/messages/count_tokens",
        endpoint: Endpoint::CountTokens,
        name: "messages_count_tokens",
        operation: "messages_count_tokens",
        family: Family::Tokenize,
        dialect: Dialect::Anthropic,
        needs: TOKENIZES,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/embeddings",
        endpoint: Endpoint::Embeddings,
        name: "embeddings",
        operation: "embeddings",
        family: Family::Embeddings,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v2/embed",
        endpoint: Endpoint::CohereEmbed,
        name: "embed_v2",
        operation: "embeddings",
        family: Family::Embeddings,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/rerank",
        endpoint: Endpoint::Rerank,
        name: "rerank",
        operation: "rerank",
        family: Family::Rerank,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/rerank",
        endpoint: Endpoint::RerankV1,
        name: "rerank_v1",
        operation: "rerank_v1",
        family: Family::Rerank,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v2/rerank",
        endpoint: Endpoint::RerankV2,
        name: "rerank_v2",
        operation: "rerank_v2",
        family: Family::Rerank,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/score",
        endpoint: Endpoint::Score,
        name: "score",
        operation: "score",
        family: Family::Score,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/score",
        endpoint: Endpoint::ScoreV1,
        name: "score_v1",
        operation: "score_v1",
        family: Family::Score,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/classify",
        endpoint: Endpoint::Classify,
        name: "classify",
        operation: "classify",
        family: Family::Classify,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/pooling",
        endpoint: Endpoint::Pooling,
        name: "pooling",
        operation: "pooling",
        family: Family::Pooling,
        dialect: Dialect::Json,
        needs: POOLS,
        prompt: &[],
    },
    // A batch answers whole, and always with usage.
    Row {
        method: Method::POST,
        path: "/v1/chat/completions/batch",
        endpoint: Endpoint::ChatBatch,
        name: "chat_batch",
        operation: "chat",
        family: Family::Chat,
        dialect: Dialect::Chat,
        needs: GENERATES,
        prompt: &[TOOLS, MESSAGES],
    },
    // A transcription's stream chunks are chat-shaped (`choices[].delta.content`).
    Row {
        method: Method::POST,
        path: "/v1/audio/transcriptions",
        endpoint: Endpoint::Transcriptions,
        name: "transcriptions",
        operation: "transcriptions",
        family: Family::Audio,
        dialect: Dialect::Chat,
        needs: TRANSCRIBES,
        prompt: &[],
    },
    Row {
        method: Method::POST,
        path: "/v1/audio/translations",
        endpoint: Endpoint::Translations,
        name: "translations",
        operation: "translations",
        family: Family::Audio,
        dialect: Dialect::Chat,
        needs: TRANSCRIBES,
        prompt: &[],
    },
];

/// The most characters of a response id in a path.
pub(crate) const MAX_ID: usize = 128;

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

/// The row of `path`, whatever the method (the router answers 405 for another method): a
/// row's own path, or a `{id}` row's with one id in its place.
pub fn lookup(path: &str) -> Option<Found<'_>> {
    if let Some(row) = TABLE
        .iter()
        .find(|r| r.path == path && !r.path.contains("{id}"))
    {
        return Some(Found { row, id: None });
    }
    TABLE.iter().find_map(|row| {
        let (before, after) = row.path.split_once("{id}")?;
        let id = path.strip_prefix(before)?.strip_suffix(after)?;
        is_id(id).then_some(Found { row, id: Some(id) })
    })
}

impl Row {
    /// The path with `id` in place of `{id}` (the path itself for a row without one), as the
    /// backend is asked.
    pub fn path_with_id(&self, id: &str) -> String {
        match self.path.split_once("{id}") {
            Some((before, after)) => {
                let mut out = String::with_capacity(before.len() + id.len() + after.len());
                out.push_str(before);
                out.push_str(id);
                out.push_str(after);
                out
            }
            None => self.path.to_owned(),
        }
    }
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
    /// It creates a stored response (unless its body says `store: false`): the answer's id is
    /// made in the key's namespace, and the backend that holds it is pinned.
    pub stores: bool,
    /// A stream that did not ask for usage gets it upstream, hidden from the client.
    pub injects_usage: bool,
    /// vLLM orders this route's requests by the body's `priority` (its request model declares
    /// the field: chat, completions, Responses, the chat batch, every pooling route). With
    /// `[pools.priority]` the gateway writes the environment's value there, and the environment
    /// the backends put first may pass the pool's capacity. On every other route a client's
    /// `priority` is taken out of the body: nothing there would read it, and an engine that
    /// starts to should not find a client's.
    pub engine_priority: bool,
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
    pub(crate) fn parse(name: &str) -> Option<Family> {
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

    pub(crate) fn insert(&mut self, f: Family) {
        self.0 |= 1 << f.index();
    }

    #[cfg(test)]
    pub(crate) fn is_empty(self) -> bool {
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
    /// Its row of the endpoint table.
    pub fn row(self) -> &'static Row {
        &TABLE[self as usize]
    }

    /// The path, the same on the gateway and on the backend (vLLM serves its tokenizer at the
    /// server root, not under `/v1`); `{id}` for the routes that name a response.
    pub fn path(self) -> &'static str {
        self.row().path
    }

    /// Its row's position in `TABLE` (the rows follow the variants' order).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The request log's name of the endpoint.
    pub fn as_str(self) -> &'static str {
        self.row().name
    }

    /// The endpoint's family: the metrics' `endpoint` label (never the path).
    pub fn family(self) -> Family {
        self.row().family
    }

    /// The wire protocol of its answers and of the gateway's errors on it.
    pub fn dialect(self) -> Dialect {
        self.row().dialect
    }

    /// What it asks of the request path. The generating endpoints take a slot and spend
    /// tokens; the pooling endpoints (embeddings, rerank, score, classify, pooling) too, but
    /// reserve only their input (they generate nothing); the tokenizer endpoints and the
    /// routes by response id do neither (they count against the key's requests per minute
    /// only, and never wait for a slot).
    pub fn needs(self) -> Needs {
        self.row().needs
    }

    /// A trace's operation name (`Row::operation`).
    pub fn operation(self) -> &'static str {
        self.row().operation
    }

    /// The body's prompt fields (`Row::prompt`).
    pub fn prompt_fields(self) -> &'static [&'static [u8]] {
        self.row().prompt
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

    /// The rows follow the variants' order (`Endpoint::row`, `Endpoint::index`, the backends'
    /// URIs).
    #[test]
    fn rows_are_indexed_by_endpoint() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(row.endpoint.index(), i, "{}", row.path);
            assert!(std::ptr::eq(row.endpoint.row(), row), "{}", row.path);
        }
    }

    /// Only the endpoints that generate name prompt fields (the prefix routing reads them).
    #[test]
    fn prompt_fields_are_quoted_keys_of_generating_endpoints() {
        for row in &TABLE {
            assert!(row.prompt.is_empty() || row.needs.generates, "{}", row.path);
            for f in row.prompt {
                assert!(f.len() > 2 && f.starts_with(b"\"") && f.ends_with(b"\""));
            }
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

    /// Each endpoint has one row, under its own path and log name; nothing else is found.
    #[test]
    fn the_table_routes_each_endpoint_by_its_path() {
        let mut paths: Vec<_> = TABLE.iter().map(|r| r.path).collect();
        let mut names: Vec<_> = TABLE.iter().map(|r| r.name).collect();
        paths.sort_unstable();
        paths.dedup();
        names.sort_unstable();
        names.dedup();
        assert_eq!((paths.len(), names.len()), (TABLE.len(), TABLE.len()));
        for row in &TABLE {
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
