//! What a run asks for, shared by the plan, the dataset and the runners: the endpoint type, the
//! weighted request classes of settings.json, the servers it sends to, the sweep's axis and the
//! multi-turn shape. A leaf: it imports no other module of the bench.

use std::time::Duration;

use http::{HeaderMap, Uri};
use serde::Deserialize;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointType {
    /// `/v1/chat/completions` with `messages`.
    OpenaiChat,
    /// `/v1/completions` with `prompt` (vLLM's `vllm` and `openai` backends).
    #[value(alias = "vllm")]
    Openai,
    /// `/v1/responses` with `input` (OpenAI's Responses API, as Codex speaks it; vLLM's name).
    OpenaiResponses,
    /// `/v1/messages` with `messages` and `max_tokens` (Anthropic's Messages API, as Claude
    /// Code speaks it).
    AnthropicMessages,
    /// `/v1/embeddings` with `input` (a pooling server, `vllm serve --runner pooling`): one
    /// whole JSON answer, no stream, so its only latency is the whole request (E2EL). vLLM's
    /// other embedding backends send the same request here.
    #[value(
        alias = "openai-embeddings-chat",
        alias = "openai-embeddings-clip",
        alias = "openai-embeddings-vlm2vec",
        alias = "infinity-embeddings",
        alias = "infinity-embeddings-clip"
    )]
    OpenaiEmbeddings,
}

impl EndpointType {
    /// The API path requests of this type go to.
    pub(crate) fn path(self) -> &'static str {
        match self {
            EndpointType::OpenaiChat => "/v1/chat/completions",
            EndpointType::Openai => "/v1/completions",
            EndpointType::OpenaiResponses => "/v1/responses",
            EndpointType::AnthropicMessages => "/v1/messages",
            EndpointType::OpenaiEmbeddings => "/v1/embeddings",
        }
    }

    /// The name in results (`endpoint_type`, `backend`), as `vllm bench serve` writes it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            EndpointType::OpenaiChat => "openai-chat",
            EndpointType::Openai => "openai",
            EndpointType::OpenaiResponses => "openai-responses",
            EndpointType::AnthropicMessages => "anthropic-messages",
            EndpointType::OpenaiEmbeddings => "openai-embeddings",
        }
    }

    /// Whether its answers stream token events. A pooling answer is one JSON body: no first
    /// token, no gaps between tokens, no output tokens.
    pub(crate) fn streams(self) -> bool {
        !matches!(self, EndpointType::OpenaiEmbeddings)
    }

    /// The latency metrics its answers have (a subset of `summary::METRICS`' keys).
    pub(crate) fn metrics(self) -> &'static [&'static str] {
        if self.streams() {
            &["ttft", "tpot", "itl", "e2el"]
        } else {
            &["e2el"]
        }
    }

    /// `--percentile-metrics` when none is given, as `vllm bench serve` picks it: by task.
    pub(crate) fn default_percentile_metrics(self) -> &'static str {
        if self.streams() {
            "ttft,tpot,itl"
        } else {
            "e2el"
        }
    }

    /// How its streams' events read (token events, usage, the clean end).
    pub(crate) fn dialect(self) -> fleetgate_protocol::Dialect {
        use fleetgate_protocol::Dialect;
        match self {
            // An embeddings answer is not read as a stream (`streams`); Chat for completeness.
            EndpointType::OpenaiChat | EndpointType::Openai | EndpointType::OpenaiEmbeddings => {
                Dialect::Chat
            }
            EndpointType::OpenaiResponses => Dialect::Responses,
            EndpointType::AnthropicMessages => Dialect::Anthropic,
        }
    }
}

/// One weighted request class of settings.json.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RequestClass {
    #[serde(default)]
    pub name: Option<String>,
    pub(crate) weight: f64,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
}

/// A server the run sends to.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    /// Its base URL (several: `, `-joined, as given).
    pub base: String,
    /// The endpoint's URI on its first server.
    pub uri: Uri,
    /// The endpoint's URI on each of its servers (`direct=URL1,URL2`): prompt i goes to
    /// `replicas[i % len]`, spreading the target's requests evenly, as a gateway spreads its pool.
    pub replicas: Vec<Uri>,
    pub headers: HeaderMap,
    /// Where its key came from (`$OPENAI_API_KEY`, `--header`), or why none is sent: said when
    /// a server refuses the key.
    pub key_source: String,
    /// How its answers' events read.
    pub dialect: fleetgate_protocol::Dialect,
    /// Its answers stream token events (else: one whole JSON answer, an embedding's).
    pub streamed: bool,
}

/// What a sweep varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Axis {
    Rate,
    Concurrency,
}

impl Axis {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Axis::Rate => "request rate (req/s)",
            Axis::Concurrency => "max concurrency",
        }
    }
}

