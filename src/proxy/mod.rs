//! Forwarding of completion requests: read and check the body, pick the pool and a backend,
//! send the original bytes upstream, and relay the answer (see `relay`). `forward` reads top
//! to bottom as the request path; each step stamps the request's Timeline.

pub mod error;
pub mod relay;

pub mod view;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use crate::auth::AuthFailure;
use crate::config::AffinityBy;
use crate::key::Environment;
use crate::limits::{LimitKind, Refusal};
use crate::openai::Endpoint;
use crate::openai::error::{ErrorKind, error_body, sse_error_event};
use crate::pool::{InFlight, Pool, Pools, Reachability, Waiting};
use crate::queue::{JoinRefused, TimedOut};
use crate::telemetry::RequestRecord;
use error::{ApiError, ConnectCause, TimeoutKind};
use relay::{GatewayBody, RelayBody};

/// What the forwarding path needs, shared by all requests.
#[derive(Debug)]
pub struct ProxyState {
    /// This worker's pools, swapped by a reload (`pool::fleet`).
    pub pools: crate::pool::fleet::PoolsView,
    pub max_body_bytes: usize,
    pub recorder: Arc<crate::telemetry::Recorder>,
    pub auth: Arc<crate::auth::Authenticator>,
    pub limits: Arc<crate::limits::Limits>,
    pub queue: crate::config::QueueConfig,
}

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");
static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");
static TEXT_EVENT_STREAM: HeaderValue = HeaderValue::from_static("text/event-stream");
static NO_CACHE: HeaderValue = HeaderValue::from_static("no-cache");

/// Largest error body read from a backend to rewrap it.
const MAX_UPSTREAM_ERROR_BODY: usize = 64 * 1024;

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

/// Headers never passed upstream: hop-by-hop ones, the client's credentials (the pool's own
/// upstream key is sent instead), and `accept-encoding` (the relay must see plain SSE).
const STRIP_UPSTREAM: &[HeaderName] = &[
    header::HOST,
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    header::ACCEPT_ENCODING,
    header::EXPECT,
    header::COOKIE,
];

fn strip_upstream_headers(h: &mut HeaderMap) {
    for name in STRIP_UPSTREAM {
        h.remove(name);
    }
    h.remove("x-api-key");
    h.remove("keep-alive");
    h.remove("proxy-connection");
}

/// Hop-by-hop headers of the upstream response, not passed to the client.
fn strip_downstream_headers(h: &mut HeaderMap) {
    h.remove(header::CONNECTION);
    h.remove(header::TRANSFER_ENCODING);
    h.remove(header::TRAILER);
    h.remove(header::UPGRADE);
    h.remove("keep-alive");
}

fn is_json_content_type(v: &HeaderValue) -> bool {
    let Ok(s) = v.to_str() else { return false };
    let mime = s.split(';').next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("application/json")
        || mime.len() > 5 && mime[mime.len() - 5..].eq_ignore_ascii_case("+json")
}

