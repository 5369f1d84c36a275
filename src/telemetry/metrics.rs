//! Prometheus metrics of the request path, registered on the gateway's own registry. Every
//! label value comes from config or a fixed enum (environment, configured model name, backend
//! URL as configured, status class, error kind) — never from a client. Histogram handles are
//! resolved once at start per (pool, environment); a request's record looks them up by index.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::auth::key::Environment;
use crate::pool::Pools;
use crate::proxy::error::ErrorKind;

use super::{RequestRecord, UsageSource};

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

/// Handles of one (pool, environment) pair.
struct Series {
    overhead: [Histogram; 3],
    ttft_client: Histogram,
    /// Upstream TTFT by backend index.
    ttft_upstream: Vec<Histogram>,
    tpot: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue_wait: Histogram,
    tokens: [IntCounter; 2],
    /// By status class × error kind, created on first use (most pairs never happen).
    requests: Vec<OnceLock<IntCounter>>,
}

pub struct RequestMetrics {
    /// Index: pool index (the last entry: no pool, e.g. refused before routing), then env.
    series: Vec<[Series; 4]>,
    requests: IntCounterVec,
    in_flight: IntGaugeVec,
    backend_up: IntGaugeVec,
    /// Label values per pool: (model, backends).
    labels: Vec<(String, Vec<String>)>,
    pub rejections: IntCounterVec,
}

impl std::fmt::Debug for RequestMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestMetrics").finish_non_exhaustive()
    }
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

impl RequestMetrics {
    pub fn new(registry: &Registry, pools: &Pools) -> Result<Self, prometheus::Error> {
        let overhead = hist(
            registry,
            "fleetgate_overhead_seconds",
            "Time the gateway itself added: pre (received to sent upstream, queue excluded), relay (first token in to handed to the client), total",
            &["phase", "environment", "model"],
            OVERHEAD_BUCKETS,
        )?;
        let ttft = hist(
            registry,
            "fleetgate_ttft_seconds",
            "Time to first token: client side (request received to first token handed on) and upstream side (request sent to first token read)",
            &["side", "environment", "model", "backend"],
            TTFT_BUCKETS,
        )?;
        let tpot = hist(
            registry,
            "fleetgate_tpot_seconds",
            "Time per output token after the first: (E2EL - TTFT) / (tokens - 1)",
            &["environment", "model"],
            ITL_BUCKETS,
        )?;
        let itl = hist(
            registry,
            "fleetgate_itl_seconds",
            "Gaps between consecutive content events of a stream",
            &["environment", "model"],
            ITL_BUCKETS,
        )?;
        let e2e = hist(
            registry,
            "fleetgate_e2e_seconds",
            "End-to-end latency: request received to the last data event (or the end of the body)",
            &["environment", "model"],
            E2E_BUCKETS,
        )?;
        let queue = hist(
            registry,
            "fleetgate_queue_wait_seconds",
            "Time spent waiting for admission",
            &["environment", "model"],
            QUEUE_BUCKETS,
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                "fleetgate_tokens_total",
                "Tokens served, from the backend's usage (completion falls back to content events)",
            ),
            &["kind", "environment", "model"],
        )?;
        registry.register(Box::new(tokens.clone()))?;
        let requests = IntCounterVec::new(
            Opts::new(
                "fleetgate_requests_total",
                "Requests by status class and error kind (\"none\": no error)",
            ),
            &["status_class", "error", "environment", "model"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        let rejections = IntCounterVec::new(
            Opts::new(
                "fleetgate_rejections_total",
                "Requests refused by a limit, by limit",
            ),
            &["limit"],
        )?;
        registry.register(Box::new(rejections.clone()))?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "fleetgate_backend_in_flight",
                "Requests in flight per backend",
            ),
            &["model", "backend"],
        )?;
        registry.register(Box::new(in_flight.clone()))?;
        let backend_up = IntGaugeVec::new(
            Opts::new(
                "fleetgate_backend_up",
                "1 when the backend answered its last probe or request, 0 when it failed, -1 before the first",
            ),
            &["model", "backend"],
        )?;
        registry.register(Box::new(backend_up.clone()))?;
        // Static facts about each backend, to join on `backend` (e.g. compare a canary's TTFT
        // with the stable backends': `... * on(backend) group_left(labels) fleetgate_backend_info`).
        let info = IntGaugeVec::new(
            Opts::new(
                "fleetgate_backend_info",
                "1 per configured backend, with its labels (comma-separated) and weight",
            ),
            &["model", "backend", "labels", "weight"],
        )?;
        registry.register(Box::new(info.clone()))?;
        for p in pools.iter() {
            for b in &p.backends {
                let weight = b.weight.to_string();
                let labels = b.labels.join(",");
                info.with_label_values(&[&*p.model, &*b.base, labels.as_str(), weight.as_str()])
                    .set(1);
            }
        }
        let queue_depth = IntGaugeVec::new(
            Opts::new(
                "fleetgate_queue_depth",
                "Requests waiting in a pool's admission queue (every backend at capacity)",
            ),
            &["model"],
        )?;
        registry.register(Box::new(queue_depth.clone()))?;
        for p in pools.iter() {
            p.shared
                .queue
                .set_depth_gauge(queue_depth.with_label_values(&[&*p.model]));
        }

