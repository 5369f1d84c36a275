//! Command-line flags of `fleetgate sim` and their validation into the config the sim runs on.

use std::fmt;
use std::io;
use std::time::Duration;

/// Flags of the simulated vLLM server. Names follow `vllm serve` where vLLM has the same knob,
/// so a command line can be moved between the real server and the sim with few edits.
#[derive(clap::Args, Clone)]
pub struct SimArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to bind (0 picks a free port).
    #[arg(long, default_value_t = 8001)]
    pub port: u16,

    /// Model names the sim answers to; repeat the flag or separate with commas.
    /// The first name is the one reported in responses and metrics.
    #[arg(long, value_delimiter = ',', default_value = "qwen32b")]
    pub served_model_name: Vec<String>,

    /// Require `Authorization: Bearer <key>` on every /v1/* request, as `vllm serve --api-key`.
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Longest prompt + completion, in tokens.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: u32,

    /// Most sequences in the running batch; the rest wait in FIFO order (by `priority` with
    /// `--scheduling-policy priority`).
    #[arg(long, default_value_t = 32)]
    pub max_num_seqs: u32,

    /// How waiting requests are admitted, as vLLM's flag: `fcfs` (arrival order; a request's
    /// `priority` is accepted and ignored) or `priority` (lower `priority` first, arrival order
    /// among equals).
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,

    /// Token budget of one scheduler step (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: u32,

    /// Simulated GPU time per prompt token the prefix cache does not hold, in microseconds
    /// (a GPU prefills 1000 tokens in about 0.1-0.5 ms: 0.1-0.5 here).
    #[arg(long, default_value_t = 20.0)]
    pub prefill_us_per_token: f64,

    /// Base duration of one decode step, in milliseconds.
    #[arg(long, default_value_t = 15.0)]
    pub decode_step_ms: f64,

    /// Extra decode-step time per running sequence, in milliseconds.
    #[arg(long, default_value_t = 0.5)]
    pub decode_ms_per_seq: f64,

    /// Completion length when the request names none.
    #[arg(long, default_value_t = 128)]
    pub default_max_tokens: u32,

    /// Seed for token texts and fault decisions.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Fraction of generation requests answered with a 500 (0.0..=1.0).
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,

    /// Abort the connection after this many content chunks of a stream (no [DONE]).
    #[arg(long)]
    pub drop_after_chunks: Option<u32>,

    /// Send an in-stream error event and [DONE] after this many content chunks.
    #[arg(long)]
    pub error_after_chunks: Option<u32>,

    /// Send nothing more after this many content chunks, the connection left open (a server
    /// that hangs mid-answer, as a stopped process does).
    #[arg(long)]
    pub stall_after_chunks: Option<u32>,

    /// Extra wait before a sequence's first token, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub stall_first_token_ms: f64,

    /// Hand out each sequence's first token the moment it arrives, before any scheduler step;
    /// the later tokens come one per step as usual. A backend whose own time to first token is
    /// nil but whose streams stay open: what a burst through a proxy measures is the proxy.
    #[arg(long)]
    pub first_token_at_once: bool,

    /// Refuse connections (no listen()) for this many seconds after start, like a cold instance.
    #[arg(long, default_value_t = 0.0)]
    pub warmup_secs: f64,

    /// Close a kept-alive connection idle this many seconds between requests, as vLLM's
    /// server does after 5 (uvicorn's `timeout_keep_alive`, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`).
    /// 0: never (the default: tests keep their connections).
    #[arg(long, default_value_t = 0.0)]
    pub timeout_keep_alive: f64,

    /// Zero all per-token timing: frames are produced as fast as the client reads them.
    #[arg(long)]
    pub zero_delay: bool,

    /// End every answer after this many tokens, as a model reaching its end of sequence does
    /// (finish_reason `stop`, `end_turn`, status `completed`), unless the request's own limit
    /// comes first (then `length`, `max_tokens`, `incomplete`). Without it every answer runs
    /// to its limit. Agents treat an answer cut by the limit as an error.
    #[arg(long)]
    pub output_tokens: Option<u32>,

    /// Accept `tool_choice: "auto"` (or none given) with tools on /v1/messages, as vLLM does only
    /// when started with --enable-auto-tool-choice and a --tool-call-parser (Claude Code sends
    /// tools without a tool choice). The sim calls no tools either way.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,

    /// vLLM's tool-call parser (`hermes`, `llama3_json`, `mistral`, ...), which vLLM needs
    /// beside --enable-auto-tool-choice: accepted so that a `vllm serve` line runs here as
    /// written; the sim parses no tool calls (it calls no tools).
    #[arg(long, value_name = "PARSER")]
    pub tool_call_parser: Option<String>,

    /// vLLM's reasoning parser (`deepseek_r1`, `qwen3`, ...): accepted as vLLM's; the sim's
    /// answers have no reasoning part to parse.
    #[arg(long, value_name = "PARSER")]
    pub reasoning_parser: Option<String>,

    /// Keep every response of /v1/responses in memory, as vLLM does with
    /// VLLM_ENABLE_RESPONSES_API_STORE=1: then `GET /v1/responses/{id}`, its cancel and
    /// `previous_response_id` find it (without it they answer 404, as vLLM does).
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE")]
    pub responses_store: bool,

    /// What kind of model the sim stands in for, as `vllm serve --runner`: `generate` serves
    /// chat, completions, responses, messages, the chat batch and audio transcription and
    /// translation; `pooling` serves the pooling routes of `--convert` instead (the generative
    /// routes are then not there: 404, as in vLLM).
    #[arg(long, value_enum, default_value_t = Runner::Generate)]
    pub runner: Runner,

    /// The pooling task of `--runner pooling`, as `vllm serve --convert`: `embed` serves
    /// /v1/embeddings, /v2/embed, /pooling, /score and /rerank; `classify` serves /classify and
    /// /pooling, and /score and /rerank too when `--num-labels` is 1 (a cross-encoder).
    #[arg(long, value_enum, default_value_t = Convert::Embed)]
    pub convert: Convert,

    /// Length of the embedding vectors (`--runner pooling --convert embed`): the model's hidden
    /// size.
    #[arg(long, default_value_t = 64)]
    pub embedding_size: u32,

    /// Labels of the classifier (`--convert classify`): LABEL_0 .. LABEL_{n-1}.
    #[arg(long, default_value_t = 2)]
    pub num_labels: u32,

    /// Tokens per KV block, as `vllm serve --block-size`: the prefix cache's unit (only full
    /// blocks of a prompt are cached).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Capacity of the prefix cache in tokens, least recently used blocks evicted first: a
    /// prompt whose first K tokens are cached pays prefill only for the rest. 0 (the default)
    /// turns prefix caching off (as `--no-enable-prefix-caching`): vLLM caches by default, but
    /// `fleetgate bench --compare` sends each prompt to both of its targets, and against one
    /// sim the second send would skip its prefill, so its pairs would no longer be alike.
    #[arg(long, default_value_t = 0)]
    pub kv_cache_tokens: u64,

    /// Report `usage.prompt_tokens_details` (`{"cached_tokens": K, ...}`) on chat and
    /// completions answers and `cache_read_input_tokens` on /v1/messages, as vLLM does with the
    /// same flag; without it they are `null` / absent.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,

    /// vLLM's `--kv-events-config` JSON: publish what the prefix cache stores and evicts over
    /// ZeroMQ, as vLLM does (`{"enable_kv_cache_events": true, "publisher": "zmq",
    /// "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}`). Needs
    /// `--kv-cache-tokens`.
    #[arg(long)]
    pub kv_events_config: Option<String>,

    /// How events are encoded: `map` (tagged maps, as vLLM 0.32 sends them) or `array` (tagged
    /// arrays, as vLLM before vllm#42892).
    #[arg(long, default_value = "map")]
    pub kv_events_encoding: String,

    /// A model directory (`tokenizer.json`, `tokenizer_config.json`): cut chat and
    /// completions prompts into the model's own tokens, its chat template rendered, so the
    /// prefix cache's blocks and KV events are vLLM's for the same request. Without it the
    /// sim cuts prompts into its own word pieces.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,

    /// The chat template, as `vllm serve --chat-template` takes it (with `--tokenizer`; else
    /// the tokenizer's own).
    #[arg(long)]
    pub chat_template: Option<std::path::PathBuf>,

    /// Serve LoRA adapters, as `vllm serve --enable-lora`: a request may name one as its
    /// `model` (those of `--lora-modules`, and those loaded at run time).
    #[arg(long)]
    pub enable_lora: bool,

    /// Most adapters in one running batch, as vLLM's flag: a request for one more waits until
    /// the running requests of an adapter have finished; requests behind it, of the adapters
    /// running or of the base model, are admitted past it.
    #[arg(long, default_value_t = 1)]
    pub max_loras: u32,

    /// vLLM's highest adapter rank: accepted and ignored (the sim has no weights).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: u32,

    /// Adapters loaded at start (with --enable-lora), as vLLM's flag: one or more values, each
    /// `name=path` or `{"name": "...", "path": "...", "base_model_name": "..."}`; a path must
    /// exist, as vLLM refuses to start on an adapter it cannot find.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH|JSON")]
    pub lora_modules: Vec<String>,

    /// How long `/v1/load_lora_adapter` takes to load an adapter before it answers, in
    /// milliseconds (the sim's; vLLM reads the weights).
    #[arg(long, default_value_t = 50.0)]
    pub lora_load_delay_ms: f64,

    /// vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (`1` or `true`, any case): serve
    /// `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (without it they are 404).
    #[arg(
        long = "allow-runtime-lora-updating",
        env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        action = clap::ArgAction::Set,
        value_parser = crate::lora::env_flag,
        default_value = "0",
        value_name = "1|true"
    )]
    pub runtime_lora_updating: bool,

    /// Keep the exact bytes of every response body, keyed by x-request-id (for tests).
    #[arg(long, hide = true)]
    pub capture_streams: bool,
}

