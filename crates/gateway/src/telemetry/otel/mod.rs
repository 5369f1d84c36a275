//! OpenTelemetry traces: a SERVER span per request and a CLIENT span per upstream attempt,
//! exported over OTLP/HTTP by the standard exporter (`opentelemetry-otlp`).
//!
//! Nothing here runs when tracing is off: the router asks `Pipeline::begin` only when a
//! pipeline exists. When on, the request path does three small things: it reads the client's
//! `traceparent` and asks the sampler (`begin`); it writes a `traceparent` naming the attempt's
//! span on each upstream request (`Scope::attempt`); and when the request's record is written,
//! it hands its `Scope` (with the record's figures copied in) to a bounded queue with
//! `try_send`. The spans are built and exported on the exporter's task
//! (`export`), never on the request path; a full queue drops the request's spans and counts
//! them. Spans are built from the Timeline's instants, so the gateway's figures and its spans
//! are one measurement.

mod client;
mod export;
mod span;

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use http::{HeaderMap, HeaderValue};
use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, SpanKind, TraceContextExt, TraceFlags, TraceState};
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, ShouldSample,
};

use crate::config::{OtlpExport, SamplerChoice};
use crate::key::KeyRecord;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::error::ErrorKind;
use fleetgate_protocol::trace_context::{self, SpanId, TraceId, TraceParent};

pub(crate) use export::StartError;

use super::Timeline;

/// The tracing of a running gateway: its sampler and the queue to the exporter's task.
pub(crate) struct Pipeline {
    sampler: Sampler,
    ids: RandomIdGenerator,
    queue: export::Queue,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline").finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Build the exporter for `cfg` and start its task (on `tasks`, stopped by `stop` after
    /// the last request: what is queued then is exported before it ends).
    pub(crate) fn start(
        cfg: &OtlpExport,
        registry: &prometheus::Registry,
        tasks: &tokio_util::task::TaskTracker,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<Arc<Pipeline>, StartError> {
        let queue = export::start(cfg, registry, tasks, stop)?;
        tracing::info!(
            endpoint = %cfg.endpoint,
            sampler = ?cfg.sampler,
            "exporting traces over OTLP/HTTP ([tracing], OTEL_* environment)"
        );
        Ok(Arc::new(Pipeline {
            sampler: sampler(cfg.sampler),
            ids: RandomIdGenerator::default(),
            queue,
        }))
    }

    /// The trace this request is in: the client's, when its `traceparent` is valid, else a
    /// new one; sampled as the sampler says.
    pub(crate) fn begin(self: &Arc<Self>, headers: &HeaderMap, received: Instant) -> Box<Scope> {
        let incoming = trace_context::extract(headers);
        let trace_id = match &incoming {
            Some(i) => i.parent.trace_id,
            None => TraceId(self.ids.new_trace_id().to_bytes()),
        };
        let parent_cx = incoming.as_ref().map(|i| {
            Context::new().with_remote_span_context(SpanContext::new(
                opentelemetry::trace::TraceId::from_bytes(i.parent.trace_id.0),
                opentelemetry::trace::SpanId::from_bytes(i.parent.parent_id.0),
                TraceFlags::new(i.parent.flags),
                true,
                TraceState::NONE,
            ))
        });
        let sampled = self
            .sampler
            .should_sample(
                parent_cx.as_ref(),
                opentelemetry::trace::TraceId::from_bytes(trace_id.0),
                "",
                &SpanKind::Server,
                &[],
                &[],
            )
            .decision
            == SamplingDecision::RecordAndSample;
        Box::new(Scope {
            trace_id,
            parent: incoming.as_ref().map(|i| i.parent.parent_id),
            span_id: SpanId(self.ids.new_span_id().to_bytes()),
            sampled,
            state: incoming.and_then(|i| i.state),
            received,
            wall: SystemTime::now(),
            attempts: Vec::new(),
            max_tokens: None,
            response_model: None,
            finish_reasons: Vec::new(),
            done: None,
            pipeline: self.clone(),
        })
    }

    fn new_span_id(&self) -> SpanId {
        SpanId(self.ids.new_span_id().to_bytes())
    }
}

/// The SDK's sampler for the configured choice.
fn sampler(choice: SamplerChoice) -> Sampler {
    match choice {
        SamplerChoice::AlwaysOn => Sampler::AlwaysOn,
        SamplerChoice::AlwaysOff => Sampler::AlwaysOff,
        SamplerChoice::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
        SamplerChoice::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        SamplerChoice::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        SamplerChoice::ParentBasedTraceIdRatio(r) => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r)))
        }
    }
}

