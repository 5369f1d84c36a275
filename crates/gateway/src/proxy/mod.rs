//! The forwarding path. `forward` runs `phases`, one call per phase in the order of
//! docs/architecture.md's table (which names each phase's file), and answers with what they
//! give (`answer`, or `queued` for a stream that waits, or the error). Every phase stamps the
//! request's Timeline; the `Exchange` carries the request's record and its hold on the limits
//! to the end of the response body.

pub mod answer;
pub mod backend_error;
mod background;
pub mod body;
mod claim;
pub mod error;
mod exchange;
pub mod headers;
pub mod pins;
pub mod prefix_share;
mod queued;
pub mod relay;
pub mod rename;
pub mod retry;
pub mod state;
mod stored;
pub mod timing;
pub mod upstream;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header;
use http::{Request, Response, Uri};
use hyper::body::Incoming;

use crate::limits::Admission;
use crate::pool::{Balancer, Generation};
use crate::queue::{Claim, QueueError};
use crate::route::{self, Route, RouteError};
use crate::telemetry::RequestRecord;
use error::ApiError;
use exchange::Exchange;
use fleetgate_protocol::endpoint::BodyKind;
use fleetgate_protocol::view::{self, RequestView};
use fleetgate_protocol::{Dialect, Endpoint};
use headers::Outgoing;
use queued::Queued;
use relay::GatewayBody;
use state::ProxyState;
use upstream::{Prepared, Sent};

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
        Ok(Forwarded::Sent(sent)) => answer::answer(state, sent, ex).await,
        Ok(Forwarded::Queued(queued)) => queued::answer_queued(state, queued, ex),
        Err(err) => answer::answer_error(&err, ex),
    }
}

enum Forwarded {
    Sent(Sent),
    /// A stream waiting in the admission queue, to be answered with `: queued` comments.
    Queued(Queued),
}

/// The phases up to the upstream one, in order; the answer (`answer`) follows in `forward`.
async fn phases(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    req: Request<Incoming>,
    ex: &mut Exchange,
) -> Result<Forwarded, ApiError> {
    refuse_family(state, endpoint, &ex.record)?;
    // body: the head cleaned for the backend and held to its limits, then the body read.
    let (head, body) = receive(state, endpoint, req, &mut ex.record).await?;
    if endpoint.needs().body == BodyKind::None {
        return Box::pin(by_id(state, endpoint, id, head, ex))
            .await
            .map(Forwarded::Sent);
    }
    // view: the body parsed once, the bytes kept.
    let view = view_of(endpoint, &head, &body).await?;
    ex.record.stream = view.stream;
    ex.background = view.background;
    let asked = Asked {
        view: &view,
        body: &body,
        endpoint,
    };
    // route: in the generation as it is now (a reload swaps it for the requests that follow).
    let generation = state.generation.load_full();
    let route = route_phase(state, asked, &generation, &mut ex.record)?;
    let continued = stored::continued(state, &view, route.pool, &ex.record).await?;
    // limits
    ex.admission = admit(state, endpoint, &view, &ex.record).await?;
    if let Some(continued) = continued {
        let prepared = prepare(state, head, asked, &route, &ex.record);
        drop(view);
        // Boxed, as every path only some requests take: the request's future (which a client
        // connection keeps allocated for its life) stays the size chat's needs.
        return Box::pin(stored::send_continuation(
            state, route.pool, continued, prepared, ex,
        ))
        .await
        .map(Forwarded::Sent);
    }
    // queue: a slot now or a place in the queue (routed again if a reload retired the pool).
    let mut newer = None;
    let (generation, route, claim) =
        claim_phase(state, asked, &generation, &mut newer, route, &mut ex.record)?;
    let prepared = prepare(state, head, asked, &route, &ex.record);
    drop(view);
    // A stream that must wait answers at once, `: queued` comments keeping it alive.
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
    // upstream: wait for the slot if there is none yet, then send.
    claim::wait_and_send(state, route.pool, claim, prepared, ex)
        .await
        .map(Forwarded::Sent)
}

/// The key's endpoint families, before anything is read: refused in the route's dialect.
fn refuse_family(
    state: &ProxyState,
    endpoint: Endpoint,
    record: &RequestRecord,
) -> Result<(), ApiError> {
    let Some(key) = record.key.as_deref() else {
        return Ok(());
    };
    if key.allows_family(endpoint.family()) {
        return Ok(());
    }
    let failure = crate::auth::AuthFailure::EndpointNotAllowed {
        family: endpoint.family(),
        path: endpoint.path(),
        allowed: key.allowed_endpoints.unwrap_or_default(),
    };
    state.auth.count(&failure);
    Err(ApiError::Auth(failure))
}

/// A request's head once its body has been read: as a backend gets it, with its target.
struct Head {
    outgoing: Outgoing,
    uri: Uri,
    body_read: Instant,
}

/// What the route and the upstream request are made from.
#[derive(Clone, Copy)]
struct Asked<'a> {
    view: &'a RequestView<'a>,
    body: &'a Bytes,
    endpoint: Endpoint,
}

