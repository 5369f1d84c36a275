//! The relay against real simulated backends on 127.0.0.1:0: streams byte for byte and
//! unbuffered, paced tokens one by one, cancellation when the client leaves, the Timeline and
//! the hop's cost, hop-by-hop headers kept on their connection, and the model renamed and the
//! upstream key added on the way.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_bench::measure::hop_ms;
use fleetgate_protocol::client::{self, chat_body, stream_text};
use http_body_util::BodyExt;

pub(crate) fn stream_body(max_tokens: u32) -> Bytes {
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
async fn served_model_name_rename_and_upstream_key() {
    let sim = sim(|a| {
        a.served_model_name = vec!["Qwen/Qwen2.5-32B".into()];
        a.api_key = Some("backend-secret".into());
    })
    .await;
    // A backend that refuses the gateway on a request (its probes passed: vLLM's `/health` and
    // this one's `/v1/models` need no key): its bare {"error":"Unauthorized"} comes back
    // wrapped. (A backend whose `/v1/models` refuses the key never gets requests: tests/it/model_names.rs.)
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
