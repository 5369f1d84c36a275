//! Counters the tests read directly and the Prometheus text the sim serves on `/metrics`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;

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
    captures: Option<Mutex<HashMap<String, Bytes>>>,
}

impl SimStats {
    pub(crate) fn new(capture: bool, kv_capacity_tokens: u64) -> Self {
        Self {
            requests: AtomicU64::new(0),
            tokenizations: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed_injected: AtomicU64::new(0),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            engine: EngineMetrics::new(kv_capacity_tokens),
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

    pub fn as_str(self) -> &'static str {
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
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Counters behind the vLLM metric names.
#[derive(Debug)]
pub(crate) struct EngineMetrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    finished: [AtomicU64; 2],
    pub ttft: Histogram,
    pub e2e: Histogram,
    /// Tokens held by running sequences; the KV-cache usage gauge is this over the capacity.
    pub kv_tokens: AtomicU64,
    kv_capacity_tokens: u64,
}

impl EngineMetrics {
    fn new(kv_capacity_tokens: u64) -> Self {
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: [AtomicU64::new(0), AtomicU64::new(0)],
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            kv_tokens: AtomicU64::new(0),
            kv_capacity_tokens: kv_capacity_tokens.max(1),
        }
    }

    pub fn record_finish(&self, reason: FinishReason) {
        self.finished[reason.index()].fetch_add(1, Relaxed);
    }
}

/// A fixed-bucket histogram of seconds; counts are kept per bucket and summed on render.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// One slot per bound plus the +Inf slot.
    counts: Box<[AtomicU64]>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let slot = self.bounds.partition_point(|&b| b < secs);
        if let Some(c) = self.counts.get(slot) {
            c.fetch_add(1, Relaxed);
        }
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cumulative}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
                }
            }
        }
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// Escapes a Prometheus label value (backslash, quote, newline).
fn label_value(v: &str) -> String {
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

/// Renders the Prometheus text exposition. Only scrapes pay for formatting.
pub(crate) fn render_metrics(stats: &SimStats, model_name: &str) -> String {
    let m = &stats.engine;
    let labels = format!("engine=\"0\",model_name=\"{}\"", label_value(model_name));
    let mut out = String::with_capacity(8192);
    let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    };
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        stats.running.load(Relaxed) as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        stats.waiting.load(Relaxed) as f64,
    );
    let usage = (m.kv_tokens.load(Relaxed) as f64 / m.kv_capacity_tokens as f64).min(1.0);
    // Both names: vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc, and dashboards in
    // the wild read either.
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        usage,
    );
    gauge(
        &mut out,
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        usage,
    );
    let counter = |out: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    };
    counter(
        &mut out,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        m.prompt_tokens.load(Relaxed),
    );
    counter(
        &mut out,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        m.generation_tokens.load(Relaxed),
    );
    let name = "vllm:request_success_total";
    let _ = writeln!(
        out,
        "# HELP {name} Count of successfully processed requests."
    );
    let _ = writeln!(out, "# TYPE {name} counter");
    for reason in FinishReason::ALL {
        let v = m.finished[reason.index()].load(Relaxed);
        let _ = writeln!(
            out,
            "{name}{{{labels},finished_reason=\"{}\"}} {v}",
            reason.as_str()
        );
    }
    let _ = writeln!(
        out,
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds."
    );
    m.ttft
        .render(&mut out, "vllm:time_to_first_token_seconds", &labels);
    let _ = writeln!(
        out,
        "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds."
    );
    m.e2e
        .render(&mut out, "vllm:e2e_request_latency_seconds", &labels);
    out
}
