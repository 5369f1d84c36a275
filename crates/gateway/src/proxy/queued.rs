//! The queued stream exit: a stream that must wait in the pool's queue, with keep-alive
//! comments on (`queue.keepalive_interval_seconds`), answers at once; `: queued` lines follow,
//! and it resumes at the queue wait from its body (`continue_queued`): the same steps as
//! `phases()` from there (queue wait, send, relay), not a second copy of them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use http::header::{self, HeaderValue};

use super::error::ApiError;
use super::exchange::Exchange;
use super::headers::{NO_CACHE, TEXT_EVENT_STREAM, X_REQUEST_ID};
use super::queueing::{self, Place};
use super::relay::{GatewayBody, RelayBody};
use super::request::Prepared;
use super::send::{self, Sent};
use super::state::ProxyState;
use super::timing::SERVER_TIMING;
use crate::pool::{Balancer, Generation};
use crate::queue::{self, QueuedBody, Waiting};
use crate::telemetry::RequestRecord;
use fleetgate_protocol::error::{ErrorKind, Shaped};
use fleetgate_protocol::{Dialect, Endpoint};

/// A stream that waits: its request, its place, and the generation it was routed in.
pub(super) struct Queued {
    pub(super) prepared: Prepared,
    pub(super) waiting: Waiting<Balancer>,
    pub(super) generation: Arc<Generation>,
}

/// A stream that must wait answers at once when keep-alive comments are on.
pub(super) fn keeps_alive(state: &ProxyState, record: &RequestRecord) -> bool {
    record.stream && state.queue.keepalive_interval.is_some()
}

/// A stream that must wait, with keep-alive comments on: the head goes out now and `: queued`
/// lines follow until the backend's stream takes over.
pub(super) fn answer(
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
    if queued.prepared.answer.timing_trailer {
        h.insert(
            header::TRAILER,
            HeaderValue::from_name(SERVER_TIMING.clone()),
        );
    }
    if let Some(a) = &ex.hold {
        a.headers.write(h);
    }
    let interval = state
        .queue
        .keepalive_interval
        .unwrap_or(Duration::from_secs(10));
    let rest = Box::pin(continue_queued(state.clone(), queued, ex));
    resp.map(|()| GatewayBody::queued(QueuedBody::new(rest, interval)))
}

/// A queued stream resumes at the queue wait as its body is polled: wait for a slot, send,
/// and hand over to the relay, or end with an error event.
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
        Some(pool) => {
            let place = Place::Wait(waiting);
            let body_read = prepared.body_read;
            let steps = async {
                let slot = queueing::wait(&state, pool, place, body_read, &mut ex).await?;
                send::with_retries(&state, pool, slot, prepared, &mut ex).await
            };
            state.closing.bound(steps).await
        }
        None => Err(ApiError::Internal),
    };
    match result {
        // The head already went out: the backend's own head is dropped, its body relayed.
        Ok(Sent::Relay(_, parts)) => {
            queue::Continued::Relay(Box::pin(RelayBody::new(&state, parts, ex, None)))
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