/// `vllm serve --runner`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    Generate,
    Pooling,
}

/// `vllm serve --convert` (with `--runner pooling`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Convert {
    Embed,
    Classify,
}

impl Default for SimArgs {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 0,
            served_model_name: vec!["qwen32b".to_owned()],
            api_key: None,
            max_model_len: 32768,
            max_num_seqs: 32,
            scheduling_policy: SchedulingPolicy::Fcfs,
            max_num_batched_tokens: 8192,
            prefill_us_per_token: 20.0,
            decode_step_ms: 15.0,
            decode_ms_per_seq: 0.5,
            default_max_tokens: 128,
            seed: 0,
            fail_rate: 0.0,
            drop_after_chunks: None,
            error_after_chunks: None,
            stall_after_chunks: None,
            stall_first_token_ms: 0.0,
            first_token_at_once: false,
            warmup_secs: 0.0,
            timeout_keep_alive: 0.0,
            zero_delay: false,
            capture_streams: false,
            responses_store: false,
            enable_auto_tool_choice: false,
            tool_call_parser: None,
            reasoning_parser: None,
            output_tokens: None,
            runner: Runner::Generate,
            convert: Convert::Embed,
            embedding_size: 64,
            num_labels: 2,
            block_size: 16,
            kv_cache_tokens: 0,
            kv_events_config: None,
            kv_events_encoding: "map".into(),
            enable_prompt_tokens_details: false,
            tokenizer: None,
            chat_template: None,
            enable_lora: false,
            max_loras: 1,
            max_lora_rank: 16,
            lora_modules: Vec::new(),
            lora_load_delay_ms: 50.0,
            runtime_lora_updating: false,
        }
    }
}

