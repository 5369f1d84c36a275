//! The answer (phase 7): the backend's head goes out and its body is relayed, with the
//! request's exchange travelling in it; or the error in the endpoint's dialect.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::Response;
use http::header::{self, HeaderValue};
use http_body_util::BodyExt;

use super::error::ApiError;
use super::exchange::Exchange;
use super::headers::{APPLICATION_JSON, X_REQUEST_ID, X_SHOULD_RETRY};
use super::relay::{self, GatewayBody, RelayBody};
use super::state::ProxyState;
use super::upstream::{RelayParts, Sent};
use super::{background, pins};
use fleetgate_protocol::error::ErrorKind;
use fleetgate_protocol::{Dialect, Endpoint};

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
    // An authentication or rights refusal answers the same to the same key until an operator
    // acts: a client's retry loop only hides the message.
    if matches!(err, ApiError::Auth(_)) {
        h.insert(X_SHOULD_RETRY.clone(), HeaderValue::from_static("false"));
    }
    resp
}

/// Phase 7: the head goes out, the body is relayed.
pub(super) async fn answer(
    state: &ProxyState,
    sent: Sent,
    mut ex: Exchange,
) -> Response<GatewayBody> {
    match sent {
        // The answer of a background POST comes whole; its work is watched to its end.
        Sent::Relay(resp, relay_parts) if ex.background && !relay_parts.sse => {
            match Box::pin(background::answer(state, resp, relay_parts, ex)).await {
                Ok(resp) => resp.map(GatewayBody::full),
                Err((err, ex)) => answer_error(&err, ex),
            }
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

pub(super) fn answer_error(err: &ApiError, mut ex: Exchange) -> Response<GatewayBody> {
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
pub(super) fn relay_body(
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
