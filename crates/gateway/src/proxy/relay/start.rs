//! The relay step's start: the backend's head goes out (with the first frame when it came in
//! the same read), and the body is relayed with the request's exchange travelling in it; a
//! background POST's answer is read whole and its work watched (`proxy::background`); an
//! answer the send step already holds whole goes out as it is.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::FutureExt;
use http::Response;
use http_body_util::BodyExt;

use super::super::background;
use super::super::error;
use super::super::exchange::Exchange;
use super::super::pins;
use super::super::request::AnswerEdits;
use super::super::send::{RelayParts, Sent};
use super::super::state::ProxyState;
use super::scan::{Scan, learn_whole, observe_first_token, scan_frame};
use super::{GatewayBody, Ready, RelayBody, State, deadline};
use fleetgate_protocol::sse::SseScanner;

/// The answer to the client, from what the send step gave.
pub(in crate::proxy) async fn start(
    state: &Arc<ProxyState>,
    sent: Sent,
    mut ex: Exchange,
) -> Response<GatewayBody> {
    match sent {
        // The answer of a background POST comes whole; its work is watched to its end.
        Sent::Relay(resp, parts) if ex.background && !parts.sse => {
            match Box::pin(background::answer(state, resp, parts, ex)).await {
                Ok(resp) => resp.map(GatewayBody::full),
                Err((err, ex)) => error::answer(&err, ex),
            }
        }
        Sent::Relay(resp, mut parts) => {
            let (head, ()) = resp.into_parts();
            ex.record.status = head.status.as_u16();
            ex.record.timeline.stamp_client_first_byte(Instant::now());
            // When the first frame came in the same read as the head, send them together
            // (the upstream connection is driven by this poll: no waiting).
            let mut first = None;
            if parts.sse
                && let Some(Some(Ok(frame))) = parts.upstream.frame().now_or_never()
            {
                first = frame.into_data().ok();
            }
            let relay = RelayBody::new(state, parts, ex, first);
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

impl RelayBody {
    /// The relay of an upstream body, with the request's exchange travelling in it.
    /// `ex.record.timeline.upstream_sent()` must be set.
    pub(in crate::proxy) fn new(
        state: &Arc<ProxyState>,
        parts: RelayParts,
        mut ex: Exchange,
        first: Option<Bytes>,
    ) -> Self {
        let RelayParts {
            upstream,
            sse,
            dialect,
            mut timeouts,
            mut slot,
            resume,
            answer:
                AnswerEdits {
                    strip_usage,
                    timing_trailer,
                    mut rename,
                    pin,
                },
        } = parts;
        let strip_usage = sse && strip_usage;
        let itl = sse.then(|| state.recorder.metrics()).flatten().map(|m| {
            m.itl(
                ex.record.pool_metrics_index,
                ex.record.key.as_ref().map(|k| k.environment),
                ex.record.endpoint,
            )
        });
        let mut pin = pin.map(|pin| pins::Learn {
            pins: state.pins.clone(),
            pin,
        });
        let background = background_handover(state, &ex, sse, timeouts.total);
        let mut background_id = None;
        let now = Instant::now();
        let sent_at = ex.record.timeline.upstream_sent().unwrap_or(now);
        let mut scanner = SseScanner::for_dialect(dialect, state.max_stream_line);
        let mut ready = Ready::default();
        let mut resume = if sse {
            super::resume::Resume::new(state, resume, &mut timeouts)
        } else {
            None
        };
        if let Some(data) = first {
            // A frame read together with the head: account for it as if just relayed.
            let data = if sse {
                scan_frame(
                    &mut scanner,
                    &mut ex.record,
                    data,
                    now,
                    Scan {
                        strip_usage,
                        itl: itl.as_ref(),
                        backend: slot.backend(),
                        pin: &mut pin,
                        learned: background.as_ref().map(|_| &mut background_id),
                        capture: resume.as_deref_mut().and_then(|r| r.capture()),
                    },
                )
            } else {
                learn_whole(&mut pin, &data);
                Some(data)
            };
            let data = match rename.as_mut() {
                Some(r) => data.and_then(|d| r.pass(d)),
                None => data,
            };
            if let Some(data) = data {
                ready.push(data);
            }
        }
        let first_token = ex.record.timeline.upstream_first_token().is_some();
        if first_token && sse {
            observe_first_token(&mut slot, &mut ex.record, upstream.rx());
        }
        if !sse {
            // An answer that is not streamed comes whole: its prompt was prefilled long ago.
            slot.prefilled();
        }
        let deadline = deadline(sent_at, now, sse, first_token, &timeouts);
        let closing = &state.closing;
        Self {
            upstream,
            timer: tokio::time::sleep_until(deadline.into()),
            sse,
            dialect,
            scanner,
            pin,
            state: State::Relaying,
            sent_at,
            last_read: now,
            timeouts,
            ready,
            tail: [None, None],
            first_frame: None,
            strip_usage,
            itl,
            timing_trailer,
            rename,
            closing: closing.token.clone().cancelled_owned(),
            grace: closing.grace,
            background,
            background_id,
            resume,
            slot,
            ex,
        }
    }
}

/// A streamed background response's hand-over to a watcher, should its client leave early.
fn background_handover(
    state: &ProxyState,
    ex: &Exchange,
    sse: bool,
    total: std::time::Duration,
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
