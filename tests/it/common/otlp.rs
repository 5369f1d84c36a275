//! An OTLP/HTTP receiver: what a collector gets from the gateway, decoded with the official
//! protobuf schema (`opentelemetry-proto`), never by matching strings.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// One span as received, with its resource's attributes.
#[derive(Clone, Debug)]
pub struct Received {
    pub span: Span,
    pub resource: Vec<KeyValue>,
}

impl Received {
    pub fn attr(&self, key: &str) -> Option<&any_value::Value> {
        attr(&self.span.attributes, key)
    }
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attr(key)? {
            any_value::Value::StringValue(s) => Some(s),
            _ => None,
        }
    }
    /// A string array attribute (empty when absent).
    pub fn strs(&self, key: &str) -> Vec<String> {
        match self.attr(key) {
            Some(any_value::Value::ArrayValue(a)) => a
                .values
                .iter()
                .filter_map(|v| match &v.value {
                    Some(any_value::Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            any_value::Value::IntValue(i) => Some(*i),
            _ => None,
        }
    }
    pub fn resource_str(&self, key: &str) -> Option<&str> {
        match attr(&self.resource, key)? {
            any_value::Value::StringValue(s) => Some(s),
            _ => None,
        }
    }
    pub fn trace_hex(&self) -> String {
        hex(&self.span.trace_id)
    }
    pub fn id_hex(&self) -> String {
        hex(&self.span.span_id)
    }
    pub fn parent_hex(&self) -> String {
        hex(&self.span.parent_span_id)
    }
    /// SERVER = 2, CLIENT = 3 (`SpanKind` in the schema).
    pub fn kind(&self) -> i32 {
        self.span.kind
    }
    /// ERROR = 2 (`StatusCode` in the schema).
    pub fn status_code(&self) -> i32 {
        self.span.status.as_ref().map_or(0, |s| s.code)
    }
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A collector on 127.0.0.1: every export it is sent is decoded and kept; it answers each
/// with `status` after `delay`.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    pub spans: Arc<Mutex<Vec<Received>>>,
    /// Headers of every export request.
    pub heads: Arc<Mutex<Vec<http::HeaderMap>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        Self::answering(200, Duration::ZERO).await
    }

    pub async fn answering(status: u16, delay: Duration) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::answering_on(listener, status, delay)
    }

    /// A receiver on `addr` (where another process was told to export).
    pub async fn at(addr: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("cannot listen on {addr} for OTLP: {e}"));
        Self::answering_on(listener, 200, Duration::ZERO)
    }

    fn answering_on(listener: tokio::net::TcpListener, status: u16, delay: Duration) -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (keep, keep_heads) = (spans.clone(), heads.clone());
        let (addr, task) = super::http_backend_on(
            listener,
            move |req: http::Request<hyper::body::Incoming>| {
                let (keep, keep_heads) = (keep.clone(), keep_heads.clone());
                async move {
                    assert_eq!(req.uri().path(), "/v1/traces");
                    assert_eq!(
                        req.headers().get("content-type").unwrap(),
                        "application/x-protobuf"
                    );
                    let gzip = req
                        .headers()
                        .get("content-encoding")
                        .is_some_and(|v| v == "gzip");
                    keep_heads.lock().unwrap().push(req.headers().clone());
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let body = if gzip {
                        let mut out = Vec::new();
                        flate2::read::GzDecoder::new(&body[..])
                            .read_to_end(&mut out)
                            .unwrap();
                        Bytes::from(out)
                    } else {
                        body
                    };
                    tokio::time::sleep(delay).await;
                    if status == 200 {
                        let export = ExportTraceServiceRequest::decode(body).unwrap();
                        let mut kept = keep.lock().unwrap();
                        for rs in export.resource_spans {
                            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
                            for ss in rs.scope_spans {
                                for span in ss.spans {
                                    kept.push(Received {
                                        span,
                                        resource: resource.clone(),
                                    });
                                }
                            }
                        }
                    }
                    http::Response::builder()
                        .status(status)
                        .header("content-type", "application/x-protobuf")
                        .body(http_body_util::Full::new(Bytes::from(
                            ExportTraceServiceResponse::default().encode_to_vec(),
                        )))
                        .unwrap()
                }
            },
        );
        Self {
            addr,
            spans,
            heads,
            task,
        }
    }

    /// The `[tracing]` endpoint of this receiver.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The spans of the trace `trace` (32 hex digits), once at least `n` have arrived
    /// (within 10 s).
    pub async fn trace(&self, trace: &str, n: usize) -> Vec<Received> {
        for _ in 0..500 {
            let got = self.of_trace(trace);
            if got.len() >= n {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.of_trace(trace)
    }

    pub fn of_trace(&self, trace: &str) -> Vec<Received> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_hex() == trace)
            .cloned()
            .collect()
    }

    /// The spans whose `fleetgate.request_id` is `id`'s trace: the request's spans.
    pub async fn request(&self, id: &str, n: usize) -> Vec<Received> {
        for _ in 0..500 {
            let trace = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .find(|s| s.str("fleetgate.request_id") == Some(id))
                .map(Received::trace_hex);
            if let Some(t) = trace {
                let got = self.of_trace(&t);
                if got.len() >= n {
                    return got;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "no {n} spans for request {id}: {:#?}",
            self.spans.lock().unwrap()
        );
    }
}

/// A `[tracing]` section exporting to `endpoint` quickly (50 ms batches).
pub fn tracing_to(endpoint: &str) -> fleetgate_gateway::config::TracingConfig {
    tracing_with(endpoint, "")
}

/// `tracing_to` with more of the section's settings.
pub fn tracing_with(endpoint: &str, more: &str) -> fleetgate_gateway::config::TracingConfig {
    fleetgate_gateway::config::TracingConfig::parse(
        &format!("endpoint = \"{endpoint}\"\nschedule_delay_ms = 50\n{more}"),
        |_| None,
    )
    .unwrap()
}
