//! The upstream phase: the request as it goes to a backend (the client's bytes, its headers
//! without hop-by-hop ones and credentials), sending it with retries before the first byte,
//! reading the response head within the first-token limit, and rewrapping a backend's error
//! into OpenAI's format with whose fault it is.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full, Limited};

use super::error::{ApiError, ConnectCause, HeadExcess, TimeoutKind};
use super::{APPLICATION_JSON, Exchange, X_REQUEST_ID};
use crate::pool::driven::{SendError, UpstreamBody};
use crate::pool::{Backend, InFlight, Pool, Reachability};
use crate::protocol::Endpoint;
use crate::protocol::error::{ErrorKind, error_body};
use crate::protocol::view::{self, RequestView};
use crate::route::Route;
use crate::telemetry::RequestRecord;

pub static SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");
/// `Trailer: server-timing`.
static SERVER_TIMING_VALUE: HeaderValue = HeaderValue::from_static("server-timing");

/// Largest error body read from a backend to rewrap it.
const MAX_UPSTREAM_ERROR_BODY: usize = 64 * 1024;

/// Headers of the client's never passed upstream besides the hop-by-hop ones and `host` (taken
/// out first by `outgoing`, for `X-Forwarded-Host`; the backend's own is sent): its credentials
/// (the pool's own upstream key is sent instead), `content-length` and `x-request-id` (the
/// gateway sets both), `accept-encoding` (the relay must see plain SSE), `expect` and `cookie`.
const STRIP_UPSTREAM: &[HeaderName] = &[
    header::AUTHORIZATION,
    header::CONTENT_LENGTH,
    header::ACCEPT_ENCODING,
    header::EXPECT,
    header::COOKIE,
];

/// Hop-by-hop headers by definition (RFC 9110 §7.6.1, and the older `Keep-Alive` and
/// `Proxy-Connection` it names), removed in both directions with the ones `Connection` names.
/// `Trailer` too: the gateway frames every body anew.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Remove `Connection`, every header it names, and the hop-by-hop ones (RFC 9110 §7.6.1).
/// Without a `Connection` header (every HTTP/2 request, most HTTP/1.1 ones) this is a few
/// lookups; one `Connection` line is taken out and read in place; only several lines are
/// copied out first (their names cannot be removed while the map is borrowed).
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let (one, more) = {
        let mut lines = h.get_all(header::CONNECTION).iter();
        (lines.next().is_some(), lines.next().is_some())
    };
    if more {
        let lines: Vec<HeaderValue> = h.get_all(header::CONNECTION).iter().cloned().collect();
        for line in &lines {
            remove_named(h, line);
        }
    } else if one && let Some(line) = h.remove(header::CONNECTION) {
        remove_named(h, &line);
    }
    for name in &HOP_BY_HOP {
        h.remove(name);
    }
}

/// Remove the headers a `Connection` value names (a comma-separated list of field names).
fn remove_named(h: &mut HeaderMap, connection: &HeaderValue) {
    for token in connection.as_bytes().split(|b| *b == b',') {
        if let Ok(name) = std::str::from_utf8(token.trim_ascii())
            && !name.is_empty()
        {
            h.remove(name);
        }
    }
}

/// How forwarded requests say whom they came from (`server.forwarded_headers`,
/// `server.trusted_proxies`), made once from config.
#[derive(Debug, Clone)]
pub struct Forwarding {
    /// Set `X-Forwarded-For`, `-Proto` and `-Host` (false: the client's go, none are set).
    pub enabled: bool,
    /// Peers whose own forwarding headers are kept (and extended).
    pub trusted: Vec<ipnet::IpNet>,
    /// `http` or `https`: how the client reached this listener.
    pub proto: HeaderValue,
}

