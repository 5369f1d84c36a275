//! A measuring OpenAI client: sends one request and times the SSE answer by the vLLM benchmark
//! definitions (the same scanner and `StreamMetrics` the gateway's Timeline uses). The demo and
//! the tests use it; the load generator builds on it.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::openai::sse::{DataKind, SseScanner};
use crate::telemetry::StreamMetrics;

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
    /// Time until the response head arrived.
    pub head: Duration,
    /// Time until the body ended.
    pub total: Duration,
    /// The whole body as received (kept only when asked for).
    pub body: Option<Bytes>,
    /// The body ended with an error (connection cut) rather than cleanly.
    pub body_error: Option<String>,
}

/// Send `body` as a POST to `uri` and time the answer. `keep_body` keeps the bytes.
pub async fn send(
    client: &HttpClient,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    keep_body: bool,
) -> Result<Measured, hyper_util::client::legacy::Error> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri.clone();
    *req.headers_mut() = headers.clone();
    req.headers_mut()
        .entry(header::CONTENT_TYPE)
        .or_insert(HeaderValue::from_static("application/json"));
    let start = Instant::now();
    let resp = client.request(req).await?;
    let head = start.elapsed();
    let status = resp.status().as_u16();
    let (parts, mut incoming) = resp.into_parts();
    let mut scanner = SseScanner::new();
    let mut metrics = StreamMetrics::default();
    let mut kept = keep_body.then(BytesMut::new);
    let mut body_error = None;
    while let Some(frame) = incoming.frame().await {
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    let at = start.elapsed();
                    scanner.feed(data, |l| metrics.on_data(l.kind, l.payload, at));
                    if let Some(k) = kept.as_mut() {
                        k.extend_from_slice(data);
                    }
                }
            }
            Err(e) => {
                body_error = Some(e.to_string());
                break;
            }
        }
    }
    let total = start.elapsed();
    scanner.finish(|l| metrics.on_data(l.kind, l.payload, total));
    Ok(Measured {
        status,
        headers: parts.headers,
        metrics,
        head,
        total,
        body: kept.map(BytesMut::freeze),
        body_error,
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
