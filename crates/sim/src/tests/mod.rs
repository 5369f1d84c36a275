//! End-to-end tests: real sims on 127.0.0.1:0, driven by a hyper client. This module holds
//! the client and the helpers the test files share; each file tests one area:
//! - `generation`: chat and completions, streamed and not, and the chat batch.
//! - `routes`: auth, the tokenizer, error shapes, models and metrics.
//! - `scheduling`: cancellation, queueing and priority in the engine.
//! - `faults`: warm-up and injected faults.
//! - `flags`: the CLI flags and their validation.
//! - `pooling`: the pooling runner's routes.
//! - `audio`: speech to text.
//! - `prefix_cache`: automatic prefix caching and its metrics.
//! - `lora`: LoRA adapters, their routes and their gauge.

mod audio;
mod faults;
mod flags;
mod generation;
mod lora;
mod pooling;
mod prefix_cache;
mod routes;
mod scheduling;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::{SimArgs, SimServer};

type TestClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn zero_delay() -> SimArgs {
    SimArgs {
        zero_delay: true,
        capture_streams: true,
        ..SimArgs::default()
    }
}

/// Small but non-zero timing, so the scheduler task is exercised.
fn timed() -> SimArgs {
    SimArgs {
        decode_step_ms: 1.0,
        decode_ms_per_seq: 0.0,
        prefill_us_per_token: 1.0,
        capture_streams: true,
        ..SimArgs::default()
    }
}

async fn send(
    c: &TestClient,
    sim: &SimServer,
    method: &str,
    path: &str,
    body: Option<Value>,
    headers: &[(&str, &str)],
) -> Response<Incoming> {
    let mut b = Request::builder()
        .method(method)
        .uri(format!("{}{path}", sim.url()));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let body = body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string()));
    let req = b
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    c.request(req).await.unwrap()
}

async fn read_all(r: Response<Incoming>) -> Bytes {
    r.into_body().collect().await.unwrap().to_bytes()
}

/// Splits an SSE body into its `data:` payloads, checking the framing on the way.
fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "body ends with a blank line");
    text.split_terminator("\n\n")
        .map(|ev| ev.strip_prefix("data: ").unwrap().to_owned())
        .collect()
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    // Bounded wait for another task's effect; the bound is generous so a loaded machine does
    // not flake, and the loop exits as soon as the condition holds.
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

fn openai_error(body: &[u8]) -> (String, String, Value, u64) {
    let v: Value = serde_json::from_slice(body).unwrap();
    let e = &v["error"];
    (
        e["message"].as_str().unwrap().to_owned(),
        e["type"].as_str().unwrap().to_owned(),
        e["param"].clone(),
        e["code"].as_u64().unwrap(),
    )
}

const KEYED: [(&str, &str); 1] = [("authorization", "Bearer sekret")];

fn keys_of(v: &Value) -> Vec<String> {
    v.as_object().unwrap().keys().cloned().collect()
}
