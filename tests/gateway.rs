//! The gateway against real simulated backends on 127.0.0.1:0: relay fidelity, no buffering,
//! errors in OpenAI format, cancellation, the Timeline, HTTP/2, TLS and graceful shutdown, and
//! vLLM's tokenizer endpoints passed through.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use fleetgate_bench::measure::hop_ms;
use fleetgate_protocol::client::{self, chat_body, stream_text};
use http_body_util::BodyExt;

fn stream_body(max_tokens: u32) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "qwen32b",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}],
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_reaches_the_client_byte_for_byte() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "relay-1")],
        stream_body(24),
    )
    .await;
    assert_eq!(m.status, 200);
    assert_eq!(m.headers["x-request-id"], "relay-1");
    assert!(
        m.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let got = m.body.clone().unwrap();
    let sent = sim
        .stats()
        .captured("relay-1")
        .expect("sim captured the stream");
    assert_eq!(got, sent, "client bytes differ from backend bytes");
    assert!(got.ends_with(b"data: [DONE]\n\n"));
    // 24 token events (the last one with finish_reason); the opening role chunk is not one
    assert_eq!(m.metrics.content_events, 24);
    assert_eq!(m.metrics.usage.unwrap().completion_tokens, 24);
    assert!(!stream_text(&got).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_chunk_arrives_while_the_backend_is_still_generating() {
    let sim = sim(|a| a.decode_step_ms = 25.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let c = client::http_client();
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(stream_body(80)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut content_seen = 0;
    while content_seen < 3 {
        let frame = body.frame().await.unwrap().unwrap();
        let data = frame.into_data().unwrap();
        content_seen += data.windows(9).filter(|w| w == b"\"choices\"").count();
    }
    // Three content events reached us; an 80-token generation at 25 ms per step is far from
    // done, so nothing can have waited for the end of the stream.
    assert_eq!(sim.stats().completed.load(Ordering::SeqCst), 0);
    assert_eq!(sim.stats().running.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request() {
    let sim = sim(|a| a.decode_step_ms = 20.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let c = client::http_client();
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-request-id", "gone-1")
        .body(http_body_util::Full::new(stream_body(1000)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the sim never saw the cancellation"
    );
    assert_eq!(stats.completed.load(Ordering::SeqCst), 0);
    let rec = gw.record_of("gone-1").await;
    assert_eq!(rec.error, Some("client_disconnected"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_before_the_first_token_cancels_too() {
    let sim = sim(|a| a.stall_first_token_ms = 3000.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let uri = gw.url("/v1/chat/completions");
    let task =
        tokio::spawn(async move { post(&uri, &[], chat_body("qwen32b", "hi", 5, false)).await });
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .requests
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    task.abort();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the sim never saw the cancellation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeline_is_complete_and_ordered() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "tl-1")],
        stream_body(8),
    )
    .await;
    assert_eq!(m.status, 200);
    let rec = gw.record_of("tl-1").await;
    assert_eq!(rec.status, 200);
    assert_eq!(rec.error, None);
    assert!(rec.stream);
    assert_eq!(rec.model.as_deref(), Some("qwen32b"));
    assert_eq!(rec.backend.as_deref(), Some(sim.url().as_str()));
    let t = &rec.timeline;
    let stamps = [
        Some(t.received()),
        t.body_read(),
        t.admitted(),
        t.upstream_sent(),
        t.upstream_first_byte(),
        t.upstream_first_token(),
        t.client_first_token(),
        t.done(),
    ];
    let stamps: Vec<_> = stamps.into_iter().map(|s| s.expect("stamped")).collect();
    for w in stamps.windows(2) {
        assert!(w[0] <= w[1], "out of order: {t:?}");
    }
    assert!(t.upstream_ttft().unwrap() <= t.client_ttft().unwrap());
    assert!(t.overhead_pre().is_some() && t.overhead_relay().is_some());
    assert_eq!(t.stream().content_events, 8);
    assert_eq!(t.stream().usage.unwrap().completion_tokens, 8);
    assert!(t.tpot().is_some() && t.stream().itl_mean().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_passes_through_with_server_timing() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hello", 6, false),
    )
    .await;
    assert_eq!(m.status, 200);
    let v: serde_json::Value = serde_json::from_slice(m.body.as_ref().unwrap()).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let st = m.headers["server-timing"].to_str().unwrap();
    assert!(
        st.starts_with("gw;dur=") && st.contains(", upstream;dur="),
        "{st}"
    );
    assert!(m.headers.contains_key("x-request-id"));
}

/// The hop cost (kernel stamps on both sockets) reaches the client: in `Server-Timing` for a
/// non-streamed answer, as a trailer for a stream whose client sent `TE: trailers`, and not at
/// all to one that did not. The backend's 30 ms before its first token is never in it.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hop_cost_reaches_the_client() {
    let sim = sim(|a| a.stall_first_token_ms = 30.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hello", 4, false),
    )
    .await;
    assert_eq!(m.status, 200);
    let st = m.headers["server-timing"].to_str().unwrap();
    let hop = hop_ms(&m.headers, None).unwrap_or_else(|| panic!("hop in {st}"));
    assert!((0.0..30.0).contains(&hop), "{st}");

    let c = client::http_client();
    let stream = |te: bool| {
        let mut req =
            authed(&gw, "POST", "/v1/chat/completions").header("content-type", "application/json");
        if te {
            req = req.header("te", "trailers");
        }
        req.body(http_body_util::Full::new(stream_body(4))).unwrap()
    };
    let resp = c.request(stream(true)).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["trailer"], "server-timing");
    let head_st = resp.headers()["server-timing"].to_str().unwrap().to_owned();
    assert_eq!(
        hop_ms(resp.headers(), None),
        None,
        "not known yet: {head_st}"
    );
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected
        .trailers()
        .cloned()
        .expect("a Server-Timing trailer");
    let body = collected.to_bytes();
    assert!(stream_text(&body).len() >= 4);
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let st = trailers["server-timing"].to_str().unwrap();
    assert!(st.starts_with("gw;dur="), "{st}");
    let hop =
        hop_ms(&http::HeaderMap::new(), Some(&trailers)).unwrap_or_else(|| panic!("hop in {st}"));
    assert!((0.0..30.0).contains(&hop), "{st}");
    // The backend's own TTFT, for `bench --compare`'s like-for-like check.
    let up = fleetgate_bench::measure::server_timing_ms(&trailers, "upstream")
        .unwrap_or_else(|| panic!("upstream in {st}"));
    assert!((0.0..30_000.0).contains(&up), "{st}");

    let resp = c.request(stream(false)).await.unwrap();
    assert!(!resp.headers().contains_key("trailer"));
    let collected = resp.into_body().collect().await.unwrap();
    assert!(collected.trailers().is_none());

    // Every request is observed once it is recorded (the record's drop).
    let hop_count = || {
        metrics_text(&gw)
            .lines()
            .find(|l| {
                l.starts_with("fleetgate_hop_added_seconds_count")
                    && l.contains(r#"environment="stress""#)
                    && l.contains(r#"model="qwen32b""#)
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    assert!(
        eventually(Duration::from_secs(5), || hop_count() == Some(3)).await,
        "{:?}",
        hop_count()
    );
}

/// `"stream_options": null` on a stream: the backend gets one `stream_options` (with the usage
/// the gateway needs), the client a stream without the usage event it did not ask for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_stream_options_gets_usage_without_a_duplicate_key() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let body = serde_json::json!({"model":"qwen32b","stream":true,"stream_options":null,
        "max_tokens":5,"messages":[{"role":"user","content":"hi"}]});
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "null-opts")],
        body.to_string(),
    )
    .await;
    let text = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
    assert_eq!(m.status, 200, "{text}");
    assert!(m.metrics.done, "{text}");
    assert!(
        !text.contains("\"usage\""),
        "usage the client did not ask for: {text}"
    );
    let rec = gw.record_of("null-opts").await;
    assert_eq!(
        rec.timeline.stream().usage.map(|u| u.completion_tokens),
        Some(5)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_endpoint_streams() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let body =
        serde_json::json!({"model":"qwen32b","prompt":"Once upon","max_tokens":5,"stream":true});
    let m = post(&gw.url("/v1/completions"), &[], body.to_string()).await;
    assert_eq!(m.status, 200);
    assert!(m.metrics.done);
    assert!(stream_text(m.body.as_ref().unwrap()).len() >= 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_readiness() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let c = client::http_client();
    let get = |path: &str| {
        let req = authed(&gw, "GET", path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        c.request(req)
    };
    let resp = get("/v1/models").await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "qwen32b");
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    let mut ready = false;
    for _ in 0..300 {
        if get("/readyz").await.unwrap().status() == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready, "/readyz never became ready with a live backend");
    // Open to anyone who reaches the listener: ready or not, nothing about the backends or
    // the key store.
    let open_get = |gw: &Gateway| {
        let req = http::Request::get(gw.url("/readyz"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let resp = c.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    assert_eq!(open_get(&gw).await, (200, r#"{"ready":true}"#.to_owned()));

    let dead = closed_port().await;
    let gw2 = gateway_with(vec![pool("qwen32b", &[format!("http://{dead}")])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = open_get(&gw2).await;
    assert_eq!(status, 503);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], false);
    for secret in [dead.port().to_string(), "key".into(), "backend\"".into()] {
        assert!(!body.contains(&secret), "/readyz shows `{secret}`: {body}");
    }
    // The details are on the admin listener, for a token holder.
    let (s, _) = admin(&gw2, "GET", "/admin/ready", None, None).await;
    assert_eq!(s, 401);
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let (s, v) = admin(&gw2, "GET", "/admin/ready", Some(&viewer), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["ready"], false);
    assert_eq!(v["backends"][0]["backend"], format!("http://{dead}"), "{v}");
    assert_eq!(v["backends"][0]["state"], "down", "{v}");
    assert!(v["backends"][0]["last_error"].is_string(), "{v}");
    assert_eq!(v["key_store"]["state"], "up", "{v}");
    assert!(v["key_store"]["keys"].as_u64().unwrap() >= 1, "{v}");
}

/// Usage reaches a client exactly as it asked (issue 19, found against vLLM 0.32): the
/// gateway asks the backend for `include_usage` to count tokens and removes that usage chunk,
/// but `continuous_usage_stats` alone (which gets no usage from vLLM) must not turn into usage
/// on every chunk; with both, every chunk keeps its usage and the final chunk stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_usage_reaches_the_client_as_asked() {
    let sim = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let url = gw.url("/v1/chat/completions");
    let stream = |options: serde_json::Value| {
        let mut body = serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":4,
            "messages":[{"role":"user","content":"hi"}]});
        if !options.is_null() {
            body["stream_options"] = options;
        }
        Bytes::from(body.to_string())
    };
    let with_usage = |m: &fleetgate_protocol::client::Measured| {
        String::from_utf8_lossy(m.body.as_ref().unwrap())
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|p| p.contains("\"usage\""))
            .count()
    };
    for (options, chunks_with_usage) in [
        (serde_json::Value::Null, 0),
        (serde_json::json!({"continuous_usage_stats": true}), 0),
        (serde_json::json!({"include_usage": true}), 1),
        // The role chunk, four tokens, and the final usage chunk.
        (
            serde_json::json!({"include_usage": true, "continuous_usage_stats": true}),
            6,
        ),
    ] {
        let m = post(&url, &[], stream(options.clone())).await;
        assert_eq!(m.status, 200);
        assert_eq!(with_usage(&m), chunks_with_usage, "{options}");
        // Directly, the backend answers the same.
        let direct = post(
            &format!("{}/v1/chat/completions", sim.url())
                .parse()
                .unwrap(),
            &[("x-no-auth", "1")],
            stream(options.clone()),
        )
        .await;
        assert_eq!(with_usage(&direct), chunks_with_usage, "direct, {options}");
    }
}

/// A vLLM-like backend whose streams are written as `writes`, `gap` apart: the finish chunk and
/// the usage chunk in one write or in two.
async fn scripted_stream_backend(
    writes: &'static [&'static str],
    gap: Duration,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    http_backend(move |req| async move {
        let (content_type, body) = if req.uri().path() == "/v1/chat/completions" {
            let frames = futures_util::stream::unfold(0, move |i| async move {
                let text = writes.get(i)?;
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                let frame = hyper::body::Frame::data(Bytes::from_static(text.as_bytes()));
                Some((Ok::<_, std::convert::Infallible>(frame), i + 1))
            });
            (
                "text/event-stream",
                http_body_util::StreamBody::new(frames).boxed(),
            )
        } else {
            let models = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
            (
                "application/json",
                http_body_util::Full::new(Bytes::from_static(models.as_bytes())).boxed(),
            )
        };
        http::Response::builder()
            .header("content-type", content_type)
            .body(body)
            .unwrap()
    })
    .await
}

const ROLE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
const TOKEN: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" a\"},\"finish_reason\":null}]}\n\n";
const FINISH: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" b\"},\"finish_reason\":\"length\",\"stop_reason\":null}]}\n\n";
const USAGE_FP: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":5,\"completion_tokens\":2},\"system_fingerprint\":\"vllm-0.32.0-2048\"}\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// vLLM stamps `system_fingerprint` on the usage chunk when it sends one, else on the finish
/// chunk (issue 19, fix 2). The gateway asks for usage and removes the chunk: the client that
/// asked for no usage still finds the fingerprint on the finish chunk, whether the two chunks
/// came in one read or apart (then from the value the backend sent last); a client that asked
/// for usage gets the backend's bytes untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_fingerprint_survives_the_removed_usage_chunk() {
    let fp = "\"system_fingerprint\":\"vllm-0.32.0-2048\"";
    let finish_chunk = |body: &str| -> String {
        body.lines()
            .find(|l| l.contains("\"finish_reason\":\"length\""))
            .unwrap_or_else(|| panic!("no finish chunk in {body}"))
            .to_owned()
    };
    let request = |usage: bool| {
        let mut body = serde_json::json!({"model":"m","stream":true,"max_tokens":2,
            "messages":[{"role":"user","content":"hi"}]});
        if usage {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        Bytes::from(body.to_string())
    };
    // One write: the fingerprint comes from the usage chunk of the same read.
    static ONE_READ: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
        let tail: &'static str = Box::leak(format!("{FINISH}{USAGE_FP}{DONE}").into_boxed_str());
        vec![ROLE, TOKEN, tail]
    });
    // Apart: the finish chunk leaves before the usage chunk is read.
    const APART: &[&str] = &[ROLE, TOKEN, FINISH, USAGE_FP, DONE];
    for (writes, gap) in [
        (ONE_READ.as_slice(), Duration::ZERO),
        (APART, Duration::from_millis(150)),
    ] {
        let (addr, task) = scripted_stream_backend(writes, gap).await;
        let gw = gateway(vec![pool("m", &[format!("http://{addr}")])]).await;
        let url = gw.url("/v1/chat/completions");
        if gap > Duration::ZERO {
            // The first stream teaches the gateway this backend's fingerprint.
            let first = post(&url, &[], request(false)).await;
            assert_eq!(first.status, 200);
        }
        let m = post(&url, &[], request(false)).await;
        assert_eq!(m.status, 200);
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert!(!body.contains("\"usage\""), "usage leaked: {body}");
        let finish = finish_chunk(&body);
        assert!(
            finish.ends_with(&format!(",{fp}}}")),
            "gap {gap:?}: {finish}"
        );
        // The rest of the chunk is the backend's.
        assert_eq!(
            finish.replace(&format!(",{fp}"), ""),
            FINISH.trim_end(),
            "gap {gap:?}"
        );
        assert!(body.ends_with(DONE), "{body}");
        // Asked for usage: the backend's bytes, untouched.
        let m = post(&url, &[], request(true)).await;
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert_eq!(
            body,
            format!("{ROLE}{TOKEN}{FINISH}{USAGE_FP}{DONE}"),
            "gap {gap:?}"
        );
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_model_name_rename_and_upstream_key() {
    let sim = sim(|a| {
        a.served_model_name = vec!["Qwen/Qwen2.5-32B".into()];
        a.api_key = Some("backend-secret".into());
    })
    .await;
    // A backend that refuses the gateway on a request (its probes passed: vLLM's `/health` and
    // this one's `/v1/models` need no key): its bare {"error":"Unauthorized"} comes back
    // wrapped. (A backend whose `/v1/models` refuses the key never gets requests: tests/pool.rs.)
    let (stub, stub_task) = stub_backend(|path| match path {
        "/v1/chat/completions" => (401, "application/json", br#"{"error":"Unauthorized"}"#),
        _ => (200, "application/json", br#"{"object":"list","data":[]}"#),
    })
    .await;
    let mut p = pool("qwen32b", &[format!("http://{stub}")]);
    p.served_model_name = Some("Qwen/Qwen2.5-32B".into());
    let gw = gateway(vec![p.clone()]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 3, false),
    )
    .await;
    assert_eq!(
        m.status, 502,
        "no upstream key: the backend refuses the gateway, which is the gateway's fault (not a 401 the client's SDK would blame on its key)"
    );
    let err = openai_error(&m);
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("Unauthorized") && msg.contains("upstream_api_key"),
        "{msg}"
    );
    assert_eq!(err["code"], "backend_auth_failed");
    assert_eq!(err["type"], "upstream_error");
    stub_task.abort();

    p.backends = pool("qwen32b", &[sim.url()]).backends;
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new("backend-secret"));
    let gw = gateway(vec![p]).await;
    // The client's own key is not forwarded: the backend accepts only its key.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 3, false),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let v: serde_json::Value = serde_json::from_slice(m.body.as_ref().unwrap()).unwrap();
    // The answer names the model as the client did (OpenAI clients compare it), not as the
    // backend serves it; the body's new length is framed correctly.
    assert_eq!(v["model"], "qwen32b", "{v}");
    assert!(
        m.headers
            .get("content-length")
            .is_none_or(|l| l.to_str().unwrap() == m.body.as_ref().unwrap().len().to_string())
    );

    // Streamed, by an alias: every chunk says `qwen`; nothing else in the stream changes.
    let mut p2 = pool("qwen32b", &[sim.url()]);
    p2.served_model_name = Some("Qwen/Qwen2.5-32B".into());
    p2.aliases = vec!["qwen".into()];
    p2.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new("backend-secret"));
    let gw = gateway(vec![p2]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "renamed-stream")],
        Bytes::from(
            serde_json::json!({"model":"qwen","stream":true,"max_tokens":8,
                "stream_options":{"include_usage":true},
                "messages":[{"role":"user","content":"hi"}]})
            .to_string(),
        ),
    )
    .await;
    assert_eq!(m.status, 200);
    let got = String::from_utf8(m.body.clone().unwrap().to_vec()).unwrap();
    let sent = String::from_utf8(sim.stats().captured("renamed-stream").unwrap().to_vec()).unwrap();
    assert!(sent.contains("\"model\":\"Qwen/Qwen2.5-32B\""), "{sent}");
    assert_eq!(
        got,
        sent.replace("\"model\":\"Qwen/Qwen2.5-32B\"", "\"model\":\"qwen\""),
        "only the model's name changes"
    );
    assert!(m.metrics.done && m.metrics.usage.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_in_flight_spreads_over_backends() {
    let a = sim(|a| a.decode_step_ms = 10.0).await;
    let b = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = gateway(vec![pool("qwen32b", &[a.url(), b.url()])]).await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let uri = gw.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            post(&uri, &[], stream_body(20)).await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let na = a.stats().requests.load(Ordering::SeqCst);
    let nb = b.stats().requests.load(Ordering::SeqCst);
    assert_eq!(na + nb, 6);
    assert!(na >= 2 && nb >= 2, "uneven spread: {na} vs {nb}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    let c: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build(http);
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-request-id", "h2-1")
        .body(http_body_util::Full::new(stream_body(5)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(got, sim.stats().captured("h2-1").unwrap());
}

/// A gateway serving TLS with a fresh self-signed certificate for `localhost`, in front of
/// `backend`: the gateway, the certificate, its PEM file, and the directory holding both.
async fn tls_gateway(
    backend: &str,
) -> (
    Gateway,
    rcgen::CertifiedKey<rcgen::KeyPair>,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempdir();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])
        .unwrap_or_else(|e| panic!("certificate: {e}"));
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    for (path, pem) in [
        (&cert_path, cert.cert.pem()),
        (&key_path, cert.signing_key.serialize_pem()),
    ] {
        std::fs::write(path, pem).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let gw = gateway_with(vec![pool("qwen32b", &[backend.to_owned()])], |c| {
        c.server.tls = Some(fleetgate_gateway::config::TlsConfig {
            cert: cert_path.clone(),
            key: key_path,
        })
    })
    .await;
    (gw, cert, cert_path, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_with_alpn() {
    let sim = sim(|_| {}).await;
    let (gw, cert, _cert_path, dir) = tls_gateway(&sim.url()).await;
    assert!(gw.server.base_url().starts_with("https://"));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    for (h2, version) in [
        (true, http::Version::HTTP_2),
        (false, http::Version::HTTP_11),
    ] {
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_only();
        let conn = if h2 {
            builder.enable_http2().build()
        } else {
            builder.enable_http1().build()
        };
        let c: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(conn);
        let uri = format!(
            "https://localhost:{}/v1/chat/completions",
            gw.server.local_addr.port()
        );
        let req = http::Request::post(uri)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", gw.key))
            .body(http_body_util::Full::new(stream_body(4)))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), version);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_streams_finish() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let uri = gw.url("/v1/chat/completions");
    let stream = tokio::spawn(async move { post(&uri, &[], stream_body(60)).await });
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    let addr = gw.server.local_addr;
    gw.server.shutdown().await;
    let m = stream.await.unwrap();
    assert_eq!(m.status, 200);
    assert!(m.metrics.done, "the stream was cut by the shutdown");
    assert_eq!(m.metrics.usage.unwrap().completion_tokens, 60);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting"
    );
}

/// Streams still open when the grace period ends are not cut silently: a relayed stream, a
/// stream waiting in the queue (answered with `: queued` comments) and a request waiting for
/// its backend's head each get an error the client can read (`gateway_shutdown`, then
/// `[DONE]` and a clean end of the chunked body for the streams), and are recorded as
/// `shutdown`, not as a client that left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_open_when_the_grace_period_ends_get_an_error_event_and_done() {
    let sim = sim(|a| a.decode_step_ms = 50.0).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.backends[0].capacity = Some(1);
    let gw = gateway_with(vec![p], |c| {
        c.server.shutdown_grace = Duration::from_millis(300);
        c.queue.keepalive_interval = Some(Duration::from_millis(100));
    })
    .await;
    let uri = gw.url("/v1/chat/completions");
    let relayed = {
        let uri = uri.clone();
        tokio::spawn(
            async move { post(&uri, &[("x-request-id", "relayed")], stream_body(200)).await },
        )
    };
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    let queued = {
        let uri = uri.clone();
        tokio::spawn(async move { post(&uri, &[("x-request-id", "queued")], stream_body(5)).await })
    };
    let pools = gw.server.pools();
    let queue = pools.get("qwen32b").unwrap().balancer.queue.clone();
    assert!(eventually(Duration::from_secs(5), || queue.has_waiters()).await);
    let records = gw.records.clone();
    gw.server.shutdown().await;
    for (name, task) in [("relayed", relayed), ("queued", queued)] {
        let m = task.await.unwrap();
        assert_eq!(m.status, 200, "{name}");
        assert!(
            m.body_error.is_none(),
            "{name}: the body ended cleanly: {:?}",
            m.body_error
        );
        let body = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
        assert!(
            body.contains("\"code\":\"gateway_shutdown\""),
            "{name}: an error event says why: {body}"
        );
        assert!(body.trim_end().ends_with("data: [DONE]"), "{name}: {body}");
    }
    let seen = records.lock().unwrap().clone();
    for id in ["relayed", "queued"] {
        let r = seen.iter().find(|r| r.request_id == id).unwrap();
        assert_eq!(r.error, Some("shutdown"), "{id}");
    }
}

fn tempdir() -> std::path::PathBuf {
    use std::hash::{BuildHasher, RandomState};
    let suffix = RandomState::new().hash_one(std::time::SystemTime::now());
    let dir = std::env::temp_dir().join(format!("fleetgate-test-{}-{suffix}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("temp dir: {e}"));
    dir
}

/// Frames that arrive apart leave apart: the relay never holds one back for the next. With a
/// token every 15 ms, each content event reaches the client in its own read, as directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_tokens_are_relayed_one_by_one() {
    let sim = sim(|a| a.decode_step_ms = 15.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let c = client::http_client();
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(stream_body(12)))
        .unwrap();
    let mut body = c.request(req).await.unwrap().into_body();
    let mut reads_with_content = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            let n = data.windows(11).filter(|w| *w == b"\"choices\":[").count()
                - data.windows(12).filter(|w| *w == b"\"choices\":[]").count();
            if n > 0 {
                reads_with_content.push(n);
            }
        }
    }
    // 13 content events (role + 12 tokens). On a loaded machine two may share a read now and
    // then; merging by the relay would put many together.
    let total: usize = reads_with_content.iter().sum();
    assert_eq!(total, 13, "{reads_with_content:?}");
    assert!(
        reads_with_content.iter().filter(|n| **n == 1).count() >= 9,
        "frames were merged: {reads_with_content:?}"
    );
}

/// A stream that did not ask for usage: the gateway asks upstream, learns the real counts, and
/// the client receives exactly the backend's stream minus that one usage event, its
/// `system_fingerprint` moved to the finish chunk (where vLLM puts it without a usage chunk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_learned_on_every_stream_and_hidden_from_the_client() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    // One stream first: it teaches the gateway the backend's fingerprint, which the next ones
    // get even when the finish and usage chunks are read apart.
    let first = post(&gw.url("/v1/chat/completions"), &[], stream_body(2)).await;
    assert_eq!(first.status, 200);
    for (id, body) in [
        (
            "u-absent",
            serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":7,"messages":[{"role":"user","content":"hi there"}]}),
        ),
        (
            "u-false",
            serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":7,"stream_options":{"include_usage":false},"messages":[{"role":"user","content":"hi there"}]}),
        ),
    ] {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-request-id", id)],
            body.to_string(),
        )
        .await;
        assert_eq!(m.status, 200);
        let got = m.body.clone().unwrap();
        let sent = sim.stats().captured(id).unwrap();
        let sent_text = String::from_utf8(sent.to_vec()).unwrap();
        let usage_event = sent_text
            .split_inclusive("\n\n")
            .find(|e| e.contains("\"usage\""))
            .expect("the backend sent usage: the gateway asked for it");
        let fingerprint = usage_event
            .find(",\"system_fingerprint\":")
            .map(|at| usage_event[at..].trim_end().trim_end_matches('}'))
            .expect("the sim's usage chunk has a fingerprint");
        let finish = sent_text
            .split_inclusive("\n\n")
            .find(|e| e.contains("\"finish_reason\":\"length\""))
            .unwrap();
        let stamped = format!(
            "{}{fingerprint}}}\n\n",
            &finish.trim_end()[..finish.trim_end().len() - 1]
        );
        let expected = sent_text
            .replacen(usage_event, "", 1)
            .replacen(finish, &stamped, 1);
        assert_eq!(
            String::from_utf8(got.to_vec()).unwrap(),
            expected,
            "{id}: client bytes"
        );
        assert!(
            m.metrics.usage.is_none(),
            "{id}: the client sees no usage it did not ask for"
        );
        let rec = gw.record_of(id).await;
        let usage = rec
            .timeline
            .stream()
            .usage
            .expect("the gateway knows the real counts");
        assert_eq!(usage.completion_tokens, 7);
        assert!(usage.prompt_tokens > 0);
    }
    // A client that asked for usage gets it, unchanged.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "u-true")],
        stream_body(5),
    )
    .await;
    assert_eq!(m.body.unwrap(), sim.stats().captured("u-true").unwrap());
    assert_eq!(m.metrics.usage.unwrap().completion_tokens, 5);
}

fn tokenize_body(model: &str, prompt: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": model, "prompt": prompt, "add_special_tokens": false})
            .to_string(),
    )
}

/// `vllm bench serve`'s alignment step through the gateway: tokenize, cut, detokenize — on a
/// backend of the named model, by an alias, with the backend's own model name and key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_reach_a_backend_of_the_model() {
    let sim = sim(|a| {
        a.served_model_name = vec!["Qwen/Qwen2.5-32B".into()];
        a.api_key = Some("backend-secret".into());
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.served_model_name = Some("Qwen/Qwen2.5-32B".into());
    p.aliases = vec!["qwen".into()];
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new("backend-secret"));
    let gw = gateway(vec![p]).await;

    let prompt = "hello there, sim";
    let m = post(
        &gw.url("/tokenize"),
        &[("x-request-id", "tok-1")],
        tokenize_body("qwen", prompt),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(m.headers["x-request-id"], "tok-1");
    // The backend's own answer, unchanged (the sim knows only its served name: a 200 means the
    // alias was renamed on the way).
    assert_eq!(
        m.body.as_ref().unwrap(),
        &sim.stats().captured("tok-1").unwrap()
    );
    let v = json_body(&m);
    assert_eq!(v["count"], 4);
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 4);

    // The count the backend reports for the same prompt when it generates.
    let c = post(
        &gw.url("/v1/completions"),
        &[],
        Bytes::from(
            serde_json::json!({"model": "qwen32b", "prompt": prompt, "max_tokens": 2}).to_string(),
        ),
    )
    .await;
    assert_eq!(json_body(&c)["usage"]["prompt_tokens"], 4);

    let body = serde_json::json!({"model": "qwen32b", "tokens": tokens[..3]}).to_string();
    let d = post(
        &gw.url("/detokenize"),
        &[("x-request-id", "detok-1")],
        Bytes::from(body),
    )
    .await;
    assert_eq!(d.status, 200, "{:?}", d.body);
    assert_eq!(json_body(&d), serde_json::json!({"prompt": "hello there,"}));
    assert_eq!(sim.stats().tokenizations.load(Ordering::SeqCst), 2);

    // Recorded as what it is: a request of the model to its backend, with no first token and
    // no queue wait (it is not inference).
    for (id, endpoint) in [("tok-1", "tokenize"), ("detok-1", "detokenize")] {
        let rec = gw.record_of(id).await;
        assert_eq!(rec.endpoint, Some(endpoint));
        assert_eq!((rec.status, rec.error), (200, None));
        assert!(!rec.stream);
        assert_eq!(rec.model.as_deref(), Some("qwen32b"));
        assert_eq!(rec.backend.as_deref(), Some(sim.url().as_str()));
        let t = &rec.timeline;
        assert!(t.upstream_sent().is_some() && t.done().is_some());
        assert!(t.overhead_pre().is_some());
        assert_eq!(t.admitted(), None, "{id}: no queue wait recorded");
        assert_eq!(t.client_ttft(), None, "{id}: no first token");
        assert_eq!(t.upstream_ttft(), None, "{id}: no first token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_is_refused_like_chat() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (limited, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.allowed_models = Some(vec!["other".into()]);
    })
    .await;
    let url = gw.url("/tokenize");
    let limited = format!("Bearer {limited}");
    let unknown = format!(
        "Bearer {}",
        fleetgate_gateway::key::generate(fleetgate_gateway::key::Environment::Stress, None).full
    );
    // (case, headers, body, status, code)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], Bytes, u16, &'a str);
    let cases: [Case<'_>; 5] = [
        (
            "no key",
            &[("x-no-auth", "1")],
            tokenize_body("qwen32b", "hi"),
            401,
            "missing_api_key",
        ),
        (
            "a wrong key",
            &[("authorization", unknown.as_str())],
            tokenize_body("qwen32b", "hi"),
            401,
            "invalid_api_key",
        ),
        (
            "a model the key may not use",
            &[("authorization", limited.as_str())],
            tokenize_body("qwen32b", "hi"),
            403,
            "model_not_allowed",
        ),
        (
            "an unknown model",
            &[],
            tokenize_body("llama", "hi"),
            404,
            "model_not_found",
        ),
        (
            "no prompt",
            &[],
            Bytes::from_static(br#"{"model":"qwen32b"}"#),
            400,
            "invalid_value",
        ),
    ];
    for (case, hdrs, body, status, code) in cases {
        let m = post(&url, hdrs, body).await;
        assert_eq!(m.status, status, "{case}: {:?}", m.body);
        let err = openai_error(&m);
        assert_eq!(err["code"], code, "{case}: {err}");
    }
    let d = post(
        &gw.url("/detokenize"),
        &[],
        Bytes::from_static(br#"{"model":"qwen32b","tokens":"1 2"}"#),
    )
    .await;
    assert_eq!(d.status, 400);
    assert_eq!(openai_error(&d)["param"], "tokens");
    assert_eq!(
        sim.stats().tokenizations.load(Ordering::SeqCst),
        0,
        "a refused request never reaches the backend"
    );

    // vLLM serves its tokenizer at the root only; the answer under /v1 says where it is.
    let m = post(&gw.url("/v1/tokenize"), &[], tokenize_body("qwen32b", "hi")).await;
    assert_eq!(m.status, 404);
    let err = openai_error(&m);
    assert_eq!(err["code"], "unknown_url");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("not under /v1: POST /tokenize"),
        "{err}"
    );
    let c = client::http_client();
    let req = authed(&gw, "GET", "/tokenize")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["allow"], "POST");
}

/// Tokenization is a request (the key's rate counts it), not inference: no token budget, no
/// concurrency slot, no backend capacity, never the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_as_a_request_but_not_as_inference() {
    let sim = sim(|a| a.decode_step_ms = 20.0).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.max_in_flight_per_backend = 1;
    let gw = gateway(vec![p]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.requests_per_minute = Some(4);
        k.tokens_per_minute = Some(200);
        k.max_concurrent_streams = Some(1);
    })
    .await;
    let auth = format!("Bearer {key}");
    let auth = [("authorization", auth.as_str())];

    // A stream holds the key's one concurrent slot and the backend's one capacity slot.
    let c = client::http_client();
    let req = http::Request::post(gw.url("/v1/chat/completions"))
        .header("authorization", auth[0].1)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(stream_body(100)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    stream.frame().await.unwrap().unwrap();

    // A prompt far over the key's 200 tokens a minute, while the stream runs: answered now.
    let long = "word ".repeat(2000);
    let started = std::time::Instant::now();
    let m = post(&gw.url("/tokenize"), &auth, tokenize_body("qwen32b", &long)).await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(json_body(&m)["count"], 2500);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "it did not wait for the stream"
    );
    assert_eq!(m.headers["x-ratelimit-remaining-requests"], "2");
    assert!(m.headers.get("x-ratelimit-remaining-tokens").is_none());
    let backend = gw.server.pools().at(0).unwrap().backends[0].clone();
    assert_eq!(
        backend.in_flight.load(Ordering::SeqCst),
        1,
        "only the stream holds a slot"
    );
    let m = post(
        &gw.url("/detokenize"),
        &auth,
        Bytes::from_static(br#"{"model":"qwen32b","tokens":[104,105]}"#),
    )
    .await;
    assert_eq!(m.status, 200);
    assert_eq!(json_body(&m)["prompt"], "hi");
    // The fourth request of the minute passes; the fifth is over the key's rate.
    let m = post(&gw.url("/tokenize"), &auth, tokenize_body("qwen32b", "hi")).await;
    assert_eq!(m.status, 200);
    let m = post(&gw.url("/tokenize"), &auth, tokenize_body("qwen32b", "hi")).await;
    assert_eq!(m.status, 429);
    assert_eq!(openai_error(&m)["code"], "requests_per_minute_exceeded");
    drop(stream);
}

/// A backend that is not vLLM and has no tokenizer route: the client is told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_without_tokenization_says_so() {
    let (addr, server) = stub_backend(|path| match path {
        "/health" => (200, "application/json", b""),
        _ => (404, "application/json", br#"{"detail":"Not Found"}"#),
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[format!("http://{addr}")])]).await;
    let m = post(
        &gw.url("/tokenize"),
        &[("x-request-id", "no-tok")],
        tokenize_body("qwen32b", "hi"),
    )
    .await;
    assert_eq!(m.status, 404);
    let err = openai_error(&m);
    assert_eq!(err["code"], "tokenization_unavailable");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("qwen32b#0") && msg.contains("does not offer tokenization"),
        "{msg}"
    );
    let rec = gw.record_of("no-tok").await;
    assert_eq!((rec.status, rec.error), (404, Some("upstream_error")));
    server.abort();
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) stay on their own connection: the ones a client's
/// `Connection` names and the hop-by-hop ones by definition never reach the backend, and the
/// backend's never reach the client; end-to-end headers pass both ways. `TE: trailers`, named
/// in `Connection` as HTTP/1.1 asks, still gets a stream its `Server-Timing` trailer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_stay_on_their_connection() {
    let backend = HeadRecorder::start(&[
        ("connection", "x-backend-hop"),
        ("x-backend-hop", "internal"),
        ("keep-alive", "timeout=5"),
        ("proxy-authenticate", "Basic"),
        ("x-backend-end", "kept"),
    ])
    .await;
    let gw = gateway(vec![pool("qwen32b", &[backend.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("connection", "keep-alive, X-Client-Hop ,x-other-hop"),
            ("x-client-hop", "for the gateway only"),
            ("x-other-hop", "2"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("x-end-to-end", "kept"),
        ],
        chat_body("qwen32b", "hi", 3, false),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let heads = backend.heads();
    let upstream = heads
        .iter()
        .find(|h| h.contains_key("x-end-to-end"))
        .expect("the request reached the backend");
    for hop in [
        "connection",
        "x-client-hop",
        "x-other-hop",
        "keep-alive",
        "proxy-connection",
    ] {
        assert!(
            !upstream.contains_key(hop),
            "`{hop}` went upstream: {upstream:?}"
        );
    }
    assert_eq!(upstream["x-end-to-end"], "kept");
    for hop in ["x-backend-hop", "keep-alive", "proxy-authenticate"] {
        assert!(
            !m.headers.contains_key(hop),
            "`{hop}` came back: {:?}",
            m.headers
        );
    }
    assert_eq!(m.headers["x-backend-end"], "kept");

    // `Connection: TE` + `TE: trailers`: TE goes (hop-by-hop), its meaning stays.
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("connection", "TE")
        .header("te", "trailers")
        .body(http_body_util::Full::new(stream_body(3)))
        .unwrap();
    let resp = client::http_client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["trailer"], "server-timing");
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected
        .trailers()
        .cloned()
        .expect("a Server-Timing trailer");
    assert!(
        trailers["server-timing"]
            .to_str()
            .unwrap()
            .starts_with("gw;dur="),
        "{trailers:?}"
    );
}

/// Health probes name why a backend cannot be used — a closed port, a certificate no CA vouches
/// for, a certificate for another name — with when it happened, the request path names the
/// same cause, and the reason is cleared when the backend is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_name_the_cause_and_clear_it_when_healthy() {
    // A TLS backend: a gateway with a self-signed certificate for `localhost`, before a sim.
    let sim_behind = sim(|_| {}).await;
    let (tls_backend, _cert, cert_path, dir) = tls_gateway(&sim_behind.url()).await;
    let port = tls_backend.server.local_addr.port();
    let dead = closed_port().await;
    let untrusted = pool("untrusted", &[format!("https://localhost:{port}")]);
    let mut mismatch = pool("mismatch", &[format!("https://127.0.0.1:{port}")]);
    mismatch.ca_file = Some(cert_path.clone());
    let refused = pool("refused", &[format!("http://{dead}")]);
    let gw = gateway(vec![untrusted, mismatch, refused]).await;
    let want = [
        ("untrusted", "certificate not trusted"),
        ("mismatch", "certificate name mismatch"),
        ("refused", "connection refused"),
    ];
    let named = || {
        let b = gw.server.pools().backends_json();
        want.iter().all(|(model, cause)| {
            b.iter().any(|v| {
                v["model"] == *model
                    && v["last_error"]
                        .as_str()
                        .is_some_and(|e| e.starts_with("/health failed: ") && e.contains(cause))
                    && v["last_error_at"].is_string()
            })
        })
    };
    assert!(
        eventually(Duration::from_secs(10), named).await,
        "{:#?}",
        gw.server.pools().backends_json()
    );
    // A request meets the same cause, in its 502.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("untrusted", "hi", 2, false),
    )
    .await;
    let e = openai_error(&m);
    if m.status == 502 {
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("certificate not trusted"),
            "{e}"
        );
    } else {
        // Already marked down by its probes: no backend to try.
        assert_eq!(m.status, 503, "{e}");
    }

    // The closed port starts listening: healthy again, and the old reason is gone.
    let _back = sim(|a| a.port = dead.port()).await;
    let cleared = || {
        gw.server.pools().backends_json().iter().any(|v| {
            v["model"] == "refused" && v["state"] == "healthy" && v["last_error"].is_null()
        })
    };
    assert!(
        eventually(Duration::from_secs(10), cleared).await,
        "{:#?}",
        gw.server.pools().backends_json()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
