//! A finished request's spans, built on the exporter's task: the SERVER span and one CLIENT
//! span per upstream attempt, named and attributed after the OpenTelemetry GenAI semantic
//! conventions (`{gen_ai.operation.name} {gen_ai.request.model}`), with the gateway's own
//! figures under `fleetgate.*`. No prompt or answer text is ever put in a span.

use std::borrow::Cow;
use std::str::FromStr;
use std::time::{Instant, SystemTime};

use opentelemetry::trace::{
    Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::{Finished, Scope};
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::error::ErrorKind;

// The GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/), named
// here: the Rust conventions crate marks them unstable and they move between releases.
pub(super) const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
pub(super) const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
pub(super) const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
pub(super) const GEN_AI_REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
pub(super) const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub(super) const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
pub(super) const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
// The HTTP and general conventions.
pub(super) const SERVER_ADDRESS: &str = "server.address";
pub(super) const SERVER_PORT: &str = "server.port";
pub(super) const HTTP_REQUEST_METHOD: &str = "http.request.method";
pub(super) const HTTP_ROUTE: &str = "http.route";
pub(super) const HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";
pub(super) const ERROR_TYPE: &str = "error.type";
/// The event at the first token: on the SERVER span when it reached the client, on the
/// CLIENT span when it came from the backend.
pub(super) const FIRST_TOKEN: &str = "first_token";

/// Append the request's spans to `out`.
pub(super) fn build(scope: Scope, lib: &InstrumentationScope, out: &mut Vec<SpanData>) {
    let Some(done) = &scope.done else {
        return;
    };
    let t = &done.timeline;
    let at = |i: Instant| wall(&scope, i);
    let end = t.done().unwrap_or(scope.received);
    let trace_id = TraceId::from_bytes(scope.trace_id.0);
    let state = scope
        .state
        .as_ref()
        .and_then(|s| s.to_str().ok())
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let context = |span: [u8; 8]| {
        SpanContext::new(
            trace_id,
            SpanId::from_bytes(span),
            TraceFlags::SAMPLED,
            false,
            state.clone(),
        )
    };
    let op = done.endpoint.map_or("http", Endpoint::operation);
    let name: Cow<'static, str> = match &done.model {
        Some(m) => format!("{op} {m}").into(),
        None => op.into(),
    };
    let mut common = Vec::with_capacity(4);
    common.push(KeyValue::new(GEN_AI_OPERATION_NAME, op));
    if let Some(m) = &done.model {
        common.push(KeyValue::new(GEN_AI_REQUEST_MODEL, m.to_string()));
    }
    if let Some(m) = &scope.response_model {
        common.push(KeyValue::new(GEN_AI_RESPONSE_MODEL, m.to_string()));
    }

    // The SERVER span: the request as the client saw it.
    let mut attrs = common.clone();
    attrs.extend(server_attributes(&scope, done));
    let mut events = SpanEvents::default();
    if let Some(first) = t.client_first_token() {
        events
            .events
            .push(Event::new(FIRST_TOKEN, at(first), Vec::new(), 0));
    }
    out.push(SpanData {
        span_context: context(scope.span_id.0),
        parent_span_id: scope
            .parent
            .map_or(SpanId::INVALID, |p| SpanId::from_bytes(p.0)),
        parent_span_is_remote: scope.parent.is_some(),
        span_kind: SpanKind::Server,
        name: name.clone(),
        start_time: at(scope.received),
        end_time: at(end),
        attributes: attrs,
        dropped_attributes_count: 0,
        events,
        links: SpanLinks::default(),
        status: status(done.error),
        instrumentation_scope: lib.clone(),
    });

    // A CLIENT span per attempt; the last one is the attempt that answered.
    let last = scope.attempts.len().saturating_sub(1);
    for (i, a) in scope.attempts.iter().enumerate() {
        let (ended, code, error) = a.ended.unwrap_or((end, done.status, done.error));
        let mut attrs = common.clone();
        if let Some((host, port)) = address(&a.backend) {
            attrs.push(KeyValue::new(SERVER_ADDRESS, host));
            if let Some(port) = port {
                attrs.push(KeyValue::new(SERVER_PORT, i64::from(port)));
            }
        }
        if code != 0 {
            attrs.push(KeyValue::new(HTTP_RESPONSE_STATUS_CODE, i64::from(code)));
        }
        if let Some(e) = error {
            attrs.push(KeyValue::new(ERROR_TYPE, e.as_str()));
        }
        attrs.push(KeyValue::new("fleetgate.attempt", i as i64));
        let mut events = SpanEvents::default();
        if i == last
            && let Some(first) = t.upstream_first_token()
        {
            events
                .events
                .push(Event::new(FIRST_TOKEN, at(first), Vec::new(), 0));
        }
        out.push(SpanData {
            span_context: context(a.span_id.0),
            parent_span_id: SpanId::from_bytes(scope.span_id.0),
            parent_span_is_remote: false,
            span_kind: SpanKind::Client,
            name: name.clone(),
            start_time: at(a.started),
            end_time: at(ended.max(a.started)),
            attributes: attrs,
            dropped_attributes_count: 0,
            events,
            links: SpanLinks::default(),
            status: status(error),
            instrumentation_scope: lib.clone(),
        });
    }
}