/// Forward one completion request. `record` already carries the request id and `received`.
pub async fn forward(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    mut record: RequestRecord,
) -> Response<GatewayBody> {
    record.endpoint = Some(endpoint);
    match forward_inner(state, endpoint, req, &mut record).await {
        Ok(Forwarded::Sent(Sent::Relay(resp, mut relay_parts))) => {
            let (head, ()) = resp.into_parts();
            record.status = head.status.as_u16();
            record.timeline.client_first_byte = Some(Instant::now());
            // When the first frame came in the same read as the head, send them together:
            // a few scheduler turns for the upstream connection to hand it over, no waiting.
            let mut first = None;
            if relay_parts.sse {
                for _ in 0..relay::GATHER_TURNS {
                    match relay_parts.upstream.frame().now_or_never() {
                        Some(Some(Ok(frame))) => {
                            first = frame.into_data().ok();
                            break;
                        }
                        Some(_) => break,
                        None => tokio::task::yield_now().await,
                    }
                }
            }
            let relay = relay_body(state, relay_parts, record, first);
            Response::from_parts(head, GatewayBody::relay(relay))
        }
        Ok(Forwarded::Sent(Sent::Full(resp))) => {
            record.status = resp.status().as_u16();
            let now = Instant::now();
            record.timeline.client_first_byte = Some(now);
            record.timeline.done = Some(now);
            resp.map(GatewayBody::full)
        }
        Ok(Forwarded::Queued(prepared, waiting, max_wait, pools)) => {
            // A stream that must wait, with keep-alive comments on: the head goes out now and
            // `: queued` lines follow until the backend's stream takes over.
            record.status = 200;
            record.timeline.client_first_byte = Some(Instant::now());
            let mut resp = Response::new(());
            let h = resp.headers_mut();
            h.insert(header::CONTENT_TYPE, TEXT_EVENT_STREAM.clone());
            h.insert(header::CACHE_CONTROL, NO_CACHE.clone());
            h.insert(X_REQUEST_ID.clone(), record.request_id.clone());
            if let Some(a) = &record.admission {
                a.headers.write(h);
            }
            let interval = state
                .queue
                .keepalive_interval
                .unwrap_or(Duration::from_secs(10));
            let rest = Box::pin(continue_queued(
                state.clone(),
                pools,
                prepared,
                waiting,
                max_wait,
                record,
            ));
            resp.map(|()| GatewayBody::queued(relay::QueuedBody::new(rest, interval)))
        }
        Err(err) => {
            record.status = err.status().as_u16();
            record.error = Some(err.kind());
            if matches!(err, ApiError::Internal) {
                tracing::error!(request_id = ?record.request_id, "internal error while forwarding");
            }
            record.timeline.done = Some(Instant::now());
            let mut resp = error_response(&err, &record.request_id);
            if let ApiError::Limited(r) = &err {
                r.refusal.headers.write(resp.headers_mut());
            }
            resp
        }
    }
}

/// The relay of an upstream body, with the request's record travelling in it.
fn relay_body(
    state: &ProxyState,
    parts: RelayParts,
    record: RequestRecord,
    first: Option<Bytes>,
) -> RelayBody {
    let RelayParts {
        upstream,
        sse,
        timeouts,
        slot,
        strip_usage,
    } = parts;
    let itl = sse
        .then(|| state.recorder.metrics())
        .flatten()
        .map(|m| m.itl(record.pool_slot, record.key.as_ref().map(|k| k.environment)));
    let options = relay::RelayOptions {
        sse,
        timeouts,
        strip_usage: sse && strip_usage,
        itl,
    };
    RelayBody::new(upstream, options, slot, record, first)
}

/// The rest of a queued stream's forwarding, run as its body is polled: wait for a slot, send,
/// and hand over to the relay — or end with an error event.
async fn continue_queued(
    state: Arc<ProxyState>,
    pools: Arc<Pools>,
    prepared: Prepared,
    waiting: Waiting,
    max_wait: Duration,
    mut record: RequestRecord,
) -> relay::Continued {
    let result = async {
        let pool = pools.at(prepared.pool).ok_or(ApiError::Internal)?;
        let slot = wait_for_slot(
            &state,
            pool,
            waiting,
            max_wait,
            &mut record,
            prepared.body_read,
        )
        .await?;
        send_with_retries(pool, slot, prepared, &mut record).await
    }
    .await;
    match result {
        // The head already went out: the backend's own head is dropped, its body relayed.
        Ok(Sent::Relay(_, parts)) => {
            relay::Continued::Relay(Box::pin(relay_body(&state, parts, record, None)))
        }
        Ok(Sent::Full(resp)) => {
            let body = resp.into_body();
            relay::Continued::Tail(queued_error(&mut record, &body, ErrorKind::UpstreamError))
        }
        Err(err) => relay::Continued::Tail(queued_error(&mut record, &err.body(), err.kind())),
    }
}

