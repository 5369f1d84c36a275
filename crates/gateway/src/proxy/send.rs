//! The send step: the prepared request to the slot's backend, its response head read within
//! the first-token limit, a backend's error rewrapped in the route's dialect
//! (`backend_error`), the gateway's timing stamped on the head (`timing`). A backend that
//! could not be reached, or answered 502/503, before the client had a byte gets the request
//! sent to another one (`with_retries`), within the pool's retry budget; nothing is retried
//! once the client has a byte, nor a pinned request (a stored response's).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self};
use http::{Request, Response, Version};
use http_body_util::Full;

use super::backend_error::error_answer;
use super::error::{ApiError, TimeoutKind};
use super::exchange::Exchange;
use super::headers::{X_REQUEST_ID, strip_hop_by_hop};
use super::queueing;
use super::request::{AnswerEdits, Prepared};
use super::state::ProxyState;
use super::timing::{SERVER_TIMING, SERVER_TIMING_VALUE, server_timing};
use crate::pool::cause::ConnectCause;
use crate::pool::upstream_conn::{SendError, UpstreamBody};
use crate::pool::{Backend, InFlight, Pool, Reachability};
use crate::telemetry::CacheBelief;
use fleetgate_protocol::endpoint::BodyKind;

/// Send, and when the backend could not be reached or answered 502/503 before any byte went
/// to the client, send again to another backend — at most `retries.max_retries` times and
/// within the pool's retry budget. Nothing is retried once the client has a byte.
pub(super) async fn with_retries(
    state: &ProxyState,
    pool: &Pool,
    mut slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    // Retries draw from the generation the slot came from (a queued request may have been
    // handed a slot by a newer one), so the exclusion bits name the same backends.
    let can_retry = {
        let balancer = slot.balancer();
        balancer.retries.max_retries > 0 && balancer.backends.len() > 1 && !prepared.pinned
    };
    if !can_retry {
        return send(pool, slot, prepared, ex).await;
    }
    // (Cloned only in that rare case: the count is shared by every worker.)
    let newer;
    let balancer = if Arc::ptr_eq(slot.balancer(), &pool.balancer) {
        &pool.balancer
    } else {
        newer = slot.balancer().clone();
        &newer
    };
    balancer.retry_budget.deposit();
    // A retry takes the same kind of slot (tokenization takes no capacity slot).
    let counted = slot.is_counted();
    // A LoRA adapter's request stays on the backends holding it.
    let only = prepared.only;
    let mut tried = if only == 0 { 0 } else { !only };
    let mut attempt = 0;
    loop {
        tried |= crate::pool::bit(slot.position());
        if attempt >= balancer.retries.max_retries {
            return send(pool, slot, prepared, ex).await;
        }
        let result = send(pool, slot, prepared.clone(), ex).await;
        let retryable = match &result {
            Err(ApiError::BackendUnreachable { .. }) => true,
            Ok(Sent::Full(resp)) => matches!(resp.status().as_u16(), 502 | 503),
            _ => false,
        };
        if !retryable {
            return result;
        }
        let next = if counted {
            balancer.try_acquire_excluding(tried)
        } else {
            balancer.pick_uncounted(tried)
        };
        if next.is_none() && !counted {
            return result;
        }
        if !balancer.retry_budget.try_spend() {
            return result;
        }
        let next = match next {
            Some(next) => next,
            // Every other backend is at capacity: the retry waits in the pool's queue.
            None if counted => queueing::requeue(state, pool, balancer, (tried, only), ex).await?,
            None => return result,
        };
        tracing::debug!(request_id = ?ex.record.request_id, from = ?ex.record.backend, to = %next.backend().base, "retrying on another backend");
        // The failed attempt ends its span; its stamps are forgotten: the Timeline describes
        // the one that answers.
        if let Some(scope) = ex.record.otel.as_deref_mut() {
            let (status, error) = match &result {
                Ok(Sent::Full(resp)) => (resp.status().as_u16(), ex.record.error),
                Err(e) => (0, Some(e.kind())),
                Ok(Sent::Relay(..)) => (0, None),
            };
            scope.attempt_failed(Instant::now(), status, error);
        }
        ex.record.error = None;
        ex.record.timeline.forget_attempt();
        ex.record.retries = ex.record.retries.saturating_add(1);
        slot = next;
        attempt += 1;
    }
}

/// What the relay gets from the send step: the answer's body and how to relay it.
pub(super) struct RelayParts {
    pub(super) upstream: UpstreamBody,
    pub(super) sse: bool,
    pub(super) dialect: fleetgate_protocol::Dialect,
    pub(super) timeouts: crate::config::Timeouts,
    pub(super) slot: InFlight,
    /// The request's edits of the answer, its pin naming the backend (the stored response's id
    /// still to be read), a `Server-Timing` trailer only on a stream.
    pub(super) answer: AnswerEdits,
    /// What resuming the stream on another backend needs, where its pool resumes streams.
    pub(super) resume: Option<Box<super::relay::Kept>>,
}

