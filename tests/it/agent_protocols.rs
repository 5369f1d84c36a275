//! The coding agents' protocols through the gateway: OpenAI's Responses API and
//! Anthropic's Messages API, each relayed byte for byte and measured like chat (TTFT, usage,
//! hop, the request log's endpoint), Anthropic's clients answered in Anthropic's shape, and a
//! client leaving right after the terminal event counted as answered. Stored responses:
//! stored_responses.rs.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_protocol::client;
use http_body_util::BodyExt;
use serde_json::{Value, json};

pub(crate) fn responses_body(model: &str, tokens: u32, stream: bool) -> Bytes {
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
pub(crate) fn events(body: &[u8]) -> Vec<(String, Value)> {
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
