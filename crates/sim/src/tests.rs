//! End-to-end tests: real sims on 127.0.0.1:0, driven by a hyper client.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use super::*;

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

async fn streaming_chat_frames(args: SimArgs) {
    let sim = start(args).await.unwrap();
    let c = client();
    let req = json!({
        "model": "qwen32b",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there, sim"}]}],
        "max_tokens": 5,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req),
        &[("x-request-id", "req-1")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    // vLLM builds the id from the header (below) and does not echo it.
    assert!(!r.headers().contains_key("x-request-id"));
    let body = read_all(r).await;
    let events = sse_events(&body);
    assert_eq!(events.len(), 1 + 5 + 1 + 1, "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..7]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for ch in &chunks {
        assert_eq!(ch["id"], "chatcmpl-req-1");
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["model"], "qwen32b");
        assert!(ch["created"].as_u64().unwrap() > 1_600_000_000);
    }
    let role = &chunks[0]["choices"][0];
    assert_eq!(role["delta"], json!({"role": "assistant", "content": ""}));
    assert!(role["finish_reason"].is_null());
    for (i, ch) in chunks[1..6].iter().enumerate() {
        let choice = &ch["choices"][0];
        assert!(!choice["delta"]["content"].as_str().unwrap().is_empty());
        let want = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], want, "chunk {i}");
    }
    let usage = &chunks[6];
    assert_eq!(usage["choices"], json!([]));
    // "hello there, sim" is 16 characters → 4 prompt tokens.
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5})
    );
    assert_eq!(sim.stats().captured("req-1").unwrap(), body);
    assert_eq!(sim.stats().completed.load(Relaxed), 1);
    assert_eq!(sim.stats().requests.load(Relaxed), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_chat_exact_frames_zero_delay() {
    streaming_chat_frames(zero_delay()).await;
}

#[tokio::test]
async fn streaming_chat_exact_frames_through_scheduler() {
    streaming_chat_frames(timed()).await;
}

#[tokio::test]
async fn streaming_completions_have_no_role_chunk() {
    let sim = start(timed()).await.unwrap();
    let c = client();
    let req = json!({"model": "qwen32b", "prompt": "abcdefgh", "max_tokens": 3, "stream": true});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 4);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(first["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(first["object"], "text_completion");
    assert!(first["choices"][0]["text"].is_string());
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(events[3], "[DONE]");
    sim.shutdown().await;
}

#[tokio::test]
async fn non_streaming_shapes() {
    let sim = start(timed()).await.unwrap();
    let c = client();
    let req = json!({"model": "qwen32b", "messages": [{"role": "user", "content": "12345678"}],
        "max_completion_tokens": 7});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "application/json");
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "chat.completion");
    let id = v["id"].as_str().unwrap();
    let hex = id.strip_prefix("chatcmpl-").unwrap();
    assert!(
        hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "vLLM's ids: {id}"
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 9);

    let req = json!({"model": "qwen32b", "prompt": [1, 2, 3], "max_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(sim.stats().completed.load(Relaxed), 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn same_request_same_tokens() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "determinism"}], "max_tokens": 40});
    let mut texts = Vec::new();
    for _ in 0..2 {
        let r = send(
            &c,
            &sim,
            "POST",
            "/v1/chat/completions",
            Some(req.clone()),
            &[],
        )
        .await;
        let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
        texts.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(texts[0], texts[1]);
    sim.shutdown().await;
}

#[tokio::test]
async fn api_key_is_enforced_on_v1_only() {
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    for headers in [
        &[][..],
        &[("authorization", "Bearersekret")][..],
        &[("authorization", "Bearer wrong")][..],
    ] {
        let r = send(
            &c,
            &sim,
            "POST",
            "/v1/chat/completions",
            Some(req.clone()),
            headers,
        )
        .await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(&read_all(r).await[..], br#"{"error":"Unauthorized"}"#);
    }
    let r = send(&c, &sim, "GET", "/v1/models", None, &[]).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let ok = [("authorization", "Bearer sekret")];
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &ok).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = send(&c, &sim, "GET", "/health", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(read_all(r).await.is_empty());
    assert!(
        format!(
            "{:?}",
            SimArgs {
                api_key: Some("sekret".into()),
                ..SimArgs::default()
            }
        )
        .contains("*****")
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_detokenize_like_vllm() {
    // As vLLM: at the root, outside the /v1 paths its --api-key guards.
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let prompt = "hello there, sim";
    let req = json!({"model": "qwen32b", "prompt": prompt, "add_special_tokens": false});
    let r = send(&c, &sim, "POST", "/tokenize", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    // The count generation reports as usage.prompt_tokens for the same prompt.
    assert_eq!(v["count"], 4);
    assert_eq!(v["max_model_len"], 32768);
    assert!(v["token_strs"].is_null());
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 4);

    // The first three tokens back to text.
    let req = json!({"model": "qwen32b", "tokens": tokens[..3]});
    let r = send(&c, &sim, "POST", "/detokenize", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v, json!({"prompt": "hello there,"}));

    // Chat messages go through the sim's template (their texts, concatenated); the same text
    // gives the same ids on any sim.
    let req = json!({"messages": [{"role": "user", "content": "hello there"},
        {"role": "user", "content": [{"type": "text", "text": ", sim"}]}],
        "return_token_strs": true});
    let r = send(&c, &sim, "POST", "/tokenize", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["tokens"], Value::Array(tokens));
    assert_eq!(v["token_strs"], json!(["hell", "o th", "ere,", " sim"]));
    assert_eq!(sim.stats().tokenizations.load(Relaxed), 3);
    assert_eq!(sim.stats().requests.load(Relaxed), 0);

    // vLLM's errors: an unknown model, a missing prompt, an id outside the vocabulary, GET.
    let r = send(
        &c,
        &sim,
        "POST",
        "/tokenize",
        Some(json!({"model": "x", "prompt": "a"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let (msg, kind, _, _) = openai_error(&read_all(r).await);
    assert!(msg.contains("`x` does not exist"), "{msg}");
    assert_eq!(kind, "NotFoundError");
    let r = send(
        &c,
        &sim,
        "POST",
        "/tokenize",
        Some(json!({"model": "qwen32b"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = send(
        &c,
        &sim,
        "POST",
        "/detokenize",
        Some(json!({"tokens": [1_114_112]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let (msg, _, _, _) = openai_error(&read_all(r).await);
    assert!(msg.contains("1114112"), "{msg}");
    let r = send(&c, &sim, "GET", "/tokenize", None, &[]).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
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

#[tokio::test]
async fn client_errors_in_vllm_shape() {
    let sim = start(SimArgs {
        max_model_len: 100,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(json!({"model": "gpt-4", "messages": []})),
        &[("x-request-id", "bad-model")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let body = read_all(r).await;
    let (msg, kind, param, code) = openai_error(&body);
    assert_eq!(
        msg,
        "The model `gpt-4` does not exist. Valid aliases: qwen32b."
    );
    assert_eq!(
        (kind.as_str(), param, code),
        ("NotFoundError", json!("model"), 404)
    );
    assert_eq!(sim.stats().captured("bad-model").unwrap(), body);

    let bad = Request::builder()
        .method("POST")
        .uri(format!("{}/v1/completions", sim.url()))
        .body(Full::new(Bytes::from_static(b"{not json")))
        .unwrap();
    let r = c.request(bad).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // FastAPI's validation error, at the byte where the JSON breaks (vLLM 0.32).
    let (_, kind, param, code) = openai_error(&read_all(r).await);
    assert_eq!(
        (kind.as_str(), param, code),
        ("Bad Request", json!("body.1"), 400)
    );
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(json!({"model": "qwen32b", "messages": "hello"})),
        &[],
    )
    .await;
    let (_, kind, param, _) = openai_error(&read_all(r).await);
    assert_eq!(
        (kind.as_str(), param),
        ("Bad Request", json!("body.messages"))
    );

    // A prompt that leaves no room, and max_tokens alone over the context, are refused naming
    // the parameter; prompt + max_tokens over it is clamped.
    let long = json!({"prompt": "x".repeat(400), "max_tokens": 10});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(long), &[]).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let (msg, _, param, _) = openai_error(&read_all(r).await);
    assert_eq!(param, json!("input_tokens"));
    assert!(
        msg.starts_with("This model's maximum context length is 100 tokens. However, your prompt contains at least 100 input tokens"),
        "{msg}"
    );
    let over = json!({"prompt": "hello", "max_tokens": 101});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(over), &[]).await;
    let (msg, _, param, _) = openai_error(&read_all(r).await);
    assert_eq!(param, json!("max_tokens"));
    assert!(
        msg.starts_with("max_tokens=101 cannot be greater than max_model_len=100"),
        "{msg}"
    );
    let clamped = json!({"prompt": "x".repeat(360), "max_tokens": 50});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(clamped), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 10, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    let r = send(&c, &sim, "GET", "/v1/nope", None, &[]).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = send(&c, &sim, "GET", "/v1/chat/completions", None, &[]).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
}

#[tokio::test]
async fn models_and_metrics() {
    let sim = start(SimArgs {
        served_model_name: vec!["a".into(), "b".into()],
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let r = send(&c, &sim, "GET", "/v1/models", None, &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "a");
    assert_eq!(v["data"][1]["id"], "b");
    assert_eq!(v["data"][0]["owned_by"], "vllm");
    assert_eq!(v["data"][0]["max_model_len"], 32768);
    assert!(v["data"][0]["parent"].is_null());
    // vLLM's root is the model it loaded, the same on every card.
    assert_eq!(v["data"][1]["root"], "a");
    let perm = v["data"][0]["permission"][0]["id"].as_str().unwrap();
    assert_eq!(perm.len(), "modelperm-".len() + 16, "{perm}");

    let req =
        json!({"model": "b", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 3});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["model"], "a", "the first served name is reported");

    let r = send(&c, &sim, "GET", "/metrics", None, &[]).await;
    let text = String::from_utf8(read_all(r).await.to_vec()).unwrap();
    for line in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 0.0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 0.0",
        "vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"a\",reason=\"capacity\"} 0.0",
        "vllm:prompt_tokens_total{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:generation_tokens_total{engine=\"0\",model_name=\"a\"} 3.0",
        "vllm:request_success_total{engine=\"0\",model_name=\"a\",finished_reason=\"length\"} 1.0",
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"a\"} 2.0",
        "vllm:request_queue_time_seconds_count{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:request_generation_tokens_sum{engine=\"0\",model_name=\"a\"} 3.0",
        "vllm:request_prompt_tokens_bucket{engine=\"0\",model_name=\"a\",le=\"1.0\"} 1.0",
        "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",model_name=\"a\",le=\"+Inf\"} 1.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
    }
    assert!(
        !text.contains("gpu_cache_usage_perc"),
        "gone since vLLM 0.10"
    );
    sim.shutdown().await;
}

/// Reads from a streaming body until `n` content events have arrived.
async fn read_events(body: &mut Incoming, n: usize) -> String {
    let mut seen = String::new();
    while seen.matches("\"content\":").count() < n {
        let frame = body.frame().await.unwrap().unwrap();
        if let Ok(data) = frame.into_data() {
            seen.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
    seen
}

#[tokio::test]
async fn dropped_stream_is_cancelled_and_leaves_the_batch() {
    let sim = start(SimArgs {
        decode_step_ms: 2.0,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000,
        "stream": true});
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req),
        &[("x-request-id", "gone")],
    )
    .await;
    let mut body = r.into_body();
    let seen = read_events(&mut body, 3).await;
    assert_eq!(sim.stats().running.load(Relaxed), 1);
    drop(body);
    let stats = sim.stats().clone();
    eventually("cancellation", || stats.cancelled.load(Relaxed) == 1).await;
    eventually("batch to empty", || stats.running.load(Relaxed) == 0).await;
    assert_eq!(stats.completed.load(Relaxed), 0);
    // What was captured begins with what the client saw and has no [DONE].
    eventually("capture", || stats.captured("gone").is_some()).await;
    let captured = stats.captured("gone").unwrap();
    assert!(captured.starts_with(seen.as_bytes()));
    assert!(!captured.ends_with(b"data: [DONE]\n\n"));
    sim.shutdown().await;
}

#[tokio::test]
async fn abandoned_non_streaming_request_is_cancelled() {
    let sim = start(SimArgs {
        decode_step_ms: 2.0,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000});
    let stats = sim.stats().clone();
    let pending = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]);
    tokio::select! {
        _ = pending => panic!("a 30000-token answer cannot be ready yet"),
        () = eventually("sequence to run", || stats.running.load(Relaxed) == 1) => {}
    }
    eventually("cancellation", || stats.cancelled.load(Relaxed) == 1).await;
    eventually("batch to empty", || stats.running.load(Relaxed) == 0).await;
    sim.shutdown().await;
}

#[tokio::test]
async fn queueing_beyond_max_num_seqs() {
    let sim = start(SimArgs {
        max_num_seqs: 1,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000,
        "stream": true});
    let a = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    let b = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let stats = sim.stats().clone();
    eventually("one running, one waiting", || {
        stats.running.load(Relaxed) == 1 && stats.waiting.load(Relaxed) == 1
    })
    .await;
    drop(a);
    // The waiting one is admitted once the first leaves.
    let mut b = b.into_body();
    read_events(&mut b, 1).await;
    sim.shutdown().await;
}

#[tokio::test]
async fn warmup_refuses_then_accepts() {
    let sim = start(SimArgs {
        warmup_secs: 1.0,
        ..zero_delay()
    })
    .await
    .unwrap();
    let err = tokio::net::TcpStream::connect(sim.addr())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    let mut connected = false;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(sim.addr()).await.is_ok() {
            connected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connected, "accepting after the warm-up");
    let r = send(&client(), &sim, "GET", "/health", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    sim.shutdown().await;
}

#[tokio::test]
async fn injected_faults() {
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 10,
        "stream": true});

    let sim = start(SimArgs {
        drop_after_chunks: Some(3),
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut body = r.into_body();
    let mut got = Vec::new();
    let ended_with_error = loop {
        match body.frame().await {
            Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap()),
            Some(Err(_)) => break true,
            None => break false,
        }
    };
    assert!(ended_with_error, "body error, no [DONE]");
    let events = sse_events(&got);
    assert_eq!(
        events.len(),
        1 + 3,
        "role + 3 content chunks reach the client"
    );
    assert_eq!(sim.stats().failed_injected.load(Relaxed), 1);
    assert_eq!(sim.stats().cancelled.load(Relaxed), 0);
    sim.shutdown().await;

    let sim = start(SimArgs {
        error_after_chunks: Some(2),
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 1 + 2 + 2);
    let err: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(err["error"]["type"], "InternalServerError");
    assert_eq!(err["error"]["code"], 500);
    assert_eq!(events[4], "[DONE]");
    sim.shutdown().await;

    let sim = start(SimArgs {
        fail_rate: 1.0,
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let (_, kind, _, code) = openai_error(&read_all(r).await);
    assert_eq!((kind.as_str(), code), ("InternalServerError", 500));
    assert_eq!(sim.stats().failed_injected.load(Relaxed), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn zero_delay_long_stream() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let req = json!({"prompt": "p", "max_tokens": 5000, "stream": true});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 5001);
    for e in &events[..5000] {
        let _: Value = serde_json::from_str(e).unwrap();
    }
    assert_eq!(sim.stats().running.load(Relaxed), 0);
    sim.shutdown().await;
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

#[test]
fn clap_defaults_match_default() {
    let parsed = Cli::try_parse_from(["sim"]).unwrap().sim;
    let d = SimArgs::default();
    assert_eq!(parsed.port, 8001);
    assert_eq!(
        format!("{:?}", SimArgs { port: 0, ..parsed }),
        format!("{d:?}")
    );
    let names = Cli::try_parse_from([
        "sim",
        "--served-model-name",
        "a,b",
        "--served-model-name",
        "c",
    ])
    .unwrap()
    .sim
    .served_model_name;
    assert_eq!(names, ["a", "b", "c"]);
}

#[tokio::test]
async fn invalid_flags_are_rejected() {
    for bad in [
        SimArgs {
            fail_rate: 1.5,
            ..SimArgs::default()
        },
        SimArgs {
            max_num_seqs: 64,
            max_num_batched_tokens: 32,
            ..SimArgs::default()
        },
        SimArgs {
            decode_step_ms: -1.0,
            ..SimArgs::default()
        },
    ] {
        let err = start(bad).await.err().unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    }
}

fn pooling_sim(convert: Convert) -> SimArgs {
    SimArgs {
        runner: Runner::Pooling,
        convert,
        embedding_size: 16,
        api_key: Some("sekret".into()),
        ..zero_delay()
    }
}

const KEYED: [(&str, &str); 1] = [("authorization", "Bearer sekret")];

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[tokio::test]
async fn embeddings_are_deterministic_unit_vectors_in_both_encodings() {
    use base64::Engine as _;
    let sim = start(pooling_sim(Convert::Embed)).await.unwrap();
    let c = client();
    let ask = |input: Value, format: &str| json!({"model": "qwen32b", "input": input, "encoding_format": format});
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!(["hello there", "hello there", "other"]), "float")),
        &KEYED,
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "list");
    assert!(v["id"].as_str().unwrap().starts_with("embd-"));
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let (a, b, o) = (
        floats(&data[0]["embedding"]),
        floats(&data[1]["embedding"]),
        floats(&data[2]["embedding"]),
    );
    assert_eq!(a.len(), 16);
    assert!((a.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);
    assert_eq!(a, b, "the same text, the same vector");
    assert_ne!(a, o);
    // Counted by the sim's tokenizer, the one /tokenize answers with.
    let n = 2 * tokens::count("hello there") + tokens::count("other");
    assert_eq!(v["usage"]["prompt_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], n);
    assert_eq!(v["usage"]["completion_tokens"], 0);

    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!("hello there"), "base64")),
        &KEYED,
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = raw
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // (JSON floats are f32s widened; narrowing them back is exact.)
    let narrowed: Vec<f32> = a.iter().map(|x| *x as f32).collect();
    assert_eq!(
        decoded, narrowed,
        "base64 holds the same little-endian f32s"
    );

    // Not a Matryoshka model: vLLM refuses `dimensions` whatever its value.
    let mut dims = ask(json!("x"), "float");
    dims["dimensions"] = json!(8);
    let r = send(&c, &sim, "POST", "/v1/embeddings", Some(dims), &KEYED).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Matryoshka"),
        "{e}"
    );

    // Token ids and lists of them.
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!([[1, 2, 3], [4]]), "float")),
        &KEYED,
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    sim.shutdown().await;
}

#[tokio::test]
async fn rerank_sorts_and_score_compares_like_vllm() {
    let sim = start(pooling_sim(Convert::Embed)).await.unwrap();
    let c = client();
    let body =
        json!({"query": "apple pie", "documents": ["zebra", "apple pie", "car"], "top_n": 2});
    // /rerank is not under /v1 or /v2: vLLM's key does not guard it.
    let r = send(&c, &sim, "POST", "/rerank", Some(body.clone()), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "top_n");
    assert_eq!(results[0]["index"], 1, "the identical document first");
    assert_eq!(results[0]["document"]["text"], "apple pie");
    assert!((results[0]["relevance_score"].as_f64().unwrap() - 1.0).abs() < 1e-5);
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    assert_eq!(
        keys_of(&v["usage"]),
        ["prompt_tokens", "total_tokens"],
        "rerank's usage has two keys"
    );
    let r = send(&c, &sim, "POST", "/v2/rerank", Some(body), &[]).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "/v2 is guarded");

    let r = send(
        &c,
        &sim,
        "POST",
        "/score",
        Some(json!({"text_1": ["a", "b"], "text_2": ["a", "c"]})),
        &[],
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert!((v["data"][0]["score"].as_f64().unwrap() - 1.0).abs() < 1e-5);
    let r = send(
        &c,
        &sim,
        "POST",
        "/score",
        Some(json!({"queries": ["a", "b"], "documents": ["a", "b", "c"]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(
        e["error"]["message"],
        "Input lengths must be either 1:1, 1:N or N:N"
    );
    sim.shutdown().await;
}

fn keys_of(v: &Value) -> Vec<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

#[tokio::test]
async fn each_runner_serves_its_own_routes() {
    let c = client();
    let gen_sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    for path in [
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/v2/embed",
    ] {
        let r = send(
            &c,
            &gen_sim,
            "POST",
            path,
            Some(json!({"input": "x"})),
            &KEYED,
        )
        .await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path} on a generative model"
        );
        assert_eq!(&read_all(r).await[..], br#"{"detail":"Not Found"}"#);
    }
    gen_sim.shutdown().await;

    let pool = start(pooling_sim(Convert::Embed)).await.unwrap();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
        "/v1/audio/transcriptions",
        "/classify",
    ] {
        let r = send(&c, &pool, "POST", path, Some(chat.clone()), &KEYED).await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path} on an embedding model"
        );
    }
    let r = send(&c, &pool, "GET", "/v1/models", None, &KEYED).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = send(&c, &pool, "GET", "/v1/embeddings", None, &KEYED).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    let r = send(&c, &pool, "GET", "/metrics", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    pool.shutdown().await;

    let classify = start(pooling_sim(Convert::Classify)).await.unwrap();
    let r = send(
        &c,
        &classify,
        "POST",
        "/classify",
        Some(json!({"input": ["a", "b c"]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let first = &v["data"][0];
    assert_eq!(first["num_classes"], 2);
    assert!((floats(&first["probs"]).iter().sum::<f64>() - 1.0).abs() < 1e-5);
    assert!(first["label"].as_str().unwrap().starts_with("LABEL_"));
    for path in ["/rerank", "/v1/embeddings"] {
        let r = send(
            &c,
            &classify,
            "POST",
            path,
            Some(json!({"query": "a", "documents": ["b"]})),
            &KEYED,
        )
        .await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path}: two labels, no scoring"
        );
    }
    classify.shutdown().await;
}

#[tokio::test]
async fn chat_batch_answers_one_choice_per_conversation() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let convs =
        json!([[{"role": "user", "content": "one"}], [{"role": "user", "content": "two two"}]]);
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "max_tokens": 3})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].clone(), choices[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(
        v["usage"]["prompt_tokens"],
        tokens::count("one") + tokens::count("two two")
    );
    // vLLM 0.32 does not refuse `stream`: one JSON body, each choice its last token.
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "max_tokens": 3, "stream": true})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "n": 2})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    sim.shutdown().await;
}

/// A mono 16-bit PCM WAV of `seconds` of silence at 16 kHz.
fn wav(seconds: u32) -> Vec<u8> {
    let data_len = 32_000 * seconds;
    let mut w = Vec::new();
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data_len).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&[1, 0, 1, 0]);
    w.extend_from_slice(&16_000u32.to_le_bytes());
    w.extend_from_slice(&32_000u32.to_le_bytes());
    w.extend_from_slice(&[2, 0, 16, 0]);
    w.extend_from_slice(b"data");
    w.extend_from_slice(&data_len.to_le_bytes());
    w.resize(w.len() + data_len as usize, 0);
    w
}

/// A multipart/form-data body as OpenAI's client sends one.
fn form(fields: &[(&str, &str)], file: &[u8]) -> (String, Bytes) {
    let boundary = "fleetgate-test-boundary";
    let mut b = Vec::new();
    for (k, v) in fields {
        b.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                .as_bytes(),
        );
    }
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
    b.extend_from_slice(file);
    b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (
        format!("multipart/form-data; boundary={boundary}"),
        Bytes::from(b),
    )
}

async fn post_form(
    c: &TestClient,
    sim: &SimServer,
    path: &str,
    ct: &str,
    body: Bytes,
) -> Response<Incoming> {
    let req = Request::post(format!("{}{path}", sim.url()))
        .header("content-type", ct)
        .header("authorization", "Bearer sekret")
        .body(Full::new(body))
        .unwrap();
    c.request(req).await.unwrap()
}

#[tokio::test]
async fn transcriptions_take_multipart_and_stream_vllm_chunks() {
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        decode_step_ms: 2.0,
        decode_ms_per_seq: 0.0,
        ..SimArgs::default()
    })
    .await
    .unwrap();
    let c = client();
    let audio = wav(2);
    let (ct, body) = form(&[("model", "qwen32b"), ("language", "en")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(keys_of(&v), ["text", "usage"]);
    assert_eq!(v["usage"], json!({"type": "duration", "seconds": 2}));
    let text = v["text"].as_str().unwrap().to_owned();
    assert!(!text.is_empty());

    let (ct, body) = form(&[("model", "qwen32b")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/translations", &ct, body).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(keys_of(&v), ["text"], "a translation carries no usage");

    let (ct, body) = form(
        &[("stream", "true"), ("stream_include_usage", "true")],
        &audio,
    );
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (usage, content) = chunks.split_last().unwrap();
    assert!(content.iter().all(|c| c["object"] == "transcription.chunk"));
    assert!(
        content[0]["id"]
            .as_str()
            .unwrap()
            .starts_with("transcribe-")
    );
    let streamed: String = content
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text, "the same audio, the same words");
    assert_eq!(
        content.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], content.len());

    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/audio/transcriptions",
        Some(json!({"model": "qwen32b"})),
        &KEYED,
    )
    .await;
    assert_eq!(
        r.status(),
        StatusCode::BAD_REQUEST,
        "JSON instead of a form"
    );
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(e["error"]["param"], "body.file");
    let (ct, body) = form(&[("response_format", "srt")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    sim.shutdown().await;
}

/// The value of the sample `name{engine="0",model_name="qwen32b"<extra>}` in a /metrics text.
fn sample(text: &str, name: &str, extra: &str) -> f64 {
    let head = format!("{name}{{engine=\"0\",model_name=\"qwen32b\"{extra}}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no {head}in\n{text}"));
    line[head.len()..].parse().unwrap()
}

async fn metrics_text(c: &TestClient, sim: &SimServer) -> String {
    let r = send(c, sim, "GET", "/metrics", None, &[]).await;
    String::from_utf8(read_all(r).await.to_vec()).unwrap()
}

/// ASCII text of exactly `tokens` sim tokens (four characters each), distinct per `tag`.
fn text_of(tag: char, tokens: usize) -> String {
    (0..tokens).map(|i| format!("{tag}{i:03}")).collect()
}

async fn chat_usage(c: &TestClient, sim: &SimServer, messages: Value) -> (Value, String) {
    let req = json!({"model": "qwen32b", "messages": messages, "max_tokens": 4});
    let r = send(c, sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    (v["usage"].clone(), text)
}

#[tokio::test]
async fn repeated_prefix_is_cached_and_only_the_rest_is_prefilled() {
    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let long = text_of('a', 100);
    let (u1, _) = chat_usage(&c, &sim, json!([{"role": "user", "content": long}])).await;
    assert_eq!(u1["prompt_tokens"], 100);
    assert_eq!(u1["prompt_tokens_details"]["cached_tokens"], 0);
    // The same 100 tokens and then a question: six full blocks of 16 are found.
    let (u2, _) = chat_usage(
        &c,
        &sim,
        json!([{"role": "user", "content": long}, {"role": "user", "content": text_of('q', 10)}]),
    )
    .await;
    assert_eq!(u2["prompt_tokens"], 110);
    assert_eq!(
        u2["prompt_tokens_details"],
        json!({"cached_tokens": 96, "created_cache_tokens": null, "multimodal_tokens": null})
    );
    // The streamed answer's usage chunk says the same.
    let req = json!({
        "model": "qwen32b",
        "messages": [{"role": "user", "content": long}],
        "max_tokens": 2,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 310.0);
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 192.0);
    assert_eq!(sample(&m, "vllm:prompt_tokens_cached_total", ""), 192.0);
    assert_eq!(sample(&m, "vllm:prompt_tokens_total", ""), 310.0);
    // What the scheduler prefilled (and paid prefill time for): all of the first prompt, the
    // uncached 14 tokens of the second, the last 4 of the third.
    let by_source = "vllm:prompt_tokens_by_source_total";
    assert_eq!(
        sample(&m, by_source, ",source=\"local_compute\""),
        100.0 + 14.0 + 4.0
    );
    assert_eq!(sample(&m, by_source, ",source=\"local_cache_hit\""), 192.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn cached_tokens_are_reported_only_as_vllm_does() {
    // Without --enable-prompt-tokens-details chat and completions say null, as vLLM; the
    // Responses API always reports them; the metrics count either way.
    let sim = start(SimArgs {
        kv_cache_tokens: 1_000_000,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let long = text_of('b', 40);
    for _ in 0..2 {
        let (u, _) = chat_usage(&c, &sim, json!([{"role": "user", "content": long}])).await;
        assert!(u["prompt_tokens_details"].is_null(), "{u}");
    }
    let req = json!({"model": "qwen32b", "prompt": long, "max_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    let req = json!({"model": "qwen32b", "input": long, "max_output_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/responses", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 32);
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 96.0);
    sim.shutdown().await;

    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..zero_delay()
    })
    .await
    .unwrap();
    let messages = json!([{"role": "user", "content": long}]);
    for expected in [0, 32] {
        let req = json!({"model": "qwen32b", "messages": messages, "max_tokens": 2});
        let r = send(&c, &sim, "POST", "/v1/messages", Some(req), &[]).await;
        let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 40 - expected, "output_tokens": 2, "cache_read_input_tokens": expected}),
        );
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn small_cache_evicts_least_recently_used_blocks() {
    let sim = start(SimArgs {
        kv_cache_tokens: 64,
        enable_prompt_tokens_details: true,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let cached = |u: &Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let a = json!([{"role": "user", "content": text_of('a', 100)}]);
    let b = json!([{"role": "user", "content": text_of('b', 100)}]);
    assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 0);
    // Four blocks fit: the head of the prompt stayed, its tail went first.
    assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 64);
    // Another prompt pushes all of it out.
    assert_eq!(cached(&chat_usage(&c, &sim, b.clone()).await.0), 0);
    assert_eq!(cached(&chat_usage(&c, &sim, a).await.0), 0);
    sim.shutdown().await;

    // --kv-cache-tokens 0: no prefix caching at all.
    let sim = start(SimArgs {
        kv_cache_tokens: 0,
        enable_prompt_tokens_details: true,
        ..zero_delay()
    })
    .await
    .unwrap();
    let a = json!([{"role": "user", "content": text_of('a', 100)}]);
    for _ in 0..2 {
        assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 0);
    }
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_growing_conversation_hits_more_each_turn() {
    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let mut messages = vec![json!({"role": "system", "content": text_of('s', 50)})];
    let mut last_prompt = 0u64;
    let mut last_cached = 0u64;
    for turn in 0..5 {
        messages.push(json!({"role": "user", "content": text_of('u', 20 + turn)}));
        let (u, answer) = chat_usage(&c, &sim, Value::Array(messages.clone())).await;
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if turn > 0 {
            assert!(
                cached > last_cached,
                "turn {turn}: {cached} after {last_cached}"
            );
            // All of the previous prompt but its last, partly filled block.
            assert!(
                cached + 2 * 16 > last_prompt,
                "turn {turn}: {cached} of {last_prompt}"
            );
        }
        assert_eq!(cached % 16, 0);
        (last_prompt, last_cached) = (prompt, cached);
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    let m = metrics_text(&c, &sim).await;
    assert!(sample(&m, "vllm:prefix_cache_hits_total", "") >= last_cached as f64);
    sim.shutdown().await;
}

/// The sim reads a request's `priority` as vLLM 0.32 does: with `--scheduling-policy priority`
/// a waiting request of a lower priority is admitted before earlier ones of a higher priority;
/// without it (`fcfs`, the default) it is accepted and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_orders_the_waiting_queue_only_under_the_priority_policy() {
    for policy in [
        args::SchedulingPolicy::Priority,
        args::SchedulingPolicy::Fcfs,
    ] {
        let sim = start(SimArgs {
            max_num_seqs: 1,
            decode_step_ms: 5.0,
            scheduling_policy: policy,
            ..timed()
        })
        .await
        .unwrap();
        let stats = sim.stats().clone();
        let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // The seat is taken; then three wait: priority 10, 10, and 0 last.
        for (name, priority, waiting) in [("long", 0, 0), ("a", 10, 1), ("b", 10, 2), ("p0", 0, 3)]
        {
            let url = sim.url();
            let done = done.clone();
            tasks.push(tokio::spawn(async move {
                let c = client();
                // The first holds the seat long enough for the others to queue behind it.
                let max_tokens = if name == "long" { 200 } else { 12 };
                let body = json!({"model": "qwen32b", "max_tokens": max_tokens, "priority": priority,
                                  "messages": [{"role": "user", "content": "hi"}]});
                let req = Request::post(format!("{url}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let resp = c.request(req).await.unwrap();
                assert_eq!(resp.status(), StatusCode::OK);
                read_all(resp).await;
                done.lock().unwrap().push(name);
            }));
            let engine = stats.clone();
            eventually("the request is in", || {
                engine.running.load(Relaxed) == 1 && engine.waiting.load(Relaxed) == waiting
            })
            .await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = done.lock().unwrap().clone();
        let want = match policy {
            args::SchedulingPolicy::Priority => ["long", "p0", "a", "b"],
            args::SchedulingPolicy::Fcfs => ["long", "a", "b", "p0"],
        };
        assert_eq!(order, want, "{policy:?}");
    }
}