/// End a queued stream with `data: <error>` and `data: [DONE]`; the record is written as the
/// tail is handed over.
fn queued_error(record: &mut RequestRecord, body: &[u8], kind: ErrorKind) -> Bytes {
    record.error = Some(kind);
    record.timeline.done = Some(Instant::now());
    sse_error_event(body, false)
}

struct RelayParts {
    upstream: Incoming,
    sse: bool,
    timeouts: crate::config::Timeouts,
    slot: InFlight,
    /// The gateway injected `include_usage`: hide the usage event from the client.
    strip_usage: bool,
}

/// What sending upstream gave.
enum Sent {
    /// Head ready; the body will be relayed.
    Relay(Response<()>, RelayParts),
    /// A complete response (a backend error rewrapped into OpenAI format).
    Full(Response<Bytes>),
}

enum Forwarded {
    Sent(Sent),
    /// A stream waiting in the admission queue, to be answered with `: queued` comments
    /// (with the pools it was routed in).
    Queued(Prepared, Waiting, Duration, Arc<Pools>),
}

/// The request as it goes upstream, owned: it may wait in the queue past the handler.
struct Prepared {
    headers: HeaderMap,
    body: Bytes,
    endpoint: Endpoint,
    pool: usize,
    /// The gateway injected `include_usage`: hide the usage event from the client.
    strip_usage: bool,
    body_read: Instant,
}

/// A backend slot now, or a place in the queue.
enum SlotOrWait {
    Slot(InFlight),
    Wait(Waiting, Duration),
}

