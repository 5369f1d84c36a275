//! The error wire formats, shared by every layer: the payload-free error kinds (metric and
//! log labels, and the one table from a kind to its HTTP status), the serialiser of OpenAI's
//! `{"error":{"message","type","param","code"}}` body, as a response or as an SSE event, and
//! Anthropic's `{"type":"error","error":{"type","message"}}` with its own statuses (529 when
//! overloaded) for the routes that speak it.

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

use super::Dialect;

/// Error kind without payload: a metric and log label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    RouteNotFound,
    /// A stored response this gateway did not pin (or no longer does).
    ResponseNotFound,
    /// A stored response's backend cannot take requests now.
    ResponseUnavailable,
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
    /// The gateway holds as many bytes of bodies still arriving as it takes.
    Overloaded,
    Shutdown,
    Internal,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 28] = [
        ErrorKind::RouteNotFound,
        ErrorKind::ResponseNotFound,
        ErrorKind::ResponseUnavailable,
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
        ErrorKind::Overloaded,
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
            ErrorKind::RouteNotFound | ErrorKind::ModelNotFound | ErrorKind::ResponseNotFound => {
                StatusCode::NOT_FOUND
            }
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
            | ErrorKind::ResponseUnavailable
            | ErrorKind::QueueFull
            | ErrorKind::QueueTimeout
            | ErrorKind::Overloaded
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
            ErrorKind::ResponseNotFound => "response_not_found",
            ErrorKind::ResponseUnavailable => "response_unavailable",
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
            ErrorKind::Overloaded => "overloaded",
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

/// One error the gateway sends, before it takes its dialect's shape.
#[derive(Debug, Clone, Copy)]
pub struct Shaped<'a> {
    pub status: StatusCode,
    pub message: &'a str,
    /// OpenAI's `type` (`invalid_request_error`, `rate_limit_error`, ...).
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

/// Anthropic's status for an error of `status`: 503 (overloaded, no backend, shutting down)
/// is its 529 `overloaded_error`, which its SDKs retry; the others stay.
pub fn anthropic_status(status: StatusCode) -> StatusCode {
    if status == StatusCode::SERVICE_UNAVAILABLE {
        StatusCode::from_u16(529).unwrap_or(status)
    } else {
        status
    }
}

/// Anthropic's error `type` for a status (its SDKs raise the matching exception by status).
pub fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

#[derive(Serialize)]
struct AnthropicEnvelope<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicBody<'a>,
}

#[derive(Serialize)]
struct AnthropicBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

/// Anthropic's error body: `{"type":"error","error":{"type","message"}}`.
pub fn anthropic_body(kind: &str, message: &str) -> Bytes {
    let env = AnthropicEnvelope {
        kind: "error",
        error: AnthropicBody { kind, message },
    };
    Bytes::from(serde_json::to_vec(&env).unwrap_or_default())
}

/// A Responses stream's `error` event data: `{"type":"error","code","message","param"}`.
#[derive(Serialize)]
struct ResponsesError<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    code: Option<&'a str>,
    message: &'a str,
    param: Option<&'a str>,
}

impl Shaped<'_> {
    /// The status the client gets in `dialect`.
    #[cfg(test)]
    pub(crate) fn status_in(&self, dialect: Dialect) -> StatusCode {
        if dialect.anthropic() {
            anthropic_status(self.status)
        } else {
            self.status
        }
    }

    /// The whole-answer body in `dialect`.
    pub fn body_in(&self, dialect: Dialect) -> Bytes {
        if dialect.anthropic() {
            anthropic_body(anthropic_type(self.status), self.message)
        } else {
            error_body(self.message, self.kind, self.param, self.code)
        }
    }

    /// The error as the last events of a stream in `dialect` whose head already went out:
    /// chat ends with `data: <OpenAI body>` and `data: [DONE]`; a Responses stream with an
    /// `error` event, an Anthropic one with `event: error` (its SDKs raise on it).
    /// `partial_line`: part of an event was already relayed; a blank line closes it first so
    /// the error event parses on its own.
    pub fn sse_in(&self, dialect: Dialect, partial_line: bool) -> Bytes {
        match dialect {
            Dialect::Chat | Dialect::Json => sse_error_event(&self.body_in(dialect), partial_line),
            Dialect::Responses => {
                let data = serde_json::to_vec(&ResponsesError {
                    kind: "error",
                    code: self.code,
                    message: self.message,
                    param: self.param,
                })
                .unwrap_or_default();
                named_event(b"error", &data, partial_line)
            }
            Dialect::Anthropic => named_event(b"error", &self.body_in(dialect), partial_line),
        }
    }
}

/// `event: <name>` + `data: <data>`, closing a partial line first.
fn named_event(name: &[u8], data: &[u8], partial_line: bool) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + name.len() + 24);
    if partial_line {
        out.extend_from_slice(b"\n\n");
    }
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name);
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The message of an error body in either shape (OpenAI's `error.message`, Anthropic's
/// `error.message`, a Responses `error` event's `message`), for re-shaping a backend's error
/// into a stream's dialect. Cold path.
pub fn message_of(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("error")
        .and_then(|e| e.get("message").or(Some(e)))
        .or_else(|| v.get("message"))
        .and_then(|m| m.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_errors_are_shaped_and_mapped() {
        let e = Shaped {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "queue full",
            kind: "server_error",
            param: None,
            code: Some("queue_full"),
        };
        assert_eq!(e.status_in(Dialect::Anthropic).as_u16(), 529);
        assert_eq!(e.status_in(Dialect::Chat).as_u16(), 503);
        let v: serde_json::Value = serde_json::from_slice(&e.body_in(Dialect::Anthropic)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type":"error","error":{"type":"overloaded_error","message":"queue full"}})
        );
        let sse = e.sse_in(Dialect::Anthropic, true);
        assert!(
            sse.starts_with(b"\n\nevent: error\ndata: {\"type\":\"error\""),
            "{sse:?}"
        );
        let sse = e.sse_in(Dialect::Responses, false);
        assert_eq!(
            &sse[..],
            &b"event: error\ndata: {\"type\":\"error\",\"code\":\"queue_full\",\"message\":\"queue full\",\"param\":null}\n\n"[..]
        );
        for (status, t) in [
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (400, "invalid_request_error"),
            (500, "api_error"),
            (502, "api_error"),
        ] {
            assert_eq!(anthropic_type(StatusCode::from_u16(status).unwrap()), t);
        }
        assert_eq!(
            message_of(&anthropic_body("api_error", "m")).as_deref(),
            Some("m")
        );
        assert_eq!(
            message_of(&error_body("n", "t", None, None)).as_deref(),
            Some("n")
        );
    }

    #[test]
    fn kinds_are_listed_in_order() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }
}