impl Forwarding {
    pub fn new(server: &crate::config::ServerConfig) -> Self {
        Self {
            enabled: server.forwarded_headers,
            trusted: server.trusted_proxies.clone(),
            proto: HeaderValue::from_static(if server.tls.is_some() {
                "https"
            } else {
                "http"
            }),
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Headers by which a sender states another client address, host, scheme or prefix: believed
/// only from a trusted proxy, else removed (and the gateway's own set).
static CLIENT_CLAIMS: [HeaderName; 8] = [
    header::FORWARDED,
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    HeaderName::from_static("x-forwarded-port"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-real-ip"),
    HeaderName::from_static("x-client-ip"),
];

/// Path overrides some frameworks obey instead of the request line: never forwarded, from
/// anyone — the gateway forwards only the routes it knows, and a backend must see those.
static PATH_OVERRIDES: [HeaderName; 2] = [
    HeaderName::from_static("x-original-url"),
    HeaderName::from_static("x-rewrite-url"),
];

/// Who sent the request, as the listener saw it.
#[derive(Debug, Clone, Copy)]
pub struct Sender<'a> {
    pub peer: Option<std::net::IpAddr>,
    /// The request's authority (HTTP/2's `:authority`; HTTP/1.1 has it in `Host`).
    pub authority: Option<&'a http::uri::Authority>,
}

/// Replace (or, from a trusted proxy, extend) the forwarding headers: `X-Forwarded-For` ends
/// with the peer's address, `X-Forwarded-Proto` and `-Host` say how the client reached the
/// gateway. `host` is the client's `Host` (read before it was removed).
fn forwarding(
    headers: &mut HeaderMap,
    fwd: &Forwarding,
    sender: Sender<'_>,
    host: Option<HeaderValue>,
) {
    for name in &PATH_OVERRIDES {
        headers.remove(name);
    }
    let peer = sender.peer.map(|ip| ip.to_canonical());
    let trusted = fwd.enabled && peer.is_some_and(|ip| fwd.trusted.iter().any(|n| n.contains(&ip)));
    let prior = if trusted {
        join_lines(headers, &X_FORWARDED_FOR)
    } else {
        for name in &CLIENT_CLAIMS {
            headers.remove(name);
        }
        None
    };
    let (true, Some(ip)) = (fwd.enabled, peer) else {
        return;
    };
    // One allocation: the peer's address (at most 39 bytes) after the trusted chain, if any.
    let mut value = prior.unwrap_or_else(|| Vec::with_capacity(40));
    if !value.is_empty() {
        value.extend_from_slice(b", ");
    }
    {
        use std::io::Write as _;
        let _ = write!(value, "{ip}");
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, fwd.proto.clone());
    }
    if !headers.contains_key(&X_FORWARDED_HOST) {
        let host = host.or_else(|| {
            sender
                .authority
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        if let Some(h) = host {
            headers.insert(X_FORWARDED_HOST, h);
        }
    }
}

/// Every line of `name` joined with ", " (a list header may come in several lines); taken out.
fn join_lines(headers: &mut HeaderMap, name: &HeaderName) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for v in headers.get_all(name) {
        let o = out.get_or_insert_with(|| Vec::with_capacity(v.len() + 48));
        if !o.is_empty() {
            o.extend_from_slice(b", ");
        }
        o.extend_from_slice(v.as_bytes());
    }
    headers.remove(name);
    out
}

/// The client's headers as they will go upstream, with what the gateway read of the ones
/// that do not.
pub struct Outgoing {
    pub headers: HeaderMap,
    /// The client accepts trailers (`TE: trailers`): a stream's `Server-Timing`, with the hop
    /// cost known only after its first token, comes as a trailer.
    pub trailers: bool,
}

/// Clean the client's headers for the backend: done first, so that the head limit measures
/// what would really be forwarded. `TE` is read before it goes (it is hop-by-hop, and often
/// named in `Connection` as RFC 9110 asks).
pub fn outgoing(mut headers: HeaderMap, fwd: &Forwarding, sender: Sender<'_>) -> Outgoing {
    let trailers = accepts_trailers(&headers);
    strip_hop_by_hop(&mut headers);
    let host = headers.remove(header::HOST);
    for name in STRIP_UPSTREAM {
        headers.remove(name);
    }
    forwarding(&mut headers, fwd, sender, host);
    headers.remove("x-api-key");
    headers.remove(&X_REQUEST_ID);
    Outgoing { headers, trailers }
}

/// The head limits (`server.max_upstream_*`).
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    pub max_head: usize,
    pub max_value: usize,
}

/// Header fields forwarded at most: the listener's own HTTP/1.1 limit (hyper's default of 100),
/// so an HTTP/2 client, bounded by size only, is held to the same; vLLM's server takes 256.
pub const MAX_FORWARDED_FIELDS: usize = 100;

/// Whether the request's head, as a backend would get it, is within what backends accept:
/// its headers (already `outgoing`), the gateway's own (`x-request-id`, `content-length` at
/// its widest, the blank line) and the largest part a backend decides (`backend_part`:
/// request line, `Host`, `Authorization`). Counts only; no allocation unless it refuses.
pub fn check_head(
    headers: &HeaderMap,
    request_id: &HeaderValue,
    backend_part: usize,
    limits: HeadLimits,
) -> Result<(), HeadExcess> {
    let line = |name: usize, value: usize| name + 2 + value + 2;
    let mut bytes = backend_part
        + line(X_REQUEST_ID.as_str().len(), request_id.len())
        + line("content-length".len(), 20)
        + 2;
    let mut fields = 2;
    let mut largest: Option<(&HeaderName, usize)> = None;
    for (name, value) in headers {
        bytes += line(name.as_str().len(), value.len());
        fields += 1;
        if value.len() > limits.max_value && largest.is_none_or(|(_, n)| value.len() > n) {
            largest = Some((name, value.len()));
        }
    }
    if let Some((name, n)) = largest {
        return Err(HeadExcess::Value {
            name: name.as_str().chars().take(64).collect(),
            bytes: n,
            limit: limits.max_value,
        });
    }
    if fields > MAX_FORWARDED_FIELDS {
        return Err(HeadExcess::Fields {
            count: fields,
            limit: MAX_FORWARDED_FIELDS,
        });
    }
    if bytes > limits.max_head {
        return Err(HeadExcess::Total {
            bytes,
            limit: limits.max_head,
        });
    }
    Ok(())
}

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
    request_id: &HeaderValue,
    body_read: Instant,
) -> Prepared {
    let inject_usage =
        endpoint.needs().injects_usage && view.stream && view.include_usage != Some(true);
    let upstream_body = view::upstream_body(body, view, route.rename, inject_usage);
    let Outgoing {
        mut headers,
        trailers,
    } = outgoing;
    let timing_trailer = view.stream && trailers;
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
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
    }
}

