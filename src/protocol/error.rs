//! OpenAI's error wire format, shared by every layer: the payload-free error kinds (metric and
//! log labels, and the one table from a kind to its HTTP status) and the serialiser of the
//! `{"error":{"message","type","param","code"}}` body, as a response or as an SSE event.

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

/// Error kind without payload: a metric and log label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    RouteNotFound,
    MethodNotAllowed,
    UnsupportedMediaType,
    BodyTooLarge,
    HeadersTooLarge,
    BodyRead,
    BodyTimeout,
    InvalidJson,
    InvalidRequest,
    ModelNotFound,
    NoBackend,
    BackendUnreachable,
    UpstreamTimeout,
    UpstreamError,
    UpstreamStreamError,
    /// A backend broke the wire protocol (an SSE line longer than the relay carries).
    UpstreamProtocol,
    ClientDisconnected,
    Unauthenticated,
    Forbidden,
    AuthThrottled,
    RateLimited,
    QueueFull,
    QueueTimeout,
    Shutdown,
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 25] = [
        ErrorKind::RouteNotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::BodyTooLarge,
        ErrorKind::HeadersTooLarge,
        ErrorKind::BodyRead,
        ErrorKind::BodyTimeout,
        ErrorKind::InvalidJson,
        ErrorKind::InvalidRequest,
        ErrorKind::ModelNotFound,
        ErrorKind::NoBackend,
        ErrorKind::BackendUnreachable,
        ErrorKind::UpstreamTimeout,
        ErrorKind::UpstreamError,
        ErrorKind::UpstreamStreamError,
        ErrorKind::UpstreamProtocol,
        ErrorKind::ClientDisconnected,
        ErrorKind::Unauthenticated,
        ErrorKind::Forbidden,
        ErrorKind::AuthThrottled,
        ErrorKind::RateLimited,
        ErrorKind::QueueFull,
        ErrorKind::QueueTimeout,
        ErrorKind::Shutdown,
        ErrorKind::Internal,
    ];

    /// Position in `ALL` (a metric label index).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The HTTP status of an error of this kind: the one table. Whose fault decides it: the
    /// client's → 4xx, a backend's → 502/503/504, the gateway's own → 500.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::RouteNotFound | ErrorKind::ModelNotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorKind::BodyRead | ErrorKind::InvalidJson | ErrorKind::InvalidRequest => {
                StatusCode::BAD_REQUEST
            }
            // Never sent (the client is gone); the client ended it, so it is a 4xx.
            ErrorKind::ClientDisconnected => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::AuthThrottled | ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            // The gateway stopping: the client should retry elsewhere or a moment later.
            ErrorKind::NoBackend
            | ErrorKind::QueueFull
            | ErrorKind::QueueTimeout
            | ErrorKind::Shutdown => StatusCode::SERVICE_UNAVAILABLE,
            // A backend's own error status is relayed as it is; the kind alone says 502.
            ErrorKind::BackendUnreachable
            | ErrorKind::UpstreamError
            | ErrorKind::UpstreamStreamError
            | ErrorKind::UpstreamProtocol => StatusCode::BAD_GATEWAY,
            ErrorKind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::RouteNotFound => "route_not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::HeadersTooLarge => "headers_too_large",
            ErrorKind::BodyRead => "body_read",
            ErrorKind::BodyTimeout => "body_timeout",
            ErrorKind::InvalidJson => "invalid_json",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::NoBackend => "no_backend",
            ErrorKind::BackendUnreachable => "backend_unreachable",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamError => "upstream_error",
            ErrorKind::UpstreamStreamError => "upstream_stream_error",
            ErrorKind::UpstreamProtocol => "upstream_protocol_error",
            ErrorKind::ClientDisconnected => "client_disconnected",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::AuthThrottled => "auth_throttled",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::QueueTimeout => "queue_timeout",
            ErrorKind::Shutdown => "shutdown",
            ErrorKind::Internal => "internal",
        }
    }
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

/// An error body as the last events of an SSE stream: `data: <body>` then `data: [DONE]`.
/// `partial_line`: part of an event was already relayed; a blank line closes it first so the
/// error event parses on its own.
pub fn sse_error_event(body: &[u8], partial_line: bool) -> Bytes {
    let mut out = Vec::with_capacity(body.len() + 40);
    if partial_line {
        out.extend_from_slice(b"\n\n");
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(body);
    out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_listed_in_order() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }
}
