//! The upstream phase: the request as it goes to a backend (the client's bytes, its head made
//! by `headers`), sent (with `retry` before the first byte), the response head read within the
//! first-token limit, a backend's error rewrapped (`backend_error`), the gateway's timing
//! stamped on it (`timing`).
//!
//! The client's head is cleaned before the body is read (`headers`): hop-by-hop headers as RFC
//! 9110 §7.6.1 defines them (`Connection` and every header it names), credentials and cookies
//! go; `TE: trailers` is read before it goes; the head a backend would get is held to
//! `server.max_upstream_*` (431, no backend contacted). A pinned request (a continuation, a
//! request by response id) is never retried on another backend.

use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Version};
use http_body_util::Full;

use super::error::{ApiError, TimeoutKind};
use super::exchange::Exchange;
use super::headers::{Outgoing, X_REQUEST_ID, strip_hop_by_hop};
use crate::pool::cause::ConnectCause;
use crate::pool::driven::{SendError, UpstreamBody};
use crate::pool::{Backend, InFlight, Pool, Reachability};
use crate::route::Route;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::BodyKind;
use fleetgate_protocol::view::splice::PriorityEdit;
use fleetgate_protocol::view::{self, RequestView};

use super::backend_error::error_answer;
use super::timing::{SERVER_TIMING, SERVER_TIMING_VALUE, server_timing};

/// The request as it goes upstream, owned: it may wait in the queue past the handler.
pub struct Prepared {
    pub headers: HeaderMap,
    pub body: Bytes,
    pub endpoint: Endpoint,
    pub pool: usize,
    /// The gateway injected `include_usage`: hide the usage event from the client.
    pub strip_usage: bool,
    pub body_read: Instant,
    /// The client accepts trailers (`TE: trailers`): a stream's `Server-Timing`, with the hop
    /// cost known only after its first token, comes as a trailer.
    pub timing_trailer: bool,
    /// The client named the model otherwise than the backends: its name goes back in the answer.
    pub rename: Option<Box<super::rename::Rename>>,
    /// The request's method and, where it is not the endpoint's fixed path, its own target on
    /// the backend (a path naming a stored response, a query string passed through).
    pub method: Method,
    pub target: Option<Box<str>>,
    /// It must reach one backend (the one holding a stored response): never retried on
    /// another.
    pub pinned: bool,
    /// Learn the id of the stored response the answer creates.
    pub pin: Option<super::pins::Pin>,
    /// `longest_prefix`: the prompt's block names, recorded for the backend it is sent to.
    pub prefix: Option<std::sync::Arc<[u64]>>,
    /// Where the other replicas learn it (`limits.shared = "redis"`).
    pub prefix_share: Option<std::sync::Arc<super::prefix_share::PrefixShare>>,
}

/// The request for the route's pool: the original bytes unless the model must be renamed. A
/// stream that did not ask for usage gets it anyway upstream (the relay hides it from the
/// client), so every stream's token counts are real.
pub fn prepare(
    outgoing: Outgoing,
    body: &Bytes,
    view: &RequestView<'_>,
    route: &Route<'_>,
    endpoint: Endpoint,
    record: &crate::telemetry::RequestRecord,
    body_read: Instant,
) -> Prepared {
    let inject_usage =
        endpoint.needs().injects_usage && view.stream && view.include_usage != Some(true);
    // A form field holds the bare name; a JSON body, the name as a JSON string.
    let rename = match endpoint.needs().body {
        BodyKind::Multipart => route.rename.map(|_| route.pool.served_name.as_bytes()),
        _ => route.rename,
    };
    // A new stored response's id is made from the request id (vLLM's `resp_<x-request-id>`, or
    // the body's `request_id`): in the key's namespace, so no key can name another's.
    let owner = record
        .key
        .as_deref()
        .filter(|_| endpoint == Endpoint::Responses)
        .map(|k| &*k.public_id);
    // vLLM's `priority` for the request's environment (`[pools.priority]`), where the engine
    // orders by it; elsewhere a client's is taken out.
    let priority = if !endpoint.needs().engine_priority {
        match view.priority {
            Some(_) => PriorityEdit::Remove,
            None => PriorityEdit::Keep,
        }
    } else {
        match (route.pool.config().priority, &record.key) {
            (Some(p), Some(key)) => p
                .for_request(
                    key.environment,
                    view.priority.as_ref().and_then(|c| c.value),
                )
                .map_or(PriorityEdit::Keep, PriorityEdit::Write),
            _ => PriorityEdit::Keep,
        }
    };
    let upstream_body =
        view::splice::upstream_body_owned(body, view, rename, inject_usage, owner, priority);
    let Outgoing {
        mut headers,
        trailers,
    } = outgoing;
    let timing_trailer = view.stream && trailers;
    let request_id = match owner {
        Some(owner) => owned_request_id(owner, &record.request_id),
        None => record.request_id.clone(),
    };
    headers.insert(X_REQUEST_ID.clone(), request_id);
    headers.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(upstream_body.len() as u64),
    );
    Prepared {
        headers,
        body: upstream_body,
        endpoint,
        pool: route.pool.index,
        strip_usage: inject_usage,
        body_read,
        timing_trailer,
        rename: route
            .rename
            .and_then(|_| super::rename::Rename::new(route.pool.served_field.clone(), &view.model))
            .map(Box::new),
        method: Method::POST,
        target: None,
        pinned: false,
        pin: None,
        prefix: route.prefix.clone(),
        prefix_share: None,
    }
}

