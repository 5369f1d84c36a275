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

pub mod backend_error;
mod background;
pub mod body;
pub mod error;
mod fingerprint;
pub mod headers;
pub mod pins;
pub mod prefix_share;
pub mod relay;
pub mod rename;
pub mod retry;
pub mod timing;
pub mod upstream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::key::Environment;
use crate::limits::Admission;
use crate::pool::{Balancer, Generation, InFlight, Pool};
use crate::queue::{self, Asker, Claim, QueueError, QueuedBody, Waiting};
use crate::route::{self, Route, RouteError};
use crate::telemetry::RequestRecord;
use error::ApiError;
use fleetgate_protocol::endpoint::BodyKind;
use fleetgate_protocol::error::{ErrorKind, Shaped};
use fleetgate_protocol::view;
use fleetgate_protocol::{Dialect, Endpoint};
use relay::{GatewayBody, RelayBody};
use upstream::{Prepared, RelayParts, Sent};

/// What the forwarding path needs, shared by all requests.
#[derive(Debug)]
pub struct ProxyState {
    /// This worker's pools, swapped by a reload (`pool::fleet`).
    pub generation: crate::pool::fleet::CurrentGeneration,
    pub max_body_bytes: usize,
    /// The audio routes' `multipart/form-data` bodies (`server.max_audio_body_bytes`).
    pub max_audio_body_bytes: usize,
    /// The whole request body must arrive within this, with no pause longer than the idle
    /// limit.
    pub body_timeouts: body::BodyTimeouts,
    /// The bytes of bodies still arriving, for every worker (`server.max_pending_body_*`).
    pub pending_bodies: Arc<body::PendingBodies>,
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
    /// Which backend holds each stored response (`pins`).
    pub pins: Arc<pins::Pins>,
    /// Longest-prefix records shared with the other replicas (`prefix_share`), with Redis.
    pub prefix_share: Option<Arc<prefix_share::PrefixShare>>,
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
    /// A background response (`background: true`): its answer ends while the backend still
    /// generates; it holds its slots until the backend is done (`background`), and settles
    /// with the finished response's usage, or at what was reserved when there is none.
    pub background: bool,
}

impl Exchange {
    pub fn new(record: RequestRecord) -> Self {
        Self {
            admission: None,
            record,
            background: false,
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let Some(mut adm) = self.admission.take() {
            let used = if self.background && self.record.timeline.upstream_sent().is_some() {
                self.record
                    .timeline
                    .stream()
                    .usage
                    .map_or(adm.reserved(), |u| {
                        u.prompt_tokens.saturating_add(u.completion_tokens)
                    })
            } else {
                self.record.used_tokens(adm.prompt_estimate())
            };
            adm.set_used(used);
        }
    }
}

/// An error response in its endpoint's dialect (OpenAI's shape, or Anthropic's on its
/// routes), with the request id.
pub fn error_response(
    err: &ApiError,
    dialect: Dialect,
    request_id: &HeaderValue,
) -> Response<GatewayBody> {
    let mut resp = Response::new(GatewayBody::full(err.body_in(dialect)));
    *resp.status_mut() = err.status_in(dialect);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    h.insert(X_REQUEST_ID.clone(), request_id.clone());
    if let Some((name, value)) = err.extra_header() {
        h.insert(name, value);
    }
    resp
}

/// The client's `x-request-id` if usable, else a new one: `fg-`, a per-process random prefix
/// (which replica made it), and 96 random bits: unguessable (a stored response's id is made
/// from it) and unique across replicas.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(&X_REQUEST_ID)
        && !v.is_empty()
        && v.len() <= 128
    {
        return v.clone();
    }
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let prefix = *PREFIX.get_or_init(rand::random::<u32>);
    let bits: u128 = rand::random();
    let mut buf = [0u8; 3 + 8 + 1 + 24];
    buf[..3].copy_from_slice(b"fg-");
    hex_into(&mut buf[3..11], u64::from(prefix), 8);
    buf[11] = b'-';
    hex_into(&mut buf[12..20], (bits >> 64) as u64, 8);
    hex_into(&mut buf[20..], bits as u64, 16);
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("fg-invalid"))
}

fn hex_into(out: &mut [u8], mut v: u64, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out[i] = HEX[(v & 0xf) as usize];
        v >>= 4;
    }
}

