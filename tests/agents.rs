//! The coding agents' protocols through the gateway (issue 30): OpenAI's Responses API and
//! Anthropic's Messages API, each relayed byte for byte and measured like chat (TTFT, usage,
//! hop, the request log's endpoint), Anthropic's clients answered in Anthropic's shape, and a
//! stored response reached on the backend that holds it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test: a failure here is a test failure"
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use fleetgate_protocol::client;
use http_body_util::BodyExt;
use serde_json::{Value, json};

fn responses_body(model: &str, tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        json!({"model": model, "input": "Say something about the license.", "max_output_tokens": tokens, "stream": stream})
            .to_string(),
    )
}

fn messages_body(model: &str, tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        json!({"model": model, "max_tokens": tokens, "stream": stream, "system": "be brief",
               "messages": [{"role": "user", "content": "Say something about the license."}]})
        .to_string(),
    )
}

/// The `data:` payloads of an SSE body, with their `event:` names.
fn events(body: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = String::new();
        let mut data = None;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_owned();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str(d).unwrap());
            }
        }
        out.push((name, data.expect("an event has data")));
    }
    out
}

/// Responses, streamed: relayed as the backend sent it (no `[DONE]` added, no error event),
/// its token events timed, its usage from `response.completed` in the record and the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_is_relayed_and_measured() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[("x-request-id", "resp-stream-1")],
        responses_body("qwen32b", 12, true),
    )
    .await;
    assert_eq!(m.status, 200);
    let got = m.body.clone().unwrap();
    let sent = sim
        .stats()
        .captured(&upstream_responses_id(&gw.key, "resp-stream-1"))
        .unwrap();
    assert_eq!(got, sent, "client bytes differ from backend bytes");
    let ev = events(&got);
    assert_eq!(ev[0].0, "response.created");
    assert_eq!(ev.last().unwrap().0, "response.completed");
    let deltas = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .count();
    assert_eq!(deltas, 12);
    let rec = gw.record_of("resp-stream-1").await;
    assert_eq!(rec.endpoint, Some("responses"));
    assert_eq!(rec.status, 200);
    assert_eq!(
        rec.error, None,
        "a stream that ends with response.completed is clean"
    );
    let s = rec.timeline.stream();
    assert_eq!(s.content_events, 12, "only the deltas are tokens");
    let usage = s.usage.expect("usage from response.completed");
    assert_eq!(usage.completion_tokens, 12);
    assert!(usage.prompt_tokens > 0);
    assert!(rec.timeline.upstream_ttft().is_some());
    assert!(rec.timeline.hop().is_some() || rec.timeline.overhead_total().is_some());
}

/// Responses, whole, under an alias: the client sees its own model name; usage recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_response_keeps_the_clients_model_name() {
    let sim = sim(|_| {}).await;
    let mut p = pool("coder", &[sim.url()]);
    p.served_model_name = Some("qwen32b".into());
    let gw = gateway(vec![p]).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[("x-request-id", "resp-whole-1")],
        responses_body("coder", 5, false),
    )
    .await;
    assert_eq!(m.status, 200);
    let v = json_body(&m);
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], "coder", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 5);
    let rec = gw.record_of("resp-whole-1").await;
    assert_eq!(rec.endpoint, Some("responses"));
    assert_eq!(rec.timeline.stream().usage.unwrap().completion_tokens, 5);
}

