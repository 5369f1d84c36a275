//! Background responses (`background: true` on `/v1/responses`): vLLM answers the POST at
//! once with a `queued` response and goes on generating. The work is the backend's for as long
//! as it runs, so it keeps what a request holds for as long: its backend slot (the pool's
//! `max_in_flight_per_backend` and its queue see it) and its key's hold (the key's
//! concurrency; its tokens settle with the finished response's usage). The POST's answer goes
//! out whole; then a watcher polls `GET /v1/responses/{id}` on that backend until the response
//! is no longer `queued` or `in_progress`, and releases both. A watcher gives up (and
//! releases) at the pool's total timeout, when the backend no longer knows the response, after
//! repeated failed polls, or when the shutdown grace period ends.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use tokio_util::sync::CancellationToken;

use super::error::ApiError;
use super::exchange::Exchange;
use super::pins;
use super::request::AnswerEdits;
use super::send::RelayParts;
use super::state::ProxyState;
use crate::limits::Hold;
use crate::pool::{Backend, InFlight, UpstreamClient};

/// The first pause between two polls; it doubles up to `MAX_POLL`.
const FIRST_POLL: Duration = Duration::from_millis(100);
const MAX_POLL: Duration = Duration::from_secs(1);
/// Polls that fail in a row (no answer, an error status) before the watcher gives up.
const MAX_FAILED_POLLS: u32 = 10;
/// The most bytes of a background answer (the POST's, or a poll's) read.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Answer a background POST whole, and watch the work it started until it ends; or the error
/// to answer with, when the backend's answer broke off.
pub(super) async fn answer(
    state: &ProxyState,
    resp: Response<()>,
    parts: RelayParts,
    mut ex: Exchange,
) -> Result<Response<Bytes>, (ApiError, Exchange)> {
    let (mut head, ()) = resp.into_parts();
    let RelayParts {
        upstream,
        timeouts,
        slot,
        answer: AnswerEdits { pin, rename, .. },
        ..
    } = parts;
    ex.record.status = head.status.as_u16();
    let read = tokio::time::timeout(
        timeouts.total,
        Limited::new(upstream, MAX_ANSWER_BYTES).collect(),
    )
    .await;
    let body = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => return Err((failed(&slot, &e.to_string()), ex)),
        Err(_) => return Err((failed(&slot, "the answer did not arrive in time"), ex)),
    };
    let now = Instant::now();
    ex.record.timeline.stamp_client_first_byte(now);
    ex.record.finish(now);
    let id = pins::leading_id(&body);
    if let (Some(pin), Some(id)) = (pin, &id) {
        pins::Learn {
            pins: state.pins.clone(),
            pin,
        }
        .learned(id.clone());
    }
    let running = head.status.is_success() && still_running(&body);
    if !running {
        // Already finished (or refused): what the answer says it used is all there is.
        ex.record
            .timeline
            .set_usage(fleetgate_protocol::stream::usage_in(&body));
    }
    let body = match rename {
        Some(mut r) => {
            let mut out = r.pass(body).map(|b| b.to_vec()).unwrap_or_default();
            if let Some(rest) = r.finish() {
                out.extend_from_slice(&rest);
            }
            Bytes::from(out)
        }
        None => body,
    };
    head.headers.remove(header::CONTENT_LENGTH);
    if let (true, Some(id)) = (running, id) {
        let pool = state
            .generation
            .load()
            .get(ex.record.model.as_deref().unwrap_or_default())
            .map(|p| p.client.clone());
        if let Some(client) = pool {
            let watch = Watch {
                client,
                id,
                deadline: now + timeouts.total,
                closing: state.closing.token.clone(),
            };
            tokio::spawn(watch.run(slot, Held::Exchange(Box::new(ex))));
        }
    }
    Ok(Response::from_parts(head, body))
}

/// The backend's answer broke off: a 502 naming it (slot and hold are released as the
/// error is answered).
fn failed(slot: &InFlight, why: &str) -> ApiError {
    ApiError::UpstreamStreamFailed {
        backend: slot.backend().shown.to_string(),
        detail: why.to_owned(),
    }
}

/// The response object's `status` says the backend still works on it.
fn still_running(body: &[u8]) -> bool {
    matches!(status_of(body).as_deref(), Some("queued" | "in_progress"))
}

