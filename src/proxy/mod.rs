//! Forwarding of completion requests. `forward` runs the request path's phases in order, each
//! a call into its own room, and answers with what they give:
//!
//! 1. body (`body`): the headers first cleaned for the backend and held to the head limits
//!    (`upstream::outgoing`, `upstream::check_head`), then JSON within the size limit, read
//!    whole;
//! 2. view (`protocol::view`): parsed once, the bytes kept;
//! 3. route (`route`): model → pool, the key's rights, long-prompt pool, backend preferences;
//! 4. limits (`limits`): the key's rates, token budget and concurrency, its environment's caps;
//! 5. queue (`queue`): a backend slot now, or a wait in the pool's admission queue;
//! 6. upstream (`upstream`): send (retrying before the first byte), read the head;
//! 7. relay (`relay`): the backend's body handed on frame by frame;
//! 8. record (`telemetry`): once, when the request's `Exchange` is dropped.
//!
//! A stream that must wait answers at once with `: queued` comments and resumes at phase 5 from
//! its body (`wait_and_send`): the same phases, not a second copy of them. Every phase stamps
//! the request's Timeline.
//!
//! vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`) take the same phases, with the
//! differences that follow from their not being inference: limits count them as requests only
//! (no tokens, no concurrency slot), the queue phase names a backend without taking one of its
//! capacity slots and never waits, and their answer has no first token.

pub mod body;
pub mod error;
mod fingerprint;
pub mod relay;
pub mod rename;
pub mod upstream;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::key::Environment;
use crate::limits::Admission;
use crate::pool::{Balancer, Generation, Pool};
use crate::protocol::Endpoint;
use crate::protocol::error::{ErrorKind, sse_error_event};
use crate::protocol::view;
use crate::queue::{self, Asker, Claim, QueueError, QueuedBody, Waiting};
use crate::route::{self, Route, RouteError};
use crate::telemetry::RequestRecord;
use error::ApiError;
use relay::{GatewayBody, RelayBody};
use upstream::{Prepared, RelayParts, Sent};

/// What the forwarding path needs, shared by all requests.
#[derive(Debug)]
pub struct ProxyState {
    /// This worker's pools, swapped by a reload (`pool::fleet`).
    pub generation: crate::pool::fleet::CurrentGeneration,
    pub max_body_bytes: usize,
    /// The whole request body must arrive within this.
    pub body_timeout: Duration,
    /// What a forwarded request's head may come to (`server.max_upstream_*`).
    pub head_limits: upstream::HeadLimits,
    pub recorder: Arc<crate::telemetry::Recorder>,
    pub auth: Arc<crate::auth::Authenticator>,
    pub limits: Arc<crate::limits::Limits>,
    pub queue: crate::config::QueueConfig,
    pub queue_metrics: Option<queue::QueueMetrics>,
    /// The longest SSE line a relay carries across reads (`server.max_stream_line_bytes`).
    pub max_stream_line: usize,
    /// How forwarded requests say whom they came from.
    pub forwarding: upstream::Forwarding,
    /// Cancelled when the shutdown grace period has run out: what is still open ends now,
    /// with an error the client can read (`ApiError::Shutdown`).
    pub closing: Closing,
}

/// The end of the shutdown grace period, as the request path sees it.
#[derive(Debug, Clone, Default)]
pub struct Closing {
    /// This worker's own child of the server's token (its waiters never share a lock with
    /// another worker's).
    pub token: tokio_util::sync::CancellationToken,
    pub grace: Duration,
}

impl Closing {
    pub fn error(&self) -> ApiError {
        ApiError::Shutdown {
            grace_ms: self.grace.as_millis(),
        }
    }
}

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");
static TEXT_EVENT_STREAM: HeaderValue = HeaderValue::from_static("text/event-stream");
static NO_CACHE: HeaderValue = HeaderValue::from_static("no-cache");