async fn forward_inner(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    record: &mut RequestRecord,
) -> Result<Forwarded, ApiError> {
    let (mut parts, body) = req.into_parts();

    // 1. Body: JSON, within the size limit, read whole (requests are small).
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE)
        && !is_json_content_type(ct)
    {
        return Err(ApiError::UnsupportedMediaType {
            got: String::from_utf8_lossy(ct.as_bytes()).into_owned(),
        });
    }
    let limit = state.max_body_bytes;
    if let Some(len) = parts.headers.get(header::CONTENT_LENGTH)
        && let Some(len) = len.to_str().ok().and_then(|s| s.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let body = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(ApiError::BodyTooLarge { limit });
        }
        Err(e) => return Err(ApiError::BodyRead(e.to_string())),
    };
    let body_read = Instant::now();
    record.timeline.body_read = Some(body_read);

    // 2. The view: parsed once; the bytes stay as they are.
    let view = view::parse(&body, endpoint)?;
    record.stream = view.stream;

    // 3. Route: model → pool → backend, in the pools as they are now (a reload swaps them
    // for the requests that follow; this one keeps these).
    let pools = state.pools.load_full();
    let pool = pools
        .get(&view.model)
        .ok_or_else(|| ApiError::ModelNotFound {
            model: view.model.clone().into_owned(),
            available: pools.model_list.clone(),
        })?;
    record.model = Some(pool.model.clone());
    record.pool_slot = Some(pool.slot);
    if let Some(key) = &record.key {
        let refusal = if !key.allows_model(&pool.model) {
            Some(AuthFailure::ModelNotAllowed {
                model: pool.model.to_string(),
                allowed: key.allowed_models.clone().unwrap_or_default(),
            })
        } else if let Some(envs) = &pool.environments
            && !envs.contains(&key.environment)
        {
            Some(AuthFailure::EnvironmentNotAllowed {
                env: key.environment,
                model: pool.model.to_string(),
                allowed: envs.clone(),
            })
        } else {
            None
        };
        if let Some(f) = refusal {
            state.auth.count(&f);
            return Err(ApiError::Auth(f));
        }
    }

    // Long prompts go to their own pool (if the key's environment may use it), so they do
    // not hold up short ones.
    let mut pool = pool;
    if let Some((min_tokens, target)) = pool.long_prompt
        && state.limits.prompt_tokens(view.prompt_chars) >= min_tokens
        && let Some(t) = pools.at(target)
        && record.key.as_ref().is_none_or(|k| {
            t.environments
                .as_ref()
                .is_none_or(|e| e.contains(&k.environment))
        })
    {
        pool = t;
        record.model = Some(t.model.clone());
        record.pool_slot = Some(t.slot);
    }

    // 4. Limits: the key's rate, token budget and concurrency, its environment's caps.
    if let Some(key) = &record.key {
        let demand = state
            .limits
            .demand(view.prompt_chars, view.max_tokens, view.n);
        match state.limits.admit(key, demand).await {
            Ok(adm) => record.admission = Some(adm),
            Err(refusal) => return Err(ApiError::limited(refusal, &pool.model)),
        }
    }

    // 5. The upstream request: original bytes, unless the model must be renamed.
    // A stream that did not ask for usage gets it anyway upstream (the relay hides it from
    // the client), so every stream's token counts are real.
    let inject_usage = view.stream && view.include_usage != Some(true);
    // The backends' name for the model: spliced in when the client named another (an alias
    // or the pool's name when `served_model_name` differs).
    let rename = (*view.model != *pool.served_name).then_some(&*pool.served_json);
    // Backend affinity: requests of the same user, or with the same prompt prefix, prefer the
    // same backend (its prefix cache). The key is computed only for pools that ask for it.
    let affinity = pool.affinity.and_then(|a| match a.by {
        AffinityBy::User => view.user.map(|u| crate::pool::fnv1a(u.as_bytes())),
        AffinityBy::Prefix => {
            let key: &[u8] = match endpoint {
                Endpoint::Chat => b"\"messages\"",
                Endpoint::Completions => b"\"prompt\"",
            };
            memchr::memmem::find(&body, key).map(|at| {
                let end = (at + key.len() + a.prefix_bytes).min(body.len());
                crate::pool::fnv1a(&body[at..end])
            })
        }
    });
    let upstream_body = view::upstream_body(&body, &view, rename, inject_usage);
    drop(view);
    strip_upstream_headers(&mut parts.headers);
    let mut headers = parts.headers;
    headers.insert(X_REQUEST_ID.clone(), record.request_id.clone());
    headers.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(upstream_body.len() as u64),
    );
    let prepared = Prepared {
        headers,
        body: upstream_body,
        endpoint,
        pool: pool.index,
        strip_usage: inject_usage,
        body_read,
    };

    // 6. A backend slot: at once when one has room, else in the admission queue.
    let slot = match acquire_slot(state, pool, record, body_read, affinity)? {
        SlotOrWait::Slot(slot) => slot,
        SlotOrWait::Wait(waiting, max_wait) => {
            if record.stream && state.queue.keepalive_interval.is_some() {
                return Ok(Forwarded::Queued(
                    prepared,
                    waiting,
                    max_wait,
                    pools.clone(),
                ));
            }
            wait_for_slot(state, pool, waiting, max_wait, record, body_read).await?
        }
    };
    send_with_retries(pool, slot, prepared, record)
        .await
        .map(Forwarded::Sent)
}

