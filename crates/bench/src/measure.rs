//! One request of the load generator, timed by vLLM 0.33's `vllm bench serve` definitions (see
//! `protocol::event::DataKind::Content`): TTFT at the first token event, one ITL per later token
//! event (the gap to the one before), E2EL at the last token event, output tokens from
//! `usage.completion_tokens`, TPOT = (E2EL − TTFT) / (output tokens − 1). An
//! in-stream `{"error": ...}` event, a non-2xx status, a cut body or a stream without a token
//! makes the request failed, with the reason kept. Beside the client's own clock, it keeps what
//! a gateway says of itself in `Server-Timing`: its own time (`gw`) and the hop cost it recorded
//! (`hop`, which a stream carries in a trailer).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};

use fleetgate_protocol::client::{self, BodyEnd, HttpClient};
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use fleetgate_protocol::stream::StreamMetrics;

/// What one request gave.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Which target (0 unless comparing).
    pub target: u8,
    /// Index of the prompt sent.
    pub prompt: usize,
    /// When it was sent, from the start of the run.
    pub(crate) sent_at: Duration,
    /// From sending to the end of the answer (or the failure).
    pub(crate) took: Duration,
    /// The error, when it failed.
    pub error: Option<String>,
    pub ttft: Option<Duration>,
    pub e2el: Option<Duration>,
    /// One per content event after the first.
    pub itls_ms: Vec<f32>,
    /// Offsets (from `sent_at`, ms) of every content event: peak throughput.
    pub(crate) token_at_ms: Vec<f32>,
    /// Prompt tokens: the server's usage, else the dataset's count.
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The output count came from the server's usage (else: content events).
    pub usage_reported: bool,
    /// The gateway's own time for this request, from its `Server-Timing: gw;dur=` header.
    pub gateway_ms: Option<f64>,
    /// The hop cost the gateway recorded for this request (`Server-Timing: hop;dur=`): from the
    /// trailer that ends a stream, else from the response header.
    pub hop_ms: Option<f64>,
    /// The backend's time as the gateway saw it (`Server-Timing: upstream;dur=`): a stream's
    /// trailer gives the backend's TTFT, a whole answer's head its time to answer.
    pub(crate) upstream_ms: Option<f64>,
    /// The answer's text, kept only when asked (`send_keeping_text`: a multi-turn conversation
    /// sends it back as the next turn's history).
    pub(crate) answer: Option<String>,
    /// The prompt tokens the server found in its prefix cache (`cached_tokens` of the usage),
    /// read only with the answer's text.
    pub(crate) cached_tokens: Option<u64>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// TPOT, defined for two or more output tokens (the Timeline's own definition).
    pub fn tpot(&self) -> Option<Duration> {
        fleetgate_protocol::stream::tpot(self.ttft?, self.e2el?, self.output_tokens)
    }
}

/// Times one stream from its reads: feed each read with its offset from the moment the
/// request was sent, then `finish`.
#[derive(Debug, Default)]
pub struct StreamTimer {
    scanner: SseScanner,
    metrics: StreamMetrics,
    itls_ms: Vec<f32>,
    token_at_ms: Vec<f32>,
    error_text: Option<String>,
    /// The answer's text and cached prompt tokens, when kept (a JSON parse per event, so only
    /// for multi-turn runs, never for the measured hot loop of the plain benchmark).
    kept: Option<Kept>,
}

/// What a multi-turn conversation needs of an answer beyond its timing.
#[derive(Debug, Default)]
struct Kept {
    text: String,
    cached: Option<u64>,
}

impl Kept {
    /// Take the text delta and any `cached_tokens` from one event's JSON, in whichever dialect
    /// (chat chunk, Responses event, Anthropic event).
    fn take(&mut self, payload: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) else {
            return;
        };
        let delta = v["choices"][0]["delta"]["content"]
            .as_str()
            .or_else(|| v["choices"][0]["text"].as_str())
            .or_else(|| {
                (v["type"] == "response.output_text.delta")
                    .then(|| v["delta"].as_str())
                    .flatten()
            })
            .or_else(|| v["delta"]["text"].as_str());
        if let Some(d) = delta {
            self.text.push_str(d);
        }
        let usage = [
            &v["usage"]["prompt_tokens_details"]["cached_tokens"],
            &v["response"]["usage"]["input_tokens_details"]["cached_tokens"],
            &v["usage"]["cache_read_input_tokens"],
            &v["message"]["usage"]["cache_read_input_tokens"],
        ];
        if let Some(n) = usage.iter().find_map(|c| c.as_u64()) {
            self.cached = Some(n);
        }
    }
}

