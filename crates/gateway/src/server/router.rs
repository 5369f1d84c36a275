//! The HTTP router of the API listener: the open routes (`/healthz`, `/readyz` and vLLM's `/health`,
//! `/`), then the key,
//! then the endpoint table (`protocol::endpoint`) and `GET /v1/models`; anything else is 404.
//!
//! A 405 and the authentication refusals speak the route's dialect (Anthropic's on
//! `/v1/messages`); an unknown path gets OpenAI's 404, naming every route the table forwards.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;

use super::AppState;
use crate::auth::AuthFailure;
use crate::proxy;
use crate::proxy::ApiError;
use crate::proxy::relay::GatewayBody;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::{Dialect, endpoint, trace_context};

pub(super) static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");

pub(super) fn json(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    r
}

/// Dispatch one request from `peer` by method and path.
/// `arrival`: when the request's first bytes reached the host (the kernel's stamp), where the
/// platform stamps them.
pub(crate) async fn dispatch(
    state: Arc<AppState>,
    req: Request<Incoming>,
    peer: SocketAddr,
    arrival: Option<Instant>,
) -> Response<GatewayBody> {
    let received = Instant::now();
    let path = req.uri().path();
    // The endpoint table (`protocol::endpoint`): the only routes forwarded.
    let found = endpoint::lookup(path);
    let endpoint = found.map(|f| f.row);
    let id: Option<Box<str>> = found.and_then(|f| f.id).map(Box::from);
    // The gateway's own errors on a route speak its protocol (Anthropic's on /v1/messages).
    let dialect = endpoint.map_or(Dialect::Chat, |r| r.endpoint.dialect());
    // Open routes: no record, no auth.
    match (path, req.method()) {
        ("/healthz", &Method::GET | &Method::HEAD) => {
            return json(StatusCode::OK, r#"{"status":"ok"}"#);
        }
        // vLLM's own probe path, open as vLLM's is: a load balancer or script written for a
        // vLLM server asks the gateway whether it can serve (the same answer as `/readyz`).
        ("/readyz" | "/health", &Method::GET | &Method::HEAD) => return readyz(&state),
        // Claude Code warms its connection with `HEAD <base URL>` (no key): answered, not
        // counted as a failed authentication of the address.
        ("/", &Method::HEAD | &Method::GET) => {
            return json(StatusCode::OK, r#"{"status":"ok"}"#);
        }
        _ => {}
    }
    let request_id = proxy::headers::request_id(req.headers());
    let mut record = RequestRecord::new(received, request_id, state.proxy.recorder.clone());
    record.client_addr = Some(peer);
    // The request's trace: with tracing on, the client's or a new one (the backend gets a
    // `traceparent` naming the gateway's span); off, the client's, when it names one (its
    // `traceparent` goes to the backend as it came). On the record's row and event.
    match state.proxy.recorder.tracing() {
        Some(p) => {
            let scope = p.begin(req.headers(), received);
            record.trace_id = Some(scope.trace_id);
            record.otel = Some(scope);
        }
        None => record.trace_id = trace_context::parent_of(req.headers()).map(|p| p.trace_id),
    }
    // Counted under its route's family from the start (a refused key included).
    record.endpoint = endpoint.map(|r| r.endpoint);
    if let Some(at) = arrival {
        record.timeline.stamp_kernel_arrival(at);
    }
    let method = req.method().clone();
    let fail = |err: ApiError, mut record: RequestRecord| {
        record.status = err.status_in(dialect).as_u16();
        record.error = Some(err.kind());
        record.finish(Instant::now());
        err.response(dialect, &record.request_id)
    };
    // Everything but the open routes above needs a key. A refusal comes back only after its
    // delay (`auth::Authenticator::authenticate`).
    match state
        .auth()
        .authenticate(req.headers(), peer.ip(), received)
        .await
    {
        Ok(key) => record.key = Some(key),
        Err(refused) => {
            let throttled = matches!(refused.failure, AuthFailure::TooManyFailures { .. });
            // A key that was identified (revoked, expired, rotated out) owns its refusal.
            record.key = refused.key;
            let mut resp = fail(ApiError::Auth(refused.failure), record);
            // A throttled address gets no more attempts on this connection: hyper closes an
            // HTTP/1 connection after a response that says `Connection: close` (HTTP/2 has no
            // such header; there the delay is the brake).
            if throttled && req.version() <= Version::HTTP_11 {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return resp;
        }
    }
    let path = req.uri().path();
    match (endpoint, path) {
        (Some(row), _) if method == row.method => {
            proxy::forward(&state.proxy, row.endpoint, id, req, record).await
        }
        (Some(row), _) => fail(
            ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: row.path,
                allow: row.method.as_str(),
            },
            record,
        ),
        (None, "/v1/models") if method == Method::GET || method == Method::HEAD => {
            let body = match &record.key {
                Some(k) => state.pools().models_for(k),
                None => state.pools().models_body(),
            };
            let mut resp = json(StatusCode::OK, body);
            resp.headers_mut().insert(
                proxy::headers::X_REQUEST_ID.clone(),
                record.request_id.clone(),
            );
            record.status = 200;
            record.finish(Instant::now());
            resp
        }
        (None, "/v1/models") => fail(
            ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: "/v1/models",
                allow: "GET",
            },
            record,
        ),
        (None, _) => {
            let err = ApiError::RouteNotFound {
                method: method.to_string(),
                path: path.chars().take(200).collect(),
            };
            fail(err, record)
        }
    }
}

/// The public readiness probe says ready or not, nothing more: anyone who can reach the
/// listener may ask, so the backends, their errors and the key store's state are for the
/// admin listener (`GET /admin/ready`).
fn readyz(state: &AppState) -> Response<GatewayBody> {
    if state.pools().any_reachable() {
        json(StatusCode::OK, r#"{"ready":true}"#)
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"ready":false,"detail":"no backend is reachable yet; the admin listener's GET /admin/ready says more"}"#,
        )
    }
}
