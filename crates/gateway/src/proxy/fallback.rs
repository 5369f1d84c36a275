//! The fallback step: when the route's pool cannot serve the request before its first byte (no
//! backend can take it, every attempt failed, its queue is full or the wait ended), or a
//! backend answered vLLM's context-length error, the request goes to the next of the pool's
//! fallbacks (`crate::route::fallback` chooses it) and the queue, upstream request, queue wait
//! and send steps run again there. The record, the trace and the answer's
//! `x-fleetgate-fallback` header say where it went and why.

use std::time::Instant;

use http::HeaderValue;

use super::error::ApiError;
use super::exchange::Exchange;
use super::route::Asked;
use super::send::Sent;
use crate::pool::{Generation, Pool};
use crate::queue::RefusalKind;
use crate::route::{self, Route};
use crate::telemetry::RequestRecord;
use crate::telemetry::fallback::FallbackCause;

/// The response header naming the model of the fallback pool that answered.
pub(super) static X_FLEETGATE_FALLBACK: http::HeaderName =
    http::HeaderName::from_static("x-fleetgate-fallback");

/// Why a step's error lets a fallback take the request. A key's own share of a queue
/// (`max_per_key`) is the key's limit, not the pool's: it does not fall back.
pub(super) fn cause_of(e: &ApiError) -> Option<FallbackCause> {
    match e {
        ApiError::NoBackend { .. } => Some(FallbackCause::NoBackend),
        // (Not a first-token timeout: as for retries, the engine may still be working on it.)
        ApiError::BackendUnreachable { .. } => Some(FallbackCause::RetriesFailed),
        ApiError::QueueRefused(r) => match r.kind {
            RefusalKind::Full => Some(FallbackCause::QueueFull),
            RefusalKind::Timeout => Some(FallbackCause::QueueTimeout),
            RefusalKind::KeyShare => None,
        },
        _ => None,
    }
}

/// Why the send step's answer lets a fallback take the request: 502/503 once the retries
/// are spent, or vLLM's context-length error (a whole answer: the client has no byte yet).
pub(super) fn cause_of_answer(sent: &Sent) -> Option<FallbackCause> {
    let Sent::Full(resp) = sent else {
        return None;
    };
    match resp.status().as_u16() {
        502 | 503 => Some(FallbackCause::RetriesFailed),
        400 | 413 if is_context_error(resp.body()) => Some(FallbackCause::ContextError),
        _ => None,
    }
}

/// The messages engines refuse a prompt too long for their context with (lower-cased): vLLM's
/// (`This model's maximum context length is … tokens`, `max_tokens=… cannot be greater than
/// max_model_len=…`, the V1 engine's `… is longer than the maximum model length of …`, the
/// older `Input prompt (… tokens) is too long and exceeds limit of …`), OpenAI's
/// `context_length_exceeded` code, SGLang's `… longer than the model's context length`.
const CONTEXT_ERRORS: [&str; 6] = [
    "maximum context length",
    "cannot be greater than max_model_len",
    "longer than the maximum model length",
    "is too long and exceeds limit",
    "context_length_exceeded",
    "longer than the model's context length",
];

/// An error body says the prompt (or the output asked for) does not fit the model's context.
pub(super) fn is_context_error(body: &[u8]) -> bool {
    let lower = body.to_ascii_lowercase();
    CONTEXT_ERRORS
        .iter()
        .any(|m| memchr::memmem::find(&lower, m.as_bytes()).is_some())
}

/// The request leaves `from` for `cause`: the route in its next fallback, with the record
/// saying so and the failed attempt's stamps forgotten, or `None` when no fallback is left
/// (the request ends with `from`'s error).
pub(super) fn reroute<'p>(
    (asked, headers): (Asked<'_>, &http::HeaderMap),
    pools: &'p Generation,
    from: &Pool,
    cause: FallbackCause,
    ex: &mut Exchange,
) -> Option<Route<'p>> {
    let record = &mut ex.record;
    let log = record.fallback.get_or_insert_with(Box::default);
    if !log.tried.contains(&from.index) {
        log.tried.push(from.index);
    }
    let key = record.key.as_deref();
    let to = route::fallback::next(from, cause, pools, key, &log.tried);
    let Some(to) = to else {
        // Nothing left: the record keeps no fallback that did not happen.
        if log.hops.is_empty() {
            record.fallback = None;
        }
        return None;
    };
    let request = route::Request {
        view: asked.view,
        body: asked.body,
        endpoint: asked.endpoint,
        headers,
    };
    let route = Route {
        fallback: Some((cause, pools.at(from.index).unwrap_or(to))),
        ..route::route_in(to, request, key)
    };
    tracing::info!(
        request_id = ?record.request_id,
        from = &*from.model,
        to = &*to.model,
        cause = cause.as_str(),
        "request falls back to another pool"
    );
    if let Some(scope) = record.otel.as_deref_mut() {
        scope.attempt_failed(Instant::now(), record.status, record.error);
        scope.response_model = Some(to.served_name.clone());
    }
    log.hops.push((from.model.clone(), cause));
    record.model = Some(to.model.clone());
    record.pool_metrics_index = Some(to.metrics_index);
    record.backend = None;
    record.backend_metrics_index = None;
    record.error = None;
    record.status = 0;
    record.cache_belief = None;
    record.timeline.forget_upstream();
    Some(route)
}

/// The answer names the model of the fallback pool that gave it.
pub(super) fn mark(sent: &mut Sent, record: &RequestRecord) {
    if record.fallback.is_none() {
        return;
    }
    let Some(Ok(value)) = record.model.as_deref().map(HeaderValue::from_str) else {
        return;
    };
    let headers = match sent {
        Sent::Relay(resp, _) => resp.headers_mut(),
        Sent::Full(resp) => resp.headers_mut(),
    };
    headers.insert(X_FLEETGATE_FALLBACK.clone(), value);
}
