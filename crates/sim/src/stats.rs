//! Counters the tests read directly and the Prometheus text the sim serves on `/metrics`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;

use crate::lora::gauge::LoraGauge;

/// Live counters of one sim. Everything on the request path is a relaxed atomic so that
/// recording costs next to nothing; readers only need eventually-consistent numbers.
#[derive(Debug)]
pub struct SimStats {
    /// Generation requests received (chat and completions, before any validation).
    pub requests: AtomicU64,
    /// `/tokenize` and `/detokenize` requests received.
    pub tokenizations: AtomicU64,
    /// Generations that produced every token and ended normally.
    pub completed: AtomicU64,
    /// Generations whose client went away (response body or handler dropped) before the end.
    pub cancelled: AtomicU64,
    /// Injected faults: `--fail-rate` 500s plus dropped or errored streams.
    pub failed_injected: AtomicU64,
    /// Sequences in the running batch (gauge).
    pub running: AtomicU64,
    /// Sequences queued for admission (gauge).
    pub waiting: AtomicU64,
    pub(crate) engine: EngineMetrics,
    /// `vllm:lora_requests_info`, with `--enable-lora`.
    pub(crate) lora: Option<LoraGauge>,
    captures: Option<Mutex<HashMap<String, Bytes>>>,
}

impl SimStats {
    /// `cache_config`: the block size and the number of KV blocks `vllm:cache_config_info`
    /// reports; `max_loras`: `--max-loras` with `--enable-lora`.
    pub(crate) fn new(
        capture: bool,
        kv_capacity_tokens: u64,
        max_model_len: u64,
        cache_config: (u32, u64),
        max_loras: Option<u32>,
    ) -> Self {
        Self {
            requests: AtomicU64::new(0),
            tokenizations: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed_injected: AtomicU64::new(0),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            engine: EngineMetrics::new(kv_capacity_tokens, max_model_len, cache_config),
            lora: max_loras.map(LoraGauge::new),
            captures: capture.then(|| Mutex::new(HashMap::new())),
        }
    }

    /// The exact bytes of the response body sent for the request whose `x-request-id` was
    /// `request_id` (only with `--capture-streams`). A stream is stored when its last frame is
    /// produced, so the bytes are here by the time a client has read `[DONE]`; an aborted stream
    /// is stored with whatever was sent.
    pub fn captured(&self, request_id: &str) -> Option<Bytes> {
        let map = self.captures.as_ref()?.lock().ok()?;
        map.get(request_id).cloned()
    }

    pub(crate) fn capturing(&self) -> bool {
        self.captures.is_some()
    }

    pub(crate) fn store_capture(&self, request_id: String, body: Bytes) {
        if let Some(Ok(mut map)) = self.captures.as_ref().map(Mutex::lock) {
            map.insert(request_id, body);
        }
    }
}

/// Why a sequence left the engine; the `finished_reason` label of `vllm:request_success_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FinishReason {
    Length,
    Abort,
}

impl FinishReason {
    const ALL: [FinishReason; 2] = [FinishReason::Length, FinishReason::Abort];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }

    fn index(self) -> usize {
        match self {
            FinishReason::Length => 0,
            FinishReason::Abort => 1,
        }
    }
}

/// vLLM's own bucket bounds, so dashboards built for vLLM read the sim unchanged.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Also `vllm:request_queue_time_seconds`'s.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to the context length.
fn one_two_five(max: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut decade = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let b = decade.saturating_mul(m);
            if b > max.max(1) {
                break 'outer;
            }
            out.push(b as f64);
        }
        decade = decade.saturating_mul(10);
    }
    out
}

/// Counters behind the vLLM metric names.
#[derive(Debug)]
pub(crate) struct EngineMetrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: AtomicU64,
    /// Of those, the tokens found (a hit skips its prefill).
    pub prefix_cache_hits: AtomicU64,
    /// Prompt tokens actually prefilled, cached ones excluded: what prefill time was paid for
    /// (`vllm:prompt_tokens_by_source_total{source="local_compute"}`).
    pub prefilled_tokens: AtomicU64,
    finished: [AtomicU64; 2],
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub itl: Histogram,
    pub queue_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    /// Tokens held by running sequences; the KV-cache usage gauge is this over the capacity.
    pub kv_tokens: AtomicU64,
    kv_capacity_tokens: u64,
    /// `vllm:cache_config_info`'s block size and number of KV blocks.
    cache_config: (u32, u64),
}

