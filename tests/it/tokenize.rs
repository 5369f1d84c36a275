//! vLLM's `/tokenize` and `/detokenize` passed through: to a backend of the model, refused like
//! chat, counted as a request but not as inference, and a backend without them says so.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use crate::relay::stream_body;
use bytes::Bytes;
use fleetgate_protocol::client::{self};
use http_body_util::BodyExt;

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
