//! Longest-prefix routing (`[pools.affinity] by = "longest_prefix"`): each turn of a
//! conversation resends its whole history, and goes to the backend that was sent that history —
//! where its KV cache is — unless that backend is loaded beyond the least loaded one's, when
//! the usual choice takes over and the metrics count a miss.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::config::{AffinityBy, AffinityConfig, PoolConfig};
use serde_json::{Value, json};

fn longest_prefix(urls: &[String], slack: u32) -> PoolConfig {
    let mut p = pool("qwen32b", urls);
    p.affinity = Some(AffinityConfig {
        by: AffinityBy::LongestPrefix,
        prefix_bytes: 512,
        slack,
        block_bytes: 64,
        max_blocks: 65_536,
        max_age: Duration::from_secs(600),
    });
    p
}

/// The system prompt every conversation starts with, as an agent's.
fn system() -> Value {
    json!({"role": "system", "content": "You are a coding agent. ".repeat(40)})
}

fn chat(messages: &[Value], max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        json!({"model": "qwen32b", "max_tokens": max_tokens, "stream": stream, "messages": messages})
            .to_string(),
    )
}

async fn prefix_metric(gw: &Gateway, outcome: &str) -> u64 {
    let text = admin_metrics(gw).await;
    let line =
        format!("fleetgate_prefix_routing_total{{model=\"qwen32b\",outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Eight conversations of four turns over four backends: every turn of a conversation lands on
/// the backend of its first turn, and every later turn is counted a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_turns_of_a_conversation_land_on_one_backend() {
    let sims = [
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let gw = gateway_with(vec![longest_prefix(&urls, 4)], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let mut histories: Vec<Vec<Value>> = (0..8).map(|_| vec![system()]).collect();
    let mut first_backend: HashMap<usize, String> = HashMap::new();
    let mut n = 0;
    for turn in 0..4 {
        for (c, history) in histories.iter_mut().enumerate() {
            history.push(json!({"role": "user",
                "content": format!("conversation {c}, turn {turn}: {}", "details ".repeat(20))}));
            n += 1;
            let id = format!("turn-{c}-{turn}");
            let m = post(&url, &[("x-request-id", &id)], chat(history, 8, false)).await;
            assert_eq!(m.status, 200);
            let answer = json_body(&m)["choices"][0]["message"]["content"].clone();
            history.push(json!({"role": "assistant", "content": answer}));
            let backend = gw.record_of(&id).await.backend.unwrap();
            match first_backend.get(&c) {
                None => {
                    first_backend.insert(c, backend);
                }
                Some(b) => assert_eq!(
                    &backend, b,
                    "conversation {c}'s turn {turn} left its backend"
                ),
            }
        }
    }
    assert_eq!(n, 32);
    // Turns 2 to 4 of each conversation are hits (the first turns may be too: they share
    // the system prompt).
    let (hits, misses) = (
        prefix_metric(&gw, "hit").await,
        prefix_metric(&gw, "miss").await,
    );
    assert_eq!(hits + misses, 32);
    assert!(hits >= 24, "hits {hits}, misses {misses}");
    let blocks: u64 = admin_metrics(&gw)
        .await
        .lines()
        .find_map(|l| l.strip_prefix("fleetgate_prefix_index_blocks{model=\"qwen32b\"} "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(blocks > 0, "the index's size is shown");
}

/// When the backend holding a conversation is loaded beyond the least loaded one (twice its
/// requests and more than `slack` above them), the next turn goes elsewhere and is a miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_backend_falls_back_to_the_usual_choice() {
    // Streams that stay open ~1 s each, so requests in flight are what the router sees.
    let slow = |a: &mut fleetgate_sim::SimArgs| {
        a.decode_step_ms = 20.0;
        a.max_num_seqs = 64;
    };
    let sims = [sim(slow).await, sim(slow).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let gw = gateway_with(vec![longest_prefix(&urls, 1)], |c| c.admin = admin_cfg()).await;
    let url = gw.url("/v1/chat/completions");
    let history = vec![
        system(),
        json!({"role": "user", "content": "the same conversation ".repeat(20)}),
    ];
    // Its first turn teaches the index where it is.
    let m = post(&url, &[("x-request-id", "seed")], chat(&history, 2, false)).await;
    assert_eq!(m.status, 200);
    let home = gw.record_of("seed").await.backend.unwrap();
    // Three long streams of the same conversation, one after the other while the earlier
    // ones run: two fit on its backend (loads 0 and 1 are within slack 1 of the idle
    // backend's 0), the third would make it 2 against 0.
    let mut tasks = Vec::new();
    for i in 0..3 {
        let url = url.clone();
        let body = chat(&history, 50, true);
        tasks.push(tokio::spawn(async move {
            post(&url, &[("x-request-id", &format!("long-{i}"))], body).await
        }));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    let b0 = gw.record_of("long-0").await.backend.unwrap();
    let b1 = gw.record_of("long-1").await.backend.unwrap();
    let b2 = gw.record_of("long-2").await.backend.unwrap();
    assert_eq!(
        (&b0, &b1),
        (&home, &home),
        "within the bound: its own backend"
    );
    assert_ne!(b2, home, "beyond the bound: the other backend");
    assert!(prefix_metric(&gw, "miss").await >= 1);
    assert!(prefix_metric(&gw, "hit").await >= 2);
}

/// What already steers a request keeps working on top: a gray key's turns go to the canary
/// backend, even when their conversation's history went to the stable one (a prod key sent
/// it there first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gray_keys_stay_on_the_canary() {
    let stable = sim(|a| a.zero_delay = true).await;
    let canary = sim(|a| a.zero_delay = true).await;
    let mut p = longest_prefix(&[stable.url()], 4);
    p.backends.push(fleetgate_gateway::config::BackendConfig {
        labels: vec!["canary".into()],
        ..fleetgate_gateway::config::BackendConfig::new(canary.url().parse().unwrap())
    });
    p.gray_canary_label = Some("canary".into());
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let (gray, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Gray, |_| {}).await;
    let canary_url = canary.url();
    let on_canary = |b: &str| canary_url.trim_end_matches('/') == b.trim_end_matches('/');
    let send = |key: String, id: String, history: Vec<Value>| {
        let url = url.clone();
        async move {
            let m = post(
                &url,
                &[
                    ("authorization", &format!("Bearer {key}")),
                    ("x-request-id", &id),
                ],
                chat(&history, 2, false),
            )
            .await;
            assert_eq!(m.status, 200);
        }
    };
    // A conversation whose history prod sent to the stable backend.
    let mut history = None;
    for i in 0..20 {
        // (No shared system prompt: each new conversation is unknown, so the usual choice
        // places it.)
        let h = vec![json!({"role": "user", "content": format!("question {i} ").repeat(20)})];
        let id = format!("prod-{i}");
        send(prod.clone(), id.clone(), h.clone()).await;
        if !on_canary(&gw.record_of(&id).await.backend.unwrap()) {
            history = Some(h);
            break;
        }
    }
    let history = history.expect("a prod turn on the stable backend");
    // Gray sends the same history: its key is pinned to the canary.
    for id in ["gray-1", "gray-2"] {
        send(gray.clone(), id.to_owned(), history.clone()).await;
        let b = gw.record_of(id).await.backend.unwrap();
        assert!(
            on_canary(&b),
            "{id} went to {b}, not the canary {canary_url}"
        );
    }
}

/// Records reach only the deployment they are meant for, and none displaces the index: with
/// the shared limits in Redis database 1, a record published on the channel of the same key
/// prefix in database 0 (pub/sub channels ignore the database) or on the channel's former,
/// prefix-only name is never received, one longer than the longest prompt the gateway takes
/// (`server.max_body_bytes` / `block_bytes`) is dropped and counted, and a record of the
/// deployment's own is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_records_are_scoped_to_one_deployment_and_bounded() {
    let Some(redis) = redis_url("prefix_records_are_scoped_to_one_deployment_and_bounded").await
    else {
        return;
    };
    let s = sim(|_| {}).await;
    let prefix = format!("fgtest-scoped-{}", std::process::id());
    let db1 = format!("{}/1", redis.trim_end_matches('/'));
    let gw = gateway_with(vec![longest_prefix(&[s.url()], 4)], |c| {
        c.server.max_body_bytes = 64 * 1024;
        c.limits.shared = fleetgate_gateway::config::SharedLimits::Redis;
        c.limits.redis = Some(fleetgate_gateway::config::RedisConfig {
            url: fleetgate_gateway::secret::Secret::new(db1.as_str()),
            timeout: Duration::from_millis(200),
            replicas: 2,
            key_prefix: prefix.clone(),
        });
    })
    .await;
    let metric = |name: &'static str| {
        let gw = &gw;
        async move {
            admin_metrics(gw)
                .await
                .lines()
                .find_map(|l| {
                    l.strip_prefix(name)
                        .map(|v| v.trim().parse::<f64>().unwrap())
                })
                .unwrap_or(-1.0)
        }
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric("fleetgate_prefix_share_up ").await != 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica subscribed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A message as another replica encodes it (proxy::prefix_share's format): one record.
    let message = |names: u32| {
        let mut m = 99u64.to_le_bytes().to_vec();
        m.extend_from_slice(&1u32.to_le_bytes());
        for text in ["qwen32b", s.url().as_str()] {
            m.extend_from_slice(&(text.len() as u16).to_le_bytes());
            m.extend_from_slice(text.as_bytes());
        }
        m.extend_from_slice(&names.to_le_bytes());
        for n in 0..u64::from(names) {
            m.extend_from_slice(&(n + 1).to_le_bytes());
        }
        m
    };
    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let max_names = 64 * 1024 / 64;
    for (channel, names) in [
        // Keys and channels carry the prefix as a Redis Cluster hash tag.
        (format!("{{{prefix}}}:prefix-index"), 3),
        (format!("{{{prefix}}}:db0:prefix-index"), 3),
        (format!("{{{prefix}}}:db1:prefix-index"), max_names + 1),
        (format!("{{{prefix}}}:db1:prefix-index"), max_names),
    ] {
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(message(names))
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric("fleetgate_prefix_share_received_total ").await < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the deployment's own record arrived: {}",
            admin_metrics(&gw)
                .await
                .lines()
                .filter(|l| l.contains("prefix_share"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric("fleetgate_prefix_share_received_total ").await, 1.0);
    assert_eq!(
        metric("fleetgate_prefix_share_dropped_total ").await,
        1.0,
        "the oversized record was dropped"
    );
}