/// `<owner>-<request id>`: the request id in a key's namespace.
fn owned_request_id(owner: &str, request_id: &HeaderValue) -> HeaderValue {
    let mut v = Vec::with_capacity(owner.len() + 1 + request_id.len());
    v.extend_from_slice(owner.as_bytes());
    v.push(b'-');
    v.extend_from_slice(request_id.as_bytes());
    HeaderValue::from_bytes(&v).unwrap_or_else(|_| request_id.clone())
}

pub struct RelayParts {
    pub upstream: UpstreamBody,
    pub sse: bool,
    pub dialect: fleetgate_protocol::Dialect,
    /// Where the stored response this answer creates lives (its id still to be read).
    pub pin: Option<super::pins::Pin>,
    pub timeouts: crate::config::Timeouts,
    pub slot: InFlight,
    /// The gateway injected `include_usage`: hide the usage event from the client.
    pub strip_usage: bool,
    /// End the stream with a `Server-Timing` trailer.
    pub timing_trailer: bool,
    pub rename: Option<Box<super::rename::Rename>>,
}

/// What sending upstream gave.
pub enum Sent {
    /// Head ready; the body will be relayed.
    Relay(Response<()>, RelayParts),
    /// A complete response (a backend error rewrapped into OpenAI format).
    Full(Response<Bytes>),
}

