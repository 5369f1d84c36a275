//! What the forwarding path shares across requests: the worker's pools and limits, the body
//! and head limits, the stored-response pins, and the end of the shutdown grace period.

use std::sync::Arc;
use std::time::Duration;

use super::error::ApiError;
use super::{body, headers, pins, prefix_share};
use crate::queue;

/// What the forwarding path needs, shared by all requests.
#[derive(Debug)]
pub(crate) struct ProxyState {
    /// This worker's pools, swapped by a reload (`pool::fleet`).
    pub(crate) generation: crate::pool::fleet::CurrentGeneration,
    pub(crate) max_body_bytes: usize,
    /// The audio routes' `multipart/form-data` bodies (`server.max_audio_body_bytes`).
    pub(crate) max_audio_body_bytes: usize,
    /// The whole request body must arrive within this, with no pause longer than the idle
    /// limit.
    pub(crate) body_timeouts: body::BodyTimeouts,
    /// The bytes of bodies still arriving, for every worker (`server.max_pending_body_*`).
    pub(crate) pending_bodies: Arc<body::PendingBodies>,
    /// What a forwarded request's head may come to (`server.max_upstream_*`).
    pub(crate) head_limits: headers::HeadLimits,
    pub(crate) recorder: Arc<crate::telemetry::Recorder>,
    pub(crate) auth: Arc<crate::auth::Authenticator>,
    pub(crate) limits: Arc<crate::limits::Limits>,
    pub(crate) queue: crate::config::QueueConfig,
    pub(crate) queue_metrics: Option<queue::QueueMetrics>,
    /// The longest SSE line a relay carries across reads (`server.max_stream_line_bytes`).
    pub(crate) max_stream_line: usize,
    /// How forwarded requests say whom they came from.
    pub(crate) forwarding: headers::Forwarding,
    /// Which backend holds each stored response (`pins`).
    pub(crate) pins: Arc<pins::Pins>,
    /// Longest-prefix records shared with the other replicas (`prefix_share`), with Redis.
    pub(crate) prefix_share: Option<Arc<prefix_share::PrefixShare>>,
    /// Cancelled when the shutdown grace period has run out: what is still open ends now,
    /// with an error the client can read (`ApiError::Shutdown`).
    pub(crate) closing: Closing,
}

/// The end of the shutdown grace period, as the request path sees it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Closing {
    /// This worker's own child of the server's token (its waiters never share a lock with
    /// another worker's).
    pub(crate) token: tokio_util::sync::CancellationToken,
    pub(crate) grace: Duration,
}

impl Closing {
    pub(crate) fn error(&self) -> ApiError {
        ApiError::Shutdown {
            grace_ms: self.grace.as_millis(),
        }
    }

    /// A step that may wait, ended with `gateway_shutdown` when the grace period runs out
    /// first. The step is polled first: one that is ready at once never registers a waiter.
    pub(crate) async fn bound<T>(
        &self,
        step: impl Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        tokio::select! {
            biased;
            r = step => r,
            () = self.token.cancelled() => Err(self.error()),
        }
    }
}