fn ms(d: Duration) -> f32 {
    (d.as_secs_f64() * 1e3) as f32
}

impl StreamTimer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A timer of a stream in `dialect` (Responses events, Anthropic events, chat chunks).
    pub(crate) fn for_dialect(dialect: fleetgate_protocol::Dialect) -> Self {
        Self {
            scanner: SseScanner::for_dialect(dialect, usize::MAX),
            ..Self::default()
        }
    }

    /// Keep the answer's text and its cached prompt tokens too.
    pub(crate) fn keeping_text(mut self) -> Self {
        self.kept = Some(Kept::default());
        self
    }

    pub fn feed(&mut self, bytes: &[u8], at: Duration) {
        let Self {
            scanner,
            metrics,
            itls_ms,
            token_at_ms,
            error_text,
            kept,
        } = self;
        scanner.feed(bytes, |d| {
            if let Some(k) = kept.as_mut() {
                k.take(d.payload);
            }
            match d.kind {
                DataKind::Content => {
                    if let Some(prev) = metrics.last_content {
                        itls_ms.push(ms(at.saturating_sub(prev)));
                    }
                    token_at_ms.push(ms(at));
                }
                DataKind::Error if error_text.is_none() => {
                    *error_text = Some(error_message(d.payload));
                }
                _ => {}
            }
            metrics.on_data(d.kind, d.usage, at);
        });
    }

    /// The outcome once the body ended at `end` (`cut`: it ended with a transport error).
    pub fn finish(mut self, end: Duration, cut: Option<String>, expected_input: u64) -> Outcome {
        let Self {
            scanner,
            metrics,
            itls_ms,
            token_at_ms,
            error_text,
            kept,
        } = &mut self;
        scanner.finish(|d| {
            if let Some(k) = kept.as_mut() {
                k.take(d.payload);
            }
            metrics.on_data(d.kind, d.usage, end)
        });
        let kept = kept.take();
        let m = &*metrics;
        let error = if let Some(e) = error_text.take() {
            Some(format!("error event in the stream: {e}"))
        } else if let Some(c) = cut {
            Some(format!("the stream was cut: {c}"))
        } else if m.first_content.is_none() {
            Some("the stream ended without a token".to_owned())
        } else {
            None
        };
        let (output_tokens, usage_reported) = match m.usage {
            Some(u) => (u.completion_tokens, true),
            None => (u64::from(m.content_events), false),
        };
        Outcome {
            error,
            ttft: m.ttft(),
            e2el: m.e2el(),
            itls_ms: std::mem::take(itls_ms),
            token_at_ms: std::mem::take(token_at_ms),
            input_tokens: m.usage.map_or(expected_input, |u| u.prompt_tokens),
            output_tokens,
            usage_reported,
            took: end,
            cached_tokens: kept.as_ref().and_then(|k| k.cached),
            answer: kept.map(|k| k.text),
            ..Outcome::default()
        }
    }
}

/// The outcome of a whole (not streamed) answer, an embedding's, read to its end at `end`, as
/// `vllm bench serve` times a pooling request: its latency (E2EL) is the whole request, to the
/// last byte; there is no first token and no output. Input tokens are the answer's
/// `usage.prompt_tokens`. A cut body, a body that is not JSON, one carrying an `error`, or one
/// without `data` is a failed request.
pub(crate) fn whole_answer(
    body: &[u8],
    end: Duration,
    cut: Option<String>,
    expected_input: u64,
) -> Outcome {
    let v: Result<serde_json::Value, _> = serde_json::from_slice(body);
    let error = match (&cut, &v) {
        (Some(c), _) => Some(format!("the answer was cut: {c}")),
        (None, Err(e)) => Some(format!("the answer is not JSON: {e}")),
        (None, Ok(v)) if v.get("error").is_some_and(|e| !e.is_null()) => {
            Some(format!("error in the answer: {}", error_message(body)))
        }
        (None, Ok(v)) if !v["data"].is_array() => Some("the answer has no `data` list".to_owned()),
        (None, Ok(_)) => None,
    };
    let usage = v
        .as_ref()
        .ok()
        .and_then(|v| v["usage"]["prompt_tokens"].as_u64());
    Outcome {
        e2el: error.is_none().then_some(end),
        error,
        input_tokens: usage.unwrap_or(expected_input),
        usage_reported: usage.is_some(),
        took: end,
        ..Outcome::default()
    }
}

