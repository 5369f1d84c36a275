//! Prometheus metrics of the request path, registered on the gateway's own registry. Every
//! label value comes from config or a fixed enum (environment, endpoint family, configured
//! model name, backend URL as configured, status class, error kind) — never from a client.
//! Handles are resolved once per (pool, environment, endpoint family), on the first request
//! that needs them, and a request's record looks them up by the pool's and backend's metrics
//! indexes, which a reload never reassigns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;
use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::key::Environment;
use crate::pool::Generation;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::Family;
use fleetgate_protocol::error::ErrorKind;

use fleetgate_protocol::stream::UsageSource;

use super::RequestRecord;

mod engines;
mod fallback;
mod resume;

/// vLLM's own buckets (vllm/v1/metrics/loggers.py), so the gateway's and the engine's
/// histograms line up.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// The gateway's own cost lives in microseconds.
const OVERHEAD_BUCKETS: &[f64] = &[
    5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25,
];
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Environment label index: 0..3 for a key's environment, 3 for "none" (no key).
fn env_index(env: Option<Environment>) -> usize {
    match env {
        Some(Environment::Stress) => 0,
        Some(Environment::Gray) => 1,
        Some(Environment::Prod) => 2,
        None => 3,
    }
}

const ENV_LABELS: [&str; 4] = ["stress", "gray", "prod", "none"];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
/// Error-kind labels: every `ErrorKind`, then "none".
const KIND_COUNT: usize = ErrorKind::ALL.len() + 1;
/// Endpoint-family labels: every `Family`, then "none" (a request that matched no route).
const FAMILY_COUNT: usize = Family::ALL.len() + 1;

fn family_index(endpoint: Option<Endpoint>) -> usize {
    endpoint.map_or(FAMILY_COUNT - 1, |e| e.family().index())
}

fn family_label(index: usize) -> &'static str {
    Family::ALL.get(index).map_or("none", |f| f.as_str())
}

/// Handles of one (pool, environment, endpoint family).
#[derive(Clone)]
struct Series {
    overhead: [Histogram; 3],
    hop: Histogram,
    ttft_client: Histogram,
    /// Upstream TTFT by backend index, created on first use.
    ttft_upstream: Vec<OnceLock<Histogram>>,
    tpot: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue_wait: Histogram,
    tokens: [IntCounter; 2],
    /// By status class × error kind, created on first use (most pairs never happen).
    requests: Vec<OnceLock<IntCounter>>,
}

/// One pool's handles.
struct PoolSeries {
    model: String,
    /// Backend URLs (as configured) by backend index: the upstream TTFT's `backend` label.
    backends: Vec<Option<Arc<str>>>,
    /// By environment × endpoint family (`env * FAMILY_COUNT + family`), created on the first
    /// request of each: most pairs never happen.
    series: Vec<OnceLock<Series>>,
    /// `fleetgate_prompt_cache_tokens_total` by `CACHE_KINDS`, resolved on first use.
    cache: OnceLock<[IntCounter; 4]>,
}

impl PoolSeries {
    fn new(model: &str) -> Self {
        Self {
            model: model.to_owned(),
            backends: Vec::new(),
            series: (0..ENV_LABELS.len() * FAMILY_COUNT)
                .map(|_| OnceLock::new())
                .collect(),
            cache: OnceLock::new(),
        }
    }

    /// Count one answer whose engine reported its cached prompt tokens (`served`), beside what
    /// the routing predicted (none: 0).
    fn count_cache(&self, families: &Families, prompt: u64, served: u64, predicted: Option<u64>) {
        let c = self.cache.get_or_init(|| {
            CACHE_KINDS.map(|k| families.cache_tokens.with_label_values(&[&self.model, k]))
        });
        let served = served.min(prompt);
        let predicted = predicted.unwrap_or(0).min(prompt);
        c[0].inc_by(prompt);
        c[1].inc_by(served);
        c[2].inc_by(predicted);
        c[3].inc_by(served.abs_diff(predicted));
    }