/// Forward one request of the endpoint table. `record` already carries the request id and
/// `received`; `id` is the stored response a path names.
pub async fn forward(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    req: Request<Incoming>,
    record: RequestRecord,
) -> Response<GatewayBody> {
    let mut ex = Exchange::new(record);
    ex.record.endpoint = Some(endpoint);
    // A request still waiting for its backend's answer when the grace period ends is answered
    // 503 `gateway_shutdown` rather than cut.
    let phased = tokio::select! {
        biased;
        r = phases(state, endpoint, id, req, &mut ex) => r,
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
    id: Option<Box<str>>,
    req: Request<Incoming>,
    ex: &mut Exchange,
) -> Result<Forwarded, ApiError> {
    // The key's endpoint families, before anything is read: refused in the route's dialect.
    if let Some(key) = ex.record.key.as_deref()
        && !key.allows_family(endpoint.family())
    {
        let failure = crate::auth::AuthFailure::EndpointNotAllowed {
            family: endpoint.family(),
            path: endpoint.path(),
            allowed: key.allowed_endpoints.unwrap_or_default(),
        };
        state.auth.count(&failure);
        return Err(ApiError::Auth(failure));
    }
    let (parts, body) = req.into_parts();
    // Anthropic's routes pass their query string through (`?beta=true`).
    let target: Option<Box<str>> = match (endpoint.dialect(), parts.uri.path_and_query()) {
        (Dialect::Anthropic, Some(pq)) if pq.query().is_some() => Some(pq.as_str().into()),
        _ => None,
    };
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
    let kind = endpoint.needs().body;
    let accepted = match kind {
        BodyKind::Multipart => body::Accepted {
            kind,
            limit: state.max_audio_body_bytes,
            setting: "server.max_audio_body_bytes",
        },
        BodyKind::Json | BodyKind::None => body::Accepted {
            kind,
            limit: state.max_body_bytes,
            setting: "server.max_body_bytes",
        },
    };
    let body = body::read(
        &outgoing.headers,
        declared,
        body,
        accepted,
        state.body_timeouts,
        (&state.pending_bodies, ex.record.key.as_ref().map(|k| k.id)),
    )
    .await?;
    let body_read = Instant::now();
    ex.record.timeline.stamp_body_read(body_read);

    if endpoint.needs().body == BodyKind::None {
        let id = id.ok_or(ApiError::Internal)?;
        // A read passes its query through (`?stream=true&starting_after=N` replays a
        // background stream's events).
        let query = parts
            .uri
            .query()
            .filter(|_| endpoint == Endpoint::ResponseGet);
        let by = ById {
            endpoint,
            id: &id,
            query,
        };
        return Box::pin(by_id(state, by, outgoing.headers, body_read, ex))
            .await
            .map(Forwarded::Sent);
    }

    let view = match kind {
        BodyKind::Multipart => {
            let ct = outgoing
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            Box::pin(view::parse_form(&body, ct, endpoint)).await?
        }
        _ => view::parse(&body, endpoint)?,
    };
    ex.record.stream = view.stream;
    ex.background = view.background;

    // In the generation as it is now: a reload swaps it for the requests that follow, this
    // one keeps it to its end.
    let generation = state.generation.load_full();
    let route = route_phase(state, &view, &body, endpoint, &generation, &mut ex.record)?;
    // A response that continues a stored one goes where that one is, or nowhere.
    let pinned_at = match view.previous_response_id.as_deref() {
        Some(prev) => {
            let pin = Box::pin(state.pins.locate(prev)).await;
            let at = pinned_backend(state, prev, pin, route.pool, &ex.record, false)?;
            Some((at, prev.to_owned()))
        }
        None => None,
    };

    ex.admission = admit(state, endpoint, &view, &ex.record).await?;

    if let Some((at, prev)) = pinned_at {
        let mut prepared = upstream::prepare(
            outgoing, &body, &view, &route, endpoint, &ex.record, body_read,
        );
        prepared.pinned = true;
        prepared.pin = view.store.then(|| pin_of(route.pool, &ex.record));
        if prepared.prefix.is_some() {
            prepared.prefix_share.clone_from(&state.prefix_share);
        }
        drop(view);
        // Boxed, as every path only some requests take: the request's future (which a client
        // connection keeps allocated for its life) stays the size chat's needs.
        return Box::pin(send_pinned(state, route.pool, at, &prev, prepared, ex))
            .await
            .map(Forwarded::Sent);
    }

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

    let mut prepared = upstream::prepare(
        outgoing, &body, &view, &route, endpoint, &ex.record, body_read,
    );
    // A `store: false` answer is kept nowhere: it takes no place among the pins.
    if endpoint == Endpoint::Responses && view.store {
        prepared.pin = Some(pin_of(route.pool, &ex.record));
    }
    drop(view);
    prepared.target = target;
    if prepared.prefix.is_some() {
        prepared.prefix_share.clone_from(&state.prefix_share);
    }
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

/// What a new stored response's pin starts from (the backend is filled in by the attempt
/// that answers).
fn pin_of(pool: &Pool, record: &RequestRecord) -> pins::Pin {
    pins::Pin {
        model: pool.model.clone(),
        backend: Arc::from(""),
        key: record
            .key
            .as_ref()
            .map_or_else(|| Arc::from(""), |k| Arc::from(&*k.public_id)),
    }
}

/// The position of the backend holding stored response `id` in `pool`, when it can take the
/// request: a read or a cancel (`reading`) still reaches a draining backend (the response is
/// there until it stops), a new response does not.
fn pinned_backend(
    state: &ProxyState,
    id: &str,
    pin: Option<pins::Pin>,
    pool: &Pool,
    record: &RequestRecord,
    reading: bool,
) -> Result<usize, ApiError> {
    let not_found = || ApiError::ResponseNotFound {
        id: id.to_owned(),
        ttl_s: state.pins.ttl().as_secs(),
    };
    let pin = pin.ok_or_else(not_found)?;
    // Another key's response does not exist for this one (its existence is not told).
    let asker = record.key.as_ref().map_or("", |k| &*k.public_id);
    if *pin.key != *asker {
        return Err(not_found());
    }
    let unavailable = |why: String| ApiError::ResponseUnavailable {
        id: id.to_owned(),
        why,
    };
    if pin.model != pool.model {
        return Err(unavailable(format!(
            "serves model `{}`, not `{}`: continue it with the model that made it",
            pin.model, pool.model
        )));
    }
    let Some(at) = pool.backends.iter().position(|b| *b.base == *pin.backend) else {
        return Err(unavailable(
            "is no longer in the pool (a reload or DNS removed it)".to_owned(),
        ));
    };
    let backend = &pool.backends[at];
    use crate::pool::BackendState as S;
    let why = match backend.state() {
        S::Draining if reading => None,
        _ if backend.eligible() => None,
        S::Draining => Some("is draining (it takes no new requests)"),
        S::Removed => Some("was removed by a reload"),
        S::Down => Some("is down (it failed its last health check or connection)"),
        S::Ejected => Some("was ejected after consecutive failures"),
        S::Warming => Some("is warming up after being down (a restart loses its stored responses)"),
        S::Misconfigured => Some("refuses the gateway's upstream_api_key"),
        _ => Some("cannot take requests now"),
    };
    match why {
        Some(why) => Err(unavailable(format!("{} {why}", backend.shown))),
        None => Ok(at),
    }
}

/// A continuation of stored response `prev`: a slot on its backend (waited for), then sent
/// there and nowhere else.
async fn send_pinned(
    state: &ProxyState,
    pool: &Pool,
    at: usize,
    prev: &str,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let env = ex
        .record
        .key
        .as_ref()
        .map_or(Environment::Stress, |k| k.environment);
    let max_wait = state.queue.max_wait[env.index()];
    let slot = wait_pinned(state, pool, at, prev, prepared.body_read, max_wait, ex).await?;
    let requeue = upstream::Requeue {
        max_wait,
        metrics: state.queue_metrics.as_ref(),
    };
    upstream::send_with_retries(pool, slot, prepared, ex, requeue).await
}

/// A slot on the one backend that holds the continued response: it cannot take another's, so
/// it waits for room there (the environment's longest wait), outside the pool's queue, which
/// hands out any backend's slots.
async fn wait_pinned(
    state: &ProxyState,
    pool: &Pool,
    at: usize,
    id: &str,
    body_read: Instant,
    max_wait: Duration,
    ex: &mut Exchange,
) -> Result<crate::pool::InFlight, ApiError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(slot) = pool.balancer.try_acquire_at(at, true) {
            ex.record
                .timeline
                .stamp_admitted(body_read + started.elapsed());
            return Ok(slot);
        }
        if !pool.backends[at].eligible() {
            return Err(ApiError::ResponseUnavailable {
                id: id.to_owned(),
                why: format!(
                    "{} stopped taking requests while this one waited",
                    pool.backends[at].shown
                ),
            });
        }
        if started.elapsed() >= max_wait {
            let limit = u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX);
            let e = asker(state, pool, &ex.record).refuse(
                crate::queue::RefusalKind::Timeout,
                limit,
                Duration::from_secs(2),
            );
            return Err(queue_error(e, pool));
        }
        tokio::time::sleep(pause.min(max_wait.saturating_sub(started.elapsed()))).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// What a request by response id names.
struct ById<'a> {
    endpoint: Endpoint,
    id: &'a str,
    query: Option<&'a str>,
}

