//! KV-event routing over engines that publish no events (`kv_events = false`): the gateway
//! estimates what each engine holds from the prompts it sent there, within the cache size the
//! engine's `/metrics` reports (`vllm:cache_config_info`), and records that belief against
//! what the engine then says it served.

use std::time::Duration;

use crate::common::*;
use crate::kv_events::{chat_model_dir, next_turn, predictions_match, rows, words};
use fleetgate_gateway::config::{AffinityBy, AffinityConfig, BackendConfig, KvEventsConfig};
use serde_json::{Value, json};

/// `n` sims with a prefix cache of `cache_tokens` and no event publisher, cutting prompts
/// with the test model; a `kv_events` pool over them with `kv_events = false` on every
/// backend, and no publisher port. Returns once every backend's cache size is known.
async fn estimated_fleet(n: usize, cache_tokens: u64) -> (Gateway, Vec<fleetgate_sim::SimServer>) {
    let (dir, template) = chat_model_dir();
    let mut sims = Vec::new();
    let mut p = pool("qwen32b", &[]);
    for _ in 0..n {
        let (dir, template) = (dir.clone(), template.clone());
        let s = sim(move |a| {
            a.zero_delay = true;
            a.kv_cache_tokens = cache_tokens;
            a.enable_prompt_tokens_details = true;
            a.tokenizer = Some(dir);
            a.chat_template = Some(template);
        })
        .await;
        p.backends.push(BackendConfig {
            kv_events: false,
            ..BackendConfig::new(s.url().parse().unwrap())
        });
        sims.push(s);
    }
    p.affinity = Some(AffinityConfig {
        by: AffinityBy::KvEvents,
        prefix_bytes: 512,
        slack: 4,
        block_bytes: 256,
        max_blocks: 65_536,
        max_age: Duration::from_secs(600),
    });
    p.kv_events = Some(KvEventsConfig {
        port: None,
        replay_port: None,
        data_parallel_size: 1,
        topic: String::new(),
        max_blocks: 1 << 16,
        tokenizer: Some(dir),
        chat_template: Some(template),
    });
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let blocks = cache_tokens / 16;
    let start = std::time::Instant::now();
    loop {
        let (_, v) = admin(&gw, "GET", "/admin/ready", Some(&viewer), None).await;
        let known = v["backends"].as_array().is_some_and(|bs| {
            bs.len() == n
                && bs.iter().all(|b| {
                    b["kv_events"]["state"] == "estimated"
                        && b["kv_events"]["num_gpu_blocks"] == json!(blocks)
                        && b["kv_events"]["block_size"] == json!(16)
                })
        });
        if known {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the engines' cache sizes were never read: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (gw, sims)
}

async fn ask(gw: &Gateway, id: &str, messages: &[Value]) -> Value {
    let body = json!({"model": "qwen32b", "max_tokens": 2, "messages": messages});
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", id)],
        bytes::Bytes::from(body.to_string()),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    json_body(&m)
}

/// Without events, each later turn still goes where its history is: the estimate believes what
/// was sent there, and on a fleet only this gateway uses, that is what the engines serve.
#[tokio::test]
async fn without_events_each_turn_goes_where_it_was_sent_before() {
    let (gw, sims) = estimated_fleet(3, 65_536).await;
    let mut histories: Vec<Vec<Value>> = (0..4)
        .map(|c| {
            vec![
                json!({"role": "system", "content": words(0, 600)}),
                json!({"role": "user", "content": words(200 + c * 40, 40)}),
            ]
        })
        .collect();
    let mut served = 0;
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let answer = ask(&gw, &format!("est-{c}-{turn}"), history).await;
            served += next_turn(&answer, history, (c, turn), 600);
        }
    }
    let text = predictions_match(&gw, 12, served).await;
    assert!(text.contains("fleetgate_kv_events_state{"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("fleetgate_kv_events_state{")
                && l.contains("rank=\"estimated\"")
                && l.ends_with(" 3")),
        "{text}"
    );
    for s in sims {
        s.shutdown().await;
    }
}

/// A cache of 32 blocks cannot hold two prompts of 20: the estimate stops believing what the
/// engine must have evicted (the first prompt's tail, as vLLM evicts), so its prediction for
/// the first prompt sent again is what the engine serves, not the whole prompt it was sent.
#[tokio::test]
async fn blocks_the_engines_cache_must_have_evicted_are_not_believed() {
    let (gw, sims) = estimated_fleet(1, 512).await;
    // About 20 blocks each, nothing in common (the template's first tokens aside).
    let a = [json!({"role": "user", "content": words(0, 310)})];
    let b = [json!({"role": "user", "content": words(320, 310)})];
    ask(&gw, "ev-1", &a).await;
    ask(&gw, "ev-2", &b).await;
    let again = ask(&gw, "ev-3", &a).await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > 0 && cached + 64 < prompt,
        "the engine kept the head of the first prompt only: {cached} of {prompt}"
    );
    let rows = rows(&gw, 3).await;
    let third = rows.iter().find(|r| r.0 == "ev-3").unwrap();
    assert_eq!(
        third.1,
        Some(cached as i64),
        "believed what the engine kept: {rows:?}"
    );
    for s in sims {
        s.shutdown().await;
    }
}
