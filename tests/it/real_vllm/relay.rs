//! The relay in front of real vLLM: answers and pooling answers byte for byte, usage and
//! fingerprint as the client asked, refusals, `/v1/models`, a wrong upstream key, load-aware
//! balancing reading vLLM's gauges, and a client disconnect aborting the sequence.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_relayed_byte_for_byte() {
    let Some(r) = real("answers_are_relayed_byte_for_byte").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, false).await;
    // The first stream the gateway relays from a backend teaches it the backend's
    // `system_fingerprint` when vLLM writes the finish and usage chunks apart (docs/testing.md).
    let first = through(&gw, "/v1/chat/completions", &chat(&r.model, 2, true)).await;
    assert_eq!(first.status, 200);
    for (path, body) in [
        ("/v1/chat/completions", chat(&r.model, 12, true)),
        ("/v1/chat/completions", chat(&r.model, 12, false)),
        ("/v1/completions", completion(&r.model, 12, true)),
        ("/v1/completions", completion(&r.model, 12, false)),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": r.model, "stream": true, "max_tokens": 6,
                "temperature": 1, "seed": 7, "n": 2,
                "messages": [{"role": "user", "content": "Two answers"}]}),
        ),
    ] {
        let d = direct(&r, path, &body).await;
        let g = through(&gw, path, &body).await;
        assert_eq!((d.status, g.status), (200, 200), "{path} {body}");
        assert_eq!(
            g.headers.get("content-type"),
            d.headers.get("content-type"),
            "{path}"
        );
        assert_eq!(neutral(&text(&g)), neutral(&text(&d)), "{path} {body}");
    }
}

/// The pooling routes through the gateway as a real `--runner pooling --convert embed` server
/// answers them directly: embeddings as floats, as base64, of one text, of several
/// and of token ids, Cohere's `/v2/embed`, `/pooling`, the rerank routes (cut to `top_n`) and
/// the score routes, byte for byte but for the request id and `created`; the usage the gateway
/// recorded is vLLM's own. Needs `FLEETGATE_TEST_VLLM_POOLING` (see `real_pooling`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooling_answers_are_relayed_byte_for_byte() {
    let Some(r) = real_pooling("pooling_answers_are_relayed_byte_for_byte").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let mut p = pool(&r.model, std::slice::from_ref(&r.url));
    p.kind = fleetgate_gateway::config::PoolKind::Embed;
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new(&r.key));
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    wait_for_200(&gw.url("/readyz").to_string()).await;

    let m = r.model.as_str();
    let docs = serde_json::json!([
        "the license is Apache-2.0",
        "a color",
        "the license",
        "blue"
    ]);
    let cases = [
        (
            "/v1/embeddings",
            serde_json::json!({"model": m, "input": ["the license", "a color"],
                "encoding_format": "float"}),
        ),
        (
            "/v1/embeddings",
            serde_json::json!({"model": m, "input": ["the license", "a color"],
                "encoding_format": "base64"}),
        ),
        (
            "/v1/embeddings",
            serde_json::json!({"model": m, "input": "Tell me about the sea"}),
        ),
        (
            "/v1/embeddings",
            serde_json::json!({"model": m, "input": [[11, 12, 13], [14, 15]]}),
        ),
        (
            "/v2/embed",
            serde_json::json!({"model": m, "texts": ["a color"],
                "embedding_types": ["float", "base64"]}),
        ),
        (
            "/pooling",
            serde_json::json!({"model": m, "input": "the license"}),
        ),
        (
            "/rerank",
            serde_json::json!({"model": m, "query": "license?", "documents": docs, "top_n": 2}),
        ),
        (
            "/v1/rerank",
            serde_json::json!({"model": m, "query": "license?", "documents": docs, "top_n": 2}),
        ),
        (
            "/v2/rerank",
            serde_json::json!({"model": m, "query": "license?", "documents": docs, "top_n": 2}),
        ),
        (
            "/score",
            serde_json::json!({"model": m, "queries": "license?", "documents": docs}),
        ),
        (
            "/v1/score",
            serde_json::json!({"model": m, "text_1": "license?", "text_2": ["a color", "the license"]}),
        ),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let d = direct(&r, path, body).await;
        let id = format!("pooling-{i}");
        let g = post(
            &gw.url(path),
            &[("x-request-id", &id)],
            Bytes::from(body.to_string()),
        )
        .await;
        assert_eq!(
            (d.status, g.status),
            (200, 200),
            "{path} {body}: {}",
            text(&g)
        );
        assert_eq!(
            g.headers.get("content-type"),
            d.headers.get("content-type"),
            "{path}"
        );
        assert_eq!(neutral(&text(&g)), neutral(&text(&d)), "{path} {body}");
        // The usage the gateway read and recorded is the answer's.
        let v = json_body(&g);
        let want = v["usage"]["prompt_tokens"]
            .as_u64()
            .or_else(|| v["meta"]["billed_units"]["input_tokens"].as_u64())
            .unwrap_or_else(|| panic!("{path}: no token count in {v}"));
        let seen = gw.record_of(&id).await;
        assert_eq!(seen.error, None, "{path}: {seen:?}");
        let usage = seen.timeline.stream().usage.expect("usage read");
        assert_eq!(usage.prompt_tokens, want, "{path}: {v}");
        if path.ends_with("rerank") {
            assert_eq!(v["results"].as_array().unwrap().len(), 2, "{path}: top_n");
        }
        if path.ends_with("embeddings") {
            assert!(
                v["data"][0]["embedding"]
                    .as_array()
                    .is_some_and(|e| e.len() == 128)
                    || v["data"][0]["embedding"]
                        .as_str()
                        .is_some_and(|e| e.len() == 684),
                "{path}: 128 dimensions, as floats or as base64 of 512 bytes: {v}"
            );
        }
    }
}