/// `rate=2,4,8` or `concurrency=1,2,4`.
pub(crate) fn parse_sweep(text: &str) -> Result<(Axis, Vec<f64>), String> {
    let (k, v) = text
        .split_once('=')
        .ok_or_else(|| format!("--sweep `{text}`: write rate=2,4,8 or concurrency=1,2,4"))?;
    let axis = match k.trim() {
        "rate" | "request_rate" => Axis::Rate,
        "concurrency" | "max_concurrency" => Axis::Concurrency,
        other => return Err(format!("--sweep: `{other}` is not rate or concurrency")),
    };
    let mut values = Vec::new();
    for p in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let x: f64 = p
            .parse()
            .ok()
            .filter(|x: &f64| *x > 0.0 && x.is_finite())
            .ok_or_else(|| format!("--sweep: `{p}` is not a positive number"))?;
        if axis == Axis::Concurrency && x.fract() != 0.0 {
            return Err(format!("--sweep: concurrency `{p}` must be a whole number"));
        }
        values.push(x);
    }
    if values.len() < 2 {
        return Err("--sweep needs at least two values".into());
    }
    if values.windows(2).any(|w| w[1] <= w[0]) {
        return Err("--sweep values must increase".into());
    }
    Ok((axis, values))
}

/// The shape of a multi-turn run (the `--multi-turn-*` flags, resolved).
#[derive(Debug, Clone)]
pub struct MultiTurn {
    pub conversations: usize,
    pub(crate) turns: usize,
    pub(crate) user_len: u64,
    pub(crate) system_len: u64,
    pub(crate) think: Duration,
    /// The system prompt every conversation starts with (empty: none).
    pub(crate) system: String,
    /// Base URLs whose `/metrics` carry vLLM's prefix-cache counters.
    pub(crate) cache_metrics: Vec<String>,
    /// Uneven load (`--multi-turn-hot-share`): conversation 0 sends each turn by several lanes.
    pub(crate) hot: Option<HotConversation>,
}

/// Conversation 0 when `--multi-turn-hot-share` makes it hot: every turn of it is sent by
/// `lanes` parallel requests over the same history, as an agent fanning out sub-agents or
/// parallel tool calls over one long context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct HotConversation {
    /// The share of all requests asked (`--multi-turn-hot-share`).
    pub(crate) share: f64,
    pub(crate) lanes: usize,
}

impl HotConversation {
    /// Lanes for a share `f` of the requests of `conversations`:
    /// L = max(2, round(f / (1 − f) × (conversations − 1))), so the hot conversation sends
    /// L / (L + conversations − 1) of the requests (f = 1/3 of 16: 8 lanes, 8/23).
    pub(crate) fn lanes_for(share: f64, conversations: usize) -> usize {
        let others = conversations.saturating_sub(1) as f64;
        // Bounded by the plan's check of the share (0 < f < 1) and the conversations. The nudge
        // keeps an exact half a half: 1/3 of 16 is 7.5 lanes, 7.4999… in floating point.
        let lanes = (share / (1.0 - share) * others + 1e-9).round();
        if lanes.is_finite() && lanes > 2.0 {
            lanes as usize
        } else {
            2
        }
    }

    /// The share of all requests the hot conversation sends when every turn is answered.
    pub(crate) fn planned_share(&self, conversations: usize) -> f64 {
        self.lanes as f64 / (self.lanes + conversations.saturating_sub(1)) as f64
    }
}

impl MultiTurn {
    /// The index in `Plan::prompts` (and `Outcome::prompt`) of a conversation's turn: the
    /// prompt there is that turn's new user message.
    pub(crate) fn index(&self, conversation: usize, turn: usize) -> usize {
        conversation * self.turns + turn
    }

    /// Requests a turn of conversation `c` sends at once: the hot conversation's lanes, else 1.
    pub(crate) fn lanes(&self, c: usize) -> usize {
        match self.hot {
            Some(h) if c == 0 => h.lanes,
            _ => 1,
        }
    }

    /// The index in `Plan::prompts` of lane `lane` of a conversation's turn: lane 0 is the
    /// conversation's own prompt; the hot conversation's other lanes have theirs after all
    /// conversations', `turns` per lane, so that `turn_of` holds for them too.
    pub fn lane_index(&self, conversation: usize, lane: usize, turn: usize) -> usize {
        match lane {
            0 => self.index(conversation, turn),
            k => self.index(self.conversations + k - 1, turn),
        }
    }

    /// Whether prompt `prompt` is a request of the hot conversation (any lane).
    pub fn is_hot(&self, prompt: usize) -> bool {
        self.hot.is_some() && (prompt < self.turns || prompt >= self.conversations * self.turns)
    }

    /// The turn (0-based) prompt `prompt` is.
    pub fn turn_of(&self, prompt: usize) -> usize {
        prompt % self.turns.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_axes_parse() {
        assert!(parse_sweep("rate=2,4,8").is_ok());
        assert!(parse_sweep("rate=4,2").is_err());
        assert!(parse_sweep("concurrency=1.5,2").is_err());
        assert!(parse_sweep("speed=1,2").is_err());
    }
}
