//! The upstream request step: the request as a backend gets it. The client's original bytes,
//! with only the splices the route asks for (the model's name, `stream_options.include_usage`
//! on a stream that did not ask for usage, the owner of a stored response, the engine's
//! `priority`); the head cleaned in the body step (`headers`), with the request id and the
//! new length. A continuation of a stored response is pinned: never retried elsewhere.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap, HeaderValue};

use super::body::Head;
use super::headers::{Outgoing, X_REQUEST_ID};
use super::prefix_share::PrefixShare;
use super::queueing::Place;
use super::rename::Rename;
use super::route::Asked;
use super::state::ProxyState;
use super::{pins, stored};
use crate::route::Route;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::endpoint::BodyKind;
use fleetgate_protocol::view::splice::PriorityEdit;
use fleetgate_protocol::view::{self, RequestView};
use fleetgate_protocol::{Dialect, Endpoint};

/// The request as it goes upstream, owned: it may wait in the queue past the handler. A retry
/// sends a clone (the body and the block names are reference-counted).
#[derive(Clone)]
pub(super) struct Prepared {
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
    pub(super) endpoint: Endpoint,
    pub(super) pool: usize,
    pub(super) body_read: Instant,
    /// What the relay does to the answer.
    pub(super) answer: AnswerEdits,
    /// The request's method and, where it is not the endpoint's fixed path, its own target on
    /// the backend (a path naming a stored response, a query string passed through).
    pub(super) method: Method,
    pub(super) target: Option<Box<str>>,
    /// It must reach one backend (the one holding a stored response): never retried on
    /// another.
    pub(super) pinned: bool,
    /// `longest_prefix`: the prompt's block names, recorded for the backend it is sent to.
    pub(super) prefix: Option<Arc<[u64]>>,
    /// `kv_events`: the prompt's engine blocks, to say what the chosen backend holds of it.
    pub(super) engine_blocks: Option<Arc<crate::route::EngineBlocks>>,
    /// Where the other replicas learn it (`limits.shared = "redis"`).
    pub(super) prefix_share: Option<Arc<PrefixShare>>,
    /// The backends it may go to (their bits; 0: any): a LoRA adapter's holders.
    pub(super) only: u64,
}

/// What the relay does to the answer, decided with the request and handed unchanged to the
/// relay (`RelayParts::answer`).
#[derive(Clone, Default)]
pub(super) struct AnswerEdits {
    /// The gateway injected `include_usage`: hide the usage event from the client.
    pub(super) strip_usage: bool,
    /// The client accepts trailers (`TE: trailers`): a stream's `Server-Timing`, with the hop
    /// cost known only after its first token, comes as a trailer.
    pub(super) timing_trailer: bool,
    /// The client named the model otherwise than the backends: its name goes back in the answer.
    pub(super) rename: Option<Box<Rename>>,
    /// Learn the id of the stored response the answer creates (where it lives: the backend is
    /// filled in when one is chosen).
    pub(super) pin: Option<pins::Pin>,
}