/// Messages, streamed and whole: relayed as sent, `?beta=true` passed through, the key in
/// `x-api-key` accepted, usage from `message_start` + `message_delta`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_relayed_and_measured() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let key = gw.key.clone();
    let m = post(
        &gw.url("/v1/messages?beta=true"),
        &[
            ("x-request-id", "msg-stream-1"),
            ("x-api-key", &key),
            ("anthropic-version", "2023-06-01"),
        ],
        messages_body("qwen32b", 9, true),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let got = m.body.clone().unwrap();
    assert_eq!(got, sim.stats().captured("msg-stream-1").unwrap());
    let ev = events(&got);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["message_start", "content_block_start"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let rec = gw.record_of("msg-stream-1").await;
    assert_eq!(rec.endpoint, Some("messages"));
    assert_eq!(rec.error, None);
    assert_eq!(rec.timeline.stream().content_events, 9);
    let u = rec.timeline.stream().usage.unwrap();
    assert_eq!(u.completion_tokens, 9);
    assert!(u.prompt_tokens > 0);

    let m = post(
        &gw.url("/v1/messages"),
        &[("x-request-id", "msg-whole-1")],
        messages_body("qwen32b", 4, false),
    )
    .await;
    assert_eq!(m.status, 200);
    let v = json_body(&m);
    assert_eq!(v["type"], "message");
    assert_eq!(v["usage"]["output_tokens"], 4);
    let rec = gw.record_of("msg-whole-1").await;
    assert_eq!(rec.timeline.stream().usage.unwrap().completion_tokens, 4);

    let m = post(
        &gw.url("/v1/messages/count_tokens"),
        &[],
        Bytes::from(
            json!({"model": "qwen32b", "messages": [{"role": "user", "content": "hello there"}]})
                .to_string(),
        ),
    )
    .await;
    assert_eq!(m.status, 200);
    assert!(json_body(&m)["input_tokens"].as_u64().unwrap() > 0);
}

/// The Anthropic shape of one error: `{"type":"error","error":{"type","message"}}`.
fn anthropic_error(m: &client::Measured) -> (String, String) {
    let v: Value = serde_json::from_slice(m.body.as_ref().unwrap()).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert!(v.get("error").and_then(|e| e.get("code")).is_none(), "{v}");
    (
        v["error"]["type"].as_str().unwrap().to_owned(),
        v["error"]["message"].as_str().unwrap().to_owned(),
    )
}

/// Every error the gateway makes on /v1/messages is Anthropic's, with the status its SDKs map
/// to the right exception; never an OpenAI body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_clients_get_anthropic_errors() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let url = gw.url("/v1/messages");
    // No key; a wrong key; two different keys.
    let m = post(
        &url,
        &[("x-no-auth", "1")],
        messages_body("qwen32b", 4, false),
    )
    .await;
    assert_eq!(m.status, 401);
    assert_eq!(anthropic_error(&m).0, "authentication_error");
    let m = post(
        &url,
        &[("x-api-key", "fg-stress-nope")],
        messages_body("qwen32b", 4, false),
    )
    .await;
    assert_eq!(m.status, 401);
    let key = gw.key.clone();
    let bearer = format!("Bearer {key}");
    let m = post(
        &url,
        &[("authorization", &bearer), ("x-api-key", "fg-prod-other")],
        messages_body("qwen32b", 4, false),
    )
    .await;
    assert_eq!(m.status, 401);
    let (kind, msg) = anthropic_error(&m);
    assert_eq!(kind, "authentication_error");
    assert!(msg.contains("two different keys"), "{msg}");
    // The same key in both is fine.
    let m = post(
        &url,
        &[("authorization", &bearer), ("x-api-key", &key)],
        messages_body("qwen32b", 4, false),
    )
    .await;
    assert_eq!(m.status, 200);
    // max_tokens is required (the gateway says so before any backend).
    let m = post(
        &url,
        &[],
        Bytes::from(
            json!({"model": "qwen32b", "messages": [{"role": "user", "content": "x"}]}).to_string(),
        ),
    )
    .await;
    assert_eq!(m.status, 400);
    let (kind, msg) = anthropic_error(&m);
    assert_eq!(kind, "invalid_request_error");
    assert!(msg.contains("max_tokens"), "{msg}");
    // An unknown model, an unknown route under the protocol, a wrong method.
    let m = post(&url, &[], messages_body("nope", 4, false)).await;
    assert_eq!(m.status, 404);
    assert_eq!(anthropic_error(&m).0, "not_found_error");
    // A backend's own Anthropic-shaped error passes as it came (vLLM names its error class).
    let m = post(&url, &[], messages_body("qwen32b", 40_000, false)).await;
    assert_eq!(m.status, 400);
    assert_eq!(anthropic_error(&m).0, "BadRequestError");
    // One the backend shapes OpenAI's way (its request validation) is re-shaped.
    let m = post(
        &url,
        &[],
        Bytes::from(json!({"model": "qwen32b", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}).to_string()),
    )
    .await;
    assert_eq!(m.status, 400, "{:?}", m.body);
    assert_eq!(anthropic_error(&m).0, "invalid_request_error");
}