// Written by hand so the API key never reaches a log line through `{:?}`.
impl fmt::Debug for SimArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimArgs")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("served_model_name", &self.served_model_name)
            .field("api_key", &self.api_key.as_ref().map(|_| "*****"))
            .field("max_model_len", &self.max_model_len)
            .field("max_num_seqs", &self.max_num_seqs)
            .field("max_num_batched_tokens", &self.max_num_batched_tokens)
            .field("prefill_us_per_token", &self.prefill_us_per_token)
            .field("decode_step_ms", &self.decode_step_ms)
            .field("decode_ms_per_seq", &self.decode_ms_per_seq)
            .field("default_max_tokens", &self.default_max_tokens)
            .field("seed", &self.seed)
            .field("fail_rate", &self.fail_rate)
            .field("drop_after_chunks", &self.drop_after_chunks)
            .field("error_after_chunks", &self.error_after_chunks)
            .field("stall_after_chunks", &self.stall_after_chunks)
            .field("stall_first_token_ms", &self.stall_first_token_ms)
            .field("first_token_at_once", &self.first_token_at_once)
            .field("warmup_secs", &self.warmup_secs)
            .field("timeout_keep_alive", &self.timeout_keep_alive)
            .field("zero_delay", &self.zero_delay)
            .field("enable_auto_tool_choice", &self.enable_auto_tool_choice)
            .field("tool_call_parser", &self.tool_call_parser)
            .field("reasoning_parser", &self.reasoning_parser)
            .field("runner", &self.runner)
            .field("convert", &self.convert)
            .field("embedding_size", &self.embedding_size)
            .field("num_labels", &self.num_labels)
            .field("block_size", &self.block_size)
            .field("kv_cache_tokens", &self.kv_cache_tokens)
            .field("kv_events_config", &self.kv_events_config)
            .field("kv_events_encoding", &self.kv_events_encoding)
            .field("tokenizer", &self.tokenizer)
            .field("chat_template", &self.chat_template)
            .field("enable_lora", &self.enable_lora)
            .field("max_loras", &self.max_loras)
            .field("max_lora_rank", &self.max_lora_rank)
            .field("lora_modules", &self.lora_modules)
            .field("lora_load_delay_ms", &self.lora_load_delay_ms)
            .field("runtime_lora_updating", &self.runtime_lora_updating)
            .field(
                "enable_prompt_tokens_details",
                &self.enable_prompt_tokens_details,
            )
            .field("capture_streams", &self.capture_streams)
            .finish()
    }
}