/// The `message` of an OpenAI error payload, else the payload itself (shortened).
fn error_message(payload: &[u8]) -> String {
    let v: Option<serde_json::Value> = serde_json::from_slice(payload).ok();
    message_of(v.as_ref(), payload)
}

/// A refused request's error: `HTTP <status> <code>: <message>`, the code being the error
/// body's `code` (or Anthropic's `error.type`) when it names one, so that refusals count by
/// kind (`HTTP 429 requests_per_minute_exceeded`).
fn status_error(status: u16, payload: &[u8]) -> String {
    let v: Option<serde_json::Value> = serde_json::from_slice(payload).ok();
    let code = v.as_ref().and_then(|v| {
        v["error"]["code"]
            .as_str()
            .or_else(|| v["error"]["type"].as_str())
            .filter(|c| {
                !c.is_empty()
                    && c.len() <= 64
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
            })
    });
    let message = message_of(v.as_ref(), payload);
    match code {
        Some(code) => format!("HTTP {status} {code}: {message}"),
        None => format!("HTTP {status}: {message}"),
    }
}

/// The message of a parsed error payload `v`, else the payload's text (shortened).
fn message_of(v: Option<&serde_json::Value>, payload: &[u8]) -> String {
    let msg = v.and_then(|v| {
        v["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| v["error"].as_str().map(str::to_owned))
            .or_else(|| v["message"].as_str().map(str::to_owned))
    });
    let text = msg.unwrap_or_else(|| String::from_utf8_lossy(payload).into_owned());
    text.chars().take(300).collect()
}

/// The `dur` (milliseconds) of the metric `name` in `Server-Timing` fields, e.g. 0.21 for `hop`
/// in `gw;dur=0.045, hop;dur=0.21`: the first entry of that name with a valid duration, across
/// every `Server-Timing` line of `fields` (a header map or a trailer map).
pub fn server_timing_ms(fields: &HeaderMap, name: &str) -> Option<f64> {
    fields
        .get_all("server-timing")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|entry| {
            let mut parts = entry.split(';').map(str::trim);
            if parts.next()? != name {
                return None;
            }
            parts.find_map(|p| {
                let (k, v) = p.split_once('=')?;
                if !k.trim().eq_ignore_ascii_case("dur") {
                    return None;
                }
                v.trim()
                    .trim_matches('"')
                    .parse::<f64>()
                    .ok()
                    .filter(|d| d.is_finite() && *d >= 0.0)
            })
        })
}

/// The gateway's own time: `gw` of the response head's `Server-Timing`.
pub(crate) fn gateway_ms(headers: &HeaderMap) -> Option<f64> {
    server_timing_ms(headers, "gw")
}