/// Send, and when the backend could not be reached or answered 502/503 before any byte went
/// to the client, send again to another backend — at most `retries.max_retries` times and
/// within the pool's retry budget. Nothing is retried once the client has a byte.
async fn send_with_retries(
    pool: &Pool,
    mut slot: InFlight,
    prepared: Prepared,
    record: &mut RequestRecord,
) -> Result<Sent, ApiError> {
    // Retries draw from the generation the slot came from (a queued request may have been
    // handed a slot by a newer one), so the exclusion bits name the same backends.
    let can_retry = {
        let shared = slot.shared();
        shared.retries.max_retries > 0 && shared.backends.len() > 1
    };
    if !can_retry {
        return send(pool, slot, prepared, record).await;
    }
    // (Cloned only in that rare case: the count is shared by every worker.)
    let newer;
    let shared = if Arc::ptr_eq(slot.shared(), &pool.shared) {
        &pool.shared
    } else {
        newer = slot.shared().clone();
        &newer
    };
    shared.retry_budget.deposit();
    let mut tried = 0u64;
    let mut attempt = 0;
    loop {
        tried |= crate::pool::bit(slot.position());
        if attempt >= shared.retries.max_retries {
            return send(pool, slot, prepared, record).await;
        }
        let this = Prepared {
            headers: prepared.headers.clone(),
            body: prepared.body.clone(),
            ..prepared
        };
        let result = send(pool, slot, this, record).await;
        let retryable = match &result {
            Err(ApiError::BackendUnreachable { .. }) => true,
            Ok(Sent::Full(resp)) => matches!(resp.status().as_u16(), 502 | 503),
            _ => false,
        };
        if !retryable {
            return result;
        }
        let Some(next) = shared.try_acquire_excluding(tried) else {
            return result;
        };
        if !shared.retry_budget.try_spend() {
            return result;
        }
        tracing::debug!(request_id = ?record.request_id, from = ?record.backend, to = %next.backend().base, "retrying on another backend");
        // The failed attempt's stamps are forgotten: the Timeline describes the one that
        // answers.
        record.error = None;
        record.timeline.upstream_first_token = None;
        record.timeline.client_first_token = None;
        record.retries = record.retries.saturating_add(1);
        slot = next;
        attempt += 1;
    }
}

/// Send the prepared request to the slot's backend and read the response head.
async fn send(
    pool: &Pool,
    slot: InFlight,
    prepared: Prepared,
    record: &mut RequestRecord,
) -> Result<Sent, ApiError> {
    let backend = slot.backend().clone();
    record.backend = Some(backend.base.clone());
    record.backend_slot = Some(backend.slot);
    let Prepared {
        headers,
        body,
        endpoint,
        strip_usage,
        ..
    } = prepared;
    let mut headers = headers;
    if let Some(auth) = &backend.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    let mut upstream_req = Request::new(Full::new(body));
    *upstream_req.method_mut() = Method::POST;
    *upstream_req.uri_mut() = match endpoint {
        Endpoint::Chat => backend.chat_uri.clone(),
        Endpoint::Completions => backend.completions_uri.clone(),
    };
    *upstream_req.version_mut() = Version::HTTP_11;
    *upstream_req.headers_mut() = headers;

    // 7. Send; wait for the head within the first-token (and total) limit.
    let sent = Instant::now();
    record.timeline.upstream_sent = Some(sent);
    let t = pool.timeouts;
    let head_deadline = sent + t.first_token.min(t.total);
    let resp = match tokio::time::timeout_at(
        head_deadline.into(),
        pool.client.request(upstream_req),
    )
    .await
    {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => {
            let (cause, detail) = classify_client_error(&e);
            if matches!(
                cause,
                ConnectCause::Refused | ConnectCause::Dns | ConnectCause::ConnectTimeout
            ) {
                backend.mark(Reachability::Down);
            }
            backend.record_failure(
                &pool.shared.ejection,
                &format!("{}: {detail}", cause.describe()),
            );
            tracing::warn!(backend = %backend.base, cause = ?cause, %detail, "upstream request failed");
            return Err(ApiError::BackendUnreachable {
                backend: backend.base.to_string(),
                cause,
                detail,
            });
        }
        Err(_) => {
            let kind = if t.total <= t.first_token {
                TimeoutKind::Total
            } else {
                TimeoutKind::FirstToken
            };
            backend.record_failure(
                &pool.shared.ejection,
                &format!(
                    "no response head within {} ms",
                    t.first_token.min(t.total).as_millis()
                ),
            );
            return Err(ApiError::UpstreamTimeout {
                backend: backend.base.to_string(),
                kind,
                after_ms: t.first_token.min(t.total).as_millis(),
            });
        }
    };
    let head_at = Instant::now();
    record.timeline.upstream_first_byte = Some(head_at);
    backend.mark(Reachability::Up);
    if resp.status().is_server_error() {
        backend.record_failure(
            &pool.shared.ejection,
            &format!("answered {}", resp.status()),
        );
    } else {
        backend.record_success();
    }

    let (mut head, upstream) = resp.into_parts();
    if head.status.is_client_error() || head.status.is_server_error() {
        record.error = Some(ErrorKind::UpstreamError);
        let bytes = read_error_body(upstream, head_deadline.max(head_at + t.idle)).await;
        let (body, wrapped) = openai_error_body(head.status, &bytes, &backend.base, &pool.model);
        let mut resp = Response::new(body);
        *resp.status_mut() = head.status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
        h.insert(X_REQUEST_ID.clone(), record.request_id.clone());
        if let Some(ra) = head.headers.get(header::RETRY_AFTER) {
            h.insert(header::RETRY_AFTER, ra.clone());
        }
        if let Some(a) = &record.admission {
            a.headers.write(h);
        }
        if wrapped {
            tracing::debug!(backend = %backend.base, status = head.status.as_u16(), "wrapped a non-OpenAI error body");
        }
        record.timeline.upstream_first_token = Some(head_at);
        record.timeline.client_first_token = Some(Instant::now());
        return Ok(Sent::Full(resp));
    }

    let sse = head
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    strip_downstream_headers(&mut head.headers);
    head.headers
        .insert(X_REQUEST_ID.clone(), record.request_id.clone());
    if let Some(a) = &record.admission
        && !a.headers.is_empty()
    {
        a.headers.write(&mut head.headers);
    }
    head.version = Version::HTTP_11;
    if !sse {
        // The whole answer is in this head's body: the first token is the head.
        record.timeline.upstream_first_token = Some(head_at);
        backend.observe_ttft(head_at.saturating_duration_since(sent));
        record.timeline.client_first_token = Some(head_at);
    }
    if let Some(v) = server_timing(record, head_at, sse) {
        head.headers.insert(SERVER_TIMING.clone(), v);
    }
    Ok(Sent::Relay(
        Response::from_parts(head, ()),
        RelayParts {
            upstream,
            sse,
            timeouts: t,
            slot,
            strip_usage,
        },
    ))
}

