//! Stored responses (the Responses API's `store`): a request by response id goes to the
//! backend that holds it (`by_id`, an exit of the path before the view); a continuation
//! (`previous_response_id`, the stored continuation step) to the backend that holds the
//! response it continues, waiting for room there (`wait_pinned`, in the queue wait); and a new
//! stored response's id is learnt as its answer passes (`pin_of`, `pins`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header;

use super::body::Head;
use super::error::ApiError;
use super::exchange::Exchange;
use super::headers::X_REQUEST_ID;
use super::pins;
use super::queueing::asker;
use super::request::{AnswerEdits, Prepared};
use super::send::{self, Sent};
use super::state::ProxyState;
use crate::pool::{InFlight, Pool};
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::view::RequestView;

/// What a new stored response's pin starts from (the backend is filled in by the attempt
/// that answers).
pub(super) fn pin_of(pool: &Pool, record: &RequestRecord) -> pins::Pin {
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

/// A response that continues a stored one (`previous_response_id`): where that one is.
pub(super) struct Continued {
    /// The position in the pool of the backend that holds it.
    at: usize,
    prev: String,
}

/// The stored response a request continues, if it names one: it goes where that one is, or
/// nowhere.
pub(super) async fn continued(
    state: &ProxyState,
    view: &RequestView<'_>,
    pool: &Pool,
    record: &RequestRecord,
) -> Result<Option<Continued>, ApiError> {
    let Some(prev) = view.previous_response_id.as_deref() else {
        return Ok(None);
    };
    let pin = Box::pin(state.pins.locate(prev)).await;
    let at = pinned_backend(state, prev, pin, pool, record, false)?;
    Ok(Some(Continued {
        at,
        prev: prev.to_owned(),
    }))
}

/// A slot on the one backend that holds the continued response: it cannot take another's, so
/// it waits for room there (the environment's longest wait), outside the pool's queue, which
/// hands out any backend's slots.
pub(super) async fn wait_pinned(
    state: &ProxyState,
    pool: &Pool,
    continued: Continued,
    body_read: Instant,
    max_wait: Duration,
    ex: &mut Exchange,
) -> Result<InFlight, ApiError> {
    let Continued { at, prev } = continued;
    let id = &*prev;
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
            return Err(ApiError::from_queue(e, pool));
        }
        tokio::time::sleep(pause.min(max_wait.saturating_sub(started.elapsed()))).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// A request by response id (`GET /v1/responses/{id}`, its cancel): to the backend that holds
/// it, with the key's rights on its model checked; no slot, no tokens.
pub(super) async fn by_id(
    state: &ProxyState,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    head: Head,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let id = &*id.ok_or(ApiError::Internal)?;
    // A read passes its query through (`?stream=true&starting_after=N` replays a background
    // stream's events).
    let query = head
        .uri
        .query()
        .filter(|_| endpoint.row().method == http::Method::GET);
    let body_read = head.body_read;
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
    ex.record.pool_metrics_index = Some(pool.metrics_index);
    if let Some(key) = ex.record.key.as_deref()
        && let Err(failure) = crate::route::check_rights(key, pool)
    {
        state.auth.count(&failure);
        return Err(ApiError::Auth(failure));
    }
    if let Some(key) = &ex.record.key {
        match state.limits.hold_request(key).await {
            Ok(adm) => ex.hold = Some(adm),
            Err(refusal) => return Err(ApiError::Limited(Box::new(refusal))),
        }
    }
    let at = pinned_backend(state, id, Some(pin), pool, &ex.record, true)?;
    let slot = pool
        .balancer
        .try_acquire_at(at, false)
        .ok_or(ApiError::Internal)?;
    let mut headers = head.outgoing.headers;
    headers.insert(X_REQUEST_ID.clone(), ex.record.request_id.clone());
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::CONTENT_TYPE);
    let method = endpoint.row().method.clone();
    let mut target = endpoint.row().path_with_id(id);
    if let Some(q) = query {
        target.push('?');
        target.push_str(q);
    }
    let prepared = Prepared {
        headers,
        body: Bytes::new(),
        endpoint,
        pool: pool.index,
        body_read,
        answer: AnswerEdits::default(),
        method,
        target: Some(target.into()),
        pinned: true,
        prefix: None,
        prefix_share: None,
        engine_blocks: None,
        only: 0,
    };
    send::with_retries(state, pool, slot, prepared, ex).await
}