/// Per-step costs of the batching model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct StepTiming {
    pub decode_step: Duration,
    pub decode_per_seq: Duration,
    pub prefill_per_token: Duration,
    pub stall_first_token: Duration,
    /// `--first-token-at-once`: the first token waits for no step.
    pub first_token_at_once: bool,
}

impl StepTiming {
    /// All-zero timing means no scheduler task and no timers at all (see `engine::Feed`).
    pub(crate) fn is_zero(&self) -> bool {
        self.decode_step.is_zero()
            && self.decode_per_seq.is_zero()
            && self.prefill_per_token.is_zero()
            && self.stall_first_token.is_zero()
    }
}

/// A content-chunk fault to inject into every stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamFault {
    /// Abort the body (connection reset, no terminating chunk) after K content chunks.
    Drop(u32),
    /// Send vLLM's in-stream error event and `[DONE]` after K content chunks.
    EngineDead(u32),
    /// Send nothing more after K content chunks, the connection left open.
    Stall(u32),
}

/// What a pooling model computes (`--runner pooling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolingTask {
    /// Unit vectors of `dims` numbers.
    Embed { dims: u32 },
    /// Probabilities over `labels` classes.
    Classify { labels: u32 },
}

impl PoolingTask {
    /// vLLM enables /score and /rerank for an embedding model (cosine similarity) and for a
    /// classifier with one label (a cross-encoder) only.
    pub(crate) fn scores(self) -> bool {
        matches!(
            self,
            PoolingTask::Embed { .. } | PoolingTask::Classify { labels: 1 }
        )
    }
}

/// vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    Fcfs,
    Priority,
}

