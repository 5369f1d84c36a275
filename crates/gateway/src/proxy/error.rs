//! Every error the gateway itself answers with, and its one conversion into an OpenAI-format
//! body (`{"error":{"message","type","param","code"}}`) with the right status. Whose fault it is
//! decides the status: the client's → 4xx saying what to change; a backend's → 502/503/504
//! naming the backend and the cause; ours → 500 with the detail in the log only. A step of the
//! path that fails is answered here (`answer`), in the route's dialect.

use std::time::Instant;

use bytes::Bytes;
use http::Response;

use super::exchange::Exchange;
use super::headers::{APPLICATION_JSON, X_REQUEST_ID, X_SHOULD_RETRY};
use super::relay::GatewayBody;

use crate::auth::AuthFailure;
use crate::limits::Refusal;
use crate::pool::Pool;
use crate::pool::cause::ConnectCause;
use crate::queue::{QueueError, QueueRefusal};
use fleetgate_protocol::error::{ErrorKind, Shaped, anthropic_status};
use fleetgate_protocol::view::ViewError;
use fleetgate_protocol::{Dialect, Endpoint};
use http::{HeaderValue, StatusCode, header};

/// A step's error, answered: the record closed on it (status, kind), then the response in
/// the endpoint's dialect, with the limits' headers on a refusal by the limits.
pub(super) fn answer(err: &ApiError, mut ex: Exchange) -> Response<GatewayBody> {
    let dialect = ex.record.endpoint.map_or(Dialect::Chat, Endpoint::dialect);
    ex.record.status = err.status_in(dialect).as_u16();
    ex.record.error = Some(err.kind());
    if err.kind() == ErrorKind::Internal {
        tracing::error!(request_id = ?ex.record.request_id, "internal error while forwarding");
    }
    ex.record.finish(Instant::now());
    let mut resp = err.response(dialect, &ex.record.request_id);
    if let ApiError::Limited(r) = err {
        r.headers.write(resp.headers_mut());
    }
    resp
}

/// Which bound a body would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PendingScope {
    /// `server.max_pending_body_bytes`, every key together.
    Gateway,
    /// `server.max_pending_body_bytes_per_key`.
    Key,
}

/// Which upstream timeout fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimeoutKind {
    FirstToken,
    Idle,
    Total,
}

impl TimeoutKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TimeoutKind::FirstToken => "first_token",
            TimeoutKind::Idle => "idle",
            TimeoutKind::Total => "total",
        }
    }
}

/// What about a request's head is more than the backends accept, as it would be forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HeadExcess {
    /// The whole head: request line, `Host`, the headers that go on, the gateway's own.
    Total { bytes: usize, limit: usize },
    /// One header's value (the name cut to 64 characters).
    Value {
        name: String,
        bytes: usize,
        limit: usize,
    },
    /// More header fields than the listener takes over HTTP/1.1 (HTTP/2 bounds only the size).
    Fields { count: usize, limit: usize },
}

