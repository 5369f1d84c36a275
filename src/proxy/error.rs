//! Every error the gateway itself answers with, and its one conversion into an OpenAI-format
//! body (`{"error":{"message","type","param","code"}}`) with the right status. Whose fault it is
//! decides the status: the client's → 4xx saying what to change; a backend's → 502/503/504
//! naming the backend and the cause; ours → 500 with the detail in the log only.

use std::borrow::Cow;

use bytes::Bytes;

use crate::auth::AuthFailure;
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

/// Why a backend could not be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectCause {
    Refused,
    Dns,
    Tls,
    ConnectTimeout,
    Reset,
    Other,
}

impl ConnectCause {
    pub fn describe(self) -> &'static str {
        match self {
            ConnectCause::Refused => {
                "connection refused (is the server running and listening on that port?)"
            }
            ConnectCause::Dns => "DNS lookup failed (check the host name)",
            ConnectCause::Tls => {
                "TLS handshake failed (check https vs http, the certificate and pools[].ca_file)"
            }
            ConnectCause::ConnectTimeout => "connect timed out (host unreachable or firewalled?)",
            ConnectCause::Reset => "the connection was closed before a response arrived",
            ConnectCause::Other => "connection failed",
        }
    }
}

/// Which upstream timeout fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutKind {
    FirstToken,
    Idle,
    Total,
}

impl TimeoutKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TimeoutKind::FirstToken => "first_token",
            TimeoutKind::Idle => "idle",
            TimeoutKind::Total => "total",
        }
    }
}

/// Error kind without payload: a metric and log label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    RouteNotFound,
    MethodNotAllowed,
    UnsupportedMediaType,
    BodyTooLarge,
    BodyRead,
    InvalidJson,
    InvalidRequest,
    ModelNotFound,
    NoBackend,
    BackendUnreachable,
    UpstreamTimeout,
    UpstreamError,
    UpstreamStreamError,
    ClientDisconnected,
    Unauthenticated,
    Forbidden,
    AuthThrottled,
    RateLimited,
    QueueFull,
    QueueTimeout,
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 21] = [
        ErrorKind::RouteNotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::BodyTooLarge,
        ErrorKind::BodyRead,
        ErrorKind::InvalidJson,
        ErrorKind::InvalidRequest,
        ErrorKind::ModelNotFound,
        ErrorKind::NoBackend,
        ErrorKind::BackendUnreachable,
        ErrorKind::UpstreamTimeout,
        ErrorKind::UpstreamError,
        ErrorKind::UpstreamStreamError,
        ErrorKind::ClientDisconnected,
        ErrorKind::Unauthenticated,
        ErrorKind::Forbidden,
        ErrorKind::AuthThrottled,
        ErrorKind::RateLimited,
        ErrorKind::QueueFull,
        ErrorKind::QueueTimeout,
        ErrorKind::Internal,
    ];

    /// Position in `ALL` (a metric label index).
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::RouteNotFound => "route_not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::BodyRead => "body_read",
            ErrorKind::InvalidJson => "invalid_json",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::NoBackend => "no_backend",
            ErrorKind::BackendUnreachable => "backend_unreachable",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamError => "upstream_error",
            ErrorKind::UpstreamStreamError => "upstream_stream_error",
            ErrorKind::ClientDisconnected => "client_disconnected",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::AuthThrottled => "auth_throttled",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::QueueTimeout => "queue_timeout",
            ErrorKind::Internal => "internal",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("unknown route {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed {
        method: String,
        path: &'static str,
        allow: &'static str,
    },
    #[error("content type `{got}` is not JSON")]
    UnsupportedMediaType { got: String },
    #[error("body larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    #[error("{message}")]
    InvalidRequest {
        param: Option<Cow<'static, str>>,
        message: String,
    },
    #[error("model `{model}` not found")]
    ModelNotFound { model: String, available: String },
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
    #[error("authentication: {}", .0.reason())]
    Auth(AuthFailure),
    #[error("limit: {}", .0.refusal.code())]
    Limited(Box<Limited>),
    #[error("internal error")]
    Internal,
}

/// A request refused by a rate limit or by the admission queue, for the model it asked for.
#[derive(Debug, Clone)]
pub struct Limited {
    pub refusal: crate::limits::Refusal,
    pub model: std::sync::Arc<str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// Serialise an OpenAI-format error body.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Bytes {
    let env = Envelope {
        error: Body {
            message,
            kind,
            param,
            code,
        },
    };
    // Serialising plain strings into a Vec cannot fail.
    Bytes::from(serde_json::to_vec(&env).unwrap_or_default())
}

