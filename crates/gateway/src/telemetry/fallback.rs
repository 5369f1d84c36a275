//! What a request's record keeps of a fallback (issue 62): the model the client's request was
//! routed to first, why it left each pool, and the pools it passed through before the one that
//! answered (the record's own model). Boxed in the record: most requests never fall back.

use std::sync::Arc;

/// Why a request left a pool for one of its fallbacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FallbackCause {
    /// No backend of the pool could take requests (down, ejected, draining, warming).
    NoBackend,
    /// Every attempt failed before the first byte (unreachable, or 502/503), retries
    /// included.
    RetriesFailed,
    /// The pool's queue was full.
    QueueFull,
    /// The request's wait in the pool's queue reached its environment's limit.
    QueueTimeout,
    /// The prompt plus the requested output exceed the pool's context length, as the gateway
    /// counted them before sending.
    ContextWindow,
    /// A backend answered vLLM's context-length error (400) before any byte reached the
    /// client.
    ContextError,
}

impl FallbackCause {
    /// The metric label and request-log value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FallbackCause::NoBackend => "no_backend",
            FallbackCause::RetriesFailed => "retries_failed",
            FallbackCause::QueueFull => "queue_full",
            FallbackCause::QueueTimeout => "queue_timeout",
            FallbackCause::ContextWindow => "context_window",
            FallbackCause::ContextError => "context_error",
        }
    }

    /// A context cause: the request goes to a `context_window_fallbacks` pool.
    pub(crate) fn is_context(self) -> bool {
        matches!(
            self,
            FallbackCause::ContextWindow | FallbackCause::ContextError
        )
    }
}

/// The pools a request left, in order, each with why.
#[derive(Debug, Clone, Default)]
pub(crate) struct FallbackLog {
    pub(crate) hops: Vec<(Arc<str>, FallbackCause)>,
    /// The pools the request was sent to (their indexes in its generation), so none is tried
    /// twice.
    pub(crate) tried: Vec<usize>,
}

impl FallbackLog {
    /// The model the request was routed to first.
    pub(crate) fn first(&self) -> Option<&Arc<str>> {
        self.hops.first().map(|(m, _)| m)
    }

    /// Why it left the last pool it left (the fallback that answered was chosen for this).
    pub(crate) fn last_cause(&self) -> Option<FallbackCause> {
        self.hops.last().map(|(_, c)| *c)
    }

    /// The request log's `fallback_detail`: each pool left and why, as JSON.
    pub(crate) fn detail(&self) -> String {
        let hops: Vec<serde_json::Value> = self
            .hops
            .iter()
            .map(|(model, cause)| serde_json::json!({ "model": &**model, "cause": cause.as_str() }))
            .collect();
        serde_json::Value::Array(hops).to_string()
    }
}
