//! Per-request measurement: the Timeline and the record that is written exactly once per
//! request — on success, error and client disconnect alike — when the request's
//! `RequestRecord` is dropped.

pub(crate) mod fallback;
pub mod metrics;
pub(crate) mod otel;
pub mod request_log;
pub(crate) mod resume;
pub(crate) mod timeline;
pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderValue;

pub use timeline::Timeline;

use crate::key::KeyRecord;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::error::ErrorKind;

/// Where finished requests go: the per-request log event, and an optional observer (tests,
/// and later the metrics registry and request-log writer).
pub struct Recorder {
    emit_events: bool,
    observer: Option<Observer>,
    metrics: Option<Arc<metrics::RequestMetrics>>,
    log: Option<Arc<request_log::RequestLog>>,
    /// OpenTelemetry export, when `[tracing]` (or `OTEL_*`) names a collector.
    otel: Option<Arc<otel::Pipeline>>,
    /// Backends already named in the log for an implausible usage (said once each).
    implausible_said: std::sync::Mutex<std::collections::HashSet<Arc<str>>>,
}

type Observer = Box<dyn Fn(&RequestRecord) + Send + Sync>;

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("emit_events", &self.emit_events)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

impl Recorder {
    pub fn new(emit_events: bool) -> Self {
        Self {
            emit_events,
            observer: None,
            metrics: None,
            log: None,
            otel: None,
            implausible_said: std::sync::Mutex::default(),
        }
    }

    /// Record every finished request into these Prometheus metrics too.
    pub fn set_metrics(&mut self, m: Arc<metrics::RequestMetrics>) {
        self.metrics = Some(m);
    }

    /// Write every finished request to the request log too.
    pub fn set_request_log(&mut self, log: Arc<request_log::RequestLog>) {
        self.log = Some(log);
    }

    /// Export every sampled request's spans too.
    pub(crate) fn set_tracing(&mut self, p: Arc<otel::Pipeline>) {
        self.otel = Some(p);
    }

    /// The tracing pipeline, when tracing is on.
    pub(crate) fn tracing(&self) -> Option<&Arc<otel::Pipeline>> {
        self.otel.as_ref()
    }

    pub(crate) fn metrics(&self) -> Option<&Arc<metrics::RequestMetrics>> {
        self.metrics.as_ref()
    }

    /// Also hand every finished record to `f` (called on the task that ends the request).
    pub fn with_observer(mut self, f: impl Fn(&RequestRecord) + Send + Sync + 'static) -> Self {
        self.observer = Some(Box::new(f));
        self
    }

    fn record(&self, r: &RequestRecord) {
        if r.timeline.stream().implausible_usage {
            self.say_implausible(r);
        }
        if let Some(m) = &self.metrics {
            m.observe(r);
        }
        if let Some(log) = &self.log {
            log.record(r);
        }
        if self.emit_events {
            emit_event(r);
        }
        if let Some(f) = &self.observer {
            f(r);
        }
    }
}

impl Recorder {
    /// A backend's usage past every plausible count: said once per backend (counted each
    /// time in `fleetgate_upstream_implausible_usage_total`).
    fn say_implausible(&self, r: &RequestRecord) {
        let backend = r.backend.clone().unwrap_or_else(|| Arc::from("none"));
        let first = self
            .implausible_said
            .lock()
            .map(|mut said| said.insert(backend.clone()))
            .unwrap_or(false);
        if first {
            tracing::warn!(
                backend = %backend,
                max = fleetgate_protocol::usage::MAX_PLAUSIBLE_TOKENS,
                "a backend reported a usage count no request can have: treated as no usage (the reservation stands in for it); said once per backend, counted in fleetgate_upstream_implausible_usage_total"
            );
        }
    }
}

/// Everything known about one request; its `Drop` records it.
#[derive(Debug)]
pub struct RequestRecord {
    pub timeline: Timeline,
    pub request_id: HeaderValue,
    pub endpoint: Option<Endpoint>,
    /// The pool's configured model name (never the raw client string).
    pub model: Option<Arc<str>>,
    pub backend: Option<Arc<str>>,
    /// Metrics slots of the pool and of the backend (metric handles are found by these; a
    /// reload never reassigns them).
    pub pool_metrics_index: Option<usize>,
    pub backend_metrics_index: Option<usize>,
    /// The client's address (TCP peer).
    pub client_addr: Option<std::net::SocketAddr>,
    /// The authenticated key (its public id and environment label the record).
    pub key: Option<Arc<KeyRecord>>,
    pub stream: bool,
    pub status: u16,
    pub error: Option<ErrorKind>,
    /// Attempts on other backends before the one that answered.
    pub retries: u8,
    /// The W3C trace the request joined (its valid `traceparent`).
    pub(crate) trace_id: Option<fleetgate_protocol::trace_context::TraceId>,
    /// The request's place in its trace, when tracing is on.
    pub(crate) otel: Option<Box<otel::Scope>>,
    /// How much of the prompt the routing believed the chosen backend's engine holds.
    pub(crate) cache_belief: Option<CacheBelief>,
    /// A stream resumed on another backend, or refused that (`resume`).
    pub(crate) resume: Option<Box<resume::ResumeLog>>,
    /// The pools the request left for a fallback, and why (`route::fallback`).
    pub(crate) fallback: Option<Box<fallback::FallbackLog>>,
    recorder: Arc<Recorder>,
}

/// What prefix-aware routing believed the chosen backend's engine holds of the prompt (12
/// bytes: every request's record carries the field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheBelief {
    /// `kv_events`: the prompt tokens the engine will serve from its cache, by its events.
    Tokens(u32),
    /// `longest_prefix`: `held` of the prompt's `of` blocks of text were sent to the backend
    /// before; in tokens, that share of the prompt the backend reports.
    Share { held: u32, of: u32 },
}

