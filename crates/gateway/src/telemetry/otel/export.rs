//! The exporter's task: finished requests come through a bounded queue (`try_send`: the
//! request path never waits, and wakes the task only when a batch is queued), their spans are
//! built here and exported in batches of `max_export_batch_size`, at least every
//! `schedule_delay`, each within `export_timeout`.
//!
//! A collector that is down or slow costs the request path nothing: while an export waits,
//! requests queue up to `max_queue_size`; beyond, their spans are dropped. Every dropped span
//! is counted in `fleetgate_trace_spans_dropped_total`, by reason, and the first drop of an
//! outage is said in the log once (and the recovery after it).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanExporter as _};
use prometheus::{IntCounter, Registry};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Scope;
use crate::config::OtlpExport;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot build the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("cannot build the OTLP exporter's TLS client: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Metrics(#[from] prometheus::Error),
}

/// `fleetgate_trace_*`: what was exported and what was not, each series resolved once (and
/// shown at 0 from the start).
#[derive(Clone, Debug)]
struct ExportMetrics {
    exported: IntCounter,
    /// `fleetgate_trace_spans_dropped_total{reason="queue_full"}`: the exporter was behind.
    queue_full: IntCounter,
    /// `{reason="export_failed"}`: the collector refused, failed or did not answer in time.
    export_failed: IntCounter,
}

impl ExportMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let exported = IntCounter::new(
            "fleetgate_trace_spans_exported_total",
            "Spans the OTLP collector accepted.",
        )?;
        registry.register(Box::new(exported.clone()))?;
        let dropped = crate::telemetry::metrics::counter_vec(
            registry,
            "fleetgate_trace_spans_dropped_total",
            "Spans never exported: the queue to the exporter was full (queue_full), or the collector refused, failed or timed out (export_failed).",
            &["reason"],
        )?;
        Ok(Self {
            exported,
            queue_full: dropped.with_label_values(&["queue_full"]),
            export_failed: dropped.with_label_values(&["export_failed"]),
        })
    }
}

/// The request path's end of the queue.
pub(super) struct Queue {
    tx: mpsc::Sender<Box<Scope>>,
    /// Requests queued at which the exporter is woken before its delay ends (a batch).
    wake_at: usize,
    wake: Arc<Notify>,
    queue_full: IntCounter,
    /// A full queue was said in the log (until the next export that succeeds).
    said: Arc<AtomicBool>,
}

impl Queue {
    /// Queue a sampled request's spans, or drop and count them.
    pub(super) fn send(&self, scope: Box<Scope>) {
        let spans = 1 + scope.attempts.len() as u64;
        if self.tx.try_send(scope).is_ok() {
            if self.tx.max_capacity() - self.tx.capacity() >= self.wake_at {
                self.wake.notify_one();
            }
        } else {
            self.queue_full.inc_by(spans);
            if !self.said.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "trace export is behind (the collector is slow or down): spans are dropped until it catches up; counted in fleetgate_trace_spans_dropped_total{{reason=\"queue_full\"}}"
                );
            }
        }
    }
}

/// Build the exporter and start its task.
pub(super) fn start(
    cfg: &OtlpExport,
    registry: &Registry,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> Result<Queue, StartError> {
    let metrics = ExportMetrics::new(registry)?;
    let headers: HashMap<String, String> = cfg
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.expose().to_owned()))
        .collect();
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(super::client::Collector::new(cfg.timeout)?)
        .with_endpoint(cfg.endpoint.clone())
        .with_protocol(Protocol::HttpBinary)
        .with_timeout(cfg.timeout)
        .with_headers(headers);
    if cfg.gzip {
        builder = builder.with_compression(opentelemetry_otlp::Compression::Gzip);
    }
    let mut exporter = builder.build().map_err(|source| StartError::Exporter {
        endpoint: cfg.endpoint.clone(),
        source,
    })?;
    exporter.set_resource(&resource(cfg));
    let (tx, rx) = mpsc::channel(cfg.max_queue_size);
    let said = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    let task = Exporter {
        wake: wake.clone(),
        rx,
        exporter,
        batch: cfg.max_export_batch_size,
        delay: cfg.schedule_delay,
        timeout: cfg.export_timeout,
        metrics: metrics.clone(),
        said: said.clone(),
        failing: false,
        scope: InstrumentationScope::builder("fleetgate")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build(),
    };
    tasks.spawn(task.run(stop));
    Ok(Queue {
        tx,
        // A request is a SERVER span and at least one CLIENT span.
        wake_at: (cfg.max_export_batch_size / 2).max(1),
        wake,
        queue_full: metrics.queue_full.clone(),
        said,
    })
}