/// Send the prepared request to the slot's backend and read the response head.
pub(super) async fn send(
    pool: &Pool,
    slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let backend = slot.backend().clone();
    // The backend now holds the prompt's prefixes (a retry elsewhere records them there too).
    if let (Some(names), Some(index)) = (&prepared.prefix, &pool.prefix) {
        index.record(names, u32::try_from(backend.slot).unwrap_or(u32::MAX));
        if let Some(share) = &prepared.prefix_share {
            share.publish(&pool.model, &backend.base, names);
        }
    }
    ex.record.backend = Some(backend.base.clone());
    ex.record.backend_slot = Some(backend.slot);
    let mut prepared = prepared;
    let strip_usage = prepared.strip_usage;
    let timing_trailer = prepared.timing_trailer;
    let rename = prepared.rename.take();
    let pin = prepared.pin.take();
    let endpoint = prepared.endpoint;
    // Inference, pooling included: a whole answer's head is its first token (the hop's
    // measure), as on a non-streaming chat.
    let inference = endpoint.needs().takes_slot;
    let mut upstream_req = upstream_request(&backend, prepared)?;

    // Send; wait for the head within the first-token (and total) limit.
    let sent = Instant::now();
    // Traced: this attempt is its own span, named in the `traceparent` the backend gets.
    if let Some(scope) = ex.record.otel.as_deref_mut() {
        let traceparent = scope.attempt(&backend.base, sent);
        scope.write_headers(upstream_req.headers_mut(), traceparent);
    }
    ex.record.timeline.stamp_upstream_sent(sent);
    let t = pool.timeouts;
    let head_deadline = sent + t.first_token.min(t.total);
    let resp = match tokio::time::timeout_at(
        head_deadline.into(),
        pool.client.send(backend.slot, upstream_req),
    )
    .await
    {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => return Err(unreachable(pool, &backend, &e)),
        Err(_) => return Err(head_timeout(pool, &backend)),
    };
    let head_at = Instant::now();
    ex.record.timeline.stamp_upstream_first_byte(head_at);
    backend.mark(Reachability::Up);
    if resp.status().is_server_error() {
        backend.record_failure(
            &pool.balancer.ejection,
            &format!("answered {}", resp.status()),
        );
    } else {
        backend.record_success();
    }

    let (mut head, upstream) = resp.into_parts();
    if head.status.is_client_error() || head.status.is_server_error() {
        let deadline = head_deadline.max(head_at + t.idle);
        let answer = error_answer(pool, &backend, &head, upstream, deadline, ex).await;
        ex.record
            .timeline
            .stamp_whole_answer(head_at, Instant::now());
        return Ok(Sent::Full(answer));
    }

    let sse = head
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    // The response's hop-by-hop headers stay on the upstream connection.
    strip_hop_by_hop(&mut head.headers);
    head.headers
        .insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    if let Some(a) = &ex.admission
        && !a.headers.is_empty()
    {
        a.headers.write(&mut head.headers);
    }
    head.version = Version::HTTP_11;
    if rename.is_some() && !sse {
        // The client's name may be longer or shorter than the backend's: the body is sent
        // chunked (HTTP/1.1) or framed (HTTP/2) instead of with the backend's length.
        head.headers.remove(header::CONTENT_LENGTH);
    }
    // (Tokenization has no first token: its answer feeds neither TTFT figure. A pooling
    // answer's first token is its whole answer.)
    if !sse && inference {
        // The whole answer is in this head's body: the first token is the head, handed to the
        // client now.
        if let Some(rx) = upstream.rx() {
            let (written, arrived) = rx.0.first_token_arrival();
            ex.record.timeline.stamp_upstream_wire(written, arrived);
        }
        ex.record
            .timeline
            .stamp_whole_answer(head_at, Instant::now());
        backend.observe_ttft(head_at.saturating_duration_since(sent));
    } else if sse && timing_trailer {
        head.headers
            .insert(header::TRAILER, SERVER_TIMING_VALUE.clone());
    }
    if let Some(v) = server_timing(&ex.record, head_at, sse) {
        head.headers.insert(SERVER_TIMING.clone(), v);
    }
    Ok(Sent::Relay(
        Response::from_parts(head, ()),
        RelayParts {
            upstream,
            sse,
            dialect: endpoint.dialect(),
            pin: pin.map(|mut pin| {
                pin.backend = backend.base.clone();
                pin
            }),
            timeouts: t,
            slot,
            strip_usage,
            timing_trailer: sse && timing_trailer,
            rename,
        },
    ))
}

/// The request as this backend gets it: its own URI and its own upstream key. A client's key
/// in `x-api-key` never reaches a backend (the gateway's own goes as `Authorization`).
fn upstream_request(
    backend: &Backend,
    prepared: Prepared,
) -> Result<Request<Full<Bytes>>, ApiError> {
    let Prepared {
        mut headers,
        body,
        endpoint,
        method,
        target,
        ..
    } = prepared;
    if let Some(auth) = &backend.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    headers.insert(header::HOST, backend.host.clone());
    let uri = match target {
        Some(t) => backend.uri_for(&t).ok_or(ApiError::Internal)?,
        // (A route naming a stored response always has its own target.)
        None if endpoint.needs().body == BodyKind::None => return Err(ApiError::Internal),
        None => backend.uri(endpoint).clone(),
    };
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Ok(req)
}

/// The backend could not be reached: counted against it (and marked down when nothing
/// listens there), named with the cause.
fn unreachable(pool: &Pool, backend: &Backend, e: &SendError) -> ApiError {
    let (cause, detail) = crate::pool::cause::classify(e, e.connect);
    if matches!(
        cause,
        ConnectCause::Refused | ConnectCause::Dns | ConnectCause::ConnectTimeout
    ) {
        backend.mark(Reachability::Down);
    }
    backend.record_failure(
        &pool.balancer.ejection,
        &format!("{}: {detail}", cause.describe()),
    );
    tracing::warn!(backend = %backend.base, cause = ?cause, %detail, "upstream request failed");
    ApiError::BackendUnreachable {
        backend: backend.shown.to_string(),
        cause,
        detail,
    }
}

/// No response head within the first-token (or total) limit.
fn head_timeout(pool: &Pool, backend: &Backend) -> ApiError {
    let t = pool.timeouts;
    let kind = if t.total <= t.first_token {
        TimeoutKind::Total
    } else {
        TimeoutKind::FirstToken
    };
    let after = t.first_token.min(t.total);
    backend.record_failure(
        &pool.balancer.ejection,
        &format!("no response head within {} ms", after.as_millis()),
    );
    ApiError::UpstreamTimeout {
        backend: backend.shown.to_string(),
        kind,
        after_ms: after.as_millis(),
    }
}