/// A request by response id (`GET /v1/responses/{id}`, its cancel): to the backend that holds
/// it, with the key's rights on its model checked; no slot, no tokens.
async fn by_id(
    state: &ProxyState,
    by: ById<'_>,
    headers: HeaderMap,
    body_read: Instant,
    ex: &mut Exchange,
) -> Result<upstream::Sent, ApiError> {
    let ById {
        endpoint,
        id,
        query,
    } = by;
    let generation = state.generation.load_full();
    let pin = state
        .pins
        .locate(id)
        .await
        .ok_or_else(|| ApiError::ResponseNotFound {
            id: id.to_owned(),
            ttl_s: state.pins.ttl().as_secs(),
        })?;
    let Some(pool) = generation.get(&pin.model) else {
        return Err(ApiError::ResponseUnavailable {
            id: id.to_owned(),
            why: format!(
                "served model `{}`, which this gateway no longer serves",
                pin.model
            ),
        });
    };
    ex.record.model = Some(pool.model.clone());
    ex.record.pool_slot = Some(pool.slot);
    if let Some(key) = ex.record.key.as_deref()
        && let Err(failure) = crate::route::check_rights(key, pool)
    {
        state.auth.count(&failure);
        return Err(ApiError::Auth(failure));
    }
    if let Some(key) = &ex.record.key {
        match state.limits.admit_request(key).await {
            Ok(adm) => ex.admission = Some(adm),
            Err(refusal) => return Err(ApiError::Limited(Box::new(refusal))),
        }
    }
    let at = pinned_backend(state, id, Some(pin), pool, &ex.record, true)?;
    let slot = pool
        .balancer
        .try_acquire_at(at, false)
        .ok_or(ApiError::Internal)?;
    let mut headers = headers;
    headers.insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::CONTENT_TYPE);
    let method = if endpoint == Endpoint::ResponseGet {
        http::Method::GET
    } else {
        http::Method::POST
    };
    let mut target = String::with_capacity(32 + id.len());
    target.push_str("/v1/responses/");
    target.push_str(id);
    if endpoint == Endpoint::ResponseCancel {
        target.push_str("/cancel");
    }
    if let Some(q) = query {
        target.push('?');
        target.push_str(q);
    }
    let prepared = Prepared {
        headers,
        body: Bytes::new(),
        endpoint,
        pool: pool.index,
        strip_usage: false,
        body_read,
        timing_trailer: false,
        rename: None,
        method,
        target: Some(target.into()),
        pinned: true,
        pin: None,
        prefix: None,
        prefix_share: None,
    };
    let requeue = upstream::Requeue {
        max_wait: Duration::ZERO,
        metrics: state.queue_metrics.as_ref(),
    };
    upstream::send_with_retries(pool, slot, prepared, ex, requeue).await
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
/// request, not as inference; a pooling request spends its input's tokens.
async fn admit(
    state: &ProxyState,
    endpoint: Endpoint,
    view: &view::RequestView<'_>,
    record: &RequestRecord,
) -> Result<Option<Admission>, ApiError> {
    let Some(key) = &record.key else {
        return Ok(None);
    };
    let needs = endpoint.needs();
    let admitted = if needs.spends_tokens {
        // A pooling request generates nothing: it reserves its input only, never
        // `default_max_tokens`.
        let max_tokens = if needs.reserves_output {
            view.max_tokens
        } else {
            Some(0)
        };
        let demand = state.limits.demand(view.prompt_chars, max_tokens, view.n);
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
    let key = record.key.as_deref();
    Asker {
        key,
        model: &pool.model,
        metrics: state.queue_metrics.as_ref(),
        goes_first: key.is_some_and(|k| {
            pool.config()
                .priority
                .is_some_and(|p| p.goes_first(k.environment))
        }),
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
    let balancer = &pool.balancer;
    let asker = asker(state, pool, record);
    // With `[pools.priority]`, the environment the backends put first may pass the capacity
    // (up to twice it) when every backend is full: the seats it finds taken are held by
    // requests vLLM will put behind it, whichever replica sent them.
    let overflow = |slot: Option<InFlight>| {
        slot.or_else(|| {
            asker
                .goes_first
                .then(|| balancer.try_acquire_overflow(route.avoid))
                .flatten()
        })
    };
    // Longest-prefix routing: the backends holding the prompt's longest known prefix first;
    // a request that waits for any slot, or falls back, counts as a miss.
    if let (Some(names), Some(index), Some(a)) = (&route.prefix, &pool.prefix, pool.affinity) {
        let found = index.lookup(names);
        let hit = std::cell::Cell::new(false);
        let claimed = queue::claim(
            balancer,
            || {
                overflow(
                    // Gray pinning first (its backends while one can take it), as on every pool.
                    balancer
                        .try_acquire_prefix(&found, route.avoid, a.slack)
                        .or_else(|| {
                            (route.avoid != 0)
                                .then(|| balancer.try_acquire_prefix(&found, 0, a.slack))
                                .flatten()
                        })
                        .map(|(slot, on_prefix)| {
                            hit.set(on_prefix);
                            slot
                        }),
                )
            },
            &asker,
        );
        index.count(hit.get());
        return claimed;
    }
    let affinity = route
        .affinity
        .zip(pool.affinity)
        .map(|(key, a)| (key, a.slack));
    queue::claim(
        balancer,
        || overflow(balancer.try_acquire_routed(route.avoid, affinity)),
        &asker,
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
        // The answer of a background POST comes whole; its work is watched to its end.
        Sent::Relay(resp, relay_parts) if ex.background && !relay_parts.sse => {
            Box::pin(background::answer(state, resp, relay_parts, ex)).await
        }
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
    let dialect = ex.record.endpoint.map_or(Dialect::Chat, Endpoint::dialect);
    ex.record.status = err.status_in(dialect).as_u16();
    ex.record.error = Some(err.kind());
    if err.kind() == ErrorKind::Internal {
        tracing::error!(request_id = ?ex.record.request_id, "internal error while forwarding");
    }
    ex.record.finish(Instant::now());
    let dialect = ex.record.endpoint.map_or(Dialect::Chat, Endpoint::dialect);
    let mut resp = error_response(err, dialect, &ex.record.request_id);
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
        dialect,
        pin,
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
            ex.record.endpoint,
        )
    });
    let options = relay::RelayOptions {
        sse,
        dialect,
        pin: pin.map(|pin| pins::Learn {
            pins: state.pins.clone(),
            pin,
        }),
        timeouts,
        strip_usage: sse && strip_usage,
        itl,
        timing_trailer,
        closing: state.closing.clone(),
        rename,
        max_line: state.max_stream_line,
        background: background_handover(state, &ex, sse, timeouts.total),
    };
    RelayBody::new(upstream, options, slot, ex, first)
}