/// One request's record and its hold on the limits, ended together: dropping it settles the
/// hold with the tokens the request really used, then the record is written (its own `Drop`).
/// The limits never reach into the record, nor the record into the limits.
#[derive(Debug)]
pub struct Exchange {
    pub admission: Option<Admission>,
    pub record: RequestRecord,
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let Some(mut adm) = self.admission.take() {
            adm.set_used(self.record.used_tokens(adm.prompt_estimate()));
        }
    }
}

/// An error response in OpenAI format, with the request id.
pub fn error_response(err: &ApiError, request_id: &HeaderValue) -> Response<GatewayBody> {
    let mut resp = Response::new(GatewayBody::full(err.body()));
    *resp.status_mut() = err.status();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    h.insert(X_REQUEST_ID.clone(), request_id.clone());
    if let Some((name, value)) = err.extra_header() {
        h.insert(name, value);
    }
    resp
}

/// The client's `x-request-id` if usable, else a new one: a per-process random prefix and a
/// counter (unique across replicas without a per-request random draw).
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(&X_REQUEST_ID)
        && !v.is_empty()
        && v.len() <= 128
    {
        return v.clone();
    }
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(rand::random::<u32>);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut buf = [0u8; 3 + 8 + 1 + 16];
    buf[..3].copy_from_slice(b"fg-");
    hex_into(&mut buf[3..11], u64::from(prefix), 8);
    buf[11] = b'-';
    hex_into(&mut buf[12..], n, 16);
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("fg-invalid"))
}

fn hex_into(out: &mut [u8], mut v: u64, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out[i] = HEX[(v & 0xf) as usize];
        v >>= 4;
    }
}

/// Forward one completion request. `record` already carries the request id and `received`.
pub async fn forward(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    record: RequestRecord,
) -> Response<GatewayBody> {
    let mut ex = Exchange {
        admission: None,
        record,
    };
    ex.record.endpoint = Some(endpoint);
    // A request still waiting for its backend's answer when the grace period ends is answered
    // 503 `gateway_shutdown` rather than cut.
    let phased = tokio::select! {
        biased;
        r = phases(state, endpoint, req, &mut ex) => r,
        () = state.closing.token.cancelled() => Err(state.closing.error()),
    };
    match phased {
        Ok(Forwarded::Sent(sent)) => answer(state, sent, ex).await,
        Ok(Forwarded::Queued(queued)) => answer_queued(state, queued, ex),
        Err(err) => answer_error(&err, ex),
    }
}

/// Phases 1 to 6, in order.
async fn phases(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    ex: &mut Exchange,
) -> Result<Forwarded, ApiError> {
    let (parts, body) = req.into_parts();
    // The head as a backend would get it, refused here when a backend would refuse it: before
    // the body is read, and without a backend charged for the client's headers.
    let declared = body::declared_length(&parts.headers);
    let sender = upstream::Sender {
        peer: ex.record.client_addr.map(|a| a.ip()),
        authority: parts.uri.authority(),
    };
    let outgoing = upstream::outgoing(parts.headers, &state.forwarding, sender);
    let backend_part = state.generation.load().max_backend_head;
    upstream::check_head(
        &outgoing.headers,
        &ex.record.request_id,
        backend_part,
        state.head_limits,
    )
    .map_err(ApiError::HeadersTooLarge)?;
    let body = body::read(
        &outgoing.headers,
        declared,
        body,
        state.max_body_bytes,
        state.body_timeout,
    )
    .await?;
    let body_read = Instant::now();
    ex.record.timeline.stamp_body_read(body_read);

    let view = view::parse(&body, endpoint)?;
    ex.record.stream = view.stream;

    // In the generation as it is now: a reload swaps it for the requests that follow, this
    // one keeps it to its end.
    let generation = state.generation.load_full();
    let route = route_phase(state, &view, &body, endpoint, &generation, &mut ex.record)?;

    ex.admission = admit(state, endpoint, &view, &ex.record).await?;

    // A reload that retired every backend this request could use, between its routing and
    // its claim, is not the client's problem: it is routed once more, in the generation that
    // replaced the old one.
    let newer;
    let (generation, route, claim) = match claim(state, &route, &ex.record) {
        Ok(claim) => (&generation, route, claim),
        Err(QueueError::NoUsableBackend)
            if !Arc::ptr_eq(&generation, &*state.generation.load()) =>
        {
            newer = state.generation.load_full();
            let route = route_phase(state, &view, &body, endpoint, &newer, &mut ex.record)?;
            let claim = claim(state, &route, &ex.record).map_err(|e| queue_error(e, route.pool))?;
            (&newer, route, claim)
        }
        Err(e) => return Err(queue_error(e, route.pool)),
    };

    let prepared = upstream::prepare(
        outgoing,
        &body,
        &view,
        &route,
        endpoint,
        &ex.record.request_id,
        body_read,
    );
    drop(view);
    // A stream that must wait answers at once, `: queued` comments keeping it alive; it
    // resumes at `wait_and_send` from its body.
    if ex.record.stream
        && state.queue.keepalive_interval.is_some()
        && let Claim::Wait(waiting) = claim
    {
        return Ok(Forwarded::Queued(Queued {
            prepared,
            waiting,
            generation: generation.clone(),
        }));
    }
    wait_and_send(state, route.pool, claim, prepared, ex)
        .await
        .map(Forwarded::Sent)
}