/// The request for the route's pool. A new stored response learns its backend from the answer
/// (`pin`), and a longest-prefix request tells the other replicas where its prefix went.
pub(super) fn prepare(
    state: &ProxyState,
    (head, keep): (&mut Head, bool),
    asked: Asked<'_>,
    route: &Route<'_>,
    place: &Place,
    record: &RequestRecord,
) -> Prepared {
    // The client's headers are taken, or copied when `keep` (another pool may need them).
    let outgoing = match keep {
        true => head.outgoing.clone(),
        false => Outgoing {
            headers: std::mem::take(&mut head.outgoing.headers),
            trailers: head.outgoing.trailers,
        },
    };
    let (uri, body_read) = (&head.uri, head.body_read);
    let Asked {
        view,
        body,
        endpoint,
    } = asked;
    let mut prepared = spliced(outgoing, body, view, route, endpoint, record, body_read);
    prepared.pinned = matches!(place, Place::Pinned(_));
    // A `store: false` answer is kept nowhere: it takes no place among the pins.
    if endpoint.needs().stores && view.store {
        prepared.answer.pin = Some(stored::pin_of(route.pool, record));
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

/// The original bytes unless the model must be renamed. A stream that did not ask for usage
/// gets it anyway upstream (the relay hides it from the client), so every stream's token
/// counts are real.
fn spliced(
    outgoing: Outgoing,
    body: &Bytes,
    view: &RequestView<'_>,
    route: &Route<'_>,
    endpoint: Endpoint,
    record: &RequestRecord,
    body_read: Instant,
) -> Prepared {
    let inject_usage =
        endpoint.needs().injects_usage && view.stream && view.include_usage != Some(true);
    // A form field holds the bare name; a JSON body, the name as a JSON string.
    let rename = match endpoint.needs().body {
        BodyKind::Multipart => route.rename.map(|_| route.pool.served_name.as_bytes()),
        _ => route.rename,
    };
    // A new stored response's id is made from the request id (vLLM's `resp_<x-request-id>`, or
    // the body's `request_id`): in the key's namespace, so no key can name another's.
    let owner = record
        .key
        .as_deref()
        .filter(|_| endpoint.needs().stores)
        .map(|k| &*k.public_id);
    // vLLM's `priority` for the request's environment (`[pools.priority]`), where the engine
    // orders by it; elsewhere a client's is taken out.
    let priority = if !endpoint.needs().engine_priority {
        match view.priority {
            Some(_) => PriorityEdit::Remove,
            None => PriorityEdit::Keep,
        }
    } else {
        match (route.pool.config().priority, &record.key) {
            (Some(p), Some(key)) => p
                .for_request(
                    key.environment,
                    view.priority.as_ref().and_then(|c| c.value),
                )
                .map_or(PriorityEdit::Keep, PriorityEdit::Write),
            _ => PriorityEdit::Keep,
        }
    };
    let upstream_body =
        view::splice::upstream_body_owned(body, view, rename, inject_usage, owner, priority);
    let Outgoing {
        mut headers,
        trailers,
    } = outgoing;
    let timing_trailer = view.stream && trailers;
    let request_id = match owner {
        Some(owner) => owned_request_id(owner, &record.request_id),
        None => record.request_id.clone(),
    };
    headers.insert(X_REQUEST_ID.clone(), request_id);
    headers.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(upstream_body.len() as u64),
    );
    Prepared {
        headers,
        body: upstream_body,
        endpoint,
        pool: route.pool.index,
        body_read,
        answer: AnswerEdits {
            strip_usage: inject_usage,
            timing_trailer,
            rename: answer_rename(route, view),
            pin: None,
        },
        method: Method::POST,
        target: None,
        pinned: false,
        prefix: route.prefix.clone(),
        engine_blocks: route.engine_blocks.clone(),
        prefix_share: None,
        only: route.only,
    }
}

/// The name the answer's `model` takes in place of the backends' own: the one the client sent
/// (an alias, or the pool's name under a different `served_model_name`), or, from a fallback,
/// the model of the pool that answered.
fn answer_rename(route: &Route<'_>, view: &RequestView<'_>) -> Option<Box<Rename>> {
    let pool = route.pool;
    let name = match route.fallback {
        Some(_) if *pool.model == *pool.served_name => return None,
        Some(_) => &*pool.model,
        None => {
            route.rename?;
            &*view.model
        }
    };
    Rename::new(pool.served_field.clone(), name).map(Box::new)
}

/// `<owner>-<request id>`: the request id in a key's namespace.
fn owned_request_id(owner: &str, request_id: &HeaderValue) -> HeaderValue {
    let mut v = Vec::with_capacity(owner.len() + 1 + request_id.len());
    v.extend_from_slice(owner.as_bytes());
    v.push(b'-');
    v.extend_from_slice(request_id.as_bytes());
    HeaderValue::from_bytes(&v).unwrap_or_else(|_| request_id.clone())
}
