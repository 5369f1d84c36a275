//! A request log row: what a request hands over (`Pending`, cheap clones only), the values the
//! writer encodes from it (`Fields`), and the row as stored and spilled (`SpillRow`).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One row as the spill file holds it (JSON lines), and as it is replayed into the store.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SpillRow {
    pub row_id: String,
    pub at: i64,
    pub request_id: String,
    pub key_id: Option<String>,
    pub environment: Option<String>,
    pub model: Option<String>,
    pub backend: Option<String>,
    pub status: i32,
    pub error: Option<String>,
    pub stream: bool,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub usage_source: String,
    pub queue_wait_us: Option<i64>,
    pub upstream_ttft_us: Option<i64>,
    pub client_ttft_us: Option<i64>,
    pub overhead_pre_us: Option<i64>,
    pub overhead_relay_us: Option<i64>,
    /// Written by versions that record the hop cost (absent in older spill files).
    #[serde(default)]
    pub hop_us: Option<i64>,
    pub e2el_us: Option<i64>,
    pub tpot_us: Option<i64>,
    pub itl_mean_us: Option<i64>,
    pub itl_p99_us: Option<i64>,
    pub itl_max_us: Option<i64>,
    pub content_events: i32,
    pub client_addr: Option<String>,
    /// The endpoint (`chat`, `responses`, `messages`, …); absent in older spill files.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The W3C trace the request joined (32 hex digits); absent in older spill files.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// Prompt tokens the gateway predicted the chosen backend's engine holds; absent in older
    /// spill files.
    #[serde(default)]
    pub predicted_cached_tokens: Option<i64>,
    /// Prompt tokens the engine reported it served from its cache; absent in older spill
    /// files.
    #[serde(default)]
    pub cached_tokens: Option<i64>,
    /// Continuations sent for a stream whose backend failed mid-answer; absent in older spill
    /// files and where no stream failed.
    #[serde(default)]
    pub resumes: Option<i32>,
    /// The failed parts and a refusal's reason, as JSON.
    #[serde(default)]
    pub resume_detail: Option<String>,
    /// Tokens the fleet spent: the usage plus every continuation's prompt.
    #[serde(default)]
    pub fleet_tokens: Option<i64>,
    /// The model the request was routed to first, when a fallback answered it; absent in older
    /// spill files.
    #[serde(default)]
    pub fallback_from: Option<String>,
    /// Each pool the request left and why, as JSON.
    #[serde(default)]
    pub fallback_detail: Option<String>,
}

pub(super) const COLUMNS: &str = "row_id, at, request_id, key_id, environment, model, backend, status, error, \
    stream, prompt_tokens, completion_tokens, usage_source, queue_wait_us, upstream_ttft_us, \
    client_ttft_us, overhead_pre_us, overhead_relay_us, e2el_us, tpot_us, itl_mean_us, itl_p99_us, \
    itl_max_us, content_events, client_addr, hop_us, endpoint, trace_id, \
    predicted_cached_tokens, cached_tokens, resumes, resume_detail, fleet_tokens, fallback_from, \
    fallback_detail";

pub(super) fn us(d: Option<Duration>) -> Option<i64> {
    d.map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// What a request hands over: cheap clones only; the row is built on the writer's side.
pub(super) struct Pending {
    pub(super) row_id: u64,
    pub(super) at: i64,
    pub(super) record: RecordCopy,
}

pub(super) struct RecordCopy {
    pub(super) request_id: http::HeaderValue,
    pub(super) key: Option<Arc<crate::key::KeyRecord>>,
    pub(super) model: Option<Arc<str>>,
    pub(super) backend: Option<Arc<str>>,
    pub(super) status: u16,
    pub(super) error: Option<fleetgate_protocol::error::ErrorKind>,
    pub(super) stream: bool,
    pub(super) timeline: crate::telemetry::Timeline,
    pub(super) client_addr: Option<std::net::SocketAddr>,
    pub(super) endpoint: Option<fleetgate_protocol::Endpoint>,
    pub(super) trace_id: Option<fleetgate_protocol::trace_context::TraceId>,
    pub(super) predicted_cached: Option<u64>,
    /// (continuations, detail, fleet tokens) of a stream that failed mid-answer.
    pub(super) resume: Option<(i32, String, Option<u64>)>,
    /// (the model routed to first, each pool left and why) of a request a fallback answered.
    pub(super) fallback: Option<(Arc<str>, String)>,
}

/// A row's values, borrowed from its `Pending` (nothing allocated, except a request id that
/// is not UTF-8). Every store encoding reads this, in `COLUMNS` order.
pub(super) struct Fields<'a> {
    pub(super) at: i64,
    pub(super) request_id: std::borrow::Cow<'a, str>,
    pub(super) key_id: Option<&'a str>,
    pub(super) environment: Option<&'static str>,
    pub(super) model: Option<&'a str>,
    pub(super) backend: Option<&'a str>,
    pub(super) status: i32,
    pub(super) error: Option<&'static str>,
    pub(super) stream: bool,
    pub(super) prompt_tokens: Option<i64>,
    pub(super) completion_tokens: Option<i64>,
    pub(super) usage_source: &'static str,
    /// `queue_wait_us` … `itl_max_us`, in `COLUMNS` order.
    pub(super) times: [Option<i64>; 10],
    pub(super) content_events: i32,
    pub(super) client_addr: Option<std::net::IpAddr>,
    pub(super) hop_us: Option<i64>,
    pub(super) endpoint: Option<&'static str>,
    /// The trace id's 32 hex digits.
    pub(super) trace_id: Option<[u8; 32]>,
    pub(super) predicted_cached_tokens: Option<i64>,
    pub(super) cached_tokens: Option<i64>,
    pub(super) resumes: Option<i32>,
    pub(super) resume_detail: Option<&'a str>,
    pub(super) fleet_tokens: Option<i64>,
    pub(super) fallback_from: Option<&'a str>,
    pub(super) fallback_detail: Option<&'a str>,
}