/// Phase 3: the route, with the pool named in the record (even when the key may not use it).
fn route_phase<'p>(
    state: &ProxyState,
    view: &view::RequestView<'_>,
    body: &[u8],
    endpoint: Endpoint,
    pools: &'p Generation,
    record: &mut RequestRecord,
) -> Result<Route<'p>, ApiError> {
    let key = record.key.as_deref();
    match route::resolve(view, body, endpoint, key, pools, |chars| {
        state.limits.prompt_tokens(chars)
    }) {
        Ok(route) => {
            record.model = Some(route.pool.model.clone());
            record.pool_slot = Some(route.pool.slot);
            Ok(route)
        }
        Err(RouteError::ModelNotFound { model, available }) => {
            Err(ApiError::ModelNotFound { model, available })
        }
        Err(RouteError::Denied {
            failure,
            model,
            pool_slot,
        }) => {
            record.model = Some(model);
            record.pool_slot = Some(pool_slot);
            state.auth.count(&failure);
            Err(ApiError::Auth(failure))
        }
    }
}

/// Phase 4: the key's limits (requests without a key have none). Tokenization counts as a
/// request, not as inference.
async fn admit(
    state: &ProxyState,
    endpoint: Endpoint,
    view: &view::RequestView<'_>,
    record: &RequestRecord,
) -> Result<Option<Admission>, ApiError> {
    let Some(key) = &record.key else {
        return Ok(None);
    };
    let admitted = if endpoint.needs().spends_tokens {
        let demand = state
            .limits
            .demand(view.prompt_chars, view.max_tokens, view.n);
        state.limits.admit(key, demand).await
    } else {
        state.limits.admit_request(key).await
    };
    match admitted {
        Ok(adm) => Ok(Some(adm)),
        Err(refusal) => Err(ApiError::Limited(Box::new(refusal))),
    }
}

fn asker<'a>(state: &'a ProxyState, pool: &'a Pool, record: &'a RequestRecord) -> Asker<'a> {
    Asker {
        key: record.key.as_deref(),
        model: &pool.model,
        metrics: state.queue_metrics.as_ref(),
    }
}

/// Phase 5, first half: a slot now or a place in the queue. Tokenization gets a backend now,
/// without a capacity slot, or none.
fn claim(
    state: &ProxyState,
    route: &Route<'_>,
    record: &RequestRecord,
) -> Result<Claim<Balancer>, QueueError> {
    let pool = route.pool;
    if record.endpoint.is_some_and(|e| !e.needs().takes_slot) {
        return pool
            .balancer
            .try_acquire_uncounted(route.avoid)
            .map(Claim::Now)
            .ok_or(QueueError::NoUsableBackend);
    }
    let affinity = route
        .affinity
        .zip(pool.affinity)
        .map(|(key, a)| (key, a.slack));
    let balancer = &pool.balancer;
    queue::claim(
        balancer,
        || balancer.try_acquire_routed(route.avoid, affinity),
        &asker(state, pool, record),
    )
}