/// Validated settings; built once at start and shared read-only by every connection.
#[derive(Debug)]
pub(crate) struct SimConfig {
    pub served_names: Vec<String>,
    pub api_key: Option<String>,
    pub max_model_len: u32,
    pub max_num_seqs: u32,
    pub scheduling_policy: SchedulingPolicy,
    pub max_num_batched_tokens: u32,
    pub timing: StepTiming,
    pub default_max_tokens: u32,
    pub seed: u64,
    pub fail_rate: f64,
    pub fault: Option<StreamFault>,
    pub warmup: Duration,
    /// `--timeout-keep-alive`; None: kept-alive connections are never closed for idleness.
    pub keep_alive_timeout: Option<Duration>,
    pub capture: bool,
    pub responses_store: bool,
    pub auto_tool_choice: bool,
    pub output_tokens: Option<u32>,
    /// `Some` with `--runner pooling`: the generative routes are gone.
    pub pooling: Option<PoolingTask>,
    /// `--block-size`.
    pub block_size: u32,
    /// `--kv-cache-tokens`; 0 = no prefix cache.
    pub prefix_cache_tokens: u64,
    /// `--kv-events-config`, when it publishes.
    pub kv_events: Option<crate::kv_events::KvEventsSettings>,
    pub prompt_tokens_details: bool,
    /// `--tokenizer`: prompts in the model's own tokens.
    pub tokens: Option<crate::model_tokens::ModelTokens>,
    /// `--enable-lora` and its flags; `None` without it.
    pub lora: Option<crate::lora::LoraSettings>,
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load and unload routes exist.
    pub runtime_lora_updating: bool,
    /// `--lora-load-delay-ms`.
    pub lora_load_delay: Duration,
}

impl SimConfig {
    /// Whether prompts are hashed into blocks for the prefix cache at all.
    pub(crate) fn prefix_caching(&self) -> bool {
        self.prefix_cache_tokens >= u64::from(self.block_size)
    }
}

impl SimConfig {
    /// The name reported in `model` fields and the `model_name` metric label.
    pub(crate) fn model_name(&self) -> &str {
        self.served_names.first().map_or("", String::as_str)
    }