#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ApiError {
    #[error("unknown route {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed {
        method: String,
        path: &'static str,
        allow: &'static str,
    },
    #[error("content type `{got}` is not JSON")]
    UnsupportedMediaType { got: String, multipart: bool },
    #[error("body larger than {limit} bytes")]
    BodyTooLarge { limit: usize, setting: &'static str },
    #[error("request head too large for the backends: {0:?}")]
    HeadersTooLarge(HeadExcess),
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    #[error("request body not received within {after_ms} ms")]
    BodyTimeout { after_ms: u128 },
    /// The body stopped arriving: nothing came for this long.
    #[error("request body stalled for {after_ms} ms")]
    BodyStalled { after_ms: u128 },
    /// Past the bytes of bodies still arriving that the gateway (or this key) may hold.
    #[error("pending request bodies over {limit} bytes")]
    PendingBodies { scope: PendingScope, limit: usize },
    /// The body is not the JSON the endpoint takes (the view's own error, kept whole).
    #[error("{0}")]
    View(ViewError),
    #[error("model `{model}` not found")]
    ModelNotFound { model: String, available: String },
    /// A response id this gateway has no pin for.
    #[error("response `{id}` not pinned here")]
    ResponseNotFound { id: String, ttl_s: u64 },
    /// The backend holding a stored response cannot take requests.
    #[error("response `{id}`: its backend is unavailable")]
    ResponseUnavailable { id: String, why: String },
    #[error("no backend available for `{model}`")]
    NoBackend { model: String, detail: String },
    #[error("backend {backend} unreachable: {}", cause.describe())]
    BackendUnreachable {
        backend: String,
        cause: ConnectCause,
        detail: String,
    },
    #[error("backend {backend}: {} timeout", kind.as_str())]
    UpstreamTimeout {
        backend: String,
        kind: TimeoutKind,
        after_ms: u128,
    },
    #[error("backend {backend} closed the stream before [DONE]")]
    UpstreamStreamCut { backend: String },
    #[error("backend {backend} sent an SSE line longer than {limit} bytes")]
    UpstreamLineTooLong { backend: String, limit: usize },
    #[error("backend {backend} failed mid-stream: {detail}")]
    UpstreamStreamFailed { backend: String, detail: String },
    /// The gateway is stopping and its grace period ran out while this stream was open.
    #[error("gateway shut down mid-stream")]
    Shutdown { grace_ms: u128 },
    #[error("authentication: {}", .0.reason())]
    Auth(AuthFailure),
    #[error("limit: {}", .0.code())]
    Limited(Box<Refusal>),
    #[error("queue: {}", .0.kind.code())]
    QueueRefused(Box<QueueRefusal>),
    #[error("internal error")]
    Internal,
    /// A stream failure that could not be resumed on another backend: the failure as it is,
    /// and why it was not continued (`proxy::relay::resume`).
    #[error("{failure} (not resumed: {reason})")]
    NotResumed {
        failure: Box<ApiError>,
        reason: &'static str,
        why: &'static str,
    },
}

impl ApiError {
    /// The error as a response in `dialect` (OpenAI's shape, or Anthropic's on its routes),
    /// with the request id.
    pub(crate) fn response(
        &self,
        dialect: Dialect,
        request_id: &HeaderValue,
    ) -> Response<GatewayBody> {
        let mut resp = Response::new(GatewayBody::full(self.body_in(dialect)));
        *resp.status_mut() = self.status_in(dialect);
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
        h.insert(X_REQUEST_ID.clone(), request_id.clone());
        if let Some((name, value)) = self.extra_header() {
            h.insert(name, value);
        }
        // An authentication or rights refusal answers the same to the same key until an
        // operator acts: a client's retry loop only hides the message.
        if matches!(self, ApiError::Auth(_)) {
            h.insert(X_SHOULD_RETRY.clone(), HeaderValue::from_static("false"));
        }
        resp
    }

    /// The status comes from the kind: one table (`ErrorKind::status`).
    pub(crate) fn status(&self) -> StatusCode {
        self.kind().status()
    }

    pub(crate) fn kind(&self) -> ErrorKind {
        match self {
            ApiError::RouteNotFound { .. } => ErrorKind::RouteNotFound,
            ApiError::MethodNotAllowed { .. } => ErrorKind::MethodNotAllowed,
            ApiError::UnsupportedMediaType { .. } => ErrorKind::UnsupportedMediaType,
            ApiError::BodyTooLarge { .. } => ErrorKind::BodyTooLarge,
            ApiError::HeadersTooLarge(_) => ErrorKind::HeadersTooLarge,
            ApiError::BodyRead(_) => ErrorKind::BodyRead,
            ApiError::BodyTimeout { .. } | ApiError::BodyStalled { .. } => ErrorKind::BodyTimeout,
            ApiError::PendingBodies {
                scope: PendingScope::Gateway,
                ..
            } => ErrorKind::Overloaded,
            ApiError::PendingBodies {
                scope: PendingScope::Key,
                ..
            } => ErrorKind::RateLimited,
            ApiError::View(ViewError::InvalidJson(_)) => ErrorKind::InvalidJson,
            ApiError::View(ViewError::InvalidRequest { .. }) => ErrorKind::InvalidRequest,
            ApiError::View(ViewError::Unlocatable) => ErrorKind::Internal,
            ApiError::ModelNotFound { .. } => ErrorKind::ModelNotFound,
            ApiError::ResponseNotFound { .. } => ErrorKind::ResponseNotFound,
            ApiError::ResponseUnavailable { .. } => ErrorKind::ResponseUnavailable,
            ApiError::NoBackend { .. } => ErrorKind::NoBackend,
            ApiError::BackendUnreachable { .. } => ErrorKind::BackendUnreachable,
            ApiError::UpstreamTimeout { .. } => ErrorKind::UpstreamTimeout,
            ApiError::UpstreamStreamCut { .. } | ApiError::UpstreamStreamFailed { .. } => {
                ErrorKind::UpstreamStreamError
            }
            ApiError::UpstreamLineTooLong { .. } => ErrorKind::UpstreamProtocol,
            ApiError::Shutdown { .. } => ErrorKind::Shutdown,
            ApiError::Auth(f) => f.kind(),
            ApiError::Limited(r) => r.kind.error_kind(),
            ApiError::QueueRefused(r) => r.kind.error_kind(),
            ApiError::Internal => ErrorKind::Internal,
            ApiError::NotResumed { failure, .. } => failure.kind(),
        }
    }