    /// The handles of (environment, family), resolved on first use.
    fn get(&self, families: &Families, env: usize, family: usize) -> &Series {
        self.series[env * FAMILY_COUNT + family].get_or_init(|| {
            families.series(
                ENV_LABELS[env],
                family_label(family),
                &self.model,
                self.backends.len(),
            )
        })
    }

    /// The upstream TTFT histogram of a backend index in `s`, resolved on first use.
    fn upstream_ttft<'a>(
        &self,
        families: &Families,
        s: &'a Series,
        env: usize,
        family: usize,
        backend: usize,
    ) -> Option<&'a Histogram> {
        let base = self.backends.get(backend)?.as_deref()?;
        let cell = s.ttft_upstream.get(backend)?;
        Some(cell.get_or_init(|| {
            families.ttft.with_label_values(&[
                "upstream",
                family_label(family),
                ENV_LABELS[env],
                &self.model,
                base,
            ])
        }))
    }
}

/// The handles by pool index (`None`: an index not handed out).
struct Layout {
    pools: Vec<Option<Arc<PoolSeries>>>,
}

/// The metric families whose children are resolved per pool and backend.
struct Families {
    overhead: HistogramVec,
    hop: HistogramVec,
    ttft: HistogramVec,
    tpot: HistogramVec,
    itl: HistogramVec,
    e2e: HistogramVec,
    queue: HistogramVec,
    tokens: IntCounterVec,
    info: IntGaugeVec,
    queue_depth: IntGaugeVec,
    cache_tokens: IntCounterVec,
}

/// `fleetgate_prompt_cache_tokens_total`'s kinds, in `PoolSeries::cache` order.
const CACHE_KINDS: [&str; 4] = ["prompt", "served", "predicted", "error"];

pub struct RequestMetrics {
    layout: ArcSwap<Layout>,
    /// Requests that never reached a pool (e.g. refused before routing).
    none: PoolSeries,
    families: Families,
    /// `fleetgate_backend_info` label values set per (model, backend), to replace on change.
    info_set: Mutex<HashMap<(String, String), (String, String)>>,
    requests: IntCounterVec,
    in_flight: IntGaugeVec,
    backend_up: IntGaugeVec,
    pub(crate) rejections: IntCounterVec,
    /// Longest-prefix routing's outcomes and its index's size, per pool (at scrape time).
    prefix_routing: IntCounterVec,
    prefix_blocks: IntGaugeVec,
    kv_events_state: IntGaugeVec,
    kv_events_blocks: IntGaugeVec,
    kv_events_batches: IntCounterVec,
    kv_routing: IntCounterVec,
    /// Answers whose usage was past every plausible count, by backend (treated as none).
    implausible_usage: IntCounterVec,
    resume: resume::ResumeMetrics,
    fallback: fallback::FallbackMetrics,
}

impl std::fmt::Debug for RequestMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestMetrics").finish_non_exhaustive()
    }
}

pub(crate) fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, prometheus::Error> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, prometheus::Error> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