fn status_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Status {
        status: Option<String>,
    }
    serde_json::from_slice::<Status>(body).ok()?.status
}

/// What a streamed background response's relay needs to hand its work to a watcher when its
/// client leaves before the end (the backend goes on generating).
#[derive(Debug)]
pub(super) struct Handover {
    pub(crate) client: UpstreamClient,
    pub(crate) deadline: Instant,
    pub(crate) closing: CancellationToken,
}

impl Handover {
    /// The client of a streamed background response left before its end: its slot and its
    /// key's hold stay held until the backend is done.
    pub(super) fn watch(self, id: String, slot: InFlight, hold: Option<Hold>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let watch = Watch {
            client: self.client,
            id,
            deadline: self.deadline,
            closing: self.closing,
        };
        runtime.spawn(watch.run(slot, Held::Hold(hold)));
    }
}

/// What a watcher settles when the work ends: a background POST's whole exchange (its record
/// is written then), or the hold of a stream whose client left (its record was written
/// when it left).
enum Held {
    Exchange(Box<Exchange>),
    Hold(Option<Hold>),
}

impl Held {
    fn settle(self, usage: Option<fleetgate_protocol::usage::Usage>) {
        match self {
            Held::Exchange(mut ex) => {
                if usage.is_some() {
                    ex.record.timeline.set_usage(usage);
                }
            }
            Held::Hold(Some(mut adm)) => {
                let used = usage
                    .filter(fleetgate_protocol::usage::Usage::plausible)
                    .map_or(adm.reserved(), |u| {
                        u.prompt_tokens.saturating_add(u.completion_tokens)
                    });
                adm.set_used(used);
            }
            Held::Hold(None) => {}
        }
    }
}

/// What a watcher needs besides the slot and what it settles.
struct Watch {
    client: UpstreamClient,
    id: String,
    deadline: Instant,
    closing: CancellationToken,
}

impl Watch {
    /// Poll until the response ends; `slot` and `held` are released when this returns (the
    /// key's tokens settle with the final usage, if the backend gave one).
    async fn run(self, slot: InFlight, held: Held) {
        let mut usage = None;
        let backend = slot.backend().clone();
        let mut pause = FIRST_POLL;
        let mut failures = 0u32;
        let ended = loop {
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.closing.cancelled() => break "the gateway shut down",
            }
            if Instant::now() >= self.deadline {
                break "the pool's total timeout passed";
            }
            pause = (pause * 2).min(MAX_POLL);
            match self.poll(&backend).await {
                Poll::Running => failures = 0,
                Poll::Ended(body) => {
                    usage = fleetgate_protocol::stream::usage_in(&body);
                    break "";
                }
                Poll::Gone => break "the backend no longer knows it",
                Poll::Failed => {
                    failures += 1;
                    if failures >= MAX_FAILED_POLLS {
                        break "its backend did not answer the polls";
                    }
                }
            }
        };
        if !ended.is_empty() {
            tracing::warn!(
                backend = %backend.base,
                response_id = %self.id,
                why = ended,
                "background response no longer watched: its backend slot and its key's concurrency are released"
            );
        }
        held.settle(usage);
        drop(slot);
    }

    async fn poll(&self, backend: &Backend) -> Poll {
        let mut path = String::with_capacity(16 + self.id.len());
        path.push_str("/v1/responses/");
        path.push_str(&self.id);
        let Some(uri) = backend.uri_for(&path) else {
            return Poll::Gone;
        };
        let mut req = Request::get(uri);
        if let Some(auth) = &backend.upstream_auth {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        let Ok(req) = req.body(Full::new(Bytes::new())) else {
            return Poll::Gone;
        };
        let answer = tokio::time::timeout(Duration::from_secs(10), async {
            let resp = self.client.request(req).await.ok()?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .ok()?
                .to_bytes();
            Some((status, body))
        })
        .await;
        match answer {
            Ok(Some((status, _))) if status == http::StatusCode::NOT_FOUND => Poll::Gone,
            Ok(Some((status, body))) if status.is_success() => {
                if still_running(&body) {
                    Poll::Running
                } else {
                    Poll::Ended(body)
                }
            }
            _ => Poll::Failed,
        }
    }
}

enum Poll {
    Running,
    Ended(Bytes),
    Gone,
    Failed,
}