/// Usage as each client asked (fix 1) and `system_fingerprint` where vLLM puts it (fix 2), for
/// every `stream_options` combination, chat and completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_and_fingerprint_as_the_client_asked() {
    let Some(r) = real("usage_and_fingerprint_as_the_client_asked").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, false).await;
    let options = [
        serde_json::Value::Null,
        serde_json::json!({"include_usage": false}),
        serde_json::json!({"continuous_usage_stats": true}),
        serde_json::json!({"include_usage": true}),
        serde_json::json!({"include_usage": true, "continuous_usage_stats": true}),
    ];
    for (path, base) in [
        ("/v1/chat/completions", chat(&r.model, 6, true)),
        ("/v1/completions", completion(&r.model, 6, true)),
    ] {
        // Twice each: the first stream may be the one that teaches the gateway the backend's
        // fingerprint (when vLLM writes the finish and usage chunks apart).
        for round in 0..2 {
            for o in &options {
                let mut body = base.clone();
                if !o.is_null() {
                    body["stream_options"] = o.clone();
                }
                let d = direct(&r, path, &body).await;
                let g = through(&gw, path, &body).await;
                assert_eq!((d.status, g.status), (200, 200));
                let (d, g) = (neutral(&text(&d)), neutral(&text(&g)));
                let usage = |b: &str| b.matches("\"usage\"").count();
                assert_eq!(
                    usage(&g),
                    usage(&d),
                    "{path} {o}: usage chunks\n{g}\n---\n{d}"
                );
                let fp = |b: &str| b.matches("\"system_fingerprint\"").count();
                if round == 1 {
                    assert_eq!(fp(&g), fp(&d), "{path} {o}: fingerprints\n{g}\n---\n{d}");
                    assert_eq!(g, d, "{path} {o}: the same bytes");
                }
            }
        }
    }
}

/// vLLM's refusals come back as vLLM wrote them. The limits are the server's (1024 tokens, or
/// 32768 in agents mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_relayed() {
    let Some(r) = real("refusals_are_relayed").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, false).await;
    let over = u32::try_from(r.max_model_len).unwrap() + 1000;
    let long = "sea ".repeat(over as usize);
    for body in [
        chat(&r.model, over, false),
        serde_json::json!({"model": r.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": long}]}),
        serde_json::json!({"model": r.model, "max_tokens": 4, "temperature": -1,
            "messages": [{"role": "user", "content": "hi"}]}),
        serde_json::json!({"model": r.model, "max_tokens": 4, "prompt": long}),
    ] {
        let path = if body.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let d = direct(&r, path, &body).await;
        let g = through(&gw, path, &body).await;
        assert_eq!(d.status, 400, "{}", text(&d));
        assert_eq!(g.status, d.status, "{}", text(&g));
        assert_eq!(text(&g), text(&d));
    }
}

/// `/v1/models` through the gateway: the pool's client-facing name with what vLLM says of its
/// model (fix 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_carry_the_backends_card() {
    let Some(r) = real("models_carry_the_backends_card").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, "tiny-client", &r.key, false).await;
    let (_, body) = get(&format!("{}/v1/models", r.url), Some(&r.key)).await;
    let vllm: serde_json::Value = serde_json::from_str(&body).unwrap();
    let card = &vllm["data"][0];
    let m = post_get(&gw, "/v1/models").await;
    let ours: serde_json::Value = serde_json::from_str(&m).unwrap();
    let entry = ours["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == "tiny-client")
        .unwrap_or_else(|| panic!("tiny-client listed: {ours}"));
    for field in ["max_model_len", "root", "owned_by", "object"] {
        assert_eq!(entry[field], card[field], "{field}: {entry} vs {card}");
    }
    // And a request under the client's name is answered under it.
    let g = through(&gw, "/v1/chat/completions", &chat("tiny-client", 4, false)).await;
    assert_eq!(g.status, 200, "{}", text(&g));
    assert_eq!(json_body(&g)["model"], "tiny-client");
}