/// What sending upstream gave. (Moved once, from the send step to the relay: boxing the relay's
/// parts would cost every request an allocation to save a few hundred bytes of stack.)
#[allow(clippy::large_enum_variant)]
pub(super) enum Sent {
    /// Head ready; the body will be relayed.
    Relay(Response<()>, RelayParts),
    /// A complete response (a backend error rewrapped into OpenAI format).
    Full(Response<Bytes>),
}

/// Send the prepared request to the slot's backend and read the response head.
async fn send(
    pool: &Pool,
    slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let backend = slot.backend().clone();
    // The backend now holds the prompt's prefixes (a retry elsewhere records them there too);
    // what it was believed to hold before is the routing's prediction.
    if let (Some(names), Some(index)) = (&prepared.prefix, &pool.prefix) {
        let held = index.record(
            names,
            u32::try_from(backend.metrics_index).unwrap_or(u32::MAX),
        );
        ex.record.cache_belief = Some(CacheBelief::Share {
            held: u32::try_from(held).unwrap_or(u32::MAX),
            of: u32::try_from(names.len()).unwrap_or(u32::MAX),
        });
        if let Some(share) = &prepared.prefix_share {
            share.publish(&pool.model, &backend.base, names);
        }
    }
    // KV-event routing believes what the engine's events say it holds; a request it could
    // not cut into blocks (no event yet, another endpoint) is believed to find nothing.
    // Read again here rather than kept from the routing: events keep arriving while a
    // request waits in the queue, and the belief is the one at the moment it is sent.
    if pool
        .affinity
        .is_some_and(|a| a.by == crate::config::AffinityBy::KvEvents)
        && prepared.endpoint.needs().generates
    {
        let held = prepared.engine_blocks.as_ref().map_or(0, |e| {
            let blocks = backend.engine_cache.load().as_ref().map_or(0, |c| {
                let held = c.held(&e.blocks);
                // An engine without events is believed to hold what it was sent.
                c.sent(&e.blocks);
                held
            });
            e.cached_tokens(blocks)
        });
        ex.record.cache_belief = Some(CacheBelief::Tokens(held));
    }
    ex.record.backend = Some(backend.base.clone());
    ex.record.backend_metrics_index = Some(backend.metrics_index);
    let mut prepared = prepared;
    let mut answer = std::mem::take(&mut prepared.answer);
    let endpoint = prepared.endpoint;
    // Inference, pooling included: a whole answer's head is its first token (the hop's
    // measure), as on a non-streaming chat.
    let inference = endpoint.needs().takes_slot;
    let resume = kept_for_resuming(pool, &prepared, ex);
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
        pool.client.send(backend.metrics_index, upstream_req),
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
    if let Some(a) = &ex.hold
        && !a.headers.is_empty()
    {
        a.headers.write(&mut head.headers);
    }
    head.version = Version::HTTP_11;
    if answer.rename.is_some() && !sse {
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
    } else if sse && answer.timing_trailer {
        head.headers
            .insert(header::TRAILER, SERVER_TIMING_VALUE.clone());
    }
    if let Some(v) = server_timing(&ex.record, head_at, sse) {
        head.headers.insert(SERVER_TIMING.clone(), v);
    }
    if let Some(pin) = &mut answer.pin {
        pin.backend = backend.base.clone();
    }
    answer.timing_trailer &= sse;
    Ok(Sent::Relay(
        Response::from_parts(head, ()),
        RelayParts {
            upstream,
            sse,
            dialect: endpoint.dialect(),
            timeouts: t,
            slot,
            answer,
            resume,
        },
    ))
}

/// What a stream needs to be resumed on another backend, where its pool resumes streams: the
/// request as forwarded, kept only where an answer can be continued (chat and completions, a
/// pool of several backends, a request not pinned to one).
fn kept_for_resuming(
    pool: &Pool,
    prepared: &Prepared,
    ex: &Exchange,
) -> Option<Box<super::relay::Kept>> {
    let config = pool.config().resume;
    if !config.enabled || !ex.record.stream {
        return None;
    }
    let endpoint = prepared.endpoint;
    let alone = pool.backends.len() < 2 || prepared.pinned;
    let continued = matches!(
        endpoint,
        fleetgate_protocol::Endpoint::Chat | fleetgate_protocol::Endpoint::Completions
    );
    let request = (continued && !alone).then(|| prepared.body.clone());
    Some(Box::new(super::relay::Kept {
        endpoint,
        request,
        config,
        alone,
        only: prepared.only,
    }))
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