/// One request's place in its trace, and (when sampled) what its spans need.
pub(crate) struct Scope {
    pub(crate) trace_id: TraceId,
    /// The client's span, when it sent a valid `traceparent`.
    parent: Option<SpanId>,
    /// The gateway's SERVER span.
    span_id: SpanId,
    sampled: bool,
    /// The client's `tracestate`, when well formed: passed on as it came.
    state: Option<HeaderValue>,
    received: Instant,
    /// The wall clock at `received`: span times are this plus the Timeline's offsets.
    wall: SystemTime,
    attempts: Vec<Attempt>,
    /// The request's output limit (`max_tokens` and the like).
    pub(crate) max_tokens: Option<u64>,
    /// The model name the backend was asked for (the pool's served name).
    pub(crate) response_model: Option<Arc<str>>,
    /// Why the answer ended, as the backend said it (one per choice).
    finish_reasons: Vec<Box<str>>,
    /// The record's figures, copied in when it is written (boxed: a stream in flight carries
    /// only the scope).
    done: Option<Box<Finished>>,
    pipeline: Arc<Pipeline>,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("trace_id", &self.trace_id)
            .field("sampled", &self.sampled)
            .field("attempts", &self.attempts.len())
            .finish_non_exhaustive()
    }
}

/// One upstream attempt: its CLIENT span.
struct Attempt {
    span_id: SpanId,
    backend: Arc<str>,
    started: Instant,
    /// A failed attempt's end, status and error (the last attempt's are the record's).
    ended: Option<(Instant, u16, Option<ErrorKind>)>,
}

/// What the record knew when it was written: the spans' attributes and times.
struct Finished {
    timeline: Timeline,
    request_id: HeaderValue,
    endpoint: Option<Endpoint>,
    model: Option<Arc<str>>,
    key: Option<Arc<KeyRecord>>,
    stream: bool,
    status: u16,
    error: Option<ErrorKind>,
    retries: u8,
    /// A fallback answered: the model routed to first, and why the last pool left was left.
    fallback: Option<(Arc<str>, &'static str)>,
}

impl Scope {
    pub(crate) fn sampled(&self) -> bool {
        self.sampled
    }

    /// An upstream attempt on `backend` starts at `at`: the `traceparent` it carries names
    /// its own span, a child of the gateway's. (An attempt before it that has no end ended
    /// now.)
    pub(crate) fn attempt(&mut self, backend: &Arc<str>, at: Instant) -> HeaderValue {
        let span_id = self.pipeline.new_span_id();
        if self.sampled {
            // Most requests make one attempt.
            self.attempts.reserve_exact(1);
            self.attempts.push(Attempt {
                span_id,
                backend: backend.clone(),
                started: at,
                ended: None,
            });
        }
        TraceParent {
            trace_id: self.trace_id,
            parent_id: self.span_id,
            flags: u8::from(self.sampled),
        }
        .child_header(span_id)
    }

    /// The backend said the answer (or one of its choices) ended for `reason`.
    pub(crate) fn finish_reason(&mut self, reason: &str) {
        // (Bounded: a request asks for at most a few choices.)
        if self.finish_reasons.len() < 16 {
            self.finish_reasons.push(reason.into());
        }
    }

    pub(crate) fn has_finish_reasons(&self) -> bool {
        !self.finish_reasons.is_empty()
    }

    /// The latest attempt failed at `at` with `status` (0: no answer) and `error`; another
    /// may follow.
    pub(crate) fn attempt_failed(&mut self, at: Instant, status: u16, error: Option<ErrorKind>) {
        if let Some(a) = self.attempts.last_mut()
            && a.ended.is_none()
        {
            a.ended = Some((at, status, error));
        }
    }

    /// The headers an upstream request carries for this trace: its `traceparent` (`value`)
    /// and the client's `tracestate` when it was well formed (any other is dropped).
    pub(crate) fn write_headers(&self, headers: &mut HeaderMap, traceparent: HeaderValue) {
        headers.insert(trace_context::TRACEPARENT.clone(), traceparent);
        match &self.state {
            Some(s) => {
                headers.insert(trace_context::TRACESTATE.clone(), s.clone());
            }
            None => {
                headers.remove(&trace_context::TRACESTATE);
            }
        }
    }

    /// Hand the request's spans to the exporter (sampled requests only); never waits.
    pub(crate) fn finish(mut self: Box<Self>, r: &super::RequestRecord) {
        if !self.sampled {
            return;
        }
        self.done = Some(Box::new(Finished {
            timeline: r.timeline.clone(),
            request_id: r.request_id.clone(),
            endpoint: r.endpoint,
            model: r.model.clone(),
            key: r.key.clone(),
            stream: r.stream,
            status: r.status,
            error: r.error,
            retries: r.retries,
            fallback: r
                .fallback
                .as_ref()
                .and_then(|f| Some((f.first()?.clone(), f.last_cause()?.as_str()))),
        }));
        let pipeline = self.pipeline.clone();
        pipeline.queue.send(self);
    }
}
