//! A measuring OpenAI client: sends one request and times the SSE answer by the vLLM benchmark
//! definitions (the same scanner and `StreamMetrics` the gateway's Timeline uses). The demo and
//! the tests use `send`; the load generator (`bench::measure`) sends and reads through the same
//! `post`, `open` and `Answer::read`, and keeps its per-request figures on top.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::Dialect;
use crate::event::DataKind;
use crate::sse::SseScanner;
use crate::stream::StreamMetrics;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A keep-alive HTTP/1.1 client with TCP_NODELAY.
pub fn http_client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(http)
}

/// One measured answer.
#[derive(Debug)]
pub struct Measured {
    pub status: u16,
    pub headers: HeaderMap,
    /// Offsets from the moment the request was handed to the client.
    pub metrics: StreamMetrics,
    /// The whole body as received (kept only when asked for).
    pub body: Option<Bytes>,
    /// The body ended with an error (connection cut) rather than cleanly.
    pub body_error: Option<String>,
    /// Trailer fields after the body (sent only to a request with `TE: trailers`).
    pub trailers: Option<HeaderMap>,
}

/// A JSON POST of `body` to `uri` with `headers` (`Content-Type: application/json` unless they
/// name another).
pub fn post(uri: &Uri, headers: &HeaderMap, body: Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri.clone();
    *req.headers_mut() = headers.clone();
    req.headers_mut()
        .entry(header::CONTENT_TYPE)
        .or_insert(HeaderValue::from_static("application/json"));
    req
}

/// An answer whose head has arrived; `read` takes its body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The moment the request was handed to the client: every offset counts from here.
    pub(crate) start: Instant,
    /// The trailer fields that ended a chunked body (a server sends them only to a request that
    /// carried `TE: trailers`); set by `read`.
    pub trailers: Option<HeaderMap>,
    body: Incoming,
}

/// How a body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEnd {
    Complete,
    /// A transport error cut it (the error's text).
    Cut(String),
    /// The deadline passed first.
    Deadline,
}

/// Send `req`, timed from `start`, and wait for the answer's head.
pub async fn open(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
    start: Instant,
) -> Result<Answer, hyper_util::client::legacy::Error> {
    let resp = client.request(req).await?;
    let (parts, body) = resp.into_parts();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        start,
        trailers: None,
        body,
    })
}

impl Answer {
    /// Read the body to its end, handing every read to `on_read` with its offset from `start`
    /// (taken as it arrives: these offsets are what TTFT and ITL are measured from). Trailer
    /// fields at the end of the body are kept in `trailers`.
    pub async fn read(
        &mut self,
        deadline: Option<tokio::time::Instant>,
        mut on_read: impl FnMut(&[u8], Duration),
    ) -> BodyEnd {
        loop {
            let frame = match deadline {
                Some(d) => match tokio::time::timeout_at(d, self.body.frame()).await {
                    Ok(f) => f,
                    Err(_) => return BodyEnd::Deadline,
                },
                None => self.body.frame().await,
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => on_read(&data, self.start.elapsed()),
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            self.trailers.get_or_insert_with(HeaderMap::new).extend(t);
                        }
                    }
                },
                Some(Err(e)) => return BodyEnd::Cut(e.to_string()),
                None => return BodyEnd::Complete,
            }
        }
    }
}

/// Send `body` as a POST to `uri` and time the answer. `keep_body` keeps the bytes.
pub async fn send(
    client: &HttpClient,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    keep_body: bool,
) -> Result<Measured, hyper_util::client::legacy::Error> {
    send_in(client, uri, headers, body, keep_body, Dialect::Chat).await
}

/// `send`, for an answer in `dialect` (its token events and usage read as that protocol's).
pub async fn send_in(
    client: &HttpClient,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    keep_body: bool,
    dialect: Dialect,
) -> Result<Measured, hyper_util::client::legacy::Error> {
    let req = post(uri, headers, body);
    let mut answer = open(client, req, Instant::now()).await?;
    let mut scanner = SseScanner::for_dialect(dialect, usize::MAX);
    let mut metrics = StreamMetrics::default();
    let mut kept = keep_body.then(BytesMut::new);
    let end = answer
        .read(None, |data, at| {
            scanner.feed(data, |l| metrics.on_data(l.kind, l.usage, at));
            if let Some(k) = kept.as_mut() {
                k.extend_from_slice(data);
            }
        })
        .await;
    let total = answer.start.elapsed();
    scanner.finish(|l| metrics.on_data(l.kind, l.usage, total));
    Ok(Measured {
        status: answer.status.as_u16(),
        headers: answer.headers,
        metrics,
        body: kept.map(BytesMut::freeze),
        trailers: answer.trailers.take(),
        body_error: match end {
            BodyEnd::Cut(e) => Some(e),
            BodyEnd::Complete | BodyEnd::Deadline => None,
        },
    })
}

/// The text of every content event's first choice (delta.content or text), concatenated.
pub fn stream_text(body: &[u8]) -> String {
    let mut out = String::new();
    let mut scanner = SseScanner::new();
    scanner.feed(body, |l| {
        if l.kind != DataKind::Content {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(l.payload) {
            let c = &v["choices"][0];
            if let Some(s) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                out.push_str(s);
            }
        }
    });
    out
}

/// A small chat request body.
pub fn chat_body(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
        .to_string(),
    )
}
