//! The longest-prefix index shared through Redis: a later turn reaches its conversation's
//! backend whichever replica it reaches, and a paused, killed or slow Redis costs the
//! replicas nothing (each routes on its own index), sharing coming back when Redis does.

use std::collections::HashMap;

use super::*;

/// Four sims and a pool (TOML) routing over them by longest prefix, in blocks of 64 bytes.
async fn prefix_sims() -> (Vec<fleetgate_sim::SimServer>, String) {
    let mut sims = Vec::new();
    for _ in 0..4 {
        sims.push(sim(|_| {}).await);
    }
    let urls = sims
        .iter()
        .map(|s| format!("\"{}\"", s.url()))
        .collect::<Vec<_>>()
        .join(", ");
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = [{urls}]
max_in_flight_per_backend = 0

[pools.affinity]
by = "longest_prefix"
block_bytes = 64
"#
    );
    (sims, pools)
}

/// Whether Redis answers while a conversation runs (see `converse`).
#[derive(Clone, Copy)]
enum Redis {
    Answers,
    Faulty,
}

const RECEIVED: &str = "fleetgate_prefix_share_received_total";

/// Three turns of agent conversation `conv`, each resending the whole history, turn t sent to
/// replica `(first + t) % REPLICAS` (as a Service spreads them): the sim that served each turn.
/// Every turn must be answered, and within 10 s (a replica waiting on a Redis that does not
/// answer would hang here).
///
/// With `Redis::Answers`, the next turn is sent once the other two replicas have received the
/// turn's record (within 5 s): an agent reads, thinks and runs tools between turns, seconds
/// that a fixed 50 ms pause stood for and that a loaded CI machine could outlast (the
/// publisher's 20 ms linger, Redis and the subscriber's wake-up all run on its two cores).
/// With `Redis::Faulty` it pauses 50 ms and goes on: no record is expected.
async fn converse(
    replicas: &[Replica],
    sims: &[fleetgate_sim::SimServer],
    key: &str,
    conv: usize,
    first: usize,
    redis: Redis,
) -> Vec<usize> {
    let served = || -> Vec<u64> {
        sims.iter()
            .map(|s| s.stats().requests.load(std::sync::atomic::Ordering::SeqCst))
            .collect()
    };
    // Each conversation's own text comes first (a shared system prompt would send every new
    // conversation where that prompt is, at this load, and make a test pass unshared).
    let task = "Read the repository, plan the change, then edit it and run the tests. ".repeat(4);
    let mut messages = vec![
        serde_json::json!({"role": "user", "content": format!("Conversation {conv}: fix the failing test in module {conv}. {task}")}),
    ];
    let mut backends = Vec::new();
    let mut received = metric_sum(replicas, RECEIVED).await;
    for turn in 0..3usize {
        let r = &replicas[(first + turn) % REPLICAS];
        let before = served();
        let body = serde_json::json!({
            "model": "qwen32b", "messages": messages, "max_tokens": 4, "stream": true,
        });
        let m = tokio::time::timeout(
            Duration::from_secs(10),
            post(
                &r.url("/v1/chat/completions"),
                &[("authorization", &format!("Bearer {key}"))],
                body.to_string(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("conversation {conv} turn {turn}: no answer within 10 s"));
        assert_eq!(m.status, 200, "conversation {conv} turn {turn}");
        let after = served();
        let at = (0..sims.len()).find(|i| after[*i] > before[*i]).unwrap();
        backends.push(at);
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn} of conversation {conv}, with the reasoning behind it.")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("Turn {} of conversation {conv}: go on with the next step.", turn + 1)}));
        // The agent reads the answer before it sends the next turn.
        match redis {
            Redis::Answers => {
                let want = received + (REPLICAS - 1) as f64;
                let deadline = Instant::now() + Duration::from_secs(5);
                while metric_sum(replicas, RECEIVED).await < want {
                    assert!(
                        Instant::now() < deadline,
                        "conversation {conv} turn {turn}: the other replicas never received its record"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                received = want;
            }
            Redis::Faulty => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    backends
}

/// Longest-prefix routing across replicas: eight conversations, each turn resending the whole history, every turn sent to the next replica round robin (as a
/// Service spreads them). Each conversation's later turns reach the backend its first turn went
/// to, although the replica they reach never routed that conversation before: the replicas
/// share what they sent where through Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_turn_finds_its_conversations_backend_whichever_replica_it_reaches() {
    let Some(db) = pg_database("multi_replica_prefix").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_prefix").await else {
        return;
    };
    let (sims, pools) = prefix_sims().await;
    let dir = temp_dir("multi-replica-prefix");
    let replicas = start_replicas(&db.url, &redis, &dir, &pools).await;
    let key = issue_key_on(&replicas[0], "agent", "prod").await;
    // Each replica has subscribed to the others' records.
    prefix_index_is(&replicas, "shared").await;
    let mut used = std::collections::BTreeSet::new();
    for conv in 0..8usize {
        let backends = converse(&replicas, &sims, &key, conv, conv, Redis::Answers).await;
        assert!(
            backends.iter().all(|b| *b == backends[0]),
            "conversation {conv}: turns went to backends {backends:?} (replicas {:?})",
            (0..3).map(|t| (conv + t) % REPLICAS).collect::<Vec<_>>()
        );
        used.insert(backends[0]);
    }
    assert!(used.len() > 1, "the conversations spread: {used:?}");
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis paused, killed and slow under three replicas routing by longest prefix: every turn
/// is still answered (within the bound `converse` sets), each replica says it routes on its own
/// index (`GET /admin/ready`, `fleetgate_prefix_share_up`), and once Redis answers again the
/// replicas share their records again: a new conversation's turns, sent round robin, all reach
/// one backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_killed_or_slow_costs_the_replicas_nothing_and_sharing_comes_back() {
    let Some(db) = pg_database("multi_replica_redis_faults").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_redis_faults").await else {
        return;
    };
    let upstream: std::net::SocketAddr = redis
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|_| "127.0.0.1:6379".parse().unwrap());
    let mut proxy = Faulty::start(0, upstream).await;
    let (sims, pools) = prefix_sims().await;
    let dir = temp_dir("multi-replica-redis-faults");
    let redis_via_proxy = format!("redis://127.0.0.1:{}", proxy.port);
    let replicas = start_replicas(&db.url, &redis_via_proxy, &dir, &pools).await;
    let key = issue_key_on(&replicas[0], "agent", "prod").await;
    let all_say = |want: &'static str| prefix_index_is(&replicas, want);
    let shared_again = |conv: usize| {
        let (replicas, sims, key) = (&replicas, &sims, &key);
        async move {
            let backends = converse(replicas, sims, key, conv, conv, Redis::Answers).await;
            assert!(
                backends.iter().all(|b| *b == backends[0]),
                "conversation {conv}: turns went to backends {backends:?} once Redis answered again"
            );
        }
    };
    all_say("shared").await;
    shared_again(0).await;
    let (_, ready) = admin_call(&replicas[1], "GET", "/admin/ready", None).await;
    assert_eq!(ready["redis"]["state"], "up", "{ready}");

    // Paused: connections open, nothing answers.
    proxy.set(Fault::Paused);
    converse(&replicas, &sims, &key, 1, 1, Redis::Faulty).await;
    all_say("local").await;
    let (_, ready) = admin_call(&replicas[2], "GET", "/admin/ready", None).await;
    assert_eq!(ready["redis"]["state"], "degraded", "{ready}");
    assert!(
        ready["redis"]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("this replica's own index"),
        "{ready}"
    );
    proxy.set(Fault::None);
    all_say("shared").await;
    shared_again(2).await;

    // Killed: refused connections.
    let port = proxy.cut();
    converse(&replicas, &sims, &key, 3, 0, Redis::Faulty).await;
    all_say("local").await;
    proxy = Faulty::start(port, upstream).await;
    all_say("shared").await;
    shared_again(4).await;

    // Slow: every answer late (past the limits' timeout, within the prefix records' one
    // second). Turns are answered at once all the same; the records arrive late, and all of
    // them: once the last has crossed, sharing goes on.
    let received = metric_sum(&replicas, RECEIVED).await;
    let published = metric_sum(&replicas, "fleetgate_prefix_share_published_total").await;
    let handled = || async {
        metric_sum(&replicas, "fleetgate_prefix_share_published_total").await
            + metric_sum(&replicas, "fleetgate_prefix_share_dropped_total").await
    };
    proxy.set(Fault::Slow(Duration::from_millis(300)));
    let before = handled().await;
    converse(&replicas, &sims, &key, 5, 2, Redis::Faulty).await;
    converse(&replicas, &sims, &key, 6, 1, Redis::Faulty).await;
    proxy.set(Fault::None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while handled().await < before + 6.0 {
        assert!(
            Instant::now() < deadline,
            "the slow records were never sent"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let sent = metric_sum(&replicas, "fleetgate_prefix_share_published_total").await - published;
    assert_eq!(sent, 6.0, "a slow Redis loses no record");
    while metric_sum(&replicas, RECEIVED).await < received + 2.0 * sent {
        assert!(Instant::now() < deadline, "the slow records never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    all_say("shared").await;
    shared_again(7).await;
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each backend's prompt tokens the other replicas sent and that have no first token yet
/// (`others_prefill_pending_tokens` in `GET /admin/backends`), by backend URL.
async fn others_pending(r: &Replica) -> HashMap<String, u64> {
    let (status, body) = admin_call(r, "GET", "/admin/backends", None).await;
    assert_eq!(status, 200, "{body}");
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["backend"].as_str().unwrap().to_owned(),
                b["others_prefill_pending_tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Replica `r` counts none of the other replicas' prompts as waiting, within 10 s (`when`
/// says when in the test).
async fn nothing_counted(r: &Replica, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts = others_pending(r).await;
        if counts.values().all(|t| *t == 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "prefills still counted {when}: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the other replicas sent and is still being prefilled counts where it waits: a prompt
/// whose first token has not come (the sims hold every first token 3 s) makes its backend the
/// worse choice for a new conversation sharing only its system prompt, on a replica that did
/// not send it. Nothing of it stays counted: not once Redis stops answering (the count that
/// would take it back cannot arrive), nor once it has its first token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_another_replica_sent_and_not_yet_prefilled_count_where_they_wait() {
    let Some(db) = pg_database("multi_replica_pending").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_pending").await else {
        return;
    };
    let mut sims = Vec::new();
    for _ in 0..2 {
        sims.push(sim(|a| a.stall_first_token_ms = 3000.0).await);
    }
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = ["{}", "{}"]
max_in_flight_per_backend = 0

[pools.affinity]
by = "longest_prefix"
block_bytes = 64
"#,
        urls[0], urls[1]
    );
    let upstream: std::net::SocketAddr = redis
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|_| "127.0.0.1:6379".parse().unwrap());
    let proxy = Faulty::start(0, upstream).await;
    let dir = temp_dir("multi-replica-pending");
    let redis_via_proxy = format!("redis://127.0.0.1:{}", proxy.port);
    let replicas = start_replicas(&db.url, &redis_via_proxy, &dir, &pools).await;
    let key = issue_key_on(&replicas[0], "agent", "prod").await;
    prefix_index_is(&replicas, "shared").await;
    let system = "You are a coding agent. Read, plan, edit, test. ".repeat(12);
    let send = |r: usize, user: &str| {
        let url = replicas[r].url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let body = serde_json::json!({
            "model": "qwen32b", "max_tokens": 2, "stream": true,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        })
        .to_string();
        tokio::spawn(async move { post(&url, &[("authorization", &auth)], body).await })
    };
    let served = || -> Vec<u64> {
        sims.iter()
            .map(|s| s.stats().requests.load(std::sync::atomic::Ordering::SeqCst))
            .collect()
    };
    // Conversation A on replica 0: its prompt waits 3 s for its first token.
    let a = send(
        0,
        &"Conversation A: fix the parser and its tests. ".repeat(8),
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let (a_at, a_backend) = loop {
        let counts = others_pending(&replicas[1]).await;
        if let Some((url, _)) = counts.iter().find(|(_, t)| **t > 0) {
            let at = urls
                .iter()
                .position(|u| u.trim_end_matches('/') == url.trim_end_matches('/'))
                .unwrap();
            break (at, url.clone());
        }
        assert!(
            Instant::now() < deadline,
            "replica 1 never learnt of A's prompt waiting: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(served()[a_at], 1, "A is where replica 1 says it waits");
    // Conversation B on replica 1 shares A's system prompt, which replica 1 knows A's backend
    // was sent: without A's prefill counted there, B would follow it.
    let b = send(1, "Conversation B: rename the module.");
    let deadline = Instant::now() + Duration::from_secs(5);
    while served().iter().sum::<u64>() < 2 {
        assert!(Instant::now() < deadline, "B never reached a backend");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        served()[a_at],
        1,
        "B went behind A's prefill on {a_backend}: {:?}",
        served()
    );
    // Redis stops answering while A still waits: replica 1 can no longer hear it end, and
    // forgets what replica 0 said rather than keep A's backend counted busy.
    proxy.set(Fault::Paused);
    nothing_counted(&replicas[1], "while Redis does not answer").await;
    assert_eq!(a.await.unwrap().status, 200);
    assert_eq!(b.await.unwrap().status, 200);
    proxy.set(Fault::None);
    prefix_index_is(&replicas, "shared").await;
    // Both have their first token: nothing stays counted, on any replica.
    for r in &replicas {
        nothing_counted(r, "after their first tokens").await;
    }
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}
