//! LoRA adapters (issue 62): a pool learns which adapters each backend serves from its
//! `/v1/models` (cards with a `parent`), at start and every `health.models_interval_ms`; a
//! request naming an adapter reaches only the backends holding it, waiting for one of them when
//! they are full; the key's allow-list names adapters; the gateway's `/v1/models` lists them.

use std::time::Duration;

use crate::common::*;
use fleetgate_protocol::client::chat_body;

/// A sim serving `qwen32b` with LoRA on, `adapters` loaded at start (each `name` with a path
/// that exists), runtime loading allowed.
async fn lora_sim(adapters: &[&str], decode_ms: f64) -> fleetgate_sim::SimServer {
    let dir = temp_dir("lora-adapter");
    let modules: Vec<String> = adapters
        .iter()
        .map(|n| format!("{n}={}", dir.display()))
        .collect();
    sim(move |a| {
        a.decode_step_ms = decode_ms;
        a.enable_lora = true;
        a.max_loras = 4;
        a.lora_modules = modules;
        a.runtime_lora_updating = true;
        a.lora_load_delay_ms = 0.0;
    })
    .await
}

/// The adapters the gateway's `/v1/models` lists for `key`: (id, parent).
async fn listed(gw: &Gateway, key: &str) -> Vec<(String, String)> {
    let auth = format!("Bearer {key}");
    let (status, body) = get_body(&gw.url("/v1/models"), &[("authorization", &auth)]).await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["parent"].is_null())
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_owned(),
                c["parent"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_an_adapter_reach_only_the_backends_holding_it() {
    let holder = lora_sim(&["sql-lora"], 2.0).await;
    let other = lora_sim(&[], 2.0).await;
    let mut p = pool("qwen32b", &[holder.url(), other.url()]);
    p.set_models_interval(Duration::from_millis(200));
    let gw = gateway(vec![p]).await;
    let key = gw.key.clone();
    let want = [("sql-lora".to_owned(), "qwen32b".to_owned())];
    for _ in 0..250 {
        if listed(&gw, &key).await == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(listed(&gw, &key).await, want);
    let url = gw.url("/v1/chat/completions");
    let holder_base = holder.url().trim_end_matches('/').to_owned();
    for i in 0..12 {
        let id = format!("sql-{i}");
        let m = post(
            &url,
            &[("x-request-id", &id)],
            chat_body("sql-lora", "hi", 2, i % 2 == 0),
        )
        .await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert!(body.contains("\"model\":\"sql-lora\""), "{body}");
        let r = gw.record_of(&id).await;
        assert_eq!(r.backend.as_deref(), Some(holder_base.as_str()), "{id}");
        assert_eq!(r.model.as_deref(), Some("qwen32b"));
    }
    // Loaded at run time on the other backend: seen at the next read, then both serve it.
    let c = fleetgate_protocol::client::http_client();
    let load = fleetgate_protocol::client::send(
        &c,
        &format!("{}/v1/load_lora_adapter", other.url().trim_end_matches('/'))
            .parse()
            .unwrap(),
        &headers(&[]),
        bytes::Bytes::from(format!(
            r#"{{"lora_name":"sql-lora","lora_path":"{}"}}"#,
            temp_dir("lora-runtime").display()
        )),
        true,
    )
    .await
    .unwrap();
    assert_eq!(load.status, 200);
    let pools = gw.server.pools();
    let both = eventually(Duration::from_secs(5), || {
        pools.get("qwen32b").unwrap().adapter_backends("sql-lora") == 2
    })
    .await;
    assert!(both, "the runtime load is learnt");
    let mut backends = std::collections::HashSet::new();
    for i in 0..40 {
        let id = format!("sql-both-{i}");
        let m = post(
            &url,
            &[("x-request-id", &id)],
            chat_body("sql-lora", "hi", 2, false),
        )
        .await;
        assert_eq!(m.status, 200);
        backends.insert(gw.record_of(&id).await.backend.unwrap());
    }
    assert_eq!(
        backends.len(),
        2,
        "balanced among the holders: {backends:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_request_waits_for_its_holder_while_another_backend_is_free() {
    // 30 ms a token: a 20-token answer holds the holder's one seat for about 0.6 s.
    let holder = lora_sim(&["sql-lora"], 30.0).await;
    let other = lora_sim(&[], 30.0).await;
    let mut p = pool("qwen32b", &[holder.url(), other.url()]);
    p.max_in_flight_per_backend = 1;
    let gw = gateway(vec![p]).await;
    let pools = gw.server.pools();
    let learnt = eventually(Duration::from_secs(5), || {
        pools.get("qwen32b").unwrap().adapter_backends("sql-lora") == 1
    })
    .await;
    assert!(learnt);
    let url = gw.url("/v1/chat/completions");
    let first = tokio::spawn({
        let url = url.clone();
        async move {
            post(
                &url,
                &[("x-request-id", "first")],
                chat_body("sql-lora", "hi", 20, true),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The holder is full, the other backend free: the second waits for the holder.
    let second = tokio::spawn({
        let url = url.clone();
        async move {
            post(
                &url,
                &[("x-request-id", "second")],
                chat_body("sql-lora", "hi", 2, false),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A base-model request meanwhile takes the free backend at once.
    let base = post(
        &url,
        &[("x-request-id", "base")],
        chat_body("qwen32b", "hi", 2, false),
    )
    .await;
    assert_eq!(base.status, 200);
    let holder_base = holder.url().trim_end_matches('/').to_owned();
    let other_base = other.url().trim_end_matches('/').to_owned();
    assert_eq!(gw.record_of("base").await.backend, Some(other_base));
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(second.await.unwrap().status, 200);
    let second = gw.record_of("second").await;
    assert_eq!(second.backend, Some(holder_base));
    assert!(
        second.timeline.queue_wait() >= Duration::from_millis(100),
        "it waited for the holder: {:?}",
        second.timeline.queue_wait()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_allow_list_names_adapters_as_it_names_models() {
    let holder = lora_sim(&["sql-lora", "chat-lora"], 2.0).await;
    let gw = gateway(vec![pool("qwen32b", &[holder.url()])]).await;
    let (only_sql, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.allowed_models = Some(vec!["sql-lora".into()]);
    })
    .await;
    let pools = gw.server.pools();
    let learnt = eventually(Duration::from_secs(5), || {
        pools.get("qwen32b").unwrap().adapter_backends("chat-lora") == 1
    })
    .await;
    assert!(learnt);
    assert_eq!(
        listed(&gw, &only_sql).await,
        [("sql-lora".to_owned(), "qwen32b".to_owned())]
    );
    let url = gw.url("/v1/chat/completions");
    let auth = format!("Bearer {only_sql}");
    let ok = post(
        &url,
        &[("authorization", &auth)],
        chat_body("sql-lora", "hi", 2, false),
    )
    .await;
    assert_eq!(ok.status, 200);
    let denied = post(
        &url,
        &[("authorization", &auth)],
        chat_body("chat-lora", "hi", 2, false),
    )
    .await;
    assert_eq!(denied.status, 403);
    assert!(
        openai_error(&denied)["message"]
            .as_str()
            .unwrap()
            .contains("chat-lora")
    );
    // Nor the base model, which the list does not name.
    let base = post(
        &url,
        &[("authorization", &auth)],
        chat_body("qwen32b", "hi", 2, false),
    )
    .await;
    assert_eq!(base.status, 403);
    // An adapter no backend holds is an unknown model.
    let unknown = post(&url, &[], chat_body("nowhere-lora", "hi", 2, false)).await;
    assert_eq!(unknown.status, 404);
}