/// No backend: an Anthropic client gets 529 `overloaded_error` (its SDKs retry it), an OpenAI
/// one 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_backend_is_overloaded_for_anthropic_clients() {
    let dead = closed_port().await;
    let gw = gateway_with(vec![pool("qwen32b", &[format!("http://{dead}")])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    assert!(
        backend_states_become(&gw, &["down"]).await == ["down"],
        "the backend is seen down"
    );
    let m = post(
        &gw.url("/v1/messages"),
        &[],
        messages_body("qwen32b", 4, true),
    )
    .await;
    assert_eq!(m.status, 529);
    assert_eq!(anthropic_error(&m).0, "overloaded_error");
    let m = post(
        &gw.url("/v1/responses"),
        &[],
        responses_body("qwen32b", 4, true),
    )
    .await;
    assert_eq!(m.status, 503);
    assert_eq!(openai_error(&m)["code"], "no_backend_available");
}

/// A stored response lives on one backend: its GET, its cancel and a response that continues
/// it all reach that backend (two backends, many tries), and an id the gateway never saw, or
/// whose backend is drained, gets a clear answer, never another backend's "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_reached_where_they_live() {
    let one = sim(|a| a.responses_store = true).await;
    let two = sim(|a| a.responses_store = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[one.url(), two.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let c = client::http_client();
    let get = |path: String| {
        let req = authed(&gw, "GET", &path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        c.request(req)
    };
    let mut ids = Vec::new();
    for i in 0..6 {
        let stream = i % 2 == 0;
        let m = post(
            &gw.url("/v1/responses"),
            &[],
            responses_body("qwen32b", 3, stream),
        )
        .await;
        assert_eq!(m.status, 200);
        let id = if stream {
            events(m.body.as_ref().unwrap())[0].1["response"]["id"]
                .as_str()
                .unwrap()
                .to_owned()
        } else {
            json_body(&m)["id"].as_str().unwrap().to_owned()
        };
        ids.push(id);
    }
    for id in &ids {
        for _ in 0..3 {
            let resp = get(format!("/v1/responses/{id}")).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["id"], id.as_str());
        }
        // A continuation goes to the same backend (elsewhere it would be a 404).
        let body = json!({"model": "qwen32b", "input": "and then?", "max_output_tokens": 2, "previous_response_id": id});
        let m = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        // The sim's responses are synchronous: its cancel says so, from the right backend.
        let req = authed(&gw, "POST", &format!("/v1/responses/{id}/cancel"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).contains("synchronous"));
    }
    let rec = gw.records.lock().unwrap().clone();
    assert!(rec.iter().any(|r| r.endpoint == Some("responses_get")));
    // An id the gateway never pinned.
    let resp = get("/v1/responses/resp_0000000000000000".into())
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "response_not_found", "{v}");
    // A path that is not an id is not a route.
    let resp = get("/v1/responses/resp%2e1".into()).await.unwrap();
    assert_eq!(resp.status(), 404);
    // Drain the backend of the first response: reading it still works, continuing it does not.
    let holder = gw
        .records
        .lock()
        .unwrap()
        .iter()
        .find(|r| r.endpoint == Some("responses_get"))
        .and_then(|r| r.backend.clone())
        .unwrap();
    let first_on_holder = {
        let mut found = None;
        for id in &ids {
            let resp = get(format!("/v1/responses/{id}")).await.unwrap();
            let rid = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
            let _ = resp.into_body().collect().await;
            if gw.record_of(&rid).await.backend.as_deref() == Some(holder.as_str()) {
                found = Some(id.clone());
                break;
            }
        }
        found.unwrap()
    };
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&token(fleetgate_gateway::admin::jwt::Role::Admin)),
        Some(json!({"model": "qwen32b", "backend": holder})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let resp = get(format!("/v1/responses/{first_on_holder}"))
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "a draining backend still answers for what it holds"
    );
    let body = json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2, "previous_response_id": first_on_holder});
    let m = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
    assert_eq!(m.status, 503);
    let e = openai_error(&m);
    assert_eq!(e["code"], "response_unavailable");
    assert!(e["message"].as_str().unwrap().contains("draining"), "{e}");
    let _ = Duration::ZERO;
}