impl RequestRecord {
    pub fn new(received: Instant, request_id: HeaderValue, recorder: Arc<Recorder>) -> Self {
        Self {
            timeline: Timeline::start(received),
            request_id,
            endpoint: None,
            model: None,
            backend: None,
            pool_metrics_index: None,
            backend_metrics_index: None,
            client_addr: None,
            key: None,
            stream: false,
            status: 0,
            error: None,
            retries: 0,
            trace_id: None,
            otel: None,
            cache_belief: None,
            resume: None,
            fallback: None,
            recorder,
        }
    }

    /// Tokens this request used, for settling a token reservation made with
    /// `prompt_estimate`: see `used_tokens`.
    pub(crate) fn used_tokens(&self, prompt_estimate: u64) -> u64 {
        used_tokens(&self.timeline, self.error, prompt_estimate).saturating_add(
            self.resume
                .as_ref()
                .map_or(0, |r| r.continuation_prompt_tokens),
        )
    }

    /// Continuations sent for this request.
    pub(crate) fn resumes(&self) -> usize {
        self.resume.as_ref().map_or(0, |r| r.resumes())
    }

    /// The prompt tokens the routing predicted the chosen backend's engine serves from its
    /// cache (a share of the reported prompt for `longest_prefix`, which knows no tokens).
    pub(crate) fn predicted_cached_tokens(&self) -> Option<u64> {
        match self.cache_belief? {
            CacheBelief::Tokens(t) => Some(u64::from(t)),
            CacheBelief::Share { held, of } => {
                let prompt = self.timeline.stream().usage?.prompt_tokens;
                let share = u128::from(prompt) * u128::from(held) / u128::from(of.max(1));
                Some(u64::try_from(share).unwrap_or(u64::MAX))
            }
        }
    }

    /// The request ended at `at` (its answer complete, or failed): the one way the request
    /// path stamps `done`. A second call changes nothing.
    pub(crate) fn finish(&mut self, at: Instant) {
        self.timeline.stamp_done(at);
    }

    fn record(&mut self) {
        if self.timeline.done().is_none() {
            // Dropped before the response ended: the client went away.
            self.timeline.stamp_done(Instant::now());
            if self.error.is_none() {
                self.error = Some(ErrorKind::ClientDisconnected);
            }
        }
        let recorder = self.recorder.clone();
        recorder.record(self);
        if let Some(scope) = self.otel.take() {
            scope.finish(self);
        }
    }
}

/// Tokens a request used, for settling its reservation: the backend's usage when it reported
/// one; nothing when the request never reached a backend or the backend refused it; else the
/// prompt estimate plus one token per content event (a stream is never counted as zero).
fn used_tokens(t: &Timeline, error: Option<ErrorKind>, prompt_estimate: u64) -> u64 {
    if t.upstream_sent().is_none() {
        return 0;
    }
    if let Some(u) = t.stream().usage {
        return u.prompt_tokens.saturating_add(u.completion_tokens);
    }
    let refused = matches!(
        error,
        Some(ErrorKind::UpstreamError | ErrorKind::BackendUnreachable)
    );
    if refused && t.stream().content_events == 0 {
        return 0;
    }
    prompt_estimate.saturating_add(u64::from(t.stream().content_events))
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.record();
    }
}

/// Milliseconds to the microsecond (`2.5065`, not `2.5065399999999998`).
fn ms(d: Option<Duration>) -> f64 {
    d.map_or(-1.0, |d| (d.as_secs_f64() * 1e6).round() / 1e3)
}

/// Microseconds to the tenth (`39.7`, not `39.675000000000004`).
fn us(d: Option<Duration>) -> f64 {
    d.map_or(-1.0, |d| (d.as_secs_f64() * 1e7).round() / 1e1)
}

/// The structured per-request event. Durations are milliseconds (overheads microseconds);
/// -1 means "not reached" (e.g. no first token before an error).
fn emit_event(r: &RequestRecord) {
    let t = &r.timeline;
    let (tokens, source) = t.stream().output_tokens();
    tracing::info!(
        target: "fleetgate::request",
        request_id = r.request_id.to_str().unwrap_or("-"),
        endpoint = r.endpoint.map_or("-", Endpoint::as_str),
        key_id = r.key.as_ref().map_or("-", |k| &*k.public_id),
        environment = r.key.as_ref().map_or("-", |k| k.environment.as_str()),
        model = r.model.as_deref().unwrap_or("-"),
        backend = r.backend.as_deref().unwrap_or("-"),
        stream = r.stream,
        status = r.status,
        error = r.error.map_or("-", ErrorKind::as_str),
        retries = r.retries,
        resumes = r.resumes(),
        trace_id = r.trace_id.map(tracing::field::display),
        queue_wait_ms = ms(Some(t.queue_wait())),
        upstream_ttft_ms = ms(t.upstream_ttft()),
        client_ttft_ms = ms(t.client_ttft()),
        overhead_pre_us = us(t.overhead_pre()),
        overhead_relay_us = us(t.overhead_relay()),
        hop_us = us(t.hop()),
        e2el_ms = ms(t.e2el()),
        tpot_ms = ms(t.tpot()),
        itl_mean_ms = ms(t.stream().itl_mean()),
        itl_max_ms = ms(t.stream().itl_max()),
        content_events = t.stream().content_events,
        prompt_tokens = t.stream().usage.map_or(0, |u| u.prompt_tokens),
        cached_tokens = t.stream().usage.and_then(|u| u.cached_tokens),
        predicted_cached_tokens = r.predicted_cached_tokens(),
        completion_tokens = tokens.unwrap_or(0),
        usage_source = source.as_str(),
        "request"
    );
}