/// Phase 5, second half, and phase 6: wait for the slot if there is none yet (the wait
/// becomes the Timeline's queue wait, `admitted − body_read`), then send.
async fn wait_and_send(
    state: &ProxyState,
    pool: &Pool,
    claim: Claim<Balancer>,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let body_read = prepared.body_read;
    let env = ex
        .record
        .key
        .as_ref()
        .map_or(Environment::Stress, |k| k.environment);
    let max_wait = state.queue.max_wait[env.index()];
    let slot = match claim {
        // Tokenization never queues: it has no queue wait to record (not even a zero one).
        Claim::Now(slot) if !slot.is_counted() => slot,
        Claim::Now(slot) => {
            ex.record.timeline.stamp_admitted(body_read);
            slot
        }
        Claim::Wait(waiting) => {
            let queued_at = Instant::now();
            let result = queue::wait(waiting, max_wait, &asker(state, pool, &ex.record)).await;
            ex.record
                .timeline
                .stamp_admitted(body_read + queued_at.elapsed());
            result.map_err(|e| queue_error(e, pool))?
        }
    };
    let requeue = upstream::Requeue {
        max_wait,
        metrics: state.queue_metrics.as_ref(),
    };
    upstream::send_with_retries(pool, slot, prepared, ex, requeue).await
}

pub(super) fn queue_error(e: QueueError, pool: &Pool) -> ApiError {
    match e {
        QueueError::NoUsableBackend => no_backend(pool),
        QueueError::Refused(r) => ApiError::QueueRefused(r),
    }
}

enum Forwarded {
    Sent(Sent),
    /// A stream waiting in the admission queue, to be answered with `: queued` comments.
    Queued(Queued),
}

/// A stream that waits: its request, its place, and the generation it was routed in.
struct Queued {
    prepared: Prepared,
    waiting: Waiting<Balancer>,
    generation: Arc<Generation>,
}

/// Phase 7: the head goes out, the body is relayed.
async fn answer(state: &ProxyState, sent: Sent, mut ex: Exchange) -> Response<GatewayBody> {
    match sent {
        Sent::Relay(resp, mut relay_parts) => {
            let (head, ()) = resp.into_parts();
            ex.record.status = head.status.as_u16();
            ex.record.timeline.stamp_client_first_byte(Instant::now());
            // When the first frame came in the same read as the head, send them together
            // (the upstream connection is driven by this poll: no waiting).
            let mut first = None;
            if relay_parts.sse
                && let Some(Some(Ok(frame))) = relay_parts.upstream.frame().now_or_never()
            {
                first = frame.into_data().ok();
            }
            let relay = relay_body(state, relay_parts, ex, first);
            Response::from_parts(head, GatewayBody::relay(relay))
        }
        Sent::Full(resp) => {
            ex.record.status = resp.status().as_u16();
            let now = Instant::now();
            ex.record.timeline.stamp_client_first_byte(now);
            ex.record.finish(now);
            resp.map(GatewayBody::full)
        }
    }
}

/// A stream that must wait, with keep-alive comments on: the head goes out now and `: queued`
/// lines follow until the backend's stream takes over.
fn answer_queued(
    state: &Arc<ProxyState>,
    queued: Queued,
    mut ex: Exchange,
) -> Response<GatewayBody> {
    ex.record.status = 200;
    ex.record.timeline.stamp_client_first_byte(Instant::now());
    let mut resp = Response::new(());
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, TEXT_EVENT_STREAM.clone());
    h.insert(header::CACHE_CONTROL, NO_CACHE.clone());
    h.insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    if queued.prepared.timing_trailer {
        h.insert(
            header::TRAILER,
            HeaderValue::from_name(upstream::SERVER_TIMING.clone()),
        );
    }
    if let Some(a) = &ex.admission {
        a.headers.write(h);
    }
    let interval = state
        .queue
        .keepalive_interval
        .unwrap_or(Duration::from_secs(10));
    let rest = Box::pin(continue_queued(state.clone(), queued, ex));
    resp.map(|()| GatewayBody::queued(QueuedBody::new(rest, interval)))
}

