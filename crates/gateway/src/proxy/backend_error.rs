//! A backend's error answer, rewrapped for the client: OpenAI's shape kept as it came or
//! wrapped (vLLM's bare `{"error":"Unauthorized"}`, HTML), Anthropic's on its routes, with whose
//! fault it is (the backend refusing the gateway's own key is a 502, not the client's 401).

use std::time::Instant;

use bytes::Bytes;
use http::header;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::exchange::Exchange;
use super::headers::{APPLICATION_JSON, X_REQUEST_ID};
use crate::pool::upstream_conn::UpstreamBody;
use crate::pool::{Backend, Pool};
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::{BodyKind, Family};
use fleetgate_protocol::error::{ErrorKind, error_body};

/// Largest error body read from a backend to rewrap it.
const MAX_UPSTREAM_ERROR_BODY: usize = 64 * 1024;

/// A backend's error answer, its body in OpenAI format (rewrapped when it is not), with the
/// backend's status and `Retry-After`.
pub(super) async fn error_answer(
    pool: &Pool,
    backend: &Backend,
    head: &http::response::Parts,
    upstream: UpstreamBody,
    deadline: Instant,
    ex: &mut Exchange,
) -> Response<Bytes> {
    ex.record.error = Some(ErrorKind::UpstreamError);
    let bytes = read_error_body(upstream, deadline).await;
    let (mut body, wrapped) = openai_error_body(
        head.status,
        &bytes,
        &backend.shown,
        &pool.model,
        ex.record.endpoint,
    );
    // The backend refusing the gateway's credentials is the gateway's configuration at fault:
    // a 502, so clients do not read it as their own key being wrong (OpenAI SDKs raise
    // AuthenticationError on a 401).
    let mut status = if backend_refused_gateway(head.status) {
        StatusCode::BAD_GATEWAY
    } else {
        head.status
    };
    if ex.record.endpoint.is_some_and(|e| e.dialect().anthropic()) {
        // An Anthropic client gets Anthropic's shape: the backend's own when it wrote one,
        // else the message re-shaped, with Anthropic's status (529 for overloaded).
        if !is_anthropic_error(&bytes) || backend_refused_gateway(head.status) {
            let message = fleetgate_protocol::error::message_of(&body).unwrap_or_default();
            body = fleetgate_protocol::error::anthropic_body(
                fleetgate_protocol::error::anthropic_type(status),
                &message,
            );
        } else {
            body = bytes.clone();
        }
        status = fleetgate_protocol::error::anthropic_status(status);
    }
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    h.insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    if let Some(ra) = head.headers.get(header::RETRY_AFTER) {
        h.insert(header::RETRY_AFTER, ra.clone());
    }
    if let Some(a) = &ex.hold {
        a.headers.write(h);
    }
    if wrapped {
        tracing::debug!(backend = %backend.base, status = head.status.as_u16(), "wrapped a non-OpenAI error body");
    }
    resp
}

async fn read_error_body(body: UpstreamBody, deadline: Instant) -> Bytes {
    let limited = Limited::new(body, MAX_UPSTREAM_ERROR_BODY);
    match tokio::time::timeout_at(deadline.into(), limited.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        _ => Bytes::new(),
    }
}

/// `{"type":"error","error":{"type":...,"message":...}}`: Anthropic's error shape.
fn is_anthropic_error(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Inner {
        #[serde(rename = "type")]
        _kind: String,
        #[serde(rename = "message")]
        _message: String,
    }
    #[derive(serde::Deserialize)]
    struct Outer {
        #[serde(rename = "type")]
        kind: String,
        #[serde(rename = "error")]
        _error: Inner,
    }
    serde_json::from_slice::<Outer>(body).is_ok_and(|o| o.kind == "error")
}

/// The backend refused the gateway's own credentials (`pools[].upstream_api_key`).
fn backend_refused_gateway(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::PROXY_AUTHENTICATION_REQUIRED
    )
}