/// The resource every span is exported with: `service.name` from the file (or `fleetgate`)
/// and its attributes, then `OTEL_RESOURCE_ATTRIBUTES` over them (the SDK's own reader), then
/// `OTEL_SERVICE_NAME` over all, as the specification orders them.
fn resource(cfg: &OtlpExport) -> Resource {
    let mut b = Resource::builder_empty()
        .with_attribute(KeyValue::new("telemetry.sdk.language", "rust"))
        .with_attribute(KeyValue::new("telemetry.sdk.name", "opentelemetry"))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_service_name(cfg.service_name.clone())
        .with_attributes(
            cfg.resource
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_detector(Box::new(
            opentelemetry_sdk::resource::EnvResourceDetector::new(),
        ));
    if let Some(name) = &cfg.service_name_env {
        b = b.with_service_name(name.clone());
    }
    b.build()
}

struct Exporter {
    rx: mpsc::Receiver<Box<Scope>>,
    wake: Arc<Notify>,
    exporter: opentelemetry_otlp::SpanExporter,
    batch: usize,
    delay: Duration,
    timeout: Duration,
    metrics: ExportMetrics,
    said: Arc<AtomicBool>,
    /// The last export failed (said in the log; the recovery is said too).
    failing: bool,
    scope: InstrumentationScope,
}

impl Exporter {
    async fn run(mut self, stop: CancellationToken) {
        let mut spans: Vec<SpanData> = Vec::with_capacity(self.batch);
        loop {
            tokio::select! {
                biased;
                got = self.rx.recv() => match got {
                    Some(scope) => {
                        super::span::build(*scope, &self.scope, &mut spans);
                        // Let requests gather without a wake-up each: the queue is not polled
                        // while this waits, so a request's `try_send` wakes nobody (until a
                        // batch is queued).
                        tokio::select! {
                            () = tokio::time::sleep(self.delay) => {}
                            () = self.wake.notified() => {}
                            () = stop.cancelled() => {}
                        }
                        self.drain(&mut spans).await;
                    }
                    None => break,
                },
                () = stop.cancelled() => break,
            }
        }
        // The last requests have been recorded: export what is queued, then end.
        self.drain(&mut spans).await;
        let _ = self.exporter.shutdown();
    }

    /// Build the spans of every queued request and export them, a batch at a time.
    async fn drain(&mut self, spans: &mut Vec<SpanData>) {
        loop {
            while spans.len() < self.batch {
                match self.rx.try_recv() {
                    Ok(scope) => super::span::build(*scope, &self.scope, spans),
                    Err(_) => break,
                }
            }
            if spans.is_empty() {
                return;
            }
            let rest = spans.split_off(spans.len().min(self.batch));
            let batch = std::mem::replace(spans, rest);
            let full = batch.len() >= self.batch;
            self.export(batch).await;
            if !full && spans.is_empty() {
                return;
            }
        }
    }

    async fn export(&mut self, batch: Vec<SpanData>) {
        let n = batch.len() as u64;
        let failure = match tokio::time::timeout(self.timeout, self.exporter.export(batch)).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "no answer within {} ms (tracing.export_timeout_ms, OTEL_BSP_EXPORT_TIMEOUT)",
                self.timeout.as_millis()
            )),
        };
        match failure {
            None => {
                self.metrics.exported.inc_by(n);
                if self.failing || self.said.swap(false, Ordering::Relaxed) {
                    tracing::info!("trace export works again");
                }
                self.failing = false;
            }
            Some(why) => {
                self.metrics.export_failed.inc_by(n);
                if !self.failing {
                    tracing::warn!(
                        error = %why,
                        spans = n,
                        "trace export failed: these spans are dropped, and so are the next ones until the collector answers (said once; counted in fleetgate_trace_spans_dropped_total{{reason=\"export_failed\"}})"
                    );
                }
                self.failing = true;
            }
        }
    }
}