fn hist(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<HistogramVec, prometheus::Error> {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

impl Families {
    /// The handles of (environment, family) for `model`; its `backends` upstream TTFT cells
    /// are left to first use.
    fn series(&self, env: &str, family: &str, model: &str, backends: usize) -> Series {
        let l3 = [family, env, model];
        Series {
            overhead: ["pre", "relay", "total"]
                .map(|ph| self.overhead.with_label_values(&[ph, family, env, model])),
            hop: self.hop.with_label_values(&l3),
            ttft_client: self
                .ttft
                .with_label_values(&["client", family, env, model, "-"]),
            ttft_upstream: (0..backends).map(|_| OnceLock::new()).collect(),
            tpot: self.tpot.with_label_values(&l3),
            itl: self.itl.with_label_values(&l3),
            e2e: self.e2e.with_label_values(&l3),
            queue_wait: self.queue.with_label_values(&l3),
            tokens: ["prompt", "completion"]
                .map(|k| self.tokens.with_label_values(&[k, family, env, model])),
            requests: (0..STATUS_CLASSES.len() * KIND_COUNT)
                .map(|_| OnceLock::new())
                .collect(),
        }
    }
}

impl RequestMetrics {
    pub fn new(registry: &Registry, pools: &Generation) -> Result<Self, prometheus::Error> {
        let overhead = hist(
            registry,
            "fleetgate_overhead_seconds",
            "Time the gateway itself added: pre (received to sent upstream, queue excluded), relay (first token in to handed to the client), total",
            &["phase", "endpoint", "environment", "model"],
            OVERHEAD_BUCKETS,
        )?;
        let hop = hist(
            registry,
            "fleetgate_hop_added_seconds",
            "What the gateway added to the first token's time as the host's kernel saw it: (first token written to the client - request arrived at the host) - (first token arrived from upstream - request written upstream), queue wait excluded; Linux only",
            &["endpoint", "environment", "model"],
            OVERHEAD_BUCKETS,
        )?;
        let ttft = hist(
            registry,
            "fleetgate_ttft_seconds",
            "Time to first token: client side (request received to first token handed on) and upstream side (request sent to first token read)",
            &["side", "endpoint", "environment", "model", "backend"],
            TTFT_BUCKETS,
        )?;
        let tpot = hist(
            registry,
            "fleetgate_tpot_seconds",
            "Time per output token after the first: (E2EL - TTFT) / (tokens - 1)",
            &["endpoint", "environment", "model"],
            ITL_BUCKETS,
        )?;
        let itl = hist(
            registry,
            "fleetgate_itl_seconds",
            "Gaps between consecutive content events of a stream",
            &["endpoint", "environment", "model"],
            ITL_BUCKETS,
        )?;
        let e2e = hist(
            registry,
            "fleetgate_e2e_seconds",
            "End-to-end latency: request received to the last data event (or the end of the body)",
            &["endpoint", "environment", "model"],
            E2E_BUCKETS,
        )?;
        let queue = hist(
            registry,
            "fleetgate_queue_wait_seconds",
            "Time spent in the pool's admission queue waiting for a backend slot",
            &["endpoint", "environment", "model"],
            QUEUE_BUCKETS,
        )?;
        let tokens = counter_vec(
            registry,
            "fleetgate_tokens_total",
            "Tokens served, from the backend's usage (completion falls back to content events)",
            &["kind", "endpoint", "environment", "model"],
        )?;
        let requests = counter_vec(
            registry,
            "fleetgate_requests_total",
            "Requests by status class and error kind (\"none\": no error)",
            &["status_class", "error", "endpoint", "environment", "model"],
        )?;
        let rejections = counter_vec(
            registry,
            "fleetgate_rejections_total",
            "Requests refused by a limit, by limit",
            &["limit"],
        )?;
        let in_flight = gauge_vec(
            registry,
            "fleetgate_backend_in_flight",
            "Requests in flight per backend",
            &["model", "backend"],
        )?;
        let backend_up = gauge_vec(
            registry,
            "fleetgate_backend_up",
            "1 when the backend answered its last probe or request, 0 when it failed, -1 before the first",
            &["model", "backend"],
        )?;
        // Static facts about each backend, to join on `backend` (e.g. compare a canary's TTFT
        // with the stable backends': `... * on(backend) group_left(labels) fleetgate_backend_info`).
        let info = gauge_vec(
            registry,
            "fleetgate_backend_info",
            "1 per configured backend, with its labels (comma-separated) and weight",
            &["model", "backend", "labels", "weight"],
        )?;
        let queue_depth = gauge_vec(
            registry,
            "fleetgate_queue_depth",
            "Requests waiting in a pool's admission queue (every backend at capacity)",
            &["model"],
        )?;
        let prefix_routing = counter_vec(
            registry,
            "fleetgate_prefix_routing_total",
            "Requests of longest-prefix pools by outcome: hit (sent to a backend holding their longest known prefix) or miss (none known, or its backends too loaded: the fallback)",
            &["model", "outcome"],
        )?;
        let prefix_blocks = gauge_vec(
            registry,
            "fleetgate_prefix_index_blocks",
            "Prompt blocks a longest-prefix pool's index remembers (bounded by affinity.max_blocks)",
            &["model"],
        )?;
        let kv_events_state = gauge_vec(
            registry,
            "fleetgate_kv_events_state",
            "Per backend and data-parallel rank of pools with kv_events: 2 live (the engine's cache index is complete), 1 partial (events were lost or the history is incomplete: only blocks seen since count), 0 down or connecting (no events: the index is not trusted)",
            &["model", "backend", "rank"],
        )?;
        let kv_events_blocks = gauge_vec(
            registry,
            "fleetgate_kv_events_blocks",
            "Blocks an engine's KV events say it holds, as indexed (bounded by kv_events.max_blocks)",
            &["model", "backend", "rank"],
        )?;
        let kv_events_batches = counter_vec(
            registry,
            "fleetgate_kv_events_batches_total",
            "KV event batches by outcome: applied (live), replayed (a gap filled from the replay endpoint), lost (a gap not filled), bad (a message or payload that does not decode)",
            &["model", "backend", "outcome"],
        )?;
        let kv_routing = counter_vec(
            registry,
            "fleetgate_kv_routing_total",
            "Requests of affinity.by = \"kv_events\" pools by outcome: hit (sent to a backend whose engine holds part of the prompt, by its KV events) or miss (none holds any, or its backends were loaded beyond the bound: the usual choice)",
            &["model", "outcome"],
        )?;
        let cache_tokens = counter_vec(
            registry,
            "fleetgate_prompt_cache_tokens_total",
            "Prompt tokens of answers whose engine reported its prefix-cache hits (usage cached_tokens or cache_read_input_tokens), by kind: prompt (their prompt tokens), served (what the engines served from cache), predicted (what the routing predicted the chosen engine holds; 0 without kv_events or longest_prefix), error (the sum of each answer's |predicted - served|). served / prompt is the fleet's hit rate, predicted / prompt the gateway's belief",
            &["model", "kind"],
        )?;
        let implausible_usage = counter_vec(
            registry,
            "fleetgate_upstream_implausible_usage_total",
            "Answers whose usage named more tokens than any request can have (2^24): treated as no usage, never settled",
            &["model", "backend"],
        )?;
        let families = Families {
            overhead,
            hop,
            ttft,
            tpot,
            itl,
            e2e,
            queue,
            tokens,
            info,
            queue_depth,
            cache_tokens,
        };
        let none = PoolSeries::new("none");
        let metrics = Self {
            layout: ArcSwap::from_pointee(Layout { pools: Vec::new() }),
            none,
            families,
            info_set: Mutex::new(HashMap::new()),
            requests,
            in_flight,
            backend_up,
            rejections,
            prefix_routing,
            prefix_blocks,
            kv_events_state,
            kv_events_blocks,
            kv_events_batches,
            kv_routing,
            implausible_usage,
            resume: resume::ResumeMetrics::new(registry)?,
            fallback: fallback::FallbackMetrics::new(registry)?,
        };
        metrics.relayout(pools, &[]);
        Ok(metrics)
    }

    /// Resolve the handles of `pools` (at start and after each reload). Slots already laid
    /// out keep their handles, so records of requests that began before a reload still find
    /// theirs; `removed` backends' gauges are dropped from the exposition.
    pub(crate) fn relayout(&self, pools: &Generation, removed: &[(Arc<str>, Arc<str>)]) {
        let old = self.layout.load_full();
        let mut by_index = old.pools.clone();
        for p in pools.iter() {
            if by_index.len() <= p.metrics_index {
                by_index.resize(p.metrics_index + 1, None);
            }
            // Handles already resolved are kept (a reload never reassigns an index); the
            // backends' URLs are the current ones.
            let mut ps = match &by_index[p.metrics_index] {
                Some(old) => PoolSeries {
                    model: old.model.clone(),
                    backends: old.backends.clone(),
                    series: old.series.clone(),
                    cache: old.cache.clone(),
                },
                None => PoolSeries::new(&p.model),
            };
            for b in &p.backends {
                if ps.backends.len() <= b.metrics_index {
                    ps.backends.resize(b.metrics_index + 1, None);
                }
                ps.backends[b.metrics_index] = Some(b.base.clone());
            }
            let width = ps.backends.len();
            for cell in &mut ps.series {
                if let Some(s) = cell.get_mut() {
                    s.ttft_upstream.resize_with(width, OnceLock::new);
                }
            }
            by_index[p.metrics_index] = Some(Arc::new(ps));
            p.balancer
                .queue
                .set_depth_gauge(self.families.queue_depth.with_label_values(&[&*p.model]));
        }
        self.layout.store(Arc::new(Layout { pools: by_index }));

        let mut info = self.info_set.lock().unwrap_or_else(|e| e.into_inner());
        for (model, base) in removed {
            let labels = [&**model, &**base];
            let _ = self.in_flight.remove_label_values(&labels);
            let _ = self.backend_up.remove_label_values(&labels);
            if let Some((l, w)) = info.remove(&(model.to_string(), base.to_string())) {
                let _ =
                    self.families
                        .info
                        .remove_label_values(&[model, base, l.as_str(), w.as_str()]);
            }
        }
        for p in pools.iter() {
            for b in &p.backends {
                let now = (b.labels().join(","), b.weight().to_string());
                let key = (p.model.to_string(), b.base.to_string());
                if info.get(&key) == Some(&now) {
                    continue;
                }
                if let Some((l, w)) = info.remove(&key) {
                    let _ = self.families.info.remove_label_values(&[
                        &p.model,
                        &b.base,
                        l.as_str(),
                        w.as_str(),
                    ]);
                }
                self.families
                    .info
                    .with_label_values(&[&p.model, &b.base, now.0.as_str(), now.1.as_str()])
                    .set(1);
                info.insert(key, now);
            }
        }
    }

    /// The handles for a record's pool index, read under `layout`.
    fn pool_series<'a>(&'a self, layout: &'a Layout, pool: Option<usize>) -> &'a PoolSeries {
        pool.and_then(|p| layout.pools.get(p))
            .and_then(Option::as_ref)
            .map_or(&self.none, |p| &**p)
    }

    /// The ITL histogram a relay observes each gap into.
    pub(crate) fn itl(
        &self,
        pool: Option<usize>,
        env: Option<Environment>,
        endpoint: Option<Endpoint>,
    ) -> Histogram {
        let layout = self.layout.load();
        self.pool_series(&layout, pool)
            .get(&self.families, env_index(env), family_index(endpoint))
            .itl
            .clone()
    }

    /// Record one finished request (called once, from the record's drop).
    pub(crate) fn observe(&self, r: &RequestRecord) {
        if let Some(log) = &r.resume {
            self.resume
                .observe(r.model.as_deref().unwrap_or("none"), log);
        }
        if let Some(log) = &r.fallback {
            self.fallback
                .observe(r.model.as_deref().unwrap_or("none"), log);
        }
        if r.timeline.stream().implausible_usage {
            let model = r.model.as_deref().unwrap_or("none");
            let backend = r.backend.as_deref().unwrap_or("none");
            self.implausible_usage
                .with_label_values(&[model, backend])
                .inc();
        }
        let env = r.key.as_ref().map(|k| k.environment);
        let layout = self.layout.load();
        let ps = self.pool_series(&layout, r.pool_metrics_index);
        let (e, f) = (env_index(env), family_index(r.endpoint));
        let s = ps.get(&self.families, e, f);
        let t = &r.timeline;
        let secs = |d: Duration| d.as_secs_f64();
        if let Some(d) = t.overhead_pre() {
            s.overhead[0].observe(secs(d));
        }
        if let Some(d) = t.overhead_relay() {
            s.overhead[1].observe(secs(d));
        }
        if let Some(d) = t.overhead_total() {
            s.overhead[2].observe(secs(d));
        }
        if let Some(d) = t.hop() {
            s.hop.observe(secs(d));
        }
        if let Some(d) = t.client_ttft() {
            s.ttft_client.observe(secs(d));
        }
        if let (Some(d), Some(i)) = (t.upstream_ttft(), r.backend_metrics_index)
            && let Some(b) = ps.upstream_ttft(&self.families, s, e, f, i)
        {
            b.observe(secs(d));
        }
        if t.admitted().is_some() {
            s.queue_wait.observe(secs(t.queue_wait()));
        }
        // Tokenization is a request (counted below) but not inference: no latency or tokens.
        // A pooling request is inference without output: its latency and input tokens.
        if r.pool_metrics_index.is_some() && r.endpoint.is_none_or(|e| e.needs().takes_slot) {
            // Latency of completed requests only (as vLLM's benchmark reads them); tokens of
            // every request that produced some, cut streams included.
            if r.error.is_none() {
                if let Some(d) = t.e2el() {
                    s.e2e.observe(secs(d));
                }
                if let Some(d) = t.tpot() {
                    s.tpot.observe(secs(d));
                }
            }
            let (tokens, source) = t.stream().output_tokens();
            if let Some(u) = t.stream().usage {
                s.tokens[0].inc_by(u.prompt_tokens);
                if let Some(served) = u.cached_tokens.map(u64::from) {
                    ps.count_cache(
                        &self.families,
                        u.prompt_tokens,
                        served,
                        r.predicted_cached_tokens(),
                    );
                }
            }
            if source != UsageSource::None {
                s.tokens[1].inc_by(tokens.unwrap_or(0));
            }
        }
        let class = (usize::from(r.status / 100)).clamp(1, 5) - 1;
        let kind = r.error.map_or(KIND_COUNT - 1, |k| k.index());
        let slot = &s.requests[class * KIND_COUNT + kind];
        let model = ps.model.as_str();
        slot.get_or_init(|| {
            self.requests.with_label_values(&[
                STATUS_CLASSES[class],
                r.error.map_or("none", ErrorKind::as_str),
                family_label(f),
                ENV_LABELS[e],
                model,
            ])
        })
        .inc();
    }

    /// Refresh the per-backend gauges (at scrape time), and the longest-prefix figures.
    pub(crate) fn update_backends(&self, pools: &Generation) {
        for p in pools.iter() {
            if let Some(index) = &p.prefix {
                let model = &*p.model;
                self.prefix_blocks
                    .with_label_values(&[model])
                    .set(i64::try_from(index.len()).unwrap_or(i64::MAX));
                for (outcome, n) in [("hit", &index.hits), ("miss", &index.misses)] {
                    let c = self.prefix_routing.with_label_values(&[model, outcome]);
                    let now = n.load(std::sync::atomic::Ordering::Relaxed);
                    c.inc_by(now.saturating_sub(c.get()));
                }
            }
            if p.prompt_tokens.is_some() {
                for (outcome, n) in [("hit", &p.kv_counts[0]), ("miss", &p.kv_counts[1])] {
                    let c = self.kv_routing.with_label_values(&[&*p.model, outcome]);
                    let now = n.load(std::sync::atomic::Ordering::Relaxed);
                    c.inc_by(now.saturating_sub(c.get()));
                }
            }
            for b in &p.backends {
                let labels = [&*p.model, &*b.base];
                self.in_flight.with_label_values(&labels).set(i64::from(
                    b.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                ));
                let up = match b.reachability() {
                    crate::pool::Reachability::Up => 1,
                    crate::pool::Reachability::Down => 0,
                    crate::pool::Reachability::Unknown => -1,
                };
                self.backend_up.with_label_values(&labels).set(up);
                if let Some(cache) = b.engine_cache.load().as_ref() {
                    self.update_kv_events(&p.model, &b.base, cache);
                }
            }
        }
    }
}
