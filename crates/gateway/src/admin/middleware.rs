//! What every response of the admin listener gets, from tower-http's layers: the API, the
//! console and `/metrics` alike.
//!
//! Outermost first:
//! - `Authorization`, `Proxy-Authorization` and `Cookie` are marked sensitive on the way in, and
//!   `Set-Cookie` on the way out, so no debug output or trace shows them.
//! - `x-request-id`: the caller's, or a new one made as the API listener makes its own
//!   (`proxy::headers::request_id`), sent back on the response.
//! - Security headers on every response that did not set its own: `nosniff`, no framing, no
//!   referrer to other sites, and `Cache-Control: no-store` (keys, tokens and usage are not for
//!   any cache). Pages add their Content-Security-Policy themselves.
//! - gzip when the client accepts it: the console's assets and pages, and `/metrics` for a
//!   Prometheus that asks for it.
//! - One request-body limit for every route (`MAX_BODY`): a `Content-Length` over it is
//!   answered at once, a body that grows past it fails the handler's read; both answer 413 in
//!   OpenAI's error format.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::Either;
use hyper::body::Incoming;
use tower::{Service, ServiceBuilder};
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::sensitive_headers::{
    SetSensitiveRequestHeadersLayer, SetSensitiveResponseHeadersLayer,
};
use tower_http::set_header::SetResponseHeaderLayer;

use super::AdminState;
use crate::proxy::relay::GatewayBody;
use fleetgate_protocol::error::error_body;

/// The body of every request the admin handlers see: limited to `MAX_BODY`.
pub(crate) type Body = tower_http::body::Limited<Incoming>;

/// The largest request body the admin listener reads: a key's JSON, a console form.
pub(crate) const MAX_BODY: usize = 64 * 1024;

/// The same id the API listener gives its requests, for a request that brings none.
#[derive(Clone, Copy)]
struct GatewayRequestId;

impl MakeRequestId for GatewayRequestId {
    fn make_request_id<B>(&mut self, request: &Request<B>) -> Option<RequestId> {
        Some(RequestId::new(crate::proxy::headers::request_id(
            request.headers(),
        )))
    }
}

/// What a 413 of the admin listener says.
pub(crate) fn too_large_message() -> String {
    format!("The request body is over the admin listener's limit of {MAX_BODY} bytes.")
}

/// The limit's own answer to a `Content-Length` over it is plain text (no handler answers
/// in plain text): replaced by the JSON every other admin error has.
fn json_too_large<B>(resp: Response<B>) -> Response<Either<B, GatewayBody>> {
    let plain = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/plain"));
    if resp.status() != StatusCode::PAYLOAD_TOO_LARGE || !plain {
        return resp.map(Either::Left);
    }
    let body = error_body(
        &too_large_message(),
        "invalid_request_error",
        None,
        Some("request_too_large"),
    );
    let mut r = Response::new(Either::Right(GatewayBody::full(body)));
    *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The admin listener's service: `super::handle` inside the layers above.
pub(crate) fn service(
    state: Arc<AdminState>,
) -> impl Service<
    Request<Incoming>,
    Response = Response<
        impl http_body::Body<Data = Bytes, Error: Into<tower::BoxError>> + Send + 'static,
    >,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    let secure = |name: HeaderName, value: &'static str| {
        SetResponseHeaderLayer::if_not_present(name, HeaderValue::from_static(value))
    };
    ServiceBuilder::new()
        .layer(SetSensitiveRequestHeadersLayer::new([
            header::AUTHORIZATION,
            header::PROXY_AUTHORIZATION,
            header::COOKIE,
        ]))
        .layer(SetRequestIdLayer::x_request_id(GatewayRequestId))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetSensitiveResponseHeadersLayer::new([header::SET_COOKIE]))
        .layer(secure(header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .layer(secure(header::X_FRAME_OPTIONS, "DENY"))
        // Not `no-referrer`: with it, browsers send `Origin: null` on form posts, which the
        // console's same-origin check refuses. Nothing leaves for another site either way.
        .layer(secure(header::REFERRER_POLICY, "same-origin"))
        .layer(secure(header::CACHE_CONTROL, "no-store"))
        .layer(CompressionLayer::new())
        .map_response(json_too_large)
        .layer(RequestBodyLimitLayer::new(MAX_BODY))
        .service_fn(move |req: Request<Body>| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(super::handle(state, req).await) }
        })
}