    /// The OpenAI-format body: message, type, param, code.
    #[cfg(test)]
    pub(crate) fn body(&self) -> Bytes {
        let (message, kind, param, code) = self.parts();
        fleetgate_protocol::error::error_body(&message, kind, param, Some(code))
    }

    /// The error in `dialect`'s shape, with its status there; `f` gets it.
    pub(crate) fn shaped<T>(&self, f: impl FnOnce(&Shaped<'_>) -> T) -> T {
        let (message, kind, param, code) = self.parts();
        f(&Shaped {
            status: self.status(),
            message: &message,
            kind,
            param,
            code: Some(code),
        })
    }

    /// The status the client gets in `dialect` (Anthropic's 529 for 503).
    pub(crate) fn status_in(&self, dialect: Dialect) -> StatusCode {
        if dialect.anthropic() {
            anthropic_status(self.status())
        } else {
            self.status()
        }
    }

    /// The whole-answer body in `dialect`.
    pub(crate) fn body_in(&self, dialect: Dialect) -> Bytes {
        self.shaped(|s| s.body_in(dialect))
    }

    /// The error as the last events of a stream in `dialect` whose head already went out.
    pub(crate) fn sse_event(&self, dialect: Dialect, partial_line: bool) -> Bytes {
        self.shaped(|s| s.sse_in(dialect, partial_line))
    }

    /// The message alone (a failed non-SSE body ends with it as its I/O error).
    pub(crate) fn message(&self) -> String {
        self.parts().0
    }

    /// (message, type, param, code) of the OpenAI error body.
    fn parts(&self) -> (String, &'static str, Option<&str>, &'static str) {
        match self {
            ApiError::NotResumed {
                failure,
                reason,
                why,
            } => {
                let (message, kind, param, code) = failure.parts();
                (
                    format!(
                        "{message} It was not continued on another backend ([pools.resume]): {why} (reason `{reason}`)."
                    ),
                    kind,
                    param,
                    code,
                )
            }
            ApiError::RouteNotFound { method, path }
                if path.ends_with("/tokenize") || path.ends_with("/detokenize") =>
            {
                (
                    format!(
                        "Unknown route {method} {path}. vLLM's tokenizer endpoints are at the server root, not under /v1: POST /tokenize and POST /detokenize on the base URL without /v1."
                    ),
                    "invalid_request_error",
                    None,
                    "unknown_url",
                )
            }
            ApiError::RouteNotFound { method, path } => (
                match fleetgate_protocol::base_url::meant(path) {
                    // The fix first: the rest of a long message goes unread.
                    Some((mistakes, route)) => {
                        let mut fix = String::new();
                        for (i, m) in mistakes.iter().enumerate() {
                            fix.push_str(if i == 0 { "" } else { "; and " });
                            fix.push_str(m.fix());
                        }
                        let mut fix = fix.into_bytes();
                        if let Some(first) = fix.first_mut() {
                            first.make_ascii_uppercase();
                        }
                        format!(
                            "{}: {method} {path} is meant as {} {}. OpenAI clients: the base URL is http://<gateway>/v1; Anthropic clients (ANTHROPIC_BASE_URL): http://<gateway>, without /v1.",
                            String::from_utf8_lossy(&fix),
                            route.method,
                            route.path
                        )
                    }
                    None => format!(
                        "Unknown route {method} {path}. fleetgate serves {}, GET /v1/models, and the open probes GET /healthz, /readyz and /health; no other route of vLLM's server is forwarded (docs/security.md). OpenAI clients: the base URL ends in /v1 (not /v1/v1, /api or a trailing path); Anthropic clients (ANTHROPIC_BASE_URL): the base URL without /v1.",
                        served_routes()
                    ),
                },
                "invalid_request_error",
                None,
                "unknown_url",
            ),
            ApiError::MethodNotAllowed {
                method,
                path,
                allow,
            } => (
                format!("{path} does not accept {method}; use {allow}."),
                "invalid_request_error",
                None,
                "method_not_allowed",
            ),
            ApiError::UnsupportedMediaType {
                got,
                multipart: false,
            } => (
                format!(
                    "The request body must be JSON: send `Content-Type: application/json` (got `{got}`)."
                ),
                "invalid_request_error",
                None,
                "unsupported_media_type",
            ),
            ApiError::UnsupportedMediaType {
                got,
                multipart: true,
            } => (
                format!(
                    "The request body must be `multipart/form-data` with an audio `file` and a `model` field (e.g. curl -F file=@speech.wav -F model=...); got `Content-Type: {got}`."
                ),
                "invalid_request_error",
                None,
                "unsupported_media_type",
            ),
            ApiError::BodyTooLarge { limit, setting } => (
                format!(
                    "The request body is larger than the gateway's limit of {limit} bytes ({setting})."
                ),
                "invalid_request_error",
                None,
                "request_too_large",
            ),
            ApiError::BodyTimeout { after_ms } => (
                format!(
                    "The request body did not arrive within {after_ms} ms (server.body_timeout_seconds): send the whole body at once, as the Content-Length says."
                ),
                "invalid_request_error",
                None,
                "body_timeout",
            ),
            ApiError::BodyStalled { after_ms } => (
                format!(
                    "The request body stopped arriving: nothing came for {after_ms} ms (server.body_idle_timeout_seconds). Send the body as the Content-Length says, without pauses; check a proxy in between that stalls uploads."
                ),
                "invalid_request_error",
                None,
                "body_timeout",
            ),
            ApiError::PendingBodies {
                scope: PendingScope::Gateway,
                limit,
            } => (
                format!(
                    "The gateway is receiving as many request bodies as it holds at once ({limit} bytes of bodies still arriving, server.max_pending_body_bytes); nothing was sent to a backend. Retry shortly."
                ),
                "server_error",
                None,
                "gateway_overloaded",
            ),
            ApiError::PendingBodies {
                scope: PendingScope::Key,
                limit,
            } => (
                format!(
                    "This key has as many request bodies still arriving as it may ({limit} bytes, server.max_pending_body_bytes_per_key; a body counts its Content-Length until it has arrived); nothing was sent to a backend. Send fewer uploads at once, or wait for the ones in progress."
                ),
                "rate_limit_error",
                None,
                "key_pending_bodies",
            ),
            ApiError::HeadersTooLarge(excess) => (
                match excess {
                    HeadExcess::Total { bytes, limit } => format!(
                        "The request's headers are too large to forward: as the backend would get them they come to {bytes} bytes, over the gateway's limit of {limit} (server.max_upstream_head_bytes, just below what the backends' HTTP servers accept). Send fewer or shorter headers; nothing was sent to a backend."
                    ),
                    HeadExcess::Value { name, bytes, limit } => format!(
                        "The header `{name}` is too large to forward: its value is {bytes} bytes, over the gateway's limit of {limit} per header (server.max_upstream_header_value_bytes, just below what the backends and the proxies in front of them accept). Shorten or drop it; nothing was sent to a backend."
                    ),
                    HeadExcess::Fields { count, limit } => format!(
                        "The request has {count} header fields; the gateway forwards at most {limit}. Send fewer headers; nothing was sent to a backend."
                    ),
                },
                "invalid_request_error",
                None,
                "request_header_fields_too_large",
            ),
            ApiError::BodyRead(detail) => (
                format!("The request body could not be read: {detail}."),
                "invalid_request_error",
                None,
                "body_read_error",
            ),
            ApiError::View(ViewError::InvalidJson(detail)) => (
                format!("The request body is not valid JSON: {detail}."),
                "invalid_request_error",
                None,
                "invalid_json",
            ),
            ApiError::View(ViewError::InvalidRequest { param, message }) => (
                message.clone(),
                "invalid_request_error",
                param.as_deref(),
                "invalid_value",
            ),
            ApiError::ModelNotFound { model, available } => (
                format!(
                    "The model `{model}` does not exist on this gateway. Available models: {available}. Base URL, key and model ID must change together; GET /v1/models lists the names to use."
                ),
                "invalid_request_error",
                Some("model"),
                "model_not_found",
            ),
            ApiError::NoBackend { model, detail } => (
                format!("No backend is available for model `{model}`: {detail}. Retry shortly."),
                "upstream_error",
                None,
                "no_backend_available",
            ),
            ApiError::BackendUnreachable {
                backend,
                cause,
                detail,
            } => (
                format!(
                    "Backend {backend} is unreachable: {} ({detail}).",
                    cause.describe()
                ),
                "upstream_error",
                None,
                "backend_unreachable",
            ),
            ApiError::UpstreamTimeout {
                backend,
                kind,
                after_ms,
            } => (
                format!(
                    "Backend {backend} did not answer in time: the {} timeout of {after_ms} ms fired (pools[].timeouts.{}_ms).",
                    kind.as_str().replace('_', "-"),
                    kind.as_str()
                ),
                "upstream_error",
                None,
                "upstream_timeout",
            ),
            ApiError::UpstreamStreamCut { backend } => (
                format!(
                    "Backend {backend} closed the stream before its end (`data: [DONE]`, `response.completed`, `message_stop`); the response is incomplete."
                ),
                "upstream_error",
                None,
                "upstream_stream_cut",
            ),
            ApiError::UpstreamLineTooLong { backend, limit } => (
                format!(
                    "Backend {backend} broke the SSE protocol: a line grew past {limit} bytes without its end (server.max_stream_line_bytes); the response is incomplete."
                ),
                "upstream_error",
                None,
                "upstream_protocol_error",
            ),
            ApiError::UpstreamStreamFailed { backend, detail } => (
                format!("Backend {backend} failed after the response started: {detail}."),
                "upstream_error",
                None,
                "upstream_stream_error",
            ),
            ApiError::ResponseNotFound { id, ttl_s } => (
                format!(
                    "Response `{id}` is not known to this gateway for this key: it was not created through it with this key, or more than {ttl_s} s ago (server.response_pin_ttl_s), or was forgotten for newer ones (server.response_pin_capacity) or at a restart, or was created through another replica that shares no state with this one (limits.shared = \"redis\" shares stored responses' backends). A stored response lives on the one backend that made it, and no other can answer for it."
                ),
                "invalid_request_error",
                Some("response_id"),
                "response_not_found",
            ),
            ApiError::ResponseUnavailable { id, why } => (
                format!(
                    "Response `{id}` is stored on a backend that {why}; no other backend holds it. Retry once that backend is back, or start over without `previous_response_id`."
                ),
                "server_error",
                None,
                "response_unavailable",
            ),
            ApiError::Shutdown { grace_ms } => (
                format!(
                    "The gateway is shutting down and its grace period of {grace_ms} ms ended before this response did; the response is incomplete. Retry the request (another replica, or this one once restarted, will take it)."
                ),
                "server_error",
                None,
                "gateway_shutdown",
            ),
            ApiError::Auth(f) => {
                let (kind, code, message) = f.describe();
                (message, kind, None, code)
            }
            // Every limit refuses with 429 (`LimitKind::error_kind`).
            ApiError::Limited(r) => {
                let kind = "rate_limit_error";
                let param = matches!(
                    r.kind,
                    crate::limits::LimitKind::KeyTokens
                        | crate::limits::LimitKind::KeyTokensTooLarge
                )
                .then_some("max_tokens");
                (r.message(), kind, param, r.code())
            }
            ApiError::QueueRefused(r) => {
                let kind = if r.status() == StatusCode::TOO_MANY_REQUESTS {
                    "rate_limit_error"
                } else {
                    "server_error"
                };
                (r.message(), kind, None, r.kind.code())
            }
            ApiError::Internal | ApiError::View(ViewError::Unlocatable) => (
                "The gateway hit an internal error; the details are in its log.".to_owned(),
                "server_error",
                None,
                "internal_error",
            ),
        }
    }

    /// Extra response header the error needs (`Allow` on 405, `WWW-Authenticate` on 401,
    /// `Retry-After` on 429).
    pub(crate) fn extra_header(&self) -> Option<(header::HeaderName, HeaderValue)> {
        match self {
            ApiError::MethodNotAllowed { allow, .. } => {
                Some((header::ALLOW, HeaderValue::from_static(allow)))
            }
            ApiError::Auth(AuthFailure::TooManyFailures { retry_after }) => {
                Some(self::retry_after(*retry_after))
            }
            ApiError::Limited(r) => r.retry_after.map(retry_after),
            ApiError::QueueRefused(r) => Some(retry_after(r.retry_after)),
            ApiError::PendingBodies { .. } => Some(retry_after(std::time::Duration::from_secs(1))),
            ApiError::Auth(f) if f.kind() == ErrorKind::Unauthenticated => Some((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fleetgate\""),
            )),
            _ => None,
        }
    }
}