/// The hop cost the gateway recorded: `hop` of the trailer's `Server-Timing` (a stream's full
/// figures come at its end), else of the response head's.
pub fn hop_ms(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<f64> {
    trailer_or_head_ms(headers, trailers, "hop")
}

/// The backend's time the gateway recorded: `upstream` of the trailer, else of the head.
pub(crate) fn upstream_ms(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<f64> {
    trailer_or_head_ms(headers, trailers, "upstream")
}

/// `name` of the trailer's `Server-Timing`, else of the response head's.
fn trailer_or_head_ms(
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
    name: &str,
) -> Option<f64> {
    trailers
        .and_then(|t| server_timing_ms(t, name))
        .or_else(|| server_timing_ms(headers, name))
}

/// Send one request to `target` and time it. `started` is the run's start (for `sent_at`).
pub async fn send(
    client: &HttpClient,
    target: &super::spec::Target,
    prompt: usize,
    body: Bytes,
    expected_input: u64,
    started: Instant,
    timeout: Duration,
) -> Outcome {
    send_with(
        client,
        target,
        prompt,
        body,
        (expected_input, false),
        started,
        timeout,
    )
    .await
}

/// `send`, keeping the answer's text and cached prompt tokens (`Outcome::answer`,
/// `Outcome::cached_tokens`) for a conversation's next turn.
pub(crate) async fn send_keeping_text(
    client: &HttpClient,
    target: &super::spec::Target,
    prompt: usize,
    body: Bytes,
    expected_input: u64,
    started: Instant,
    timeout: Duration,
) -> Outcome {
    send_with(
        client,
        target,
        prompt,
        body,
        (expected_input, true),
        started,
        timeout,
    )
    .await
}

async fn send_with(
    client: &HttpClient,
    target: &super::spec::Target,
    prompt: usize,
    body: Bytes,
    (expected_input, keep_text): (u64, bool),
    started: Instant,
    timeout: Duration,
) -> Outcome {
    let uri = &target.replicas[prompt % target.replicas.len()];
    let mut req = client::post(uri, &target.headers, body);
    // A gateway sends a stream's full `Server-Timing` (with `hop`) as a trailer, and an HTTP/1
    // server sends trailers only to a client that says it takes them.
    req.headers_mut()
        .insert(header::TE, HeaderValue::from_static("trailers"));
    let start = Instant::now();
    let sent_at = start.saturating_duration_since(started);
    let failed = |error: String| Outcome {
        sent_at,
        took: start.elapsed(),
        error: Some(error),
        input_tokens: expected_input,
        ..Outcome::default()
    };
    let deadline = tokio::time::Instant::from_std(start + timeout);
    let mut answer = match tokio::time::timeout_at(deadline, client::open(client, req, start)).await
    {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => return failed(format!("request failed: {}", error_chain(&e))),
        Err(_) => return failed(format!("no response head within {timeout:?}")),
    };
    let gateway = gateway_ms(&answer.headers);
    if !answer.status.is_success() {
        let mut bytes = Vec::new();
        let end = answer
            .read(Some(deadline), |data, _| bytes.extend_from_slice(data))
            .await;
        // Only a whole body is read for its message.
        if end != BodyEnd::Complete {
            bytes.clear();
        }
        let mut o = failed(status_error(answer.status.as_u16(), &bytes));
        o.gateway_ms = gateway;
        o.hop_ms = hop_ms(&answer.headers, answer.trailers.as_ref());
        o.upstream_ms = upstream_ms(&answer.headers, answer.trailers.as_ref());
        return o;
    }
    if !target.streamed {
        let mut bytes = Vec::new();
        let end = answer
            .read(Some(deadline), |data, _| bytes.extend_from_slice(data))
            .await;
        let cut = match end {
            BodyEnd::Complete => None,
            BodyEnd::Cut(e) => Some(e),
            BodyEnd::Deadline => Some(format!("not finished within {timeout:?}")),
        };
        let mut o = whole_answer(&bytes, start.elapsed(), cut, expected_input);
        o.sent_at = sent_at;
        o.gateway_ms = gateway;
        o.hop_ms = hop_ms(&answer.headers, answer.trailers.as_ref());
        o.upstream_ms = upstream_ms(&answer.headers, answer.trailers.as_ref());
        return o;
    }
    let mut timer = StreamTimer::for_dialect(target.dialect);
    if keep_text {
        timer = timer.keeping_text();
    }
    let cut = match answer
        .read(Some(deadline), |data, at| timer.feed(data, at))
        .await
    {
        BodyEnd::Complete => None,
        BodyEnd::Cut(e) => Some(e),
        BodyEnd::Deadline => Some(format!("not finished within {timeout:?}")),
    };
    let mut o = timer.finish(start.elapsed(), cut, expected_input);
    o.sent_at = sent_at;
    o.gateway_ms = gateway;
    o.hop_ms = hop_ms(&answer.headers, answer.trailers.as_ref());
    o.upstream_ms = upstream_ms(&answer.headers, answer.trailers.as_ref());
    o
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_the_gateway_time_from_server_timing() {
        let mut h = HeaderMap::new();
        h.insert(
            "server-timing",
            HeaderValue::from_static("gw;dur=0.041, upstream;dur=812.3"),
        );
        assert_eq!(gateway_ms(&h), Some(0.041));
        h.insert("server-timing", HeaderValue::from_static("upstream;dur=3"));
        assert_eq!(gateway_ms(&h), None);
    }

    fn fields(lines: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append("server-timing", HeaderValue::from_static(l));
        }
        h
    }

    #[test]
    fn reads_the_hop_cost_from_the_trailer_else_the_header() {
        let head = fields(&["gw;dur=0.045"]);
        let trailer = fields(&["gw;dur=0.051, hop;dur=0.210"]);
        assert_eq!(hop_ms(&head, Some(&trailer)), Some(0.21));
        assert_eq!(hop_ms(&head, None), None, "no hop anywhere");
        assert_eq!(gateway_ms(&head), Some(0.045), "gw still from the head");
        // A non-streamed answer carries everything in its header.
        let whole = fields(&["gw;dur=0.045, upstream;dur=812.300, hop;dur=0.199"]);
        assert_eq!(hop_ms(&whole, None), Some(0.199));
        // The trailer wins over the header; a trailer without hop falls back to the header.
        assert_eq!(hop_ms(&whole, Some(&trailer)), Some(0.21));
        assert_eq!(hop_ms(&whole, Some(&fields(&["gw;dur=1"]))), Some(0.199));
        assert_eq!(upstream_ms(&whole, None), Some(812.3));
        let stream_end = fields(&["gw;dur=0.051, upstream;dur=40.125, hop;dur=0.210"]);
        assert_eq!(upstream_ms(&head, Some(&stream_end)), Some(40.125));
        assert_eq!(upstream_ms(&head, Some(&trailer)), None);
    }

    #[test]
    fn server_timing_entries_are_read_as_the_spec_writes_them() {
        // Several lines, parameters in any order, a quoted value, `DUR` in capitals, spaces.
        let h = fields(&[
            "cache;desc=\"hit\"",
            "hop ; desc=\"kernel rx to first token\" ; DUR = \"0.250\" , gw;dur=0.04",
        ]);
        assert_eq!(server_timing_ms(&h, "hop"), Some(0.25));
        assert_eq!(server_timing_ms(&h, "gw"), Some(0.04));
        assert_eq!(server_timing_ms(&h, "cache"), None, "no duration");
        // Not a prefix match, and nothing but a finite, non-negative duration.
        for bad in [
            "hopper;dur=1",
            "hop;dur=",
            "hop;dur=fast",
            "hop;dur=-1",
            "hop;dur=NaN",
            "hop;dur=inf",
            "hop",
        ] {
            let h = fields(&[bad]);
            assert_eq!(server_timing_ms(&h, "hop"), None, "{bad}");
        }
        // The first valid entry of the name wins.
        assert_eq!(
            server_timing_ms(&fields(&["hop;dur=x, hop;dur=2.5, hop;dur=3"]), "hop"),
            Some(2.5)
        );
    }

    proptest! {
        #[test]
        fn a_written_duration_reads_back(us in 0u64..10_000_000_000, other in "[a-z]{1,8}") {
            // Written as the gateway writes it: milliseconds with three decimals.
            let ms = format!("{}.{:03}", us / 1000, us % 1000);
            let line = format!("{other};dur=7, hop;dur={ms}");
            let mut h = HeaderMap::new();
            h.insert("server-timing", HeaderValue::try_from(line).unwrap());
            let want = if other == "hop" { 7.0 } else { ms.parse::<f64>().unwrap() };
            prop_assert_eq!(server_timing_ms(&h, "hop"), Some(want));
        }
    }

    #[test]
    fn a_whole_answer_is_timed_to_its_end_with_usage_as_its_input() {
        let end = Duration::from_millis(7);
        let body = br#"{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":12,"total_tokens":12}}"#;
        let o = whole_answer(body, end, None, 5);
        assert!(o.ok(), "{:?}", o.error);
        assert_eq!((o.e2el, o.ttft, o.took), (Some(end), None, end));
        assert_eq!(
            (o.input_tokens, o.usage_reported, o.output_tokens),
            (12, true, 0)
        );
        let o = whole_answer(br#"{"data":[]}"#, end, None, 5);
        assert_eq!(
            (o.input_tokens, o.usage_reported),
            (5, false),
            "the prompt's count"
        );
        for (body, cut, why) in [
            (&b"{\"data\":["[..], Some("reset".to_owned()), "cut"),
            (&b"not json"[..], None, "not JSON"),
            (&br#"{"error":{"message":"boom"}}"#[..], None, "boom"),
            (&br#"{"object":"list"}"#[..], None, "no `data`"),
        ] {
            let o = whole_answer(body, end, cut, 5);
            let e = o.error.unwrap_or_default();
            assert!(e.contains(why), "{e}");
            assert_eq!(o.e2el, None, "a failed request has no latency");
        }
    }

    #[test]
    fn a_stream_without_tokens_or_cut_is_failed() {
        let mut t = StreamTimer::new();
        t.feed(b"data: [DONE]\n\n", Duration::from_millis(3));
        let o = t.finish(Duration::from_millis(3), None, 5);
        assert!(o.error.unwrap().contains("without a token"));
        let mut t = StreamTimer::new();
        t.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            Duration::from_millis(3),
        );
        let o = t.finish(Duration::from_millis(9), Some("reset".into()), 5);
        assert!(o.error.unwrap().contains("cut"));
        assert_eq!(o.input_tokens, 5, "the dataset's count without usage");
    }
}