pub(super) fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Pending {
    pub(super) fn fields(&self) -> Fields<'_> {
        let r = &self.record;
        let t = &r.timeline;
        let (tokens, source) = t.stream().output_tokens();
        Fields {
            at: self.at,
            request_id: String::from_utf8_lossy(r.request_id.as_bytes()),
            key_id: r.key.as_ref().map(|k| &*k.public_id),
            environment: r.key.as_ref().map(|k| k.environment.as_str()),
            model: r.model.as_deref(),
            backend: r.backend.as_deref(),
            status: i32::from(r.status),
            error: r.error.map(|e| e.as_str()),
            stream: r.stream,
            prompt_tokens: t.stream().usage.map(|u| count(u.prompt_tokens)),
            completion_tokens: tokens.map(count),
            usage_source: source.as_str(),
            times: [
                us(t.admitted().map(|_| t.queue_wait())),
                us(t.upstream_ttft()),
                us(t.client_ttft()),
                us(t.overhead_pre()),
                us(t.overhead_relay()),
                us(t.e2el()),
                us(t.tpot()),
                us(t.stream().itl_mean()),
                us(t.stream().itl_p99()),
                us(t.stream().itl_max()),
            ],
            content_events: i32::try_from(t.stream().content_events).unwrap_or(i32::MAX),
            client_addr: r.client_addr.map(|a| a.ip()),
            hop_us: us(t.hop()),
            endpoint: r.endpoint.map(fleetgate_protocol::Endpoint::as_str),
            trace_id: r.trace_id.map(|t| t.hex()),
            predicted_cached_tokens: r.predicted_cached.map(count),
            cached_tokens: t
                .stream()
                .usage
                .and_then(|u| u.cached_tokens)
                .map(i64::from),
            resumes: r.resume.as_ref().map(|r| r.0),
            resume_detail: r.resume.as_ref().map(|r| r.1.as_str()),
            fleet_tokens: r.resume.as_ref().and_then(|r| r.2).map(count),
            fallback_from: r.fallback.as_ref().map(|f| &*f.0),
            fallback_detail: r.fallback.as_ref().map(|f| f.1.as_str()),
        }
    }

    /// The row as spilled (and replayed).
    pub(super) fn into_row(self, prefix: &str) -> SpillRow {
        let f = self.fields();
        let [
            queue_wait_us,
            upstream_ttft_us,
            client_ttft_us,
            overhead_pre_us,
            overhead_relay_us,
            e2el_us,
            tpot_us,
            itl_mean_us,
            itl_p99_us,
            itl_max_us,
        ] = f.times;
        SpillRow {
            row_id: RowId(prefix, self.row_id).to_string(),
            at: f.at,
            request_id: f.request_id.into_owned(),
            key_id: f.key_id.map(str::to_owned),
            environment: f.environment.map(str::to_owned),
            model: f.model.map(str::to_owned),
            backend: f.backend.map(str::to_owned),
            status: f.status,
            error: f.error.map(str::to_owned),
            stream: f.stream,
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
            usage_source: f.usage_source.to_owned(),
            queue_wait_us,
            upstream_ttft_us,
            client_ttft_us,
            overhead_pre_us,
            overhead_relay_us,
            hop_us: f.hop_us,
            e2el_us,
            tpot_us,
            itl_mean_us,
            itl_p99_us,
            itl_max_us,
            content_events: f.content_events,
            client_addr: f.client_addr.map(|a| a.to_string()),
            endpoint: f.endpoint.map(str::to_owned),
            trace_id: f
                .trace_id
                .as_ref()
                .map(|h| String::from_utf8_lossy(h).into_owned()),
            predicted_cached_tokens: f.predicted_cached_tokens,
            cached_tokens: f.cached_tokens,
            resumes: f.resumes,
            resume_detail: f.resume_detail.map(str::to_owned),
            fleet_tokens: f.fleet_tokens,
            fallback_from: f.fallback_from.map(str::to_owned),
            fallback_detail: f.fallback_detail.map(str::to_owned),
        }
    }
}

/// A row id: `<process prefix>-<sequence in hex>`.
pub(super) struct RowId<'a>(pub(super) &'a str, pub(super) u64);

impl std::fmt::Display for RowId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{:x}", self.0, self.1)
    }
}
