//! Every error the gateway answers with: status and an OpenAI-format body decoded as a client
//! would, and the backend never called for a request the gateway rejects.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_protocol::client::{self, chat_body};
use http_body_util::BodyExt;

async fn setup() -> (fleetgate_sim::SimServer, Gateway) {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.max_body_bytes = 4096;
    })
    .await;
    (sim, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mistakes_get_specific_4xx() {
    let (sim, gw) = setup().await;
    let chat = gw.url("/v1/chat/completions");
    let json = [("content-type", "application/json")];
    // (case, headers, body, status, param, code)
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, &'a str)>,
        Bytes,
        u16,
        Option<&'a str>,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "malformed",
            json.to_vec(),
            Bytes::from_static(b"{\"model\": "),
            400,
            None,
            "invalid_json",
        ),
        (
            "not an object",
            json.to_vec(),
            Bytes::from_static(b"[1,2,3]"),
            400,
            None,
            "invalid_value",
        ),
        (
            "empty",
            json.to_vec(),
            Bytes::new(),
            400,
            None,
            "invalid_json",
        ),
        (
            "missing model",
            json.to_vec(),
            Bytes::from_static(b"{\"messages\":[]}"),
            400,
            Some("model"),
            "invalid_value",
        ),
        (
            "stream type",
            json.to_vec(),
            Bytes::from_static(b"{\"model\":\"qwen32b\",\"stream\":\"true\",\"messages\":[]}"),
            400,
            Some("stream"),
            "invalid_value",
        ),
        (
            "prompt on chat",
            json.to_vec(),
            Bytes::from_static(b"{\"model\":\"qwen32b\",\"prompt\":\"hi\"}"),
            400,
            Some("messages"),
            "invalid_value",
        ),
        (
            "unknown model",
            json.to_vec(),
            chat_body("qwen-old", "hi", 5, true),
            404,
            Some("model"),
            "model_not_found",
        ),
        (
            "form content type",
            vec![("content-type", "application/x-www-form-urlencoded")],
            chat_body("qwen32b", "hi", 5, true),
            415,
            None,
            "unsupported_media_type",
        ),
        (
            "too large",
            json.to_vec(),
            chat_body("qwen32b", &"x".repeat(5000), 5, true),
            413,
            None,
            "request_too_large",
        ),
    ];
    for (name, hdrs, body, status, param, code) in cases {
        let m = post(&chat, &hdrs, body).await;
        assert_eq!(m.status, status, "{name}");
        let err = openai_error(&m);
        assert_eq!(err["code"], code, "{name}: {err}");
        assert_eq!(err["param"].as_str(), param, "{name}: {err}");
        assert_eq!(err["type"], "invalid_request_error", "{name}");
        assert!(m.headers.contains_key("x-request-id"), "{name}");
    }
    let m = post(&chat, &json, chat_body("qwen-old", "hi", 5, true)).await;
    let msg = openai_error(&m)["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains("qwen-old") && msg.contains("`qwen32b`"),
        "lists the models: {msg}"
    );
    assert_eq!(
        sim.stats().requests.load(Ordering::SeqCst),
        0,
        "rejected requests reached the backend"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_route_and_wrong_method() {
    let (_sim, gw) = setup().await;
    let c = client::http_client();
    for (method, path, status, code) in [
        ("GET", "/index.html", 404, "unknown_url"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ] {
        let req = authed(&gw, method, path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), status, "{method} {path}");
        if status == 405 {
            assert!(resp.headers().contains_key("allow"));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["error"]["code"], code, "{method} {path}: {v}");
        // A path near no route: the message names every route the gateway forwards.
        if status == 404 {
            let msg = v["error"]["message"].as_str().unwrap();
            for row in &fleetgate_protocol::endpoint::TABLE {
                let route = format!("{} {}", row.method, row.path);
                assert!(
                    msg.contains(&route),
                    "{method} {path}: no `{route}` in {msg}"
                );
            }
        }
    }
    // A mistyped base URL: the 404 opens with the fix for that mistake, and names the route
    // that was meant.
    for (method, path, fix, meant) in [
        (
            "POST",
            "/api/chat/completions",
            "Remove `/api` from the base URL",
            "POST /v1/chat/completions",
        ),
        (
            "POST",
            "/v1/api/embeddings",
            "Remove `/api` from the base URL",
            "POST /v1/embeddings",
        ),
        (
            "POST",
            "/v1//chat/completions",
            "Remove the trailing `/` from the base URL",
            "POST /v1/chat/completions",
        ),
        (
            "POST",
            "/v1/chat/completions/",
            "Drop the trailing `/` from the path",
            "POST /v1/chat/completions",
        ),
        (
            "GET",
            "/v1/models/",
            "Drop the trailing `/` from the path",
            "GET /v1/models",
        ),
        (
            "POST",
            "/v1/v1/messages",
            "Remove one `/v1`",
            "POST /v1/messages",
        ),
        (
            "POST",
            "/chat/completions",
            "Add `/v1` to the end of the base URL",
            "POST /v1/chat/completions",
        ),
    ] {
        let req = authed(&gw, method, path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), 404, "{method} {path}");
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["error"]["code"], "unknown_url", "{method} {path}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with(fix), "{method} {path}: {msg}");
        assert!(
            msg.contains(&format!("meant as {meant}")),
            "{method} {path}: {msg}"
        );
        assert!(
            msg.len() < 400,
            "{method} {path}: short enough to be read: {msg}"
        );
    }
    // vLLM's probe path is open, as on vLLM: no key, the gateway's readiness.
    let resp = c
        .request(
            http::Request::get(gw.url("/health"))
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "GET /health without a key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_backend_is_502_then_503() {
    let dead = closed_port().await;
    let gw = gateway_with(vec![pool("qwen32b", &[format!("http://{dead}")])], |c| {
        // No probe during the test: the first failure itself must take the backend out.
        c.server.health_interval = Duration::from_secs(3600);
    })
    .await;
    let chat = gw.url("/v1/chat/completions");
    // The probe at start may already have marked it down; either way the answer names it.
    let m = post(&chat, &[], chat_body("qwen32b", "hi", 5, true)).await;
    let err = openai_error(&m);
    match m.status {
        502 => {
            assert_eq!(err["code"], "backend_unreachable");
            let msg = err["message"].as_str().unwrap();
            assert!(
                msg.contains(&dead.to_string()) && msg.contains("connection refused"),
                "{msg}"
            );
        }
        503 => assert_eq!(err["code"], "no_backend_available"),
        s => panic!("unexpected status {s}"),
    }
    let m = post(&chat, &[], chat_body("qwen32b", "hi", 5, true)).await;
    assert_eq!(m.status, 503);
    let err = openai_error(&m);
    assert_eq!(err["code"], "no_backend_available");
    // Named as clients see backends (`server.expose_backend_addresses` shows the address).
    assert!(err["message"].as_str().unwrap().contains("qwen32b#0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_failure_is_named() {
    let gw = gateway_with(
        vec![pool(
            "qwen32b",
            &["http://no-such-host.invalid:8000".to_owned()],
        )],
        |c| c.server.health_interval = Duration::from_secs(3600),
    )
    .await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 5, true),
    )
    .await;
    if m.status == 502 {
        let msg = openai_error(&m)["message"].as_str().unwrap().to_owned();
        assert!(msg.contains("DNS"), "{msg}");
    } else {
        assert_eq!(
            m.status, 503,
            "the start-up probe may have taken it out already"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_504_or_a_final_error_event() {
    let sim = sim(|a| a.stall_first_token_ms = 5000.0).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.timeouts.first_token = Duration::from_millis(300);
    let gw = gateway(vec![p]).await;
    let chat = gw.url("/v1/chat/completions");
    // Non-streaming: no head before the limit → 504 naming the timeout.
    let m = post(&chat, &[], chat_body("qwen32b", "hi", 5, false)).await;
    assert_eq!(m.status, 504);
    let err = openai_error(&m);
    assert_eq!(err["code"], "upstream_timeout");
    assert!(
        err["message"].as_str().unwrap().contains("first-token"),
        "{err}"
    );
    // Streaming: the head came at once, the first token did not → error event + [DONE].
    let m = post(
        &chat,
        &[("x-request-id", "to-1")],
        chat_body("qwen32b", "hi", 5, true),
    )
    .await;
    if m.status == 200 {
        assert!(m.metrics.error, "a final error event");
        assert!(m.metrics.done, "then [DONE]");
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert!(body.contains("upstream_timeout"), "{body}");
    } else {
        assert_eq!(m.status, 504);
    }
    let rec = gw.record_of("to-1").await;
    assert_eq!(rec.error, Some("upstream_timeout"));
}

/// A backend whose streams send their head, then two tokens, then go silent for `silence` (the
/// connection stays open) and close. `/health` answers 200. Raw HTTP/1.1, so nothing between
/// it and the gateway buffers or times out.
#[expect(
    clippy::unwrap_used,
    reason = "test backend: failing to bind is a test failure"
)]
async fn silent_after_two_tokens(silence: Duration) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if head.starts_with(b"GET /health") {
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    return;
                }
                // The head alone first, as vLLM sends it: the tokens come after the gateway
                // started relaying, so the first token is one the relay reads itself.
                let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                if conn.write_all(head).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut out = Vec::new();
                for word in ["Hello", " there"] {
                    let event = format!(
                        "data: {{\"id\":\"s\",\"object\":\"chat.completion.chunk\",\"model\":\"qwen32b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}},\"finish_reason\":null}}]}}\n\n"
                    );
                    out.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
                }
                let _ = conn.write_all(&out).await;
                tokio::time::sleep(silence).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_silent_after_its_first_token_ends_at_the_idle_timeout() {
    // The idle limit (300 ms) is far below the first-token limit (120 s by default): once the
    // first token is in, a silence longer than the idle limit ends the stream with a timeout
    // event, not whenever the backend gives up (here: after 20 s, with a cut stream).
    let backend = silent_after_two_tokens(Duration::from_secs(20)).await;
    let mut p = pool("qwen32b", &[format!("http://{backend}")]);
    p.timeouts.idle = Duration::from_millis(300);
    let gw = gateway(vec![p]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "idle-1")],
        chat_body("qwen32b", "hi", 50, true),
    )
    .await;
    assert_eq!(m.status, 200);
    assert_eq!(m.metrics.content_events, 2, "both tokens relayed");
    assert!(
        m.metrics.error && m.metrics.done,
        "error event, then [DONE]"
    );
    let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
    assert!(body.contains("\"upstream_timeout\""), "{body}");
    assert_eq!(gw.record_of("idle-1").await.error, Some("upstream_timeout"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_after_the_stream_started_end_with_an_error_event() {
    // Connection dropped mid-stream.
    let sim_drop = sim(|a| a.drop_after_chunks = Some(3)).await;
    let gw = gateway(vec![pool("qwen32b", &[sim_drop.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 20, true),
    )
    .await;
    assert_eq!(m.status, 200);
    assert!(
        m.body_error.is_none(),
        "the client's stream must end cleanly: {:?}",
        m.body_error
    );
    assert!(m.metrics.error && m.metrics.done, "error event then [DONE]");
    assert!(m.metrics.content_events >= 1);

    // The backend's own in-stream error event is relayed unchanged.
    let sim_err = sim(|a| a.error_after_chunks = Some(2)).await;
    let gw = gateway(vec![pool("qwen32b", &[sim_err.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "err-1")],
        chat_body("qwen32b", "hi", 20, true),
    )
    .await;
    assert!(m.metrics.error && m.metrics.done);
    assert_eq!(m.body.unwrap(), sim_err.stats().captured("err-1").unwrap());
    assert_eq!(
        gw.record_of("err-1").await.error,
        Some("upstream_stream_error")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_500_keeps_its_status_in_openai_shape() {
    let sim = sim(|a| a.fail_rate = 1.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 5, true),
    )
    .await;
    assert_eq!(m.status, 500);
    openai_error(&m);
}

/// A backend that answers every request with an HTML 502, as a load balancer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn html_error_from_a_load_balancer_is_wrapped() {
    let (addr, server) = stub_backend(|path| match path {
        "/health" => (200, "text/html", b""),
        _ => (
            502,
            "text/html",
            b"<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center></body></html>",
        ),
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[format!("http://{addr}")])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("qwen32b", "hi", 5, true),
    )
    .await;
    assert_eq!(m.status, 502);
    let err = openai_error(&m);
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("502 Bad Gateway")
            && msg.contains("qwen32b#0")
            && !msg.contains(&addr.to_string()),
        "{msg}"
    );
    assert_eq!(err["type"], "upstream_error");
    server.abort();
}

/// A head the backends would refuse is the gateway's to refuse: 431 in OpenAI format, before
/// any backend is contacted and without a failure charged to one. What is not forwarded (a
/// cookie) does not count; a head beyond what the listener reads gets the listener's own 431.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_the_backends_would_refuse_get_431() {
    let (sim, gw) = setup().await;
    let chat = gw.url("/v1/chat/completions");
    let json = ("content-type", "application/json");
    let body = || chat_body("qwen32b", "hi", 3, false);

    // One value over the per-header limit (nginx's 8 KiB line buffer would refuse it).
    let big = "v".repeat(9 * 1024);
    let m = post(&chat, &[json, ("x-trace-context", &big)], body()).await;
    assert_eq!(m.status, 431, "{:?}", m.body);
    let err = openai_error(&m);
    assert_eq!(err["code"], "request_header_fields_too_large", "{err}");
    assert_eq!(err["type"], "invalid_request_error");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("`x-trace-context`") && msg.contains("server.max_upstream_header_value_bytes"),
        "{msg}"
    );
    assert!(m.headers.contains_key("x-request-id"));

    // Values each within that limit, together over the head limit (h11's 16 KiB).
    let part = "w".repeat(4 * 1024);
    let hdrs = [
        json,
        ("x-a", part.as_str()),
        ("x-b", part.as_str()),
        ("x-c", part.as_str()),
        ("x-d", part.as_str()),
    ];
    let m = post(&chat, &hdrs, body()).await;
    assert_eq!(m.status, 431, "{:?}", m.body);
    let err = openai_error(&m);
    assert_eq!(err["code"], "request_header_fields_too_large");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("server.max_upstream_head_bytes"),
        "{err}"
    );
    assert_eq!(
        sim.stats().requests.load(Ordering::SeqCst),
        0,
        "a refused head reached the backend"
    );

    // A large cookie is dropped on the way, not counted.
    let cookie = format!("session={}", "c".repeat(20 * 1024));
    let m = post(&chat, &[json, ("cookie", &cookie)], body()).await;
    assert_eq!(m.status, 200, "{:?}", m.body);

    // 480 KB: beyond what the listener reads at all (server.max_request_head_bytes). It
    // answers 431 itself, or closes while the client is still writing.
    let c = client::http_client();
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-huge", "h".repeat(480 * 1024))
        .body(http_body_util::Full::new(body()))
        .unwrap();
    if let Ok(resp) = c.request(req).await {
        assert_eq!(resp.status(), 431);
    }
    assert_eq!(
        sim.stats().requests.load(Ordering::SeqCst),
        1,
        "only the request with the cookie reached the backend"
    );
    // The backend answered for itself only: no failure is charged to it.
    let backends = gw.server.pools().backends_json();
    assert_eq!(backends[0]["state"], "healthy", "{backends:?}");
    assert!(backends[0]["last_error"].is_null(), "{backends:?}");
    let records = gw.records.lock().unwrap().clone();
    assert!(
        records
            .iter()
            .filter(|r| r.status == 431)
            .all(|r| r.error == Some("headers_too_large") && r.backend.is_none()),
        "{records:?}"
    );
}

/// The models a `model_not_found` offers a key are exactly the ones `GET /v1/models` shows it:
/// never a pool its environment may not use, or a model it is not allowed; aliases included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_not_found_offers_what_models_shows_the_key() {
    let sim = sim(|_| {}).await;
    let mut open = pool("qwen32b", &[sim.url()]);
    open.aliases = vec!["qwen".into()];
    let mut prod_only = pool("llama70b", &[sim.url()]);
    prod_only.environments = Some(vec![fleetgate_gateway::key::Environment::Prod]);
    let other = pool("mistral", &[sim.url()]);
    let gw = gateway(vec![open, prod_only, other]).await;
    let (limited, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.allowed_models = Some(vec!["llama70b".into()]);
    })
    .await;
    let c = client::http_client();
    let models = |key: String| {
        let req = http::Request::get(gw.url("/v1/models"))
            .header("authorization", format!("Bearer {key}"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let body = c
                .request(req)
                .await
                .unwrap()
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let mut ids: Vec<String> = v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect();
            ids.sort();
            ids
        }
    };
    let chat = gw.url("/v1/chat/completions");
    let offered = |key: String| {
        let chat = chat.clone();
        async move {
            let m = post(
                &chat,
                &[
                    ("content-type", "application/json"),
                    ("authorization", &format!("Bearer {key}")),
                ],
                chat_body("qwen-old", "hi", 3, false),
            )
            .await;
            assert_eq!(m.status, 404);
            let err = openai_error(&m);
            assert_eq!(err["code"], "model_not_found");
            let msg = err["message"].as_str().unwrap().to_owned();
            let list = msg
                .split("Available models: ")
                .nth(1)
                .and_then(|rest| rest.split(". ").next())
                .unwrap_or_else(|| panic!("no list in {msg}"));
            let mut ids: Vec<String> = list
                .split(", ")
                .filter_map(|s| s.strip_prefix('`')?.strip_suffix('`'))
                .map(str::to_owned)
                .collect();
            ids.sort();
            (ids, msg)
        }
    };
    // The harness key is a stress key: the prod-only pool is not for it.
    let (stress, msg) = offered(gw.key.clone()).await;
    assert_eq!(stress, ["mistral", "qwen", "qwen32b"], "{msg}");
    assert_eq!(stress, models(gw.key.clone()).await);
    let (only, msg) = offered(limited.clone()).await;
    assert_eq!(only, ["llama70b"], "{msg}");
    assert_eq!(only, models(limited).await);
}