/// `background: true`: the POST ends at once while its backend generates on. The work keeps
/// its backend slot and the key's stream until the backend is done (the gateway watches it),
/// its tokens are settled once (with the finished response's usage; reading it back later
/// charges nothing), and reading or cancelling it reaches the backend that runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_hold_their_slots_until_done_and_are_settled_once() {
    let one = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 10.0;
    })
    .await;
    let two = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 10.0;
    })
    .await;
    let mut p = pool("qwen32b", &[one.url(), two.url()]);
    p.max_in_flight_per_backend = 1;
    let gw = gateway(vec![p]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.tokens_per_minute = Some(1000);
        k.max_concurrent_streams = Some(1);
    })
    .await;
    let auth = format!("Bearer {key}");
    let h = [("authorization", auth.as_str())];
    let background = |tokens: u32| {
        Bytes::from(
            json!({"model": "qwen32b", "input": "Say something about the license.",
                   "max_output_tokens": tokens, "background": true})
            .to_string(),
        )
    };
    let c = client::http_client();
    let call = |method: &str, path: String, key: Option<&str>| {
        let mut req = http::Request::builder().method(method).uri(gw.url(&path));
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        } else {
            req = authed(&gw, method, &path);
        }
        c.request(req.body(http_body_util::Full::new(Bytes::new())).unwrap())
    };
    let read = |resp: http::Response<hyper::body::Incoming>| async move {
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&body).unwrap())
    };

    // 300 tokens at 10 ms each: answered queued, long before the backend is done.
    let bg = post(&gw.url("/v1/responses"), &h, background(300)).await;
    assert_eq!(bg.status, 200, "{:?}", bg.body);
    let v = json_body(&bg);
    assert_eq!(v["status"], "queued", "{v}");
    assert_eq!(v["background"], true);
    let id = v["id"].as_str().unwrap().to_owned();
    // The key's one stream is the background work's while it runs: the next request of the
    // same key is refused at once.
    let next = post(
        &gw.url("/v1/responses"),
        &h,
        responses_body("qwen32b", 3, false),
    )
    .await;
    assert_eq!(next.status, 429, "{:?}", next.body);
    assert_eq!(openai_error(&next)["code"], "concurrency_limit_exceeded");
    // Reading it back (pinned: the other backend would answer 404) until it is done.
    let mut done = Value::Null;
    for _ in 0..200 {
        let (status, v) = read(
            call("GET", format!("/v1/responses/{id}"), Some(&key))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        if !matches!(v["status"].as_str(), Some("queued" | "in_progress")) {
            done = v;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 300, "{done}");
    // Once the backend is done the watcher releases the key's stream: the small request is
    // answered (within a poll or two).
    let mut next_status = 0;
    for _ in 0..100 {
        let next = post(
            &gw.url("/v1/responses"),
            &h,
            responses_body("qwen32b", 3, false),
        )
        .await;
        next_status = next.status;
        if next_status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(next_status, 200, "the key's stream came back");
    // Charged once: 300 + its prompt for the background response (its final usage), the
    // small one's real use, and this request's reservation, less what a few seconds
    // refilled. Charged twice (the reads too) it would be about 300 lower; never settled,
    // about 300 higher.
    let last = post(
        &gw.url("/v1/responses"),
        &h,
        responses_body("qwen32b", 3, false),
    )
    .await;
    assert_eq!(last.status, 200, "{:?}", last.body);
    let remaining: u64 = last.headers["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (600..=850).contains(&remaining),
        "remaining tokens {remaining}: the background response was not charged exactly once"
    );

    // A long one, cancelled while it runs, on the backend that runs it.
    let long = post(&gw.url("/v1/responses"), &[], background(2000)).await;
    assert_eq!(long.status, 200, "{:?}", long.body);
    let long_id = json_body(&long)["id"].as_str().unwrap().to_owned();
    let (status, v) = read(
        call("POST", format!("/v1/responses/{long_id}/cancel"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "cancelled");
    let (status, v) = read(
        call("GET", format!("/v1/responses/{long_id}"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, &v["status"]), (200, &json!("cancelled")), "{v}");
    let (status, v) = read(
        call("POST", format!("/v1/responses/{long_id}/cancel"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "cancelled once: {v}");
    // A streamed background response, replayed from its fourth event by a read that keeps
    // its query (`?stream=true&starting_after=3`), from the backend that holds it.
    let body = json!({"model": "qwen32b", "input": "Say something about the license.",
                      "max_output_tokens": 5, "background": true, "stream": true});
    let streamed = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
    assert_eq!(streamed.status, 200);
    let sent = events(streamed.body.as_ref().unwrap());
    let sid = sent[0].1["response"]["id"].as_str().unwrap().to_owned();
    let resp = call(
        "GET",
        format!("/v1/responses/{sid}?stream=true&starting_after=3"),
        None,
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let replayed = resp.into_body().collect().await.unwrap().to_bytes();
    let replayed = events(&replayed);
    assert_eq!(replayed.len(), sent.len() - 4, "{replayed:?}");
    assert_eq!(replayed[0].1["sequence_number"], 4);
    assert_eq!(replayed.last().unwrap().0, "response.completed");
    // The backends generate nothing for it any more.
    let (a, b) = (one.stats().clone(), two.stats().clone());
    assert!(
        eventually(Duration::from_secs(5), || a
            .cancelled
            .load(std::sync::atomic::Ordering::SeqCst)
            + b.cancelled.load(std::sync::atomic::Ordering::SeqCst)
            >= 1)
        .await
    );
}

/// A backend whose streams send their terminal event, then keep the body open `hold`.
async fn lingering_backend(hold: Duration) -> std::net::SocketAddr {
    let (addr, _task) = http_backend(move |req| async move {
        let events: &'static [&'static str] = match req.uri().path() {
            "/v1/responses" => &[
                "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"model\":\"m\",\"status\":\"in_progress\"},\"sequence_number\":0}\n\n",
                "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"model\":\"m\",\"status\":\"completed\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1,\"total_tokens\":4}},\"sequence_number\":2}\n\n",
            ],
            "/v1/messages" => &[
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"m\",\"usage\":{\"input_tokens\":3,\"output_tokens\":0}}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":1}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            ],
            _ => &["data: [DONE]\n\n"],
        };
        let frames: Vec<Bytes> = events
            .iter()
            .map(|e| Bytes::from_static(e.as_bytes()))
            .collect();
        let frames = futures_util::stream::unfold(frames.into_iter(), move |mut rest| async move {
            match rest.next() {
                Some(b) => Some((
                    Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)),
                    rest,
                )),
                None => {
                    tokio::time::sleep(hold).await;
                    None
                }
            }
        });
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(http_body_util::StreamBody::new(frames))
            .unwrap()
    })
    .await;
    addr
}

/// A client that hangs up as soon as it has read the stream's terminal event (Codex closes on
/// `response.completed`) got the whole answer: the record says so, even when the backend's
/// end of body comes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_after_the_terminal_event_got_its_answer() {
    let addr = lingering_backend(Duration::from_secs(30)).await;
    let gw = gateway(vec![pool("m", &[format!("http://{addr}")])]).await;
    let c = client::http_client();
    for (path, body, last) in [
        (
            "/v1/responses",
            json!({"model": "m", "input": "hi", "stream": true, "max_output_tokens": 4}),
            "response.completed",
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 4, "stream": true,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "message_stop",
        ),
    ] {
        let req = authed(&gw, "POST", path)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let rid = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        let mut body = resp.into_body();
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains(last) {
            let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
                .await
                .expect("the terminal event is relayed at once")
                .unwrap()
                .unwrap();
            if let Ok(data) = frame.into_data() {
                seen.extend_from_slice(&data);
            }
        }
        drop(body);
        let rec = gw.record_of(&rid).await;
        assert_eq!(rec.status, 200);
        assert_eq!(rec.error, None, "{path}: {rec:?}");
    }
}

/// A stored response is its key's: another key (even one with rights on the model) is told it
/// does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_keys_response_does_not_exist_for_it() {
    let sim = sim(|a| a.responses_store = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[],
        responses_body("qwen32b", 2, false),
    )
    .await;
    let id = json_body(&m)["id"].as_str().unwrap().to_owned();
    let (other, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let bearer = format!("Bearer {other}");
    let c = client::http_client();
    let req = http::Request::get(gw.url(&format!("/v1/responses/{id}")))
        .header("authorization", &bearer)
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 404);
    let body = json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2, "previous_response_id": id});
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer)],
        Bytes::from(body.to_string()),
    )
    .await;
    assert_eq!(m.status, 404);
    assert_eq!(openai_error(&m)["code"], "response_not_found");
    // Its own key still reads it.
    let req = authed(&gw, "GET", &format!("/v1/responses/{id}"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(c.request(req).await.unwrap().status(), 200);
}

/// With `limits.shared = "redis"` a stored response made through one replica is reached
/// through another; without it, that other replica says it does not know it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_redis_share_stored_responses() {
    let Some(redis) = redis_url("replicas_sharing_redis_share_stored_responses").await else {
        return;
    };
    let one = sim(|a| a.responses_store = true).await;
    let two = sim(|a| a.responses_store = true).await;
    let db = temp_dir("pins-db").join("keys.db");
    let prefix = format!("fgtest-pins-{}-{}", std::process::id(), rand_suffix());
    let shared = |c: &mut fleetgate_gateway::config::Config| {
        c.database.sqlite_path = db.clone();
        c.limits.shared = fleetgate_gateway::config::SharedLimits::Redis;
        c.limits.redis = Some(fleetgate_gateway::config::RedisConfig {
            url: fleetgate_gateway::secret::Secret::new(&redis),
            timeout: Duration::from_millis(500),
            replicas: 2,
            key_prefix: prefix.clone(),
        });
    };
    let backends = [one.url(), two.url()];
    let a = gateway_with(vec![pool("qwen32b", &backends)], shared).await;
    let b = gateway_with(vec![pool("qwen32b", &backends)], shared).await;
    let alone = gateway_with(vec![pool("qwen32b", &backends)], |c| {
        c.database.sqlite_path = db.clone();
    })
    .await;
    // One key, known to every replica (one store).
    let key = a.key.clone();
    let bearer = format!("Bearer {key}");
    let c = client::http_client();
    for _ in 0..4 {
        let m = post(
            &a.url("/v1/responses"),
            &[],
            responses_body("qwen32b", 2, false),
        )
        .await;
        assert_eq!(m.status, 200);
        let id = json_body(&m)["id"].as_str().unwrap().to_owned();
        let mut got = 0;
        for _ in 0..50 {
            let req = http::Request::get(b.url(&format!("/v1/responses/{id}")))
                .header("authorization", &bearer)
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            got = resp.status().as_u16();
            if got == 200 {
                break;
            }

            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(got, 200, "replica b finds {id} through Redis");
        let req = http::Request::get(alone.url(&format!("/v1/responses/{id}")))
            .header("authorization", &bearer)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(
            c.request(req).await.unwrap().status(),
            404,
            "a replica without Redis"
        );
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
