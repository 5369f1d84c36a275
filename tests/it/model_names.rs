//! The names clients use: aliases reach their pool and are listed, `/v1/models` carries the
//! backends' cards under the client names, and a backend refusing the upstream key is
//! `misconfigured` until it is fixed.

use std::time::Duration;

use crate::balancing::chat;
use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::admin::jwt::Role;

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
