//! The forwarding path. `phases()` is the whole of it: one call per step, top to bottom, from
//! the key's endpoint families to the relay of the backend's answer. Its steps are the rows of
//! docs/architecture.md's table, in the same order and the same words (the `// name:` comment
//! above each call; a test below reads both). A step that fails answers the client with its
//! error in the route's dialect (`error::answer`), and nothing after it runs.
//!
//! The `Exchange` carries the request's record and its hold on the key's limits from the first
//! step into the response body, whose end settles the hold and records the request once.

mod backend_error;
mod background;
pub(crate) mod body;
mod error;
mod exchange;
mod fallback;
mod family;
pub(crate) mod headers;
mod limits;
pub(crate) mod pins;
pub(crate) mod prefix_share;
mod queued;
mod queueing;
pub(crate) mod relay;
mod rename;
mod request;
mod route;
mod send;
pub(crate) mod state;
mod stored;
mod timing;
mod view;

pub(crate) use error::ApiError;

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::telemetry::RequestRecord;
use exchange::Exchange;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::BodyKind;
use queueing::Place;
use relay::GatewayBody;
use state::ProxyState;

/// Forward one request of the endpoint table. `record` already carries the request id and
/// `received`; `id` is the stored response a path names.
///
/// Not itself `async`: it hands back `phases()`'s future, so the request's future does not hold
/// the request and its record twice (an `async fn` keeps its arguments for its whole life,
/// beside the future it awaits). That future is boxed once per request and stays allocated
/// until the response head is out: its size is memory per request in flight.
pub(crate) fn forward(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    req: Request<Incoming>,
    record: RequestRecord,
) -> impl Future<Output = Response<GatewayBody>> + '_ {
    phases(state, endpoint, id, req, Exchange::new(record, endpoint))
}

/// A step's value, or the request answered with the step's error (and `phases()` ends there).
macro_rules! step {
    ($ex:ident, $result:expr) => {
        match $result {
            Ok(value) => value,
            Err(err) => return error::answer(&err, $ex),
        }
    };
}

