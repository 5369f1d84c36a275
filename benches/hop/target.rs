//! The three targets and one measured request: the protocol's URL and body, the headers, and
//! the check that reduces a streamed answer to a `Sample` (or says what was wrong with it).

use bytes::Bytes;
use fleetgate_protocol::client::{self, HttpClient, Measured};
use http::{HeaderMap, HeaderValue, Uri, header};
use serde_json::json;

use crate::error::Res;

pub const NAMES: [&str; 3] = ["direct", "fleetgate", "nginx"];

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Chat,
    Responses,
    Messages,
}

impl Protocol {
    fn path(self) -> &'static str {
        match self {
            Protocol::Chat => "/v1/chat/completions",
            Protocol::Responses => "/v1/responses",
            Protocol::Messages => "/v1/messages",
        }
    }

    fn dialect(self) -> fleetgate_protocol::Dialect {
        use fleetgate_protocol::Dialect;
        match self {
            Protocol::Chat => Dialect::Chat,
            Protocol::Responses => Dialect::Responses,
            Protocol::Messages => Dialect::Anthropic,
        }
    }
}

/// The protocol of phases 1 and 2 (set once, from the flags).
pub static PROTOCOL: std::sync::OnceLock<Protocol> = std::sync::OnceLock::new();

fn protocol() -> Protocol {
    PROTOCOL.get().copied().unwrap_or(Protocol::Chat)
}

/// The URL of the measured protocol's endpoint.
pub fn api_uri(base: &str) -> Res<Uri> {
    let base = base.trim_end_matches('/');
    Ok(format!("{base}{}", protocol().path()).parse()?)
}

/// A streamed request of the measured protocol; chat's as `request_body`.
pub fn api_body(model: &str, max_tokens: u32, include_usage: bool) -> Bytes {
    let prompt = "Write a short poem about the sea.";
    match protocol() {
        Protocol::Chat => request_body(model, max_tokens, include_usage),
        Protocol::Responses => Bytes::from(
            json!({"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": true})
                .to_string(),
        ),
        Protocol::Messages => Bytes::from(
            json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": max_tokens, "stream": true})
            .to_string(),
        ),
    }
}

/// One way to reach the backend: its own keep-alive client and the chat URL.
pub struct Target {
    pub name: &'static str,
    pub client: HttpClient,
    pub uri: Uri,
}

pub fn chat_uri(base: &str) -> Res<Uri> {
    let base = base.trim_end_matches('/');
    Ok(format!("{base}/v1/chat/completions").parse()?)
}

pub fn request_body(model: &str, max_tokens: u32, include_usage: bool) -> Bytes {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": max_tokens,
        "stream": true,
    });
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    Bytes::from(body.to_string())
}

pub fn request_headers(api_key: Option<&str>) -> Res<HeaderMap> {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // fleetgate sends a stream's `Server-Timing` (with the hop cost it recorded) as a trailer,
    // to clients that take trailers; the backend and nginx ignore the header.
    h.insert(header::TE, HeaderValue::from_static("trailers"));
    if let Some(k) = api_key {
        let mut v = HeaderValue::try_from(format!("Bearer {k}"))?;
        v.set_sensitive(true);
        h.insert(header::AUTHORIZATION, v);
    }
    Ok(h)
}

/// A measured streamed request, reduced to what the report needs (µs).
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub ttft_us: f64,
    pub e2el_us: f64,
    /// The hop cost the gateway recorded for this request (its `Server-Timing` trailer);
    /// NaN from a target that sends none.
    pub hop_us: f64,
}

/// Whether a measured answer is a complete, correct stream; `Err` says what was wrong.
fn check(m: &Measured, max_tokens: u32) -> Result<Sample, String> {
    if m.status != 200 {
        return Err(format!("status {}", m.status));
    }
    if let Some(e) = &m.body_error {
        return Err(format!("body error: {e}"));
    }
    let s = &m.metrics;
    if s.error {
        return Err("error event in stream".into());
    }
    if !s.done {
        return Err("no clean end ([DONE], response.completed, message_stop)".into());
    }
    match s.output_tokens().0 {
        Some(n) if n == u64::from(max_tokens) => {}
        other => return Err(format!("output tokens {other:?}, expected {max_tokens}")),
    }
    let (Some(ttft), Some(e2el)) = (s.ttft(), s.e2el()) else {
        return Err("no content event".into());
    };
    Ok(Sample {
        ttft_us: ttft.as_secs_f64() * 1e6,
        e2el_us: e2el.as_secs_f64() * 1e6,
        hop_us: fleetgate_bench::measure::hop_ms(&m.headers, m.trailers.as_ref())
            .map_or(f64::NAN, |ms| ms * 1e3),
    })
}

pub async fn measure(
    t_client: &HttpClient,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    max_tokens: u32,
) -> Result<Sample, String> {
    match client::send_in(t_client, uri, headers, body, false, protocol().dialect()).await {
        Ok(m) => check(&m, max_tokens),
        Err(e) => Err(format!("request failed: {e}")),
    }
}