impl EngineMetrics {
    fn new(kv_capacity_tokens: u64, max_model_len: u64, cache_config: (u32, u64)) -> Self {
        let token_buckets = one_two_five(max_model_len);
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prefilled_tokens: AtomicU64::new(0),
            finished: [AtomicU64::new(0), AtomicU64::new(0)],
            ttft: Histogram::seconds(TTFT_BUCKETS),
            e2e: Histogram::seconds(E2E_BUCKETS),
            itl: Histogram::seconds(ITL_BUCKETS),
            queue_time: Histogram::seconds(E2E_BUCKETS),
            request_prompt_tokens: Histogram::counts(token_buckets.clone()),
            request_generation_tokens: Histogram::counts(token_buckets),
            kv_tokens: AtomicU64::new(0),
            kv_capacity_tokens: kv_capacity_tokens.max(1),
            cache_config,
        }
    }

    pub(crate) fn record_finish(&self, reason: FinishReason) {
        self.finished[reason.index()].fetch_add(1, Relaxed);
    }
}

/// A fixed-bucket histogram (of seconds, or of counts); counts are kept per bucket and summed
/// on render.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: Box<[f64]>,
    /// One slot per bound plus the +Inf slot.
    counts: Box<[AtomicU64]>,
    /// The sum of observations in `1 / unit` (µs for seconds).
    sum: AtomicU64,
    unit: f64,
}

impl Histogram {
    fn new(bounds: Vec<f64>, unit: f64) -> Self {
        Self {
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            bounds: bounds.into_boxed_slice(),
            sum: AtomicU64::new(0),
            unit,
        }
    }

    fn seconds(bounds: &[f64]) -> Self {
        Self::new(bounds.to_vec(), 1e6)
    }

    fn counts(bounds: Vec<f64>) -> Self {
        Self::new(bounds, 1.0)
    }

    fn put(&self, value: f64, sum_units: u64) {
        let slot = self.bounds.partition_point(|&b| b < value);
        if let Some(c) = self.counts.get(slot) {
            c.fetch_add(1, Relaxed);
        }
        self.sum.fetch_add(sum_units, Relaxed);
    }

    pub(crate) fn observe(&self, d: Duration) {
        self.put(
            d.as_secs_f64(),
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
        );
    }

    pub(crate) fn observe_count(&self, n: u64) {
        self.put(n as f64, n);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let n = py_float(cumulative as f64);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {n}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {n}");
                }
            }
        }
        let sum = py_float(self.sum.load(Relaxed) as f64 / self.unit);
        let _ = writeln!(
            out,
            "{name}_count{{{labels}}} {}",
            py_float(cumulative as f64)
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    }
}

/// A sample value as vLLM's Python client prints it: `0.0`, `12.0`, `0.42`.
fn py_float(v: f64) -> String {
    format!("{v:?}")
}