async fn post_get(gw: &Gateway, path: &str) -> String {
    let c = fleetgate_protocol::client::http_client();
    let resp = c
        .request(
            authed(gw, "GET", path)
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// A wrong `upstream_api_key`: vLLM's `/health` needs none, the gateway finds out anyway
/// (fix 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_upstream_key_is_found() {
    let Some(r) = real("a_wrong_upstream_key_is_found").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, "fg-wrong-key", false).await;
    let state = backend_states_become(&gw, &["misconfigured"]).await;
    assert_eq!(state, ["misconfigured"]);
    let (ready, _) = get(&gw.url("/readyz").to_string(), None).await;
    assert_eq!(ready, 503);
    let g = through(&gw, "/v1/chat/completions", &chat(&r.model, 4, false)).await;
    assert_eq!(g.status, 503, "{}", text(&g));
    let e = openai_error(&g);
    assert!(
        e["message"].as_str().unwrap().contains("upstream_api_key"),
        "{e}"
    );
}

/// The numbers vLLM exports about itself, as the gateway reads them.
async fn vllm_gauge(r: &Real, name: &str, label: &str) -> f64 {
    let (_, text) = get(&format!("{}/metrics", r.url), None).await;
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Load-aware balancing reads vLLM's own `vllm:num_requests_running` / `waiting`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_balancing_reads_vllm() {
    let Some(r) = real("load_aware_balancing_reads_vllm").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, true).await;
    let backend = gw
        .server
        .pools()
        .find_backend(&r.model, &r.url)
        .unwrap()
        .clone();
    let long = serde_json::json!({"model": r.model, "stream": true, "max_tokens": 900,
        "ignore_eos": true, "messages": [{"role": "user", "content": "go on"}]});
    let uri: http::Uri = format!("{}/v1/chat/completions", r.url).parse().unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(open(&uri, &r.key, Bytes::from(long.to_string())).await);
    }
    let seen = eventually(Duration::from_secs(10), || {
        backend.remote_load.load(Ordering::Relaxed) >= 4
    })
    .await;
    let load = backend.remote_load.load(Ordering::Relaxed);
    drop(held);
    assert!(seen, "the gateway read a load of {load}, not 4");
    // The streams were dropped: vLLM aborts them and the gateway sees the load go.
    assert!(
        eventually(Duration::from_secs(10), || backend
            .remote_load
            .load(Ordering::Relaxed)
            == 0)
        .await
    );
}

/// A client that goes away mid-stream: vLLM aborts the sequence at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_aborts_the_sequence() {
    let Some(r) = real("a_client_disconnect_aborts_the_sequence").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, false).await;
    let finished_before = vllm_gauge(
        &r,
        "vllm:request_success_total",
        "finished_reason=\"length\"",
    )
    .await;
    let long = serde_json::json!({"model": r.model, "stream": true, "max_tokens": 600,
        "ignore_eos": true, "messages": [{"role": "user", "content": "go on"}]});
    let resp = open(
        &gw.url("/v1/chat/completions"),
        &gw.key,
        Bytes::from(long.to_string()),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    // Two frames in: the sequence runs.
    for _ in 0..2 {
        body.frame().await.unwrap().unwrap();
    }
    let mut running = 0.0;
    for _ in 0..250 {
        running = vllm_gauge(&r, "vllm:num_requests_running", "").await;
        if running == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(running, 1.0, "the stream runs on vLLM");
    let gone = std::time::Instant::now();
    drop(body);
    while gone.elapsed() < Duration::from_secs(5) {
        running = vllm_gauge(&r, "vllm:num_requests_running", "").await;
        if running == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = gone.elapsed();
    assert_eq!(running, 0.0, "vLLM still runs it after {took:?}");
    eprintln!("vLLM stopped the sequence {took:?} after the client left");
    // It was stopped, not finished: had it gone on, its 600 tokens would be done by now.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let finished = vllm_gauge(
        &r,
        "vllm:request_success_total",
        "finished_reason=\"length\"",
    )
    .await;
    assert_eq!(
        finished, finished_before,
        "the aborted stream did not run to its end"
    );
}