/// The path, one call per step. The steps that wait (for the client's body, Redis, the queue,
/// a backend) end with `gateway_shutdown` when the shutdown grace period runs out first
/// (`Closing::bound`); a relay ends its stream itself then.
async fn phases(
    state: &Arc<ProxyState>,
    endpoint: Endpoint,
    id: Option<Box<str>>,
    req: Request<Incoming>,
    mut ex: Exchange,
) -> Response<GatewayBody> {
    let closing = &state.closing;
    // family: the key's endpoint families, before anything is read.
    step!(ex, family::check(state, endpoint, &ex.record));
    // body: the head cleaned for the backend and held to its limits, then the body read.
    let (mut head, body) = step!(
        ex,
        closing
            .bound(body::receive(state, endpoint, req, &mut ex.record))
            .await
    );
    // exit, by id: a read or a cancel of a stored response goes to the backend holding it.
    if endpoint.needs().body == BodyKind::None {
        // (Boxed, as every path only some requests take: the request's future, which a
        // client connection keeps allocated for its life, stays the size chat's needs.)
        let by_id = Box::pin(stored::by_id(state, endpoint, id, head, &mut ex));
        let sent = step!(ex, closing.bound(by_id).await);
        return relay::start(state, sent, ex).await;
    }
    // view: the body parsed once, the bytes kept.
    let view = step!(ex, view::read(endpoint, &head, &body, &mut ex).await);
    let asked = route::Asked {
        view: &view,
        body: &body,
        endpoint,
    };
    // route: the model's pool in the generation as it is now (a reload swaps it for the
    // requests that follow).
    let generation = state.generation.load_full();
    let headers = &head.outgoing.headers;
    let route = step!(
        ex,
        route::route(state, asked, headers, &generation, &mut ex.record)
    );
    // stored continuation: a `previous_response_id` goes to the backend holding that response.
    let continued = step!(
        ex,
        closing
            .bound(stored::continued(state, &view, route.pool, &ex.record))
            .await
    );
    // limits: the key's request rate, tokens and concurrency, held to the end of the answer.
    ex.hold = step!(
        ex,
        closing
            .bound(limits::hold(state, endpoint, &view, &ex.record))
            .await
    );
    let mut route = route;
    let mut continued = continued;
    let mut sent = loop {
        let pool = route.pool;
        // (Not a continuation, which only its backend can serve, nor a LoRA adapter's request,
        // which only its holders can.)
        let may_fall_back = pool.fallback.is_some() && continued.is_none() && route.only == 0;
        // On a failure of this pool's that a fallback may take: the route there, and again.
        macro_rules! fall_back {
            ($cause:expr, $err:expr) => {{
                let next = $cause.filter(|_| may_fall_back).and_then(|cause| {
                    let asked = (asked, &head.outgoing.headers);
                    fallback::reroute(asked, &generation, pool, cause, &mut ex)
                });
                match next {
                    Some(next) => {
                        route = next;
                        continue;
                    }
                    None => $err,
                }
            }};
        }
        // queue: a backend slot now, a place in the pool's queue, or the continued response's
        // backend (routed again if a reload retired every backend the route could use).
        let mut newer = None;
        // (Matched without a name, here and below: a named result would keep its room in the
        // request's future across the awaits that follow.)
        let (generation, route, place) = match queueing::claim(
            state,
            (asked, &head.outgoing.headers),
            (&generation, &mut newer),
            route,
            continued.take(),
            &mut ex.record,
        ) {
            Ok(claimed) => claimed,
            Err(e) => fall_back!(fallback::cause_of(&e), return error::answer(&e, ex)),
        };
        // upstream request: the client's bytes with the route's splices, and the head a backend
        // gets (the client's head is kept where a fallback may need it again).
        let head = (&mut head, may_fall_back);
        let prepared = request::prepare(state, head, asked, &route, &place, &ex.record);
        // exit, queued stream: a stream that must wait answers at once, `: queued` comments
        // keeping it alive; it resumes at the queue wait from its body. (Not on a pool with
        // fallbacks, whose answer must come from the pool that serves the request.)
        let place = match place {
            Place::Wait(waiting) if !may_fall_back && queued::keeps_alive(state, &ex.record) => {
                let queued = queued::Queued {
                    prepared,
                    waiting,
                    generation: generation.clone(),
                };
                return queued::answer(state, queued, ex);
            }
            place => place,
        };
        // queue wait: until the place becomes a slot (the Timeline's queue wait; a fallback's
        // adds to the wait before it).
        let queued_from = ex.record.timeline.admitted().unwrap_or(prepared.body_read);
        let slot = match closing
            .bound(queueing::wait(
                state,
                route.pool,
                place,
                queued_from,
                &mut ex,
            ))
            .await
        {
            Ok(slot) => slot,
            Err(e) => fall_back!(fallback::cause_of(&e), return error::answer(&e, ex)),
        };
        // send: to the slot's backend, and to another one before the first byte when it could
        // not be reached or answered 502/503, within the pool's retry budget.
        let sent = closing
            .bound(send::with_retries(
                state, route.pool, slot, prepared, &mut ex,
            ))
            .await;
        // fallback: a pool that could not serve the request before its first byte hands it to
        // the next of its fallbacks, a prompt too long for it to a context-window fallback.
        match sent {
            Ok(sent) => match fallback::cause_of_answer(&sent) {
                Some(cause) => fall_back!(Some(cause), break sent),
                None => break sent,
            },
            Err(e) => fall_back!(fallback::cause_of(&e), return error::answer(&e, ex)),
        }
    };
    drop(view);
    fallback::mark(&mut sent, &ex.record);
    // relay: the backend's head goes out and its body is relayed frame by frame.
    relay::start(state, sent, ex).await
}

#[cfg(test)]
mod tests {
    /// The steps `phases()` takes, in order: its `// name:` comments.
    fn steps_in_code() -> Vec<String> {
        let src = include_str!("mod.rs");
        let start = src.find("async fn phases(").expect("phases() is in mod.rs");
        let body = &src[start..];
        let end = body.find("\n}\n").expect("phases() ends");
        body[..end]
            .lines()
            .filter_map(|l| l.trim().strip_prefix("// "))
            .filter_map(|c| c.split_once(": ").map(|(name, _)| name))
            .filter(|name| {
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c == ' ' || c == ',')
            })
            .map(str::to_owned)
            .collect()
    }

    /// The steps of docs/architecture.md's phase table: the rows whose `phases()` column names
    /// a call.
    fn steps_in_docs() -> Vec<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/architecture.md");
        let doc = std::fs::read_to_string(path).expect("docs/architecture.md is readable");
        let start = doc
            .find("| step | call in `phases()` |")
            .expect("docs/architecture.md has the phase table");
        doc[start..]
            .lines()
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .filter_map(|row| {
                let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                (cells.len() > 2 && cells[2] != "—").then(|| cells[1].to_owned())
            })
            .collect()
    }

    #[test]
    fn phases_take_the_steps_of_the_docs_table_in_its_order() {
        let code = steps_in_code();
        assert!(code.len() >= 10, "phases() names its steps: {code:?}");
        assert_eq!(
            code,
            steps_in_docs(),
            "phases() (left) and docs/architecture.md's phase table (right) must list the same \
             steps in the same order"
        );
    }
}
