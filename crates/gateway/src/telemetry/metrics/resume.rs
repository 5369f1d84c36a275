//! `fleetgate_stream_resumes_total` and `fleetgate_stream_resume_refused_total`: streams
//! continued on another backend when theirs failed mid-answer, by cause, and the failures that
//! were not, by reason (`proxy::relay::resume`). Counted when the request is recorded.

use prometheus::{IntCounterVec, Registry};

use super::counter_vec;
use crate::telemetry::resume::ResumeLog;

pub(super) struct ResumeMetrics {
    resumes: IntCounterVec,
    refused: IntCounterVec,
}

impl ResumeMetrics {
    pub(super) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            resumes: counter_vec(
                registry,
                "fleetgate_stream_resumes_total",
                "Streams continued on another backend after theirs failed mid-answer, by cause: closed (the connection was reset or closed before the answer's end), engine_dead (vLLM's EngineDeadError event), retryable (vLLM's ServiceUnavailableError event), stalled (no token within [pools.resume] stall_ms)",
                &["model", "cause"],
            )?,
            refused: counter_vec(
                registry,
                "fleetgate_stream_resume_refused_total",
                "Streams that failed mid-answer and were not continued on another backend, by reason (docs/reliability.md lists them); each ended with an error event naming the reason",
                &["model", "reason"],
            )?,
        })
    }

    pub(super) fn observe(&self, model: &str, log: &ResumeLog) {
        let resumed = log.resumes();
        for part in log.parts.iter().take(resumed) {
            self.resumes
                .with_label_values(&[model, part.cause.as_str()])
                .inc();
        }
        if let Some(reason) = log.refused {
            self.refused.with_label_values(&[model, reason]).inc();
        }
    }
}
