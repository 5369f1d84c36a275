//! The gateway subscribed to real vLLM's KV cache events, as deployed: vLLM binds its PUB and
//! its replay ROUTER (`scripts/real-vllm.sh start --kv-events-bind PORT`, which prints
//! `FLEETGATE_TEST_VLLM_KV_PORT=PORT`), and the gateway's own ZMTP client connects to both.
//! Skipped, saying so, against a server started without it.

use std::time::Duration;

use super::*;
use fleetgate_gateway::config::KvEventsConfig;
use serde_json::{Value, json};

/// A prompt of `n` words of the model's vocabulary, drawn at random so that no earlier run
/// cached it (a cached prompt publishes nothing).
fn fresh_prompt(root: &str, n: usize) -> String {
    let tok: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{root}/tokenizer.json")).unwrap())
            .unwrap();
    let words: Vec<&str> = tok["model"]["vocab"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|w| w.chars().all(|c| c.is_ascii_alphabetic()) && w.len() > 2)
        .collect();
    (0..n)
        .map(|_| words[rand::random_range(0..words.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn the_gateway_indexes_what_real_vllm_publishes_from_a_late_join() {
    let _serial = SERIAL.lock().await;
    let test = "the_gateway_indexes_what_real_vllm_publishes_from_a_late_join";
    let Some(r) = real(test).await else { return };
    let Some(port) = std::env::var("FLEETGATE_TEST_VLLM_KV_PORT")
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
    else {
        eprintln!(
            "\n*** SKIPPED {test}: FLEETGATE_TEST_VLLM_KV_PORT is not set (scripts/real-vllm.sh start --kv-events-bind PORT). ***\n"
        );
        return;
    };
    let body = |prompt: String| {
        Bytes::from(
            json!({"model": r.model, "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]})
                .to_string(),
        )
    };
    // Before any gateway subscribes: only the replay endpoint can tell it.
    let before = post(
        &format!("{}/v1/chat/completions", r.url).parse().unwrap(),
        &[("authorization", &format!("Bearer {}", r.key))],
        body(fresh_prompt(&r.root, 300)),
    )
    .await;
    assert_eq!(before.status, 200);

    let mut p = pool(&r.model, std::slice::from_ref(&r.url));
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new(&r.key));
    p.kv_events = Some(KvEventsConfig {
        port: Some(port),
        replay_port: Some(port + 1),
        data_parallel_size: 1,
        topic: "kv".into(),
        max_blocks: 1 << 16,
        tokenizer: None,
        chat_template: None,
    });
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let events = || async {
        let (s, v) = admin(&gw, "GET", "/admin/ready", Some(&viewer), None).await;
        assert_eq!(s, 200);
        v["backends"][0]["kv_events"].clone()
    };
    let start = std::time::Instant::now();
    while events().await["state"] != "live" {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:#}",
            events().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        body(fresh_prompt(&r.root, 300)),
    )
    .await;
    assert_eq!(m.status, 200);
    let start = std::time::Instant::now();
    let v = loop {
        let v = events().await;
        if v["ranks"][0]["batches"].as_u64() >= Some(1) {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no batch: {v:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let rank = &v["ranks"][0];
    eprintln!("real vLLM's events as the gateway indexed them: {v:#}");
    assert_eq!(v["state"], "live", "{v:#}");
    assert_eq!(
        (&rank["lost"], &rank["bad_payloads"], &rank["block_size"]),
        (&json!(0), &json!(0), &json!(128)),
        "{v:#}"
    );
    assert!(
        rank["replayed"].as_u64() >= Some(1),
        "the history before the join came from the replay: {v:#}"
    );
    // Two prompts of 300 words: at least two full blocks of 128 tokens each.
    assert!(rank["blocks"].as_u64() >= Some(4), "{v:#}");
    assert_eq!(
        rank["unplaced_blocks"], 0,
        "every block chains to one the gateway saw: {v:#}"
    );
}