/// `TE: trailers` (among other codings).
fn accepts_trailers(h: &HeaderMap) -> bool {
    h.get_all(header::TE).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
    })
}

pub struct RelayParts {
    pub upstream: UpstreamBody,
    pub sse: bool,
    pub dialect: crate::protocol::Dialect,
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

/// Send, and when the backend could not be reached or answered 502/503 before any byte went
/// to the client, send again to another backend — at most `retries.max_retries` times and
/// within the pool's retry budget. Nothing is retried once the client has a byte.
pub async fn send_with_retries(
    pool: &Pool,
    mut slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
    requeue: Requeue<'_>,
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
    let mut tried = 0u64;
    let mut attempt = 0;
    loop {
        tried |= crate::pool::bit(slot.position());
        if attempt >= balancer.retries.max_retries {
            return send(pool, slot, prepared, ex).await;
        }
        let this = Prepared {
            headers: prepared.headers.clone(),
            body: prepared.body.clone(),
            rename: prepared.rename.clone(),
            method: prepared.method.clone(),
            target: prepared.target.clone(),
            pin: prepared.pin.clone(),
            ..prepared
        };
        let result = send(pool, slot, this, ex).await;
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
            // Every other backend is at capacity: the retry waits for a slot in the pool's
            // queue, as a new request would, rather than failing a request that a free slot
            // a moment later would serve.
            None if counted => match requeue.wait(pool, balancer, tried, ex).await {
                Ok(next) => next,
                Err(e) => return Err(super::queue_error(e, pool)),
            },
            None => return result,
        };
        tracing::debug!(request_id = ?ex.record.request_id, from = ?ex.record.backend, to = %next.backend().base, "retrying on another backend");
        // The failed attempt's stamps are forgotten: the Timeline describes the one that
        // answers.
        ex.record.error = None;
        ex.record.timeline.forget_attempt();
        ex.record.retries = ex.record.retries.saturating_add(1);
        slot = next;
        attempt += 1;
    }
}