/// Escapes a Prometheus label value (backslash, quote, newline).
pub(crate) fn label_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Renders the Prometheus text exposition: vLLM 0.32's families that a gateway, a dashboard or
/// an autoscaler reads, with its label names, HELP texts and value format. Only scrapes pay for
/// formatting.
pub(crate) fn render_metrics(stats: &SimStats, model_name: &str) -> String {
    let m = &stats.engine;
    let labels = format!("engine=\"0\",model_name=\"{}\"", label_value(model_name));
    let mut out = String::with_capacity(16384);
    // One family: HELP, TYPE, and one sample per (extra label, value).
    let family = |out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (extra, v) in samples {
            let sep = if extra.is_empty() { "" } else { "," };
            let _ = writeln!(out, "{name}{{{labels}{sep}{extra}}} {}", py_float(*v));
        }
    };
    let waiting = stats.waiting.load(Relaxed) as f64;
    family(
        &mut out,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &[("", stats.running.load(Relaxed) as f64)],
    );
    family(
        &mut out,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &[("", waiting)],
    );
    family(
        &mut out,
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling \
         capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, \
         blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        &[
            ("reason=\"capacity\"", waiting),
            ("reason=\"deferred\"", 0.0),
        ],
    );
    family(
        &mut out,
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is \
         awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        &[
            ("sleep_state=\"awake\"", 1.0),
            ("sleep_state=\"weights_offloaded\"", 0.0),
            ("sleep_state=\"discard_all\"", 0.0),
        ],
    );
    // (`vllm:gpu_cache_usage_perc` is gone since vLLM 0.10; the gateway still reads it from
    // older servers.)
    let usage = (m.kv_tokens.load(Relaxed) as f64 / m.kv_capacity_tokens as f64).min(1.0);
    family(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &[("", usage)],
    );
    // vLLM's info gauge: every field of its CacheConfig as a label, no `model_name` (the
    // labels and values of vLLM 0.32's CPU server, the cache's size and block size this sim's).
    let (block_size, blocks) = m.cache_config;
    let tokens = blocks * u64::from(block_size);
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{_block_size_resolved=\"True\",block_size=\"{block_size}\",\
         cache_dtype=\"auto\",cache_hit_alignment_tokens=\"None\",\
         effective_attention_block_size=\"{block_size}\",\
         enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",\
         engine=\"0\",gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",\
         is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",\
         kv_cache_layout=\"None\",kv_cache_max_concurrency=\"512.0\",\
         kv_cache_memory_bytes=\"1073741824\",kv_cache_size_tokens=\"{tokens}\",\
         kv_offloading_backend=\"native\",kv_offloading_size=\"None\",\
         kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",\
         mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",\
         mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"float32\",\
         num_cpu_blocks=\"None\",num_gpu_blocks=\"{blocks}\",\
         num_gpu_blocks_override=\"None\",prefix_cache_retention_interval=\"0\",\
         prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",\
         replayssm_buffer_len=\"16\",skip_page_size_padded=\"None\",\
         sliding_window=\"None\",swa_bounded_replay=\"True\",\
         use_kda_recoverssm=\"False\",use_replayssm=\"False\",\
         user_specified_block_size=\"False\"}} 1.0"
    );
    let count = |a: &AtomicU64| a.load(Relaxed) as f64;
    family(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &[("", count(&m.prefix_cache_queries))],
    );
    family(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &[("", count(&m.prefix_cache_hits))],
    );
    family(
        &mut out,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        &[("", 0.0)],
    );
    family(
        &mut out,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &[("", count(&m.prompt_tokens))],
    );
    family(
        &mut out,
        "vllm:prompt_tokens_by_source_total",
        "counter",
        "Number of prompt tokens by source.",
        &[
            ("source=\"local_compute\"", count(&m.prefilled_tokens)),
            ("source=\"local_cache_hit\"", count(&m.prefix_cache_hits)),
            ("source=\"external_kv_transfer\"", 0.0),
        ],
    );
    family(
        &mut out,
        "vllm:prompt_tokens_cached_total",
        "counter",
        "Number of cached prompt tokens (local + external).",
        &[("", count(&m.prefix_cache_hits))],
    );
    family(
        &mut out,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &[("", count(&m.generation_tokens))],
    );
    // vLLM lists every reason, at 0 when none finished so.
    let finished = |r: &str| {
        FinishReason::ALL
            .iter()
            .find(|f| f.as_str() == r)
            .map_or(0.0, |f| count(&m.finished[f.index()]))
    };
    family(
        &mut out,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &[
            ("finished_reason=\"stop\"", finished("stop")),
            ("finished_reason=\"length\"", finished("length")),
            ("finished_reason=\"abort\"", finished("abort")),
            ("finished_reason=\"error\"", finished("error")),
            ("finished_reason=\"repetition\"", finished("repetition")),
        ],
    );
    m.request_prompt_tokens.render(
        &mut out,
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        &labels,
    );
    m.request_generation_tokens.render(
        &mut out,
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        &labels,
    );
    m.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &labels,
    );
    m.itl.render(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &labels,
    );
    m.e2e.render(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &labels,
    );
    m.queue_time.render(
        &mut out,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &labels,
    );
    if let Some(lora) = &stats.lora {
        lora.render(&mut out);
    }
    out
}