        let mut labels: Vec<(String, Vec<String>)> = pools
            .iter()
            .map(|p| {
                (
                    p.model.to_string(),
                    p.backends.iter().map(|b| b.base.to_string()).collect(),
                )
            })
            .collect();
        labels.push(("none".to_owned(), Vec::new()));
        let mut series = Vec::with_capacity(labels.len());
        for (model, backends) in &labels {
            let one = |env: &str| -> Series {
                let l2 = [env, model.as_str()];
                Series {
                    overhead: ["pre", "relay", "total"]
                        .map(|ph| overhead.with_label_values(&[ph, env, model])),
                    ttft_client: ttft.with_label_values(&["client", env, model, "-"]),
                    ttft_upstream: backends
                        .iter()
                        .map(|b| ttft.with_label_values(&["upstream", env, model, b]))
                        .collect(),
                    tpot: tpot.with_label_values(&l2),
                    itl: itl.with_label_values(&l2),
                    e2e: e2e.with_label_values(&l2),
                    queue_wait: queue.with_label_values(&l2),
                    tokens: ["prompt", "completion"]
                        .map(|k| tokens.with_label_values(&[k, env, model])),
                    requests: (0..STATUS_CLASSES.len() * KIND_COUNT)
                        .map(|_| OnceLock::new())
                        .collect(),
                }
            };
            series.push(ENV_LABELS.map(one));
        }
        Ok(Self {
            series,
            requests,
            in_flight,
            backend_up,
            labels,
            rejections,
        })
    }

    fn series(&self, pool: Option<usize>, env: Option<Environment>) -> &Series {
        let last = self.series.len() - 1;
        let p = pool.filter(|&p| p < last).unwrap_or(last);
        &self.series[p][env_index(env)]
    }

    /// The ITL histogram a relay observes each gap into.
    pub fn itl(&self, pool: Option<usize>, env: Option<Environment>) -> Histogram {
        self.series(pool, env).itl.clone()
    }

    /// Record one finished request (called once, from the record's drop).
    pub fn observe(&self, r: &RequestRecord) {
        let env = r.key.as_ref().map(|k| k.environment);
        let s = self.series(r.pool_index, env);
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
        if let Some(d) = t.client_ttft() {
            s.ttft_client.observe(secs(d));
        }
        if let (Some(d), Some(b)) = (
            t.upstream_ttft(),
            r.backend_index.and_then(|i| s.ttft_upstream.get(i)),
        ) {
            b.observe(secs(d));
        }
        if t.admitted.is_some() {
            s.queue_wait.observe(secs(t.queue_wait()));
        }
        if r.pool_index.is_some() {
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
            let (tokens, source) = t.stream.output_tokens();
            if let Some(u) = t.stream.usage {
                s.tokens[0].inc_by(u.prompt_tokens);
            }
            if source != UsageSource::None {
                s.tokens[1].inc_by(tokens.unwrap_or(0));
            }
        }
        let class = (usize::from(r.status / 100)).clamp(1, 5) - 1;
        let kind = r.error.map_or(KIND_COUNT - 1, |k| k.index());
        let slot = &s.requests[class * KIND_COUNT + kind];
        let env_label = ENV_LABELS[env_index(env)];
        let model = self
            .labels
            .get(r.pool_index.unwrap_or(usize::MAX))
            .map_or("none", |l| l.0.as_str());
        slot.get_or_init(|| {
            self.requests.with_label_values(&[
                STATUS_CLASSES[class],
                r.error.map_or("none", ErrorKind::as_str),
                env_label,
                model,
            ])
        })
        .inc();
    }

    /// Refresh the per-backend gauges (at scrape time).
    pub fn update_backends(&self, pools: &Pools) {
        for p in pools.iter() {
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
            }
        }
    }
}