/// `Retry-After` in whole seconds, rounded up: a client that waits this long will pass.
fn retry_after(d: std::time::Duration) -> (header::HeaderName, HeaderValue) {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    (header::RETRY_AFTER, HeaderValue::from(secs.max(1)))
}

impl From<ViewError> for ApiError {
    fn from(e: ViewError) -> Self {
        ApiError::View(e)
    }
}

/// Every forwarded route, `METHOD /path` in the endpoint table's order, for the unknown-route
/// message (made once, on the first such error).
fn served_routes() -> &'static str {
    static LIST: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        fleetgate_protocol::endpoint::TABLE
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
            .join(", ")
    });
    &LIST
}

impl ApiError {
    /// The queue step's refusal, or no backend of the pool able to take the request.
    pub(crate) fn from_queue(e: QueueError, pool: &Pool) -> ApiError {
        match e {
            QueueError::NoUsableBackend => ApiError::no_backend(pool),
            QueueError::Refused(r) => ApiError::QueueRefused(r),
        }
    }

    fn no_backend(pool: &Pool) -> ApiError {
        if pool.backends.is_empty() {
            return ApiError::NoBackend {
                model: pool.model.to_string(),
                detail: "it has no backends right now: its DNS-discovered entries have found no address yet (see GET /admin/backends and the gateway's log)".to_owned(),
            };
        }
        ApiError::NoBackend {
            model: pool.model.to_string(),
            detail: format!(
                "none of its {} backend(s) can take requests: {}",
                pool.backends.len(),
                pool.backends
                    .iter()
                    .map(|b| {
                        let why = match b.state() {
                            crate::pool::BackendState::Down => {
                                "failed its last health check or connection"
                            }
                            crate::pool::BackendState::Draining => "draining",
                            crate::pool::BackendState::Ejected => {
                                "ejected after consecutive failures"
                            }
                            crate::pool::BackendState::Warming => "warming up",
                            crate::pool::BackendState::Removed => "removed by a reload",
                            crate::pool::BackendState::Misconfigured => {
                                "refuses the gateway's upstream_api_key: see GET /admin/backends"
                            }
                            _ => "at capacity",
                        };
                        format!("{} ({why})", b.shown)
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped() {
        let e = ApiError::ModelNotFound {
            model: "old".into(),
            available: "`qwen32b`".into(),
        };
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert!(v["error"]["message"].as_str().unwrap().contains("qwen32b"));
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
    }
}