/// A slot on one of the pool's backends, or — when all are at capacity — a place in the
/// pool's admission queue (prod before gray before stress, keys taking turns). A full queue,
/// or a key holding its share of it, is refused at once.
fn acquire_slot(
    state: &ProxyState,
    pool: &Pool,
    record: &mut RequestRecord,
    body_read: Instant,
    affinity: Option<u64>,
) -> Result<SlotOrWait, ApiError> {
    let shared = &pool.shared;
    // Gray keys go to the pinned (canary) backends while one of them can take the request.
    let pinned = match &record.key {
        Some(k) if k.environment == Environment::Gray => shared.gray_exclude,
        _ => 0,
    };
    let first = |exclude| match (affinity, pool.affinity) {
        (Some(key), Some(a)) => shared.try_acquire_affine(key, exclude, a.slack),
        _ => shared.try_acquire_excluding(exclude),
    };
    if !shared.queue.has_waiters()
        && let Some(slot) =
            first(pinned).or_else(|| (pinned != 0).then(|| shared.try_acquire()).flatten())
    {
        record.timeline.admitted = Some(body_read);
        return Ok(SlotOrWait::Slot(slot));
    }
    if !shared.any_usable() {
        return Err(no_backend(pool));
    }
    let (key_id, env) = match &record.key {
        Some(k) => (k.id, k.environment),
        None => (-1, Environment::Stress),
    };
    let refuse = |kind, limit: usize| {
        state.limits.count(kind);
        ApiError::limited(
            queue_refusal(record, kind, limit as u64, Duration::from_secs(1)),
            &pool.model,
        )
    };
    let mut ticket = match shared.queue.join(key_id, env, || shared.try_acquire()) {
        Ok(t) => t,
        Err(JoinRefused::Full { max_size }) => return Err(refuse(LimitKind::QueueFull, max_size)),
        Err(JoinRefused::KeyShare { max_per_key }) => {
            return Err(refuse(LimitKind::QueueKeyShare, max_per_key));
        }
    };
    // A slot freed while joining was handed over at once.
    if let Some(slot) = ticket.try_now() {
        record.timeline.admitted = Some(body_read);
        return Ok(SlotOrWait::Slot(slot));
    }
    let max_wait = state.queue.max_wait[env.index()];
    Ok(SlotOrWait::Wait(
        Waiting::new(shared.clone(), ticket),
        max_wait,
    ))
}