    pub(crate) fn serves(&self, model: &str) -> bool {
        self.served_names.iter().any(|n| n == model)
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn duration_flag(name: &str, value: f64, unit: Duration) -> io::Result<Duration> {
    if !value.is_finite() || value < 0.0 {
        return Err(invalid(format!(
            "--{name} must be a finite number >= 0, got {value}"
        )));
    }
    Ok(unit.mul_f64(value))
}

impl TryFrom<&SimArgs> for SimConfig {
    type Error = io::Error;

    fn try_from(a: &SimArgs) -> io::Result<Self> {
        let served_names: Vec<String> = a
            .served_model_name
            .iter()
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        if served_names.is_empty() {
            return Err(invalid(
                "--served-model-name needs at least one name".into(),
            ));
        }
        if a.max_num_seqs == 0 || a.max_model_len == 0 || a.default_max_tokens == 0 {
            return Err(invalid(
                "--max-num-seqs, --max-model-len and --default-max-tokens must be >= 1".into(),
            ));
        }
        // vLLM refuses this too: every running sequence needs one token of the step budget.
        if a.max_num_batched_tokens < a.max_num_seqs {
            return Err(invalid(format!(
                "--max-num-batched-tokens ({}) must be >= --max-num-seqs ({})",
                a.max_num_batched_tokens, a.max_num_seqs
            )));
        }
        if !(0.0..=1.0).contains(&a.fail_rate) {
            return Err(invalid(format!(
                "--fail-rate must be within 0.0..=1.0, got {}",
                a.fail_rate
            )));
        }
        let fault = match (
            a.drop_after_chunks,
            a.error_after_chunks,
            a.stall_after_chunks,
        ) {
            (Some(k), None, None) => Some(StreamFault::Drop(k)),
            (None, Some(k), None) => Some(StreamFault::EngineDead(k)),
            (None, None, Some(k)) => Some(StreamFault::Stall(k)),
            (None, None, None) => None,
            _ => {
                return Err(invalid(
                    "give at most one of --drop-after-chunks, --error-after-chunks and --stall-after-chunks".into(),
                ));
            }
        };
        if a.block_size == 0 {
            return Err(invalid("--block-size must be >= 1".into()));
        }
        let encoding =
            crate::kv_events::Encoding::parse(&a.kv_events_encoding).ok_or_else(|| {
                invalid(format!(
                    "--kv-events-encoding must be map or array, not {}",
                    a.kv_events_encoding
                ))
            })?;
        let kv_events = match &a.kv_events_config {
            Some(json) => crate::kv_events::parse(json, encoding).map_err(invalid)?,
            None => None,
        };
        if kv_events.is_some() && a.kv_cache_tokens < u64::from(a.block_size) {
            return Err(invalid(
                "--kv-events-config publishes the prefix cache's changes: give --kv-cache-tokens too".into(),
            ));
        }
        if a.chat_template.is_some() && a.tokenizer.is_none() {
            return Err(invalid(
                "--chat-template is rendered for --tokenizer's model: give --tokenizer too".into(),
            ));
        }
        let tokens = a
            .tokenizer
            .as_deref()
            .map(|dir| crate::model_tokens::ModelTokens::load(dir, a.chat_template.as_deref()))
            .transpose()
            .map_err(invalid)?;
        if a.embedding_size == 0 || a.num_labels == 0 {
            return Err(invalid(
                "--embedding-size and --num-labels must be >= 1".into(),
            ));
        }
        let pooling = match (a.runner, a.convert) {
            (Runner::Generate, _) => None,
            (Runner::Pooling, Convert::Embed) => Some(PoolingTask::Embed {
                dims: a.embedding_size,
            }),
            (Runner::Pooling, Convert::Classify) => Some(PoolingTask::Classify {
                labels: a.num_labels,
            }),
        };
        let lora = crate::lora::LoraSettings::validate(a.enable_lora, a.max_loras, &a.lora_modules)
            .map_err(invalid)?;
        let ms = Duration::from_millis(1);
        let lora_load_delay = duration_flag("lora-load-delay-ms", a.lora_load_delay_ms, ms)?;
        let timing = if a.zero_delay {
            StepTiming {
                decode_step: Duration::ZERO,
                decode_per_seq: Duration::ZERO,
                prefill_per_token: Duration::ZERO,
                stall_first_token: Duration::ZERO,
                first_token_at_once: false,
            }
        } else {
            if a.first_token_at_once && a.stall_first_token_ms > 0.0 {
                return Err(invalid(
                    "--first-token-at-once and --stall-first-token-ms contradict each other: \
                     the first token either leaves at once or waits"
                        .to_owned(),
                ));
            }
            StepTiming {
                decode_step: duration_flag("decode-step-ms", a.decode_step_ms, ms)?,
                decode_per_seq: duration_flag("decode-ms-per-seq", a.decode_ms_per_seq, ms)?,
                prefill_per_token: duration_flag(
                    "prefill-us-per-token",
                    a.prefill_us_per_token,
                    Duration::from_micros(1),
                )?,
                stall_first_token: duration_flag(
                    "stall-first-token-ms",
                    a.stall_first_token_ms,
                    ms,
                )?,
                first_token_at_once: a.first_token_at_once,
            }
        };
        Ok(Self {
            served_names,
            api_key: a.api_key.clone(),
            max_model_len: a.max_model_len,
            max_num_seqs: a.max_num_seqs,
            scheduling_policy: a.scheduling_policy,
            max_num_batched_tokens: a.max_num_batched_tokens,
            timing,
            default_max_tokens: a.default_max_tokens,
            seed: a.seed,
            fail_rate: a.fail_rate,
            fault,
            warmup: duration_flag("warmup-secs", a.warmup_secs, Duration::from_secs(1))?,
            keep_alive_timeout: Some(duration_flag(
                "timeout-keep-alive",
                a.timeout_keep_alive,
                Duration::from_secs(1),
            )?)
            .filter(|d| !d.is_zero()),
            capture: a.capture_streams,
            responses_store: a.responses_store,
            auto_tool_choice: a.enable_auto_tool_choice,
            output_tokens: a.output_tokens.filter(|n| *n > 0),
            pooling,
            block_size: a.block_size,
            prefix_cache_tokens: a.kv_cache_tokens,
            kv_events,
            prompt_tokens_details: a.enable_prompt_tokens_details,
            tokens,
            lora,
            runtime_lora_updating: a.runtime_lora_updating,
            lora_load_delay,
        })
    }
}