fn answer_error(err: &ApiError, mut ex: Exchange) -> Response<GatewayBody> {
    ex.record.status = err.status().as_u16();
    ex.record.error = Some(err.kind());
    if err.kind() == ErrorKind::Internal {
        tracing::error!(request_id = ?ex.record.request_id, "internal error while forwarding");
    }
    ex.record.finish(Instant::now());
    let mut resp = error_response(err, &ex.record.request_id);
    if let ApiError::Limited(r) = err {
        r.headers.write(resp.headers_mut());
    }
    resp
}

/// The relay of an upstream body, with the request's exchange travelling in it.
fn relay_body(
    state: &ProxyState,
    parts: RelayParts,
    ex: Exchange,
    first: Option<Bytes>,
) -> RelayBody {
    let RelayParts {
        upstream,
        sse,
        timeouts,
        slot,
        strip_usage,
        timing_trailer,
        rename,
    } = parts;
    let itl = sse.then(|| state.recorder.metrics()).flatten().map(|m| {
        m.itl(
            ex.record.pool_slot,
            ex.record.key.as_ref().map(|k| k.environment),
        )
    });
    let options = relay::RelayOptions {
        sse,
        timeouts,
        strip_usage: sse && strip_usage,
        itl,
        timing_trailer,
        closing: state.closing.clone(),
        rename,
        max_line: state.max_stream_line,
    };
    RelayBody::new(upstream, options, slot, ex, first)
}

/// A queued stream resumes at phase 5 as its body is polled: wait for a slot, send, and hand
/// over to the relay — or end with an error event.
async fn continue_queued(
    state: Arc<ProxyState>,
    queued: Queued,
    mut ex: Exchange,
) -> queue::Continued<RelayBody> {
    let Queued {
        prepared,
        waiting,
        generation,
    } = queued;
    let result = match generation.at(prepared.pool) {
        Some(pool) => tokio::select! {
            biased;
            r = wait_and_send(&state, pool, Claim::Wait(waiting), prepared, &mut ex) => r,
            () = state.closing.token.cancelled() => Err(state.closing.error()),
        },
        None => Err(ApiError::Internal),
    };
    match result {
        // The head already went out: the backend's own head is dropped, its body relayed.
        Ok(Sent::Relay(_, parts)) => {
            queue::Continued::Relay(Box::pin(relay_body(&state, parts, ex, None)))
        }
        Ok(Sent::Full(resp)) => {
            let body = resp.into_body();
            queue::Continued::Tail(queued_error(
                &mut ex.record,
                &body,
                ErrorKind::UpstreamError,
            ))
        }
        Err(err) => queue::Continued::Tail(queued_error(&mut ex.record, &err.body(), err.kind())),
    }
}

/// End a queued stream with `data: <error>` and `data: [DONE]`; the record is written as the
/// tail is handed over.
fn queued_error(record: &mut RequestRecord, body: &[u8], kind: ErrorKind) -> Bytes {
    record.error = Some(kind);
    record.finish(Instant::now());
    sse_error_event(body, false)
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
                        crate::pool::BackendState::Ejected => "ejected after consecutive failures",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids() {
        let mut h = HeaderMap::new();
        let a = request_id(&h);
        let b = request_id(&h);
        assert_ne!(a, b);
        assert!(a.to_str().unwrap().starts_with("fg-"));
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("mine"));
        assert_eq!(request_id(&h), "mine");
    }
}