/// Wait in the queue up to the environment's maximum; the wait becomes the Timeline's queue
/// wait (`admitted − body_read`).
async fn wait_for_slot(
    state: &ProxyState,
    pool: &Pool,
    waiting: Waiting,
    max_wait: Duration,
    record: &mut RequestRecord,
    body_read: Instant,
) -> Result<InFlight, ApiError> {
    let queued_at = Instant::now();
    let result = waiting.wait(max_wait).await;
    record.timeline.admitted = Some(body_read + queued_at.elapsed());
    match result {
        Ok(slot) => Ok(slot),
        Err(TimedOut) if !pool.shared.any_usable() => Err(no_backend(pool)),
        Err(TimedOut) => {
            state.limits.count(LimitKind::QueueTimeout);
            let limit = u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX);
            let r = queue_refusal(
                record,
                LimitKind::QueueTimeout,
                limit,
                Duration::from_secs(2),
            );
            Err(ApiError::limited(r, &pool.model))
        }
    }
}

fn queue_refusal(record: &RequestRecord, kind: LimitKind, limit: u64, retry: Duration) -> Refusal {
    let (public_id, env) = match &record.key {
        Some(k) => (k.public_id.clone(), k.environment),
        None => (Box::from("-"), Environment::Stress),
    };
    Refusal {
        kind,
        key_id: public_id,
        environment: env,
        limit,
        requested: 0,
        retry_after: Some(retry),
        headers: crate::limits::RateHeaders::default(),
    }
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
                        _ => "at capacity",
                    };
                    format!("{} ({why})", b.base)
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `Server-Timing: gw;dur=<pre-overhead ms>, upstream;dur=<head wait ms>`; streaming
/// responses carry only `gw` (their upstream time is still running). Formatted into a stack
/// buffer: this runs on every request.
fn server_timing(record: &RequestRecord, head_at: Instant, sse: bool) -> Option<HeaderValue> {
    let t = &record.timeline;
    let gw = t.overhead_pre()? + Instant::now().saturating_duration_since(head_at);
    let mut buf = [0u8; 80];
    let mut n = put(&mut buf, 0, b"gw;dur=");
    n = put_ms(&mut buf, n, gw);
    if !sse {
        n = put(&mut buf, n, b", upstream;dur=");
        n = put_ms(
            &mut buf,
            n,
            head_at.saturating_duration_since(t.upstream_sent?),
        );
    }
    HeaderValue::from_bytes(&buf[..n]).ok()
}

fn put(buf: &mut [u8], at: usize, s: &[u8]) -> usize {
    buf[at..at + s.len()].copy_from_slice(s);
    at + s.len()
}

/// Milliseconds with three decimals (microsecond resolution), e.g. `0.041`.
fn put_ms(buf: &mut [u8], at: usize, d: Duration) -> usize {
    let us = d.as_micros().min(u128::from(u64::MAX / 2)) as u64;
    let mut ib = itoa::Buffer::new();
    let mut n = put(buf, at, ib.format(us / 1000).as_bytes());
    let frac = us % 1000;
    buf[n] = b'.';
    buf[n + 1] = b'0' + (frac / 100) as u8;
    buf[n + 2] = b'0' + (frac / 10 % 10) as u8;
    buf[n + 3] = b'0' + (frac % 10) as u8;
    n += 4;
    n
}

