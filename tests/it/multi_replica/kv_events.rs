//! Routing by the engines' KV events across replicas: each replica subscribes to every engine
//! itself, so a later turn finds its prefix whichever replica it reaches, with nothing shared
//! between the replicas but what the engines publish.

use super::*;
use crate::kv_events::{
    cached_of_completion, second_turn, token_conversations, tokenizer_dir, two_ports,
};

/// Every replica's index holds `want` blocks over all engines, every engine live, within 5 s.
async fn every_index_holds(replicas: &[Replica], want: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        seen.clear();
        for r in replicas {
            let (_, ready) = admin_call(r, "GET", "/admin/ready", None).await;
            let backends = ready["backends"].as_array().cloned().unwrap_or_default();
            let live =
                !backends.is_empty() && backends.iter().all(|b| b["kv_events"]["state"] == "live");
            let blocks: u64 = backends
                .iter()
                .filter_map(|b| b["kv_events"]["ranks"][0]["blocks"].as_u64())
                .sum();
            seen.push((live, blocks));
        }
        if seen.iter().all(|(live, blocks)| *live && *blocks == want) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "every replica's index should hold {want} live blocks; (live, blocks) by replica: {seen:?}"
    );
}

/// Six conversations of ten 16-token blocks over three engines that publish their caches'
/// changes, in front of three replicas on one PostgreSQL and Redis. Each first turn goes to
/// one replica, its second to the next: the second is served from the engine's cache
/// although the replica it reaches never routed the conversation, and every request's
/// prediction in the shared request log is what the engine then reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_routes_a_later_turn_to_the_engine_that_holds_it() {
    let Some(db) = pg_database("multi_replica_kv").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_kv").await else {
        return;
    };
    let mut sims = Vec::new();
    let mut backends = Vec::new();
    for _ in 0..3 {
        let port = two_ports().await;
        let config = serde_json::json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": format!("tcp://*:{port}")});
        let s = sim(move |a| {
            a.zero_delay = true;
            a.kv_cache_tokens = 4096;
            a.enable_prompt_tokens_details = true;
            a.kv_events_config = Some(config.to_string());
        })
        .await;
        backends.push(format!(
            "{{ url = \"{}\", kv_events_port = {port} }}",
            s.url()
        ));
        sims.push(s);
    }
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = [{}]

[pools.affinity]
by = "kv_events"
slack = 4

[pools.kv_events]
tokenizer = "{}"
max_blocks = 4096
"#,
        backends.join(", "),
        tokenizer_dir().display()
    );
    let dir = temp_dir("multi-replica-kv");
    let replicas = start_replicas(&db.url, &redis, &dir, &pools).await;
    let key = issue_key_on(&replicas[0], "agent", "prod").await;
    every_index_holds(&replicas, 0).await;
    let auth = format!("Bearer {key}");
    let complete = |r: &Replica, prompt: Vec<u32>| {
        let url = r.url("/v1/completions");
        let auth = auth.clone();
        async move { cached_of_completion(&url, &[("authorization", &auth)], &prompt).await }
    };
    let first = token_conversations();
    for (c, prompt) in first.iter().enumerate() {
        assert_eq!(complete(&replicas[c % REPLICAS], prompt.clone()).await, 0);
        // Every replica has read the engine's events for it before the next turn.
        every_index_holds(&replicas, 10 * (c as u64 + 1)).await;
    }
    for (c, prompt) in first.iter().enumerate() {
        assert_eq!(
            complete(&replicas[(c + 1) % REPLICAS], second_turn(prompt)).await,
            160,
            "conversation {c}'s second turn, on replica {}, found its first turn's blocks",
            (c + 1) % REPLICAS
        );
    }
    // The shared request log: 12 answers, each predicted as the engine served it.
    let store = sqlx::PgPool::connect(&db.url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let rows: Vec<(Option<i64>, Option<i64>)> = loop {
        let rows = sqlx::query_as(
            "SELECT predicted_cached_tokens, cached_tokens FROM request_log WHERE endpoint = 'completions'",
        )
        .fetch_all(&store)
        .await
        .unwrap();
        if rows.len() >= 12 || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(rows.len(), 12, "{rows:?}");
    assert!(
        rows.iter().all(|(p, c)| p.is_some() && p == c),
        "(predicted, served) per request: {rows:?}"
    );
    assert_eq!(
        rows.iter().filter(|(_, c)| *c == Some(160)).count(),
        6,
        "{rows:?}"
    );
    store.close().await;
    drop(replicas);
    for s in sims {
        s.shutdown().await;
    }
}