/// Keep a backend's OpenAI-shaped error body as it is; wrap anything else (vLLM's
/// `{"error":"Unauthorized"}`, the old flat `{"object":"error",...}`, HTML) into that shape.
/// A wrapped 404 on a tokenizer endpoint is the server's "no such route": it does not offer
/// tokenization (an unknown model comes OpenAI-shaped from vLLM, and passes unchanged).
fn openai_error_body(
    status: StatusCode,
    body: &[u8],
    backend: &str,
    model: &str,
    endpoint: Option<Endpoint>,
) -> (Bytes, bool) {
    #[derive(serde::Deserialize)]
    struct Probe {
        error: Option<serde_json::Value>,
        message: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
        code: Option<serde_json::Value>,
        /// FastAPI's own 404 (`{"detail": "Not Found"}`): no such route on this server.
        detail: Option<serde_json::Value>,
    }
    let parsed: Option<Probe> = serde_json::from_slice(body).ok();
    // A backend's 401/403 is about the gateway's own credentials, never the client's key: it
    // is always rewrapped (as a 502, `backend_auth_failed`), even when OpenAI-shaped.
    let gateway_credentials = backend_refused_gateway(status);
    let openai_message = match &parsed {
        Some(Probe {
            error: Some(serde_json::Value::Object(obj)),
            ..
        }) => obj.get("message").and_then(|m| m.as_str()),
        _ => None,
    };
    let openai_message = match openai_message {
        Some(_) if !gateway_credentials => return (Bytes::copy_from_slice(body), false),
        m => m.map(str::to_owned),
    };
    let no_route = status == StatusCode::NOT_FOUND
        && parsed
            .as_ref()
            .is_some_and(|p| p.detail.as_ref().and_then(|d| d.as_str()) == Some("Not Found"));
    let reason = status.canonical_reason().unwrap_or("error");
    let code = status.as_u16().to_string();
    let inner = match (openai_message, parsed) {
        (Some(m), _) => m,
        (
            None,
            Some(Probe {
                error: Some(serde_json::Value::String(s)),
                ..
            }),
        ) => s,
        (
            None,
            Some(Probe {
                message: Some(m),
                kind,
                code: c,
                ..
            }),
        ) => {
            // The old flat vLLM shape: keep its type/code in the message.
            let extra = [kind, c.map(|c| c.to_string())]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(", ");
            if extra.is_empty() {
                m
            } else {
                format!("{m} ({extra})")
            }
        }
        _ => {
            let text = String::from_utf8_lossy(body);
            let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
            let short: String = text.chars().take(200).collect();
            if short.is_empty() {
                reason.to_owned()
            } else {
                format!("non-JSON body: {short}")
            }
        }
    };
    let tokenizer = endpoint.filter(|e| e.family() == Family::Tokenize);
    // A route vLLM registers by the kind of model it serves: the pooling routes on a
    // generative model, or the generating ones on a pooling model.
    let wrong_kind =
        endpoint.filter(|e| no_route && tokenizer.is_none() && e.needs().body != BodyKind::None);
    let hint = match (status.as_u16(), tokenizer, wrong_kind) {
        _ if gateway_credentials => format!(
            " The backend refused the gateway's own credentials: check pools[].upstream_api_key for model `{model}` (this is not about your key)."
        ),
        (404, None, Some(e)) => not_served_hint(e, model),
        (404, Some(e), _) => format!(
            " The backend does not offer tokenization: it has no POST {} (vLLM serves /tokenize and /detokenize at its root; other OpenAI-compatible servers may not). Tokenize for model `{model}` with its own tokenizer instead, or ask the operator for a vLLM backend.",
            e.path()
        ),
        (404, None, None) => format!(
            " The backend does not serve this path or model: check the backend's served model name (pools[].served_model_name for `{model}`)."
        ),
        _ => String::new(),
    };
    let message = if wrong_kind.is_some() && !gateway_credentials && tokenizer.is_none() {
        // The clear reason first; the backend's own words (a bare "Not Found") after it.
        format!(
            "{} (Backend {backend} answered {} {reason}: {inner}.)",
            hint.trim_start(),
            status.as_u16()
        )
    } else {
        format!(
            "Backend {backend} answered {} {reason}: {inner}.{hint}",
            status.as_u16()
        )
    };
    let kind = if status.is_server_error() || gateway_credentials {
        "upstream_error"
    } else {
        "invalid_request_error"
    };
    let code = match (status.as_u16(), tokenizer) {
        _ if gateway_credentials => "backend_auth_failed",
        (404, Some(_)) => "tokenization_unavailable",
        (404, None) if wrong_kind.is_some() => "endpoint_not_supported",
        _ => &code,
    };
    (error_body(&message, kind, None, Some(code)), true)
}