/// Name the cause of an upstream client error from its source chain.
fn classify_client_error(e: &hyper_util::client::legacy::Error) -> (ConnectCause, String) {
    let mut detail = e.to_string();
    let mut cause = if e.is_connect() {
        ConnectCause::Other
    } else {
        ConnectCause::Reset
    };
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        detail = s.to_string();
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            cause = match io.kind() {
                std::io::ErrorKind::ConnectionRefused => ConnectCause::Refused,
                std::io::ErrorKind::TimedOut => ConnectCause::ConnectTimeout,
                std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof => ConnectCause::Reset,
                _ if io
                    .get_ref()
                    .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()) =>
                {
                    ConnectCause::Tls
                }
                _ => cause,
            };
        }
        if s.downcast_ref::<rustls::Error>().is_some() {
            cause = ConnectCause::Tls;
        }
        let text = s.to_string();
        if text.contains("dns error") || text.contains("failed to lookup address") {
            cause = ConnectCause::Dns;
        }
        if text.contains("connect timed out") || text.contains("deadline has elapsed") {
            cause = ConnectCause::ConnectTimeout;
        }
        src = s.source();
    }
    (cause, detail)
}

async fn read_error_body(body: Incoming, deadline: Instant) -> Bytes {
    let limited = Limited::new(body, MAX_UPSTREAM_ERROR_BODY);
    match tokio::time::timeout_at(deadline.into(), limited.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        _ => Bytes::new(),
    }
}

/// Keep a backend's OpenAI-shaped error body as it is; wrap anything else (vLLM's
/// `{"error":"Unauthorized"}`, the old flat `{"object":"error",...}`, HTML) into that shape.
fn openai_error_body(status: StatusCode, body: &[u8], backend: &str, model: &str) -> (Bytes, bool) {
    #[derive(serde::Deserialize)]
    struct Probe {
        error: Option<serde_json::Value>,
        message: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
        code: Option<serde_json::Value>,
    }
    let parsed: Option<Probe> = serde_json::from_slice(body).ok();
    if let Some(Probe {
        error: Some(serde_json::Value::Object(obj)),
        ..
    }) = &parsed
        && obj.get("message").is_some_and(|m| m.is_string())
    {
        return (Bytes::copy_from_slice(body), false);
    }
    let reason = status.canonical_reason().unwrap_or("error");
    let code = status.as_u16().to_string();
    let inner = match parsed {
        Some(Probe {
            error: Some(serde_json::Value::String(s)),
            ..
        }) => s,
        Some(Probe {
            message: Some(m),
            kind,
            code: c,
            ..
        }) => {
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
    let hint = match status.as_u16() {
        401 | 403 => format!(
            " The backend refused the gateway's own credentials: check pools[].upstream_api_key for model `{model}` (this is not about your key)."
        ),
        404 => format!(
            " The backend does not serve this path or model: check the backend's served model name (pools[].served_model_name for `{model}`)."
        ),
        _ => String::new(),
    };
    let message = format!(
        "Backend {backend} answered {} {reason}: {inner}.{hint}",
        status.as_u16()
    );
    let kind = if status.is_server_error() {
        "upstream_error"
    } else {
        "invalid_request_error"
    };
    (error_body(&message, kind, None, Some(&code)), true)
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
        assert_eq!(v["error"]["code"], "401");
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
    fn keeps_openai_bodies() {
        let body = r#"{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}"#;
        let (b, wrapped) = openai_error_body(StatusCode::BAD_REQUEST, body.as_bytes(), "b", "m");
        assert!(!wrapped);
        assert_eq!(&b[..], body.as_bytes());
    }

    #[test]
    fn server_timing_millis() {
        let mut buf = [0u8; 40];
        let n = put_ms(&mut buf, 0, Duration::from_micros(41));
        assert_eq!(&buf[..n], b"0.041");
        let n = put_ms(&mut buf, 0, Duration::from_micros(812_305));
        assert_eq!(&buf[..n], b"812.305");
    }

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
