//! Backend pools end to end with real sims: model aliases, weighted balancing, retries on
//! another backend before the first byte, passive ejection, a backend killed under load, and
//! draining through the admin API.

#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use fleetgate_gateway::admin::jwt::Role;
use fleetgate_gateway::config::{BackendConfig, PoolConfig};

fn chat(model: &str, max_tokens: u32, stream: bool) -> Bytes {
    fleetgate_protocol::client::chat_body(model, "Say something", max_tokens, stream)
}

fn backend(url: String, weight: u32) -> BackendConfig {
    BackendConfig {
        weight,
        ..BackendConfig::new(url.parse().unwrap())
    }
}

/// Requests per backend among the gateway's records so far.
fn per_backend(gw: &Gateway) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in gw.records.lock().unwrap().iter() {
        if let Some(b) = &r.backend {
            *counts.entry(b.clone()).or_default() += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_reach_the_pool_and_are_listed() {
    let sim = sim(|_| {}).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.aliases = vec!["gpt-4o".into(), "qwen".into()];
    let gw = gateway(vec![p]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat("gpt-4o", 3, true),
    )
    .await;
    assert_eq!(m.status, 200);
    let seen = gw
        .record_of(m.headers["x-request-id"].to_str().unwrap())
        .await;
    assert_eq!(
        seen.model.as_deref(),
        Some("qwen32b"),
        "recorded under the pool's name"
    );
    let c = fleetgate_protocol::client::http_client();
    let resp = c
        .request(
            authed(&gw, "GET", "/v1/models")
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    use http_body_util::BodyExt;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["qwen32b", "gpt-4o", "qwen"]);
}

/// `GET /v1/models` with the gateway's key, as JSON.
async fn models(gw: &Gateway) -> serde_json::Value {
    use http_body_util::BodyExt;
    let resp = fleetgate_protocol::client::http_client()
        .request(
            authed(gw, "GET", "/v1/models")
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

/// `/v1/models` serves what the backends say about the model (vLLM's card: max_model_len,
/// root, created, owned_by), under every name clients use for the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_carry_the_backends_card_under_the_client_names() {
    let sim = sim(|a| {
        a.max_model_len = 4096;
        a.served_model_name = vec!["Qwen/Qwen2.5-32B-Instruct-AWQ".into()];
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.served_model_name = Some("Qwen/Qwen2.5-32B-Instruct-AWQ".into());
    p.aliases = vec!["gpt-4o".into()];
    let gw = gateway(vec![p]).await;
    let mut last = serde_json::Value::Null;
    for _ in 0..100 {
        last = models(&gw).await;
        if last["data"][0].get("max_model_len").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let data = last["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{last}");
    for (card, id) in data.iter().zip(["qwen32b", "gpt-4o"]) {
        assert_eq!(card["id"], id, "{last}");
        assert_eq!(card["max_model_len"], 4096, "{last}");
        assert_eq!(card["root"], "Qwen/Qwen2.5-32B-Instruct-AWQ", "{last}");
        assert_eq!(card["owned_by"], "vllm", "{last}");
        assert!(card["created"].as_u64().unwrap() > 0, "{last}");
    }
}

/// vLLM's `/health` needs no key: a wrong `upstream_api_key` must not look healthy. The
/// backend shows as misconfigured with the reason, readiness fails, requests are refused with
/// it; the right key (a reload) brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_refusing_the_upstream_key_is_misconfigured_until_it_is_fixed() {
    let sim = sim(|a| a.api_key = Some("the-right-key".into())).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new("a-wrong-key"));
    let gw = gateway_with(vec![p.clone()], |c| c.admin = admin_cfg()).await;
    let state = backend_states_become(&gw, &["misconfigured"]).await;
    assert_eq!(state, ["misconfigured"]);
    let why = admin_backends(&gw, "last_error").await;
    assert!(
        why[0].contains("401") && why[0].contains("upstream_api_key"),
        "{why:?}"
    );
    // Its /health keeps answering 200: still misconfigured, and not ready.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(admin_backends(&gw, "state").await, ["misconfigured"]);
    let ready = fleetgate_protocol::client::http_client()
        .request(
            http::Request::get(gw.url("/readyz"))
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat("qwen32b", 2, false),
    )
    .await;
    assert_eq!(m.status, 503);
    let e = openai_error(&m);
    assert!(
        e["message"].as_str().unwrap().contains("upstream_api_key"),
        "{e}"
    );
    // The operator fixes the key: a reload, and the backend serves.
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new("the-right-key"));
    let mut next = fleetgate_gateway::config::Config::with_pools(vec![p]);
    next.admin = admin_cfg();
    gw.server.reload(&next).unwrap();
    let mut state = Vec::new();
    for _ in 0..100 {
        state = admin_backends(&gw, "state").await;
        if state == ["healthy"] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state, ["healthy"]);
    let (_, v) = admin(
        &gw,
        "GET",
        "/admin/backends",
        Some(&token(Role::Viewer)),
        None,
    )
    .await;
    assert!(
        v["data"][0]["last_error"].is_null(),
        "the reason is cleared: {v}"
    );
    assert_eq!(
        post(
            &gw.url("/v1/chat/completions"),
            &[],
            chat("qwen32b", 2, false)
        )
        .await
        .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_share_traffic() {
    let light = sim(|a| a.zero_delay = true).await;
    let heavy = sim(|a| a.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(light.url(), 1), backend(heavy.url(), 3)];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for _ in 0..400 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    let heavy_n = counts[heavy.url().trim_end_matches('/')];
    // Expected 300 of 400 (σ ≈ 8.7): a wide band that still rules out an even split.
    assert!(
        (250..=350).contains(&heavy_n),
        "weight 3 of 4 got {heavy_n} of 400: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_another_backend() {
    let sim = sim(|_| {}).await;
    let dead = closed_port().await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    // The dead backend is drawn first half of the time; it must never cost a request.
    p.backends = vec![backend(format!("http://{dead}"), 1), backend(sim.url(), 1)];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for i in 0..20 {
        let m = post(
            &url,
            &[("x-request-id", &format!("r-{i}"))],
            chat("qwen32b", 2, true),
        )
        .await;
        assert_eq!(m.status, 200, "request {i}");
    }
    let records = gw.records.lock().unwrap().clone();
    assert!(
        records.iter().all(|r| r.error.is_none()),
        "{:?}",
        records.iter().map(|r| r.error).collect::<Vec<_>>()
    );
    assert!(
        records.iter().map(|r| u32::from(r.retries)).sum::<u32>() >= 1 || {
            // The probe may have marked the dead backend down before the first request.
            gw.server.pools().get("qwen32b").unwrap().backends[0]
                .state()
                .as_str()
                == "down"
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_refused_connection_waits_for_a_slot_when_the_others_are_full() {
    let live = sim(|_| {}).await;
    let doomed = sim(|_| {}).await;
    let one_slot = |url: String| BackendConfig {
        capacity: Some(1),
        ..backend(url, 1)
    };
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![one_slot(doomed.url()), one_slot(live.url())];
    // Probed once at start (both up), then not again during the test: the gateway learns
    // that `doomed` died only from the refused connection.
    let gw = gateway_with(vec![p], |c| {
        c.server.health_interval = Duration::from_secs(3600);
    })
    .await;
    let pools = gw.server.pools();
    let backends = &pools.get("qwen32b").unwrap().backends;
    assert!(
        eventually(Duration::from_secs(5), || backends
            .iter()
            .all(|b| b.state().as_str() == "healthy"))
        .await
    );
    doomed.shutdown().await;
    let url = gw.url("/v1/chat/completions");
    // The live backend's one slot is taken for 0.3 s...
    let pool = pools.get("qwen32b").unwrap();
    let held = pool
        .balancer
        .try_acquire_excluding(fleetgate_gateway::pool::bit(0))
        .expect("the live backend's slot");
    assert_eq!(held.backend().base.as_ref(), live.url().as_str());
    let busy = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
    });
    // ...so this request goes to the only free slot, on the dead backend: refused, it waits
    // for the live one instead of failing.
    let m = post(
        &url,
        &[("x-request-id", "after-refusal")],
        chat("qwen32b", 2, true),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    busy.await.unwrap();
    let records = gw.records.lock().unwrap().clone();
    let r = records
        .iter()
        .find(|r| r.request_id == "after-refusal")
        .unwrap();
    assert_eq!(r.retries, 1);
    assert_eq!(r.backend.as_deref(), Some(live.url().as_str()));
    assert!(
        r.timeline.queue_wait() > Duration::ZERO,
        "the wait for the slot is queue wait"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_backend_is_ejected() {
    let good = sim(|_| {}).await;
    let bad = sim(|a| a.fail_rate = 1.0).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(good.url(), 1), backend(bad.url(), 1)];
    p.ejection.consecutive_failures = 2;
    p.ejection.base = Duration::from_secs(30);
    p.ejection.max = Duration::from_secs(60);
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    // The balancer picks the bad backend now and then (when is up to its choice): requests go
    // until it has failed twice, which ejects it; after that, none reaches it.
    let mut statuses = Vec::new();
    while statuses.iter().filter(|s| **s == 500).count() < 2 && statuses.len() < 200 {
        statuses.push(post(&url, &[], chat("qwen32b", 2, false)).await.status);
    }
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 500),
        "{statuses:?}"
    );
    let ejected_at = statuses.len();
    for _ in 0..30 {
        statuses.push(post(&url, &[], chat("qwen32b", 2, false)).await.status);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 500).count(),
        2,
        "only the two failures that eject it: {statuses:?}"
    );
    assert!(
        statuses[ejected_at..].iter().all(|s| *s == 200),
        "{statuses:?}"
    );
    let bad_state = gw
        .server
        .pools()
        .find_backend("qwen32b", &bad.url())
        .unwrap()
        .state();
    assert_eq!(bad_state.as_str(), "ejected");
}

/// Every backend ejected and nothing in flight: a request that queues goes on when the
/// ejection ends (1 s here), instead of waiting out its queue deadline (20 s) for a slot that
/// no finishing request will ever free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_behind_an_ejection_goes_on_when_it_ends() {
    let bad = sim(|a| a.fail_rate = 1.0).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(bad.url(), 1)];
    p.ejection.consecutive_failures = 1;
    p.ejection.base = Duration::from_secs(1);
    p.ejection.max = Duration::from_secs(1);
    let gw = gateway_with(vec![p], |c| {
        c.queue.max_wait = [Duration::from_secs(20); 3];
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let first = post(&url, &[], chat("qwen32b", 2, false)).await;
    assert_eq!(first.status, 500, "the backend's own failure ejects it");
    let state = || {
        gw.server
            .pools()
            .find_backend("qwen32b", &bad.url())
            .unwrap()
            .state()
            .as_str()
    };
    assert_eq!(state(), "ejected");
    let started = std::time::Instant::now();
    let second = post(&url, &[], chat("qwen32b", 2, false)).await;
    let took = started.elapsed();
    // It reached the backend again (which fails again): not a 503 queue timeout.
    assert_eq!(second.status, 500, "{:?}", second.body);
    assert!(
        took < Duration::from_secs(10),
        "waited {took:?}: the queue was not woken when the ejection ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_backends_under_load_fails_no_unstarted_request() {
    let sims = [
        sim(|a| a.decode_step_ms = 5.0).await,
        sim(|a| a.decode_step_ms = 5.0).await,
        sim(|a| a.decode_step_ms = 5.0).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let gw = gateway(vec![pool("qwen32b", &urls)]).await;
    let url = gw.url("/v1/chat/completions");
    let [a, victim, c] = sims;
    let mut load = Vec::new();
    for w in 0..12 {
        let url = url.clone();
        load.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in 0..25 {
                let m = post(
                    &url,
                    &[("x-request-id", &format!("k-{w}-{i}"))],
                    chat("qwen32b", 8, true),
                )
                .await;
                out.push((m.status, m.metrics.error || m.body_error.is_some()));
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim.shutdown().await;
    let mut results = Vec::new();
    for l in load {
        results.extend(l.await.unwrap());
    }
    // A request that had not started streaming never fails: every status is 200. Only
    // streams cut mid-way on the killed backend may end with an error event.
    assert!(
        results.iter().all(|(s, _)| *s == 200),
        "{:?}",
        results
            .iter()
            .filter(|(s, _)| *s != 200)
            .collect::<Vec<_>>()
    );
    let cut = results.iter().filter(|(_, e)| *e).count();
    assert!(
        cut <= 12,
        "at most the streams open on the killed backend: {cut}"
    );
    drop((a, c));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_backend_through_the_admin_api() {
    let one = sim(|a| a.zero_delay = true).await;
    let two = sim(|a| a.zero_delay = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[one.url(), two.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let admin_token = token(Role::Admin);
    let body = serde_json::json!({"model": "qwen32b", "backend": one.url()});
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&admin_token),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "draining");
    let url = gw.url("/v1/chat/completions");
    for _ in 0..20 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    assert_eq!(
        counts.get(one.url().trim_end_matches('/')),
        None,
        "{counts:?}"
    );
    assert_eq!(admin_backends(&gw, "state").await[0], "draining");
    // A viewer may look but not drain; an unknown backend is named.
    let (s, _) = admin(
        &gw,
        "POST",
        "/admin/backends/undrain",
        Some(&token(Role::Viewer)),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 403);
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&admin_token),
        Some(serde_json::json!({"model": "qwen32b", "backend": "http://10.9.9.9:1"})),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["code"], "backend_not_found");
    let (s, _) = admin(
        &gw,
        "POST",
        "/admin/backends/undrain",
        Some(&admin_token),
        Some(body),
    )
    .await;
    assert_eq!(s, 200);
    for _ in 0..40 {
        post(&url, &[], chat("qwen32b", 2, false)).await;
    }
    assert!(per_backend(&gw).contains_key(one.url().trim_end_matches('/')));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_go_to_their_pool_when_the_environment_may_use_it() {
    let short = sim(|a| a.zero_delay = true).await;
    let long = sim(|a| a.zero_delay = true).await;
    let mut main = pool("qwen32b", &[short.url()]);
    main.long_prompt = Some(fleetgate_gateway::config::LongPromptConfig {
        min_prompt_tokens: 100,
        pool: "qwen32b-long".into(),
    });
    let mut long_pool = pool("qwen32b-long", &[long.url()]);
    long_pool.served_model_name = Some("qwen32b".into());
    long_pool.environments = Some(vec![fleetgate_gateway::key::Environment::Prod]);
    let gw = gateway(vec![main, long_pool]).await;
    let (prod, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let url = gw.url("/v1/chat/completions");
    let long_prompt = "word ".repeat(120); // 600 characters ≈ 150 tokens
    let body = |prompt: &str| fleetgate_protocol::client::chat_body("qwen32b", prompt, 2, true);
    let auth = format!("Bearer {prod}");
    for (id, prompt, key) in [
        ("short-prod", "hi", auth.as_str()),
        ("long-prod", long_prompt.as_str(), auth.as_str()),
    ] {
        let m = post(
            &url,
            &[("authorization", key), ("x-request-id", id)],
            body(prompt),
        )
        .await;
        assert_eq!(m.status, 200, "{id}");
    }
    // The harness key is a stress key: the long pool is prod-only, so it stays.
    let m = post(&url, &[("x-request-id", "long-stress")], body(&long_prompt)).await;
    assert_eq!(m.status, 200);
    let at = |id: &str| {
        let r = gw
            .records
            .lock()
            .unwrap()
            .iter()
            .find(|r| r.request_id == id)
            .cloned()
            .unwrap();
        (r.model.unwrap(), r.backend.unwrap())
    };
    let short_url = short.url().trim_end_matches('/').to_owned();
    let long_url = long.url().trim_end_matches('/').to_owned();
    assert_eq!(at("short-prod"), ("qwen32b".to_owned(), short_url.clone()));
    assert_eq!(at("long-prod"), ("qwen32b-long".to_owned(), long_url));
    assert_eq!(at("long-stress"), ("qwen32b".to_owned(), short_url));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gray_keys_are_pinned_to_the_canary() {
    let stable = sim(|a| a.zero_delay = true).await;
    let canary = sim(|a| a.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![
        backend(stable.url(), 19),
        BackendConfig {
            labels: vec!["canary".into()],
            ..backend(canary.url(), 1)
        },
    ];
    p.gray_canary_label = Some("canary".into());
    let gw = gateway(vec![p]).await;
    let (gray, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Gray, |_| {}).await;
    let url = gw.url("/v1/chat/completions");
    let auth = format!("Bearer {gray}");
    for _ in 0..20 {
        let m = post(&url, &[("authorization", &auth)], chat("qwen32b", 2, false)).await;
        assert_eq!(m.status, 200);
    }
    let canary_url = canary.url().trim_end_matches('/').to_owned();
    assert_eq!(
        per_backend(&gw).get(&canary_url),
        Some(&20),
        "every gray request on the canary"
    );
    // The canary drained: gray traffic goes on, to the stable backend.
    gw.server
        .pools()
        .find_backend("qwen32b", &canary.url())
        .unwrap()
        .set_draining(true);
    let m = post(&url, &[("authorization", &auth)], chat("qwen32b", 2, false)).await;
    assert_eq!(m.status, 200);
    assert_eq!(per_backend(&gw).get(&canary_url), Some(&20));
    // The canary's labels are on the info metric, to compare it with the stable backend.
    let text = metrics_text(&gw);
    assert!(
        text.contains(&format!(
            "fleetgate_backend_info{{backend=\"{canary_url}\",labels=\"canary\",model=\"qwen32b\",weight=\"1\"}} 1"
        )),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_gets_traffic_only_after_its_warm_up() {
    let ready = sim(|a| a.zero_delay = true).await;
    // Refuses connections for its first second, like a vLLM loading its weights.
    let cold = sim(|a| {
        a.zero_delay = true;
        a.warmup_secs = 1.0;
    })
    .await;
    let mut p = pool("qwen32b", &[ready.url(), cold.url()]);
    p.warmup.requests = 2;
    let gw = gateway(vec![p]).await;
    let cold_backend = gw
        .server
        .pools()
        .find_backend("qwen32b", &cold.url())
        .unwrap()
        .clone();
    assert_eq!(cold_backend.state().as_str(), "warming");
    let url = gw.url("/v1/chat/completions");
    let cold_url = cold.url().trim_end_matches('/').to_owned();
    // While the cold backend refuses connections, every request goes to the warm one, never
    // to the cold one (which would show as a retry). The state is read after each answer: a
    // request sent while the backend warmed may rightly reach it if the warm-up ends while it
    // is on its way, so only what was answered before the backend became healthy counts.
    let started = std::time::Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "never warmed: {:?}",
            cold_backend.last_error()
        );
        let m = post(&url, &[], chat("qwen32b", 2, false)).await;
        assert_eq!(m.status, 200);
        if cold_backend.state().as_str() == "healthy" {
            break;
        }
        let before = per_backend(&gw).get(&cold_url).copied().unwrap_or(0);
        assert_eq!(
            before, 0,
            "no client request reached the cold backend before its warm-up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gw.records.lock().unwrap().iter().all(|r| r.retries == 0));
    for _ in 0..30 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    assert!(
        per_backend(&gw).get(&cold_url).copied().unwrap_or(0) > 0,
        "it takes traffic once warm"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_balancing_sees_load_from_outside_the_gateway() {
    let busy = sim(|a| a.decode_step_ms = 20.0).await;
    let idle = sim(|a| a.decode_step_ms = 20.0).await;
    let mut p = pool("qwen32b", &[busy.url(), idle.url()]);
    p.load_aware = Some(fleetgate_gateway::config::LoadAwareConfig {
        metrics_path: "/metrics".into(),
        interval: Duration::from_millis(50),
    });
    let gw = gateway(vec![p]).await;
    // Another gateway (or a direct client) keeps 8 long streams on one backend.
    let direct: http::Uri = format!("{}/v1/chat/completions", busy.url().trim_end_matches('/'))
        .parse()
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(open(&direct, "unused", chat("qwen32b", 500, true)).await);
    }
    let busy_backend = gw
        .server
        .pools()
        .find_backend("qwen32b", &busy.url())
        .unwrap()
        .clone();
    assert!(
        eventually(Duration::from_secs(10), || busy_backend
            .remote_load
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 8)
        .await,
        "the scrape never saw the load"
    );
    let url = gw.url("/v1/chat/completions");
    for _ in 0..10 {
        assert_eq!(post(&url, &[], chat("qwen32b", 1, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    assert_eq!(
        counts.get(idle.url().trim_end_matches('/')),
        Some(&10),
        "every request went to the idle backend: {counts:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_one_user_stay_on_one_backend() {
    let sims = [
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut p = pool("qwen32b", &urls);
    p.affinity = Some(fleetgate_gateway::config::AffinityConfig {
        by: fleetgate_gateway::config::AffinityBy::User,
        prefix_bytes: 512,
        slack: 4,
        block_bytes: 256,
        max_blocks: 4096,
        max_age: std::time::Duration::from_secs(600),
    });
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    let body = |user: &str| {
        Bytes::from(
            serde_json::json!({
                "model": "qwen32b", "user": user, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            })
            .to_string(),
        )
    };
    for i in 0..20 {
        let m = post(
            &url,
            &[("x-request-id", &format!("alice-{i}"))],
            body("alice"),
        )
        .await;
        assert_eq!(m.status, 200);
    }
    let backends: std::collections::HashSet<String> = gw
        .records
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| r.backend.clone())
        .collect();
    assert_eq!(backends.len(), 1, "one user, one backend: {backends:?}");
    for u in 0..30 {
        post(&url, &[], body(&format!("user-{u}"))).await;
    }
    assert!(
        per_backend(&gw).len() >= 2,
        "users spread over the backends"
    );
}

fn base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_adds_and_removes_backends_while_streams_continue() {
    let old = sim(|a| a.decode_step_ms = 20.0).await;
    let new = sim(|a| a.zero_delay = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[old.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    // Three streams of 40 tokens (~0.8 s each) running on the old backend.
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                post(
                    &url,
                    &[("x-request-id", &format!("long-{i}"))],
                    chat("qwen32b", 40, true),
                )
                .await
            })
        })
        .collect();
    let stats = old.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 3)
        .await
    );

    // The old backend leaves, the new one joins.
    let next = fleetgate_gateway::config::Config::with_pools(vec![pool("qwen32b", &[new.url()])]);
    let summary = gw.server.reload(&next).unwrap();
    assert_eq!(
        summary.backends_added,
        [format!("qwen32b {}", base(&new.url()))]
    );
    assert_eq!(
        summary.backends_removed,
        [format!("qwen32b {}", base(&old.url()))]
    );
    assert_eq!(summary.generation, 2);

    // New requests go to the new backend at once.
    for _ in 0..10 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    // The streams that began before the reload finish whole on the old backend.
    for s in streams {
        let m = s.await.unwrap();
        assert_eq!(m.status, 200);
        assert!(m.metrics.done, "a stream was cut by the reload");
        assert_eq!(m.metrics.content_events, 40);
    }
    let counts = per_backend(&gw);
    assert_eq!(counts.get(&base(&old.url())), Some(&3), "{counts:?}");
    assert_eq!(counts.get(&base(&new.url())), Some(&10), "{counts:?}");
    for r in gw.records.lock().unwrap().iter() {
        assert!(r.error.is_none(), "{r:?}");
    }
    // The admin API lists the new membership; the metrics say a reload happened and drop the
    // removed backend's gauges.
    assert_eq!(admin_backends(&gw, "backend").await, [base(&new.url())]);
    let text = metrics_text(&gw);
    assert!(text.contains("fleetgate_config_generation 2"), "{text}");
    assert!(
        text.contains("fleetgate_config_reloads_total{result=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        !text.contains(&format!(
            "fleetgate_backend_info{{backend=\"{}\"",
            base(&old.url())
        )),
        "{text}"
    );
    // Upstream TTFT of requests recorded after the reload landed on their own backends.
    let ttft_new = format!(
        "fleetgate_ttft_seconds_count{{backend=\"{}\",endpoint=\"chat\",environment=\"stress\",model=\"qwen32b\",side=\"upstream\"}} 10",
        base(&new.url())
    );
    assert!(text.contains(&ttft_new), "{text}");
    let ttft_old = format!(
        "fleetgate_ttft_seconds_count{{backend=\"{}\",endpoint=\"chat\",environment=\"stress\",model=\"qwen32b\",side=\"upstream\"}} 3",
        base(&old.url())
    );
    assert!(text.contains(&ttft_old), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_weights_in_place() {
    let a = sim(|s| s.zero_delay = true).await;
    let b = sim(|s| s.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(a.url(), 1), backend(b.url(), 1)];
    let gw = gateway(vec![p.clone()]).await;
    // Promote b from an even split to 9 of 10: same backends, nothing added or removed.
    p.backends[1].weight = 9;
    p.backends[1].labels = vec!["promoted".into()];
    let summary = gw
        .server
        .reload(&fleetgate_gateway::config::Config::with_pools(vec![p]))
        .unwrap();
    assert!(summary.is_empty(), "{summary}");
    let url = gw.url("/v1/chat/completions");
    for _ in 0..200 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    let b_n = counts[&base(&b.url())];
    // Expected 180 of 200 (σ ≈ 4.2).
    assert!(
        (160..=195).contains(&b_n),
        "weight 9 of 10 got {b_n}: {counts:?}"
    );
    let pools = gw.server.pools();
    let kept = pools.find_backend("qwen32b", &b.url()).unwrap();
    assert_eq!(kept.weight(), 9);
    assert_eq!(*kept.labels(), ["promoted"]);
    let text = metrics_text(&gw);
    assert!(
        text.contains("labels=\"promoted\",model=\"qwen32b\",weight=\"9\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_makes_each_address_a_backend() {
    let s = sim(|a| a.zero_delay = true).await;
    let port = s.addr().port();
    let mut p = PoolConfig::new("qwen32b", vec![]);
    let mut entry = BackendConfig::new(format!("http://localhost:{port}").parse().unwrap());
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(200),
    };
    entry.labels = vec!["discovered".into()];
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for _ in 0..5 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    let pools = gw.server.pools();
    let found: Vec<String> = pools
        .get("qwen32b")
        .unwrap()
        .backends
        .iter()
        .map(|b| b.base.to_string())
        .collect();
    assert!(
        found.contains(&format!("http://127.0.0.1:{port}")),
        "localhost resolved to {found:?}"
    );
    assert!(
        pools.get("qwen32b").unwrap().backends[0]
            .labels()
            .contains(&"discovered".to_owned())
    );
    // The failure counter is exported from the first answer on, at 0.
    assert!(
        metrics_text(&gw).contains("fleetgate_dns_discovery_failures_total{model=\"qwen32b\"} 0"),
        "{}",
        metrics_text(&gw)
    );

    // A name that does not resolve leaves its pool without backends: a clear 503.
    let mut p = PoolConfig::new("ghost", vec![]);
    let mut entry = BackendConfig::new("http://fleetgate-test.invalid:8000".parse().unwrap());
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(200),
    };
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let m = post(&gw.url("/v1/chat/completions"), &[], chat("ghost", 2, true)).await;
    assert_eq!(m.status, 503);
    let e = openai_error(&m);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("no backends right now"),
        "{e}"
    );
    assert!(
        eventually(Duration::from_secs(5), || metrics_text(&gw)
            .lines()
            .any(|l| l.starts_with(
                "fleetgate_dns_discovery_failures_total{model=\"ghost\"}"
            ) && !l.ends_with(" 0")))
        .await,
        "failed lookups are counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_answers_that_change_move_traffic_and_streams_finish() {
    use std::collections::BTreeSet;
    use std::net::IpAddr;
    use std::sync::{Arc, Mutex};
    // Two backends on one port, at 127.0.0.1 and 127.0.0.2 (both loopback on Linux): what a
    // headless Service answers as its pods come and go.
    let a = sim(|s| s.decode_step_ms = 20.0).await;
    let port = a.addr().port();
    let b = sim(|s| {
        s.host = "127.0.0.2".into();
        s.port = port;
        s.zero_delay = true;
    })
    .await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    let mut entry = BackendConfig::new(
        format!("http://vllm.fleetgate-test.invalid:{port}")
            .parse()
            .unwrap(),
    );
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(100),
    };
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    // The name does not resolve yet: no backend.
    assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 503);

    let answer: Arc<Mutex<BTreeSet<IpAddr>>> = Arc::new(Mutex::new(BTreeSet::new()));
    let answer2 = answer.clone();
    gw.server.fleet.set_resolver(Arc::new(move |_host, _port| {
        let a = answer2.lock().unwrap().clone();
        Box::pin(async move { Ok(a) })
    }));
    let set = |ips: &[&str]| {
        *answer.lock().unwrap() = ips.iter().map(|i| i.parse().unwrap()).collect();
    };
    let backends = |gw: &Gateway| -> Vec<String> {
        gw.server
            .pools()
            .get("qwen32b")
            .unwrap()
            .backends
            .iter()
            .map(|b| b.base.to_string())
            .collect()
    };
    let (at_a, at_b) = (
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.2:{port}"),
    );

    set(&["127.0.0.1"]);
    assert!(eventually(Duration::from_secs(5), || backends(&gw) == [at_a.clone()]).await);
    assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);

    // A long stream on a; then the answer moves to b.
    let long = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &[], chat("qwen32b", 40, true)).await })
    };
    let stats = a.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1)
        .await
    );
    set(&["127.0.0.2"]);
    assert!(eventually(Duration::from_secs(5), || backends(&gw) == [at_b.clone()]).await);
    for _ in 0..5 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    let m = long.await.unwrap();
    assert_eq!(m.status, 200);
    assert!(
        m.metrics.done,
        "the stream on the address that left was cut"
    );
    assert_eq!(m.metrics.content_events, 40);
    let counts = per_backend(&gw);
    assert_eq!(counts.get(&at_b), Some(&5), "{counts:?}");
    assert_eq!(counts.get(&at_a), Some(&2), "{counts:?}");
    assert_eq!(
        b.stats().requests.load(std::sync::atomic::Ordering::SeqCst),
        5,
        "the backend at 127.0.0.2 served them"
    );

    // An empty answer is not taken at its word: the last addresses stay, the failure counts.
    set(&[]);
    let text = || metrics_text(&gw);
    assert!(
        eventually(Duration::from_secs(5), || text().contains(
            "fleetgate_dns_discovery_failures_total{model=\"qwen32b\"}"
        ))
        .await
    );
    assert_eq!(backends(&gw), std::slice::from_ref(&at_b));
    assert!(
        text().contains("fleetgate_config_generation 3"),
        "{}",
        text()
    );
}

/// `[pools.priority]`: each environment's vLLM `priority` reaches the backend, and with a
/// backend that orders its waiting queue by it (`--scheduling-policy priority`, one seat) a prod
/// request overtakes the gray ones that waited before it. A stress client that claims a better
/// priority than its environment's is given its environment's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_environments_priority_reaches_the_engine() {
    use fleetgate_gateway::key::Environment;
    let sim = sim(|a| {
        a.max_num_seqs = 1;
        a.decode_step_ms = 5.0;
        a.scheduling_policy = fleetgate_sim::SchedulingPolicy::Priority;
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.priority = Some(fleetgate_gateway::config::EnginePriority {
        by_env: [20, 10, 0],
        override_client: false,
    });
    let gw = gateway(vec![p]).await;
    let (stress, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let (gray, _) = issue_key(&gw, Environment::Gray, |_| {}).await;
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let stats = sim.stats().clone();
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // A stress request takes the one seat; then a gray request waits, a stress one claiming
    // priority -5 (it gets stress's 20), and a prod one.
    for (name, key, tokens, claim, waiting) in [
        ("stress", &stress, 200, None, 0),
        ("gray", &gray, 10, None, 1),
        ("stress-claiming", &stress, 10, Some(-5), 2),
        ("prod", &prod, 10, None, 3),
    ] {
        let url = gw.url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let done = done.clone();
        let mut body = serde_json::json!({"model": "qwen32b", "max_tokens": tokens,
                                          "messages": [{"role": "user", "content": "hi"}]});
        if let Some(c) = claim {
            body["priority"] = c.into();
        }
        tasks.push(tokio::spawn(async move {
            // The claim goes in vLLM's header too, which vLLM reads before the body's field.
            let claim = claim.map(|c: i64| c.to_string()).unwrap_or_default();
            let mut headers = vec![("authorization", auth.as_str())];
            if !claim.is_empty() {
                headers.push(("x-vllm-priority", claim.as_str()));
            }
            let m = post(&url, &headers, body.to_string()).await;
            assert_eq!(m.status, 200, "{name}: {:?}", m.body);
            done.lock().unwrap().push(name);
        }));
        let engine = stats.clone();
        assert!(
            eventually(Duration::from_secs(10), || {
                engine.running.load(std::sync::atomic::Ordering::SeqCst) == 1
                    && engine.waiting.load(std::sync::atomic::Ordering::SeqCst) == waiting
            })
            .await,
            "{name} is at the backend"
        );
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *done.lock().unwrap(),
        ["stress", "prod", "gray", "stress-claiming"],
        "the backend admitted prod before the requests that waited before it, and gray before stress"
    );
}