/// The body phase. The head as a backend would get it is refused here when a backend would
/// refuse it: before the body is read, and without a backend charged for the client's
/// headers. Then the body, within its endpoint's limit.
async fn receive(
    state: &ProxyState,
    endpoint: Endpoint,
    req: Request<Incoming>,
    record: &mut RequestRecord,
) -> Result<(Head, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let declared = body::declared_length(&parts.headers);
    let sender = headers::Sender {
        peer: record.client_addr.map(|a| a.ip()),
        authority: parts.uri.authority(),
    };
    let outgoing = headers::outgoing(parts.headers, &state.forwarding, sender);
    let backend_part = state.generation.load().max_backend_head;
    headers::check_head(
        &outgoing.headers,
        &record.request_id,
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
        (&state.pending_bodies, record.key.as_ref().map(|k| k.id)),
    )
    .await?;
    let body_read = Instant::now();
    record.timeline.stamp_body_read(body_read);
    let head = Head {
        outgoing,
        uri: parts.uri,
        body_read,
    };
    Ok((head, body))
}

/// A request by response id (a read or a cancel of a stored response).
async fn by_id(
    state: &ProxyState,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    head: Head,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let id = id.ok_or(ApiError::Internal)?;
    // A read passes its query through (`?stream=true&starting_after=N` replays a background
    // stream's events).
    let query = head
        .uri
        .query()
        .filter(|_| endpoint == Endpoint::ResponseGet);
    let by = stored::ById {
        endpoint,
        id: &id,
        query,
    };
    stored::by_id(state, by, head.outgoing.headers, head.body_read, ex).await
}

/// The view phase: a JSON body, or an audio form's fields.
async fn view_of<'b>(
    endpoint: Endpoint,
    head: &Head,
    body: &'b Bytes,
) -> Result<RequestView<'b>, ApiError> {
    if endpoint.needs().body == BodyKind::Multipart {
        let ct = head
            .outgoing
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        return Ok(Box::pin(view::form::parse(body, ct, endpoint)).await?);
    }
    Ok(view::parse(body, endpoint)?)
}

/// The route phase: the route, with the pool named in the record (even when the key may not use it).
fn route_phase<'p>(
    state: &ProxyState,
    asked: Asked<'_>,
    pools: &'p Generation,
    record: &mut RequestRecord,
) -> Result<Route<'p>, ApiError> {
    let key = record.key.as_deref();
    let Asked {
        view,
        body,
        endpoint,
    } = asked;
    match route::resolve(view, body, endpoint, key, pools, |chars| {
        state.limits.prompt_tokens(chars)
    }) {
        Ok(route) => {
            record.model = Some(route.pool.model.clone());
            record.pool_slot = Some(route.pool.slot);
            if let Some(scope) = record.otel.as_deref_mut() {
                scope.max_tokens = view.max_tokens;
                scope.response_model = Some(route.pool.served_name.clone());
            }
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

/// The limits phase: the key's limits (requests without a key have none). Tokenization counts as a
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

/// The queue phase's claim. A reload that retired every backend this request could use,
/// between its routing and its claim, is not the client's problem: it is routed once more, in
/// the generation that replaced the old one (kept in `newer`).
fn claim_phase<'g>(
    state: &ProxyState,
    asked: Asked<'_>,
    generation: &'g Arc<Generation>,
    newer: &'g mut Option<Arc<Generation>>,
    route: Route<'g>,
    record: &mut RequestRecord,
) -> Result<(&'g Arc<Generation>, Route<'g>, Claim<Balancer>), ApiError> {
    match claim::claim(state, &route, record) {
        Ok(claim) => Ok((generation, route, claim)),
        Err(QueueError::NoUsableBackend) if !Arc::ptr_eq(generation, &*state.generation.load()) => {
            let newer: &'g Arc<Generation> = newer.insert(state.generation.load_full());
            let route = route_phase(state, asked, newer, record)?;
            let claim = claim::claim(state, &route, record)
                .map_err(|e| ApiError::from_queue(e, route.pool))?;
            Ok((newer, route, claim))
        }
        Err(e) => Err(ApiError::from_queue(e, route.pool)),
    }
}

/// The request as it goes upstream: the original bytes, with the splices the route asks for
/// (`upstream::prepare`); a new stored response learns its backend from the answer, and a
/// longest-prefix request tells the other replicas where its prefix went.
fn prepare(
    state: &ProxyState,
    head: Head,
    asked: Asked<'_>,
    route: &Route<'_>,
    record: &RequestRecord,
) -> Prepared {
    let Head {
        outgoing,
        uri,
        body_read,
    } = head;
    let Asked {
        view,
        body,
        endpoint,
    } = asked;
    let mut prepared = upstream::prepare(outgoing, body, view, route, endpoint, record, body_read);
    // A `store: false` answer is kept nowhere: it takes no place among the pins.
    if endpoint == Endpoint::Responses && view.store {
        prepared.pin = Some(stored::pin_of(route.pool, record));
    }
    // Anthropic's routes pass their query string through (`?beta=true`).
    if endpoint.dialect() == Dialect::Anthropic
        && let Some(pq) = uri.path_and_query()
        && pq.query().is_some()
    {
        prepared.target = Some(pq.as_str().into());
    }
    if prepared.prefix.is_some() {
        prepared.prefix_share.clone_from(&state.prefix_share);
    }
    prepared
}
