//! A continuation's way upstream: its slot on another backend, its request (a head made anew),
//! its send beside the original prompt's `/tokenize` count.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};

use super::super::super::headers::{APPLICATION_JSON, TEXT_EVENT_STREAM, X_REQUEST_ID};
use super::super::super::state::ProxyState;
use super::Refused;
use crate::key::{Environment, KeyRecord};
use crate::pool::upstream_conn::UpstreamBody;
use crate::pool::{Backend, Balancer, InFlight, Reachability, UpstreamClient};
use crate::queue::{self, Asker, Claim};
use fleetgate_protocol::Endpoint;

/// The continuation's slot: on a backend not yet `tried` when one is free, else the next the
/// queue hands out (among `only`'s backends where it names some), within the environment's
/// longest wait and the request's deadline.
pub(super) async fn claim(
    state: Arc<ProxyState>,
    balancer: Arc<Balancer>,
    (key, model): (Option<Arc<KeyRecord>>, Arc<str>),
    (tried, only): (u64, u64),
    until: Instant,
) -> Result<InFlight, Refused> {
    let env = key.as_ref().map_or(Environment::Stress, |k| k.environment);
    let asker = Asker {
        key: key.as_deref(),
        model: &model,
        metrics: state.queue_metrics.as_ref(),
        goes_first: false,
    };
    let first = || balancer.try_acquire_excluding(tried);
    let claimed = queue::claim_only(&balancer, first, &asker, only).map_err(|_| Refused::Queue)?;
    match claimed {
        Claim::Now(slot) => Ok(slot),
        Claim::Wait(waiting) => {
            let left = until.saturating_duration_since(Instant::now());
            let max_wait = state.queue.max_wait[env.index()].min(left);
            queue::wait(waiting, max_wait, &asker)
                .await
                .map_err(|_| Refused::Queue)
        }
    }
}

/// Send the continuation and, beside it, count the original prompt with the backend's
/// `/tokenize` (a stream cut before its usage chunk never said it).
pub(super) async fn send(
    client: UpstreamClient,
    backend: Arc<Backend>,
    (req, count): (Request<Full<Bytes>>, Option<Request<Full<Bytes>>>),
    head_deadline: Instant,
    ejection: crate::config::EjectionConfig,
) -> Result<(UpstreamBody, Option<u64>), Refused> {
    let index = backend.metrics_index;
    let answer = async {
        let resp = tokio::time::timeout_at(head_deadline.into(), client.send(index, req))
            .await
            .map_err(|_| Refused::ContinuationFailed)?
            .map_err(|_| Refused::ContinuationFailed)?;
        let sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        // As the send step reads any head: the backend is up, and a failure or a success in a
        // row (a success ends a run of failures, which ejection counts).
        backend.mark(Reachability::Up);
        if resp.status().is_server_error() {
            backend.record_failure(&ejection, &format!("answered {}", resp.status()));
        } else {
            backend.record_success();
        }
        if resp.status() != http::StatusCode::OK || !sse {
            tracing::warn!(backend = %backend.base, status = %resp.status(), "a stream's continuation was not accepted");
            return Err(Refused::ContinuationFailed);
        }
        Ok(resp.into_body())
    };
    let counted = async {
        let req = count?;
        let resp = tokio::time::timeout_at(head_deadline.into(), client.send(index, req))
            .await
            .ok()?
            .ok()?;
        if resp.status() != http::StatusCode::OK {
            return None;
        }
        let body = tokio::time::timeout_at(head_deadline.into(), resp.into_body().collect())
            .await
            .ok()?
            .ok()?
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        v.get("count").and_then(serde_json::Value::as_u64)
    };
    let (answer, counted) = tokio::join!(answer, counted);
    Ok((answer?, counted))
}

/// A JSON request to `backend` at `uri`, with the request's id (`x-request-id`) and the
/// backend's own host and upstream key; a stream asks for events.
pub(super) fn request_to(
    backend: &Backend,
    uri: http::Uri,
    (request_id, endpoint): (&HeaderValue, Endpoint),
    body: Vec<u8>,
) -> Request<Full<Bytes>> {
    let mut headers = HeaderMap::with_capacity(6);
    headers.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    if endpoint != Endpoint::Tokenize {
        headers.insert(header::ACCEPT, TEXT_EVENT_STREAM.clone());
    }
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
    if let Some(auth) = &backend.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    headers.insert(header::HOST, backend.host.clone());
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let mut req = Request::new(Full::new(Bytes::from(body)));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    req
}

/// Does the forwarded request ask for usage (`stream_options.include_usage`)?
pub(super) fn asks_usage(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| {
        v.pointer("/stream_options/include_usage") == Some(&serde_json::Value::Bool(true))
    })
}