/// What a client is told when model `model`'s backend has no route for `e`: vLLM serves the
/// pooling routes only for a pooling model, and the generating ones only for a generative one.
fn not_served_hint(e: Endpoint, model: &str) -> String {
    let path = e.path();
    if e.family().pools() {
        format!(
            " Model `{model}` does not serve POST {path}: its backends run a generative model, and vLLM serves {path} only for a pooling model (`vllm serve --runner pooling`, an embedding, reranking or classification model). Send this request to such a model (GET /v1/models lists the gateway's models)."
        )
    } else {
        format!(
            " Model `{model}` does not serve POST {path}: its backends run a pooling model (`vllm serve --runner pooling`: embeddings, rerank, score, classify and pooling only), or a server without this API. Send generation requests to a generative model (GET /v1/models lists the gateway's models)."
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wrap(status: u16, body: &str) -> serde_json::Value {
        let (b, _) = openai_error_body(
            StatusCode::from_u16(status).unwrap(),
            body.as_bytes(),
            "http://b:1",
            "m",
            Some(Endpoint::Chat),
        );
        serde_json::from_slice(&b).unwrap()
    }

    #[test]
    fn wraps_non_openai_bodies() {
        let v = wrap(401, r#"{"error":"Unauthorized"}"#);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("Unauthorized") && msg.contains("upstream_api_key"),
            "{msg}"
        );
        assert_eq!(v["error"]["code"], "backend_auth_failed");
        assert_eq!(v["error"]["type"], "upstream_error");
        // Rewrapped even when OpenAI-shaped: its code would read as the client's key.
        let v = wrap(
            401,
            r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#,
        );
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("Incorrect API key provided") && msg.contains("not about your key"),
            "{msg}"
        );
        assert_eq!(v["error"]["code"], "backend_auth_failed");
        let v = wrap(
            400,
            r#"{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}"#,
        );
        assert!(v["error"]["message"].as_str().unwrap().contains("too long"));
        let v = wrap(502, "<html><body>Bad Gateway</body></html>");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Bad Gateway")
        );
        assert_eq!(v["error"]["type"], "upstream_error");
    }

    #[test]
    fn a_missing_tokenizer_route_says_so() {
        let (b, wrapped) = openai_error_body(
            StatusCode::NOT_FOUND,
            br#"{"detail":"Not Found"}"#,
            "http://b:1",
            "m",
            Some(Endpoint::Tokenize),
        );
        assert!(wrapped);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("does not offer tokenization") && msg.contains("POST /tokenize"),
            "{msg}"
        );
        assert_eq!(v["error"]["code"], "tokenization_unavailable");
        // vLLM's own "no such model" is OpenAI-shaped: it passes unchanged.
        let body = r#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
        let (b, wrapped) = openai_error_body(
            StatusCode::NOT_FOUND,
            body.as_bytes(),
            "b",
            "m",
            Some(Endpoint::Detokenize),
        );
        assert!(!wrapped);
        assert_eq!(&b[..], body.as_bytes());
    }

    #[test]
    fn keeps_openai_bodies() {
        let body = r#"{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}"#;
        let (b, wrapped) =
            openai_error_body(StatusCode::BAD_REQUEST, body.as_bytes(), "b", "m", None);
        assert!(!wrapped);
        assert_eq!(&b[..], body.as_bytes());
    }
}
