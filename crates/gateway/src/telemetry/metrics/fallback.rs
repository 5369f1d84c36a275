//! `fleetgate_fallbacks_total`: requests sent from one pool to one of its fallbacks, by the
//! pool left, the pool taken and why (`proxy::fallback`). Counted when the request is recorded,
//! one count per pool left.

use prometheus::{IntCounterVec, Registry};

use super::counter_vec;
use crate::telemetry::fallback::FallbackLog;

pub(super) struct FallbackMetrics {
    fallbacks: IntCounterVec,
}

impl FallbackMetrics {
    pub(super) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            fallbacks: counter_vec(
                registry,
                "fleetgate_fallbacks_total",
                "Requests sent from a pool to one of its fallbacks, by the pool left (model), the pool taken (to) and cause: no_backend, retries_failed, queue_full, queue_timeout (fallbacks), context_window (the gateway counted the prompt over the pool's context), context_error (a backend answered vLLM's context-length error) (context_window_fallbacks)",
                &["model", "to", "cause"],
            )?,
        })
    }

    /// Each pool the request left, with the pool it went to (the next one left, or `answered`,
    /// the record's model, for the last).
    pub(super) fn observe(&self, answered: &str, log: &FallbackLog) {
        for (i, (from, cause)) in log.hops.iter().enumerate() {
            let to = log.hops.get(i + 1).map_or(answered, |(m, _)| &**m);
            self.fallbacks
                .with_label_values(&[&**from, to, cause.as_str()])
                .inc();
        }
    }
}