/// The SERVER span's own attributes: the answer, the usage, and the gateway's figures.
fn server_attributes(scope: &Scope, done: &Finished) -> Vec<KeyValue> {
    let t = &done.timeline;
    let mut a = Vec::with_capacity(20);
    if let Some(e) = done.endpoint {
        let row = e.row();
        a.push(KeyValue::new(HTTP_REQUEST_METHOD, row.method.as_str()));
        a.push(KeyValue::new(HTTP_ROUTE, row.path));
    }
    if done.status != 0 {
        a.push(KeyValue::new(
            HTTP_RESPONSE_STATUS_CODE,
            i64::from(done.status),
        ));
    }
    if let Some(e) = done.error {
        a.push(KeyValue::new(ERROR_TYPE, e.as_str()));
    }
    if let Some(m) = scope.max_tokens {
        a.push(KeyValue::new(
            GEN_AI_REQUEST_MAX_TOKENS,
            i64::try_from(m).unwrap_or(i64::MAX),
        ));
    }
    if let Some(u) = t.stream().usage {
        a.push(KeyValue::new(
            GEN_AI_USAGE_INPUT_TOKENS,
            i64::try_from(u.prompt_tokens).unwrap_or(i64::MAX),
        ));
    }
    if let (Some(n), _) = t.stream().output_tokens() {
        a.push(KeyValue::new(
            GEN_AI_USAGE_OUTPUT_TOKENS,
            i64::try_from(n).unwrap_or(i64::MAX),
        ));
    }
    if !scope.finish_reasons.is_empty() {
        a.push(KeyValue::new(
            GEN_AI_RESPONSE_FINISH_REASONS,
            Value::Array(Array::String(
                scope
                    .finish_reasons
                    .iter()
                    .map(|r| StringValue::from(r.to_string()))
                    .collect(),
            )),
        ));
    }
    a.push(KeyValue::new(
        "fleetgate.request_id",
        done.request_id.to_str().unwrap_or("-").to_owned(),
    ));
    if let Some(k) = &done.key {
        a.push(KeyValue::new("fleetgate.key_id", k.public_id.to_string()));
        a.push(KeyValue::new(
            "fleetgate.environment",
            k.environment.as_str(),
        ));
    }
    if let Some(m) = &done.model {
        a.push(KeyValue::new("fleetgate.pool", m.to_string()));
    }
    a.push(KeyValue::new("fleetgate.stream", done.stream));
    a.push(KeyValue::new("fleetgate.retries", i64::from(done.retries)));
    if let Some((from, cause)) = &done.fallback {
        a.push(KeyValue::new("fleetgate.fallback.from", from.to_string()));
        a.push(KeyValue::new("fleetgate.fallback.cause", *cause));
    }
    a.push(KeyValue::new(
        "fleetgate.queue_wait_ms",
        t.queue_wait().as_secs_f64() * 1e3,
    ));
    if let Some(d) = t.client_ttft() {
        a.push(KeyValue::new("fleetgate.ttft_ms", d.as_secs_f64() * 1e3));
    }
    if let Some(d) = t.upstream_ttft() {
        a.push(KeyValue::new(
            "fleetgate.upstream_ttft_ms",
            d.as_secs_f64() * 1e3,
        ));
    }
    if let Some(d) = t.hop() {
        a.push(KeyValue::new("fleetgate.hop_us", d.as_secs_f64() * 1e6));
    }
    a
}

/// An error status on a refusal or failure, with the gateway's error kind.
fn status(error: Option<ErrorKind>) -> Status {
    match error {
        Some(e) => Status::error(e.as_str()),
        None => Status::Unset,
    }
}

/// The wall-clock time of `i`, from the request's one reading of the clock.
fn wall(scope: &Scope, i: Instant) -> SystemTime {
    if i >= scope.received {
        scope.wall + (i - scope.received)
    } else {
        scope.wall - (scope.received - i)
    }
}

/// `server.address` and `server.port` of a backend's base URL.
fn address(base: &str) -> Option<(String, Option<u16>)> {
    let uri: http::Uri = base.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    });
    Some((host.to_owned(), port))
}