impl ApiError {
    pub fn limited(refusal: crate::limits::Refusal, model: &std::sync::Arc<str>) -> Self {
        ApiError::Limited(Box::new(Limited {
            refusal,
            model: model.clone(),
        }))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyRead(_) => StatusCode::BAD_REQUEST,
            ApiError::InvalidJson(_) => StatusCode::BAD_REQUEST,
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::NoBackend { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BackendUnreachable { .. } => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Auth(f) => {
                StatusCode::from_u16(f.status()).unwrap_or(StatusCode::UNAUTHORIZED)
            }
            ApiError::Limited(l) => {
                StatusCode::from_u16(l.refusal.status()).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
            }
            ApiError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            ApiError::RouteNotFound { .. } => ErrorKind::RouteNotFound,
            ApiError::MethodNotAllowed { .. } => ErrorKind::MethodNotAllowed,
            ApiError::UnsupportedMediaType { .. } => ErrorKind::UnsupportedMediaType,
            ApiError::BodyTooLarge { .. } => ErrorKind::BodyTooLarge,
            ApiError::BodyRead(_) => ErrorKind::BodyRead,
            ApiError::InvalidJson(_) => ErrorKind::InvalidJson,
            ApiError::InvalidRequest { .. } => ErrorKind::InvalidRequest,
            ApiError::ModelNotFound { .. } => ErrorKind::ModelNotFound,
            ApiError::NoBackend { .. } => ErrorKind::NoBackend,
            ApiError::BackendUnreachable { .. } => ErrorKind::BackendUnreachable,
            ApiError::UpstreamTimeout { .. } => ErrorKind::UpstreamTimeout,
            ApiError::Auth(f) if f.status() == 403 => ErrorKind::Forbidden,
            ApiError::Auth(f) if f.status() == 429 => ErrorKind::AuthThrottled,
            ApiError::Auth(_) => ErrorKind::Unauthenticated,
            ApiError::Limited(l) => match l.refusal.kind {
                crate::limits::LimitKind::QueueFull => ErrorKind::QueueFull,
                crate::limits::LimitKind::QueueTimeout => ErrorKind::QueueTimeout,
                _ => ErrorKind::RateLimited,
            },
            ApiError::Internal => ErrorKind::Internal,
        }
    }

    /// The OpenAI-format body: message, type, param, code.
    pub fn body(&self) -> Bytes {
        let (message, kind, param, code): (String, &str, Option<&str>, &str) = match self {
            ApiError::RouteNotFound { method, path } => (
                format!(
                    "Unknown route {method} {path}. fleetgate serves POST /v1/chat/completions, POST /v1/completions and GET /v1/models; check that the client's base URL ends in /v1 (not /v1/v1, /api or a trailing path)."
                ),
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
            ApiError::UnsupportedMediaType { got } => (
                format!(
                    "The request body must be JSON: send `Content-Type: application/json` (got `{got}`)."
                ),
                "invalid_request_error",
                None,
                "unsupported_media_type",
            ),
            ApiError::BodyTooLarge { limit } => (
                format!(
                    "The request body is larger than the gateway's limit of {limit} bytes (server.max_body_bytes)."
                ),
                "invalid_request_error",
                None,
                "request_too_large",
            ),
            ApiError::BodyRead(detail) => (
                format!("The request body could not be read: {detail}."),
                "invalid_request_error",
                None,
                "body_read_error",
            ),
            ApiError::InvalidJson(detail) => (
                format!("The request body is not valid JSON: {detail}."),
                "invalid_request_error",
                None,
                "invalid_json",
            ),
            ApiError::InvalidRequest { param, message } => (
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
            ApiError::Auth(f) => {
                let (kind, code, message) = f.describe();
                return error_body(&message, kind, None, Some(code));
            }
            ApiError::Limited(l) => {
                let r = &l.refusal;
                let kind = if r.status() == 429 {
                    "rate_limit_error"
                } else {
                    "server_error"
                };
                let param = matches!(
                    r.kind,
                    crate::limits::LimitKind::KeyTokens
                        | crate::limits::LimitKind::KeyTokensTooLarge
                )
                .then_some("max_tokens");
                return error_body(&r.message(Some(&l.model)), kind, param, Some(r.code()));
            }
            ApiError::Internal => (
                "The gateway hit an internal error; the details are in its log.".to_owned(),
                "server_error",
                None,
                "internal_error",
            ),
        };
        error_body(&message, kind, param, Some(code))
    }

    /// Extra response header the error needs (`Allow` on 405, `WWW-Authenticate` on 401,
    /// `Retry-After` on 429).
    pub fn extra_header(&self) -> Option<(header::HeaderName, HeaderValue)> {
        match self {
            ApiError::MethodNotAllowed { allow, .. } => {
                Some((header::ALLOW, HeaderValue::from_static(allow)))
            }
            ApiError::Auth(AuthFailure::TooManyFailures { retry_after }) => Some((
                header::RETRY_AFTER,
                HeaderValue::from(retry_after.as_secs().max(1)),
            )),
            ApiError::Limited(l) => l.refusal.retry_after.map(|d| {
                // Whole seconds, rounded up: a client that waits this long will pass.
                let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                (header::RETRY_AFTER, HeaderValue::from(secs.max(1)))
            }),
            ApiError::Auth(f) if f.status() == 401 => Some((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fleetgate\""),
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_listed_in_order() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }

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