/// What a retry needs to wait in the pool's queue: the key's environment's longest wait.
pub struct Requeue<'a> {
    pub max_wait: Duration,
    pub metrics: Option<&'a crate::queue::QueueMetrics>,
}

impl Requeue<'_> {
    /// A slot on a backend not yet `tried` when one is free, else the next one the queue
    /// hands out; the wait joins the Timeline's queue wait.
    async fn wait(
        &self,
        pool: &Pool,
        balancer: &Arc<crate::pool::Balancer>,
        tried: u64,
        ex: &mut Exchange,
    ) -> Result<InFlight, crate::queue::QueueError> {
        use crate::queue::{self, Asker, Claim};
        let key = ex.record.key.clone();
        let asker = Asker {
            key: key.as_deref(),
            model: &pool.model,
            metrics: self.metrics,
        };
        let started = Instant::now();
        let claimed = queue::claim(balancer, || balancer.try_acquire_excluding(tried), &asker)?;
        let slot = match claimed {
            Claim::Now(slot) => slot,
            Claim::Wait(waiting) => queue::wait(waiting, self.max_wait, &asker).await?,
        };
        let waited = started.elapsed();
        let timeline = &mut ex.record.timeline;
        if let Some(admitted) = timeline.admitted() {
            timeline.stamp_admitted(admitted + waited);
        }
        Ok(slot)
    }
}

/// Send the prepared request to the slot's backend and read the response head.
async fn send(
    pool: &Pool,
    slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let backend = slot.backend().clone();
    ex.record.backend = Some(backend.base.clone());
    ex.record.backend_slot = Some(backend.slot);
    let mut prepared = prepared;
    let strip_usage = prepared.strip_usage;
    let timing_trailer = prepared.timing_trailer;
    let rename = prepared.rename.take();
    let pin = prepared.pin.take();
    let endpoint = prepared.endpoint;
    let inference = endpoint.needs().generates;
    let upstream_req = upstream_request(&backend, prepared)?;

    // Send; wait for the head within the first-token (and total) limit.
    let sent = Instant::now();
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
    // (Tokenization has no first token: its answer feeds neither TTFT figure.)
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
        None => match endpoint {
            Endpoint::Chat => backend.chat_uri.clone(),
            Endpoint::Completions => backend.completions_uri.clone(),
            Endpoint::Tokenize => backend.tokenize_uri.clone(),
            Endpoint::Detokenize => backend.detokenize_uri.clone(),
            Endpoint::Responses => backend.responses_uri.clone(),
            Endpoint::Messages => backend.messages_uri.clone(),
            Endpoint::CountTokens => backend.count_tokens_uri.clone(),
            // (Always given a target: the path names the response.)
            Endpoint::ResponseGet | Endpoint::ResponseCancel => return Err(ApiError::Internal),
        },
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

/// A backend's error answer, its body in OpenAI format (rewrapped when it is not), with the
/// backend's status and `Retry-After`.
async fn error_answer(
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
            let message = crate::protocol::error::message_of(&body).unwrap_or_default();
            body = crate::protocol::error::anthropic_body(
                crate::protocol::error::anthropic_type(status),
                &message,
            );
        } else {
            body = bytes.clone();
        }
        status = crate::protocol::error::anthropic_status(status);
    }
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    h.insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    if let Some(ra) = head.headers.get(header::RETRY_AFTER) {
        h.insert(header::RETRY_AFTER, ra.clone());
    }
    if let Some(a) = &ex.admission {
        a.headers.write(h);
    }
    if wrapped {
        tracing::debug!(backend = %backend.base, status = head.status.as_u16(), "wrapped a non-OpenAI error body");
    }
    resp
}