/// A streamed background response's hand-over to a watcher, should its client leave early.
fn background_handover(
    state: &ProxyState,
    ex: &Exchange,
    sse: bool,
    total: Duration,
) -> Option<Box<background::Handover>> {
    if !(ex.background && sse) {
        return None;
    }
    let generation = state.generation.load();
    let pool = generation.get(ex.record.model.as_deref()?)?;
    Some(Box::new(background::Handover {
        client: pool.client.clone(),
        deadline: Instant::now() + total,
        closing: state.closing.token.clone(),
    }))
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
            let status = resp.status();
            let body = resp.into_body();
            let message = fleetgate_protocol::error::message_of(&body).unwrap_or_default();
            let shaped = Shaped {
                status,
                message: &message,
                kind: "upstream_error",
                param: None,
                code: None,
            };
            let dialect = ex.record.endpoint.map_or(Dialect::Chat, Endpoint::dialect);
            // A chat client gets the backend's own body, as it came.
            let tail = if dialect == Dialect::Chat {
                fleetgate_protocol::error::sse_error_event(&body, false)
            } else {
                shaped.sse_in(dialect, false)
            };
            queue::Continued::Tail(queued_error(&mut ex.record, tail, ErrorKind::UpstreamError))
        }
        Err(err) => {
            let dialect = ex.record.endpoint.map_or(Dialect::Chat, Endpoint::dialect);
            let tail = err.sse_event(dialect, false);
            queue::Continued::Tail(queued_error(&mut ex.record, tail, err.kind()))
        }
    }
}

/// End a queued stream with its error events; the record is written as the tail is handed
/// over.
fn queued_error(record: &mut RequestRecord, tail: Bytes, kind: ErrorKind) -> Bytes {
    record.error = Some(kind);
    record.finish(Instant::now());
    tail
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