/// `Server-Timing: gw;dur=<pre-overhead ms>, upstream;dur=<head wait ms>, hop;dur=<ms>`;
/// streaming responses carry only `gw` (their upstream time is still running; the whole
/// figure comes as a trailer, `stream_timing`). Formatted into a stack buffer: this runs on
/// every request.
fn server_timing(record: &RequestRecord, head_at: Instant, sse: bool) -> Option<HeaderValue> {
    let t = &record.timeline;
    let gw = t.overhead_pre()? + Instant::now().saturating_duration_since(head_at);
    let mut buf = [0u8; 96];
    let mut n = put(&mut buf, 0, b"gw;dur=");
    n = put_ms(&mut buf, n, gw);
    if !sse {
        n = put(&mut buf, n, b", upstream;dur=");
        n = put_ms(
            &mut buf,
            n,
            head_at.saturating_duration_since(t.upstream_sent()?),
        );
        n = put_hop(&mut buf, n, t);
    }
    HeaderValue::from_bytes(&buf[..n]).ok()
}

/// A stream's `Server-Timing` trailer: `gw;dur=<pre + relay ms>, hop;dur=<ms>`.
pub fn stream_timing(record: &RequestRecord) -> Option<HeaderMap> {
    let t = &record.timeline;
    let mut buf = [0u8; 64];
    let mut n = put(&mut buf, 0, b"gw;dur=");
    n = put_ms(&mut buf, n, t.overhead_total()?);
    n = put_hop(&mut buf, n, t);
    let mut h = HeaderMap::with_capacity(1);
    h.insert(
        SERVER_TIMING.clone(),
        HeaderValue::from_bytes(&buf[..n]).ok()?,
    );
    Some(h)
}

/// `, hop;dur=<ms>` when the Timeline has the hop cost.
fn put_hop(buf: &mut [u8], at: usize, t: &crate::telemetry::Timeline) -> usize {
    match t.hop() {
        Some(hop) => {
            let n = put(buf, at, b", hop;dur=");
            put_ms(buf, n, hop)
        }
        None => at,
    }
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
    let tokenizer = endpoint.filter(|e| !e.needs().generates);
    let hint = match (status.as_u16(), tokenizer) {
        (404, Some(e)) => format!(
            " The backend does not offer tokenization: it has no POST {} (vLLM serves /tokenize and /detokenize at its root; other OpenAI-compatible servers may not). Tokenize for model `{model}` with its own tokenizer instead, or ask the operator for a vLLM backend.",
            e.path()
        ),
        _ if gateway_credentials => format!(
            " The backend refused the gateway's own credentials: check pools[].upstream_api_key for model `{model}` (this is not about your key)."
        ),
        (404, None) => format!(
            " The backend does not serve this path or model: check the backend's served model name (pools[].served_model_name for `{model}`)."
        ),
        _ => String::new(),
    };
    let message = format!(
        "Backend {backend} answered {} {reason}: {inner}.{hint}",
        status.as_u16()
    );
    let kind = if status.is_server_error() || gateway_credentials {
        "upstream_error"
    } else {
        "invalid_request_error"
    };
    let code = match (status.as_u16(), tokenizer) {
        _ if gateway_credentials => "backend_auth_failed",
        (404, Some(_)) => "tokenization_unavailable",
        _ => &code,
    };
    (error_body(&message, kind, None, Some(code)), true)
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

    #[test]
    fn server_timing_millis() {
        let mut buf = [0u8; 40];
        let n = put_ms(&mut buf, 0, Duration::from_micros(41));
        assert_eq!(&buf[..n], b"0.041");
        let n = put_ms(&mut buf, 0, Duration::from_micros(812_305));
        assert_eq!(&buf[..n], b"812.305");
    }
}
