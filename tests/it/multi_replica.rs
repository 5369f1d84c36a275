//! Several replicas on one machine: three `fleetgate serve` processes on their own ports, one
//! PostgreSQL database (keys, request log), one Redis (limits), one simulated backend. A key
//! created on one replica works on all, a revocation on one is refused by all within a second,
//! a rate limit is one limit across replicas, the request log holds every replica's rows, and
//! killing one replica mid-stream cuts only that replica's streams.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use fleetgate_gateway::admin::jwt::Role;

const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");
const REPLICAS: usize = 3;

/// A gateway process, killed if the test ends early.
struct Replica {
    child: Option<Child>,
    port: u16,
    admin_port: u16,
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Replica {
    fn url(&self, path: &str) -> http::Uri {
        format!("http://127.0.0.1:{}{path}", self.port)
            .parse()
            .unwrap()
    }
}

async fn wait_ready(port: u16) {
    wait_for_200(&format!("http://127.0.0.1:{port}/readyz")).await;
}

/// `(status, body)` of an admin call on one replica.
async fn admin_call(
    r: &Replica,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let c = fleetgate_protocol::client::http_client();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{}{path}", r.admin_port))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", token(Role::Admin)))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or_default())
}

/// Every replica's `redis.prefix_index` in `GET /admin/ready` is `want` ("shared" or
/// "local"), within 10 s.
async fn prefix_index_is(replicas: &[Replica], want: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut states = Vec::new();
        for r in replicas {
            let (_, ready) = admin_call(r, "GET", "/admin/ready", None).await;
            states.push(
                ready["redis"]["prefix_index"]
                    .as_str()
                    .unwrap_or("?")
                    .to_owned(),
            );
        }
        if states.iter().all(|s| s == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the replicas' prefix index should be {want}: {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The sum over the replicas of one metric's value (an unlabelled series).
async fn metric_sum(replicas: &[Replica], name: &str) -> f64 {
    use http_body_util::BodyExt;
    let mut sum = 0.0;
    for r in replicas {
        let req = http::Request::builder()
            .uri(format!("http://127.0.0.1:{}/metrics", r.admin_port))
            .header("authorization", format!("Bearer {}", token(Role::Admin)))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let resp = fleetgate_protocol::client::http_client()
            .request(req)
            .await
            .unwrap();
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        sum += String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(0.0);
    }
    sum
}

async fn chat(r: &Replica, key: &str, max_tokens: u32) -> fleetgate_protocol::client::Measured {
    post(
        &r.url("/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key}"))],
        fleetgate_protocol::client::chat_body("qwen32b", "hi", max_tokens, true),
    )
    .await
}

/// `REPLICAS` gateway processes on one PostgreSQL database and one Redis (a key prefix of
/// their own), each serving `pools` (TOML), ready when this returns.
async fn start_replicas(db: &str, redis: &str, dir: &std::path::Path, pools: &str) -> Vec<Replica> {
    std::fs::create_dir_all(dir).unwrap();
    let prefix = format!("fg-multi-{}-{}:", std::process::id(), fastrand_suffix());
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let port = closed_port().await.port();
        let admin_port = closed_port().await.port();
        let cfg = dir.join(format!("replica-{i}.toml"));
        std::fs::write(
            &cfg,
            format!(
                r#"[server]
listen = "127.0.0.1:{port}"
shutdown_grace_seconds = 1
health_interval_ms = 500
log_format = "json"
request_log_events = false

[database]
url = "{db}"
migrate_on_start = true

[admin]
listen = "127.0.0.1:{admin_port}"
jwt_secret = "{JWT_SECRET}"

[request_log]
flush_interval_ms = 100
spill_path = "{spill}"

[limits]
shared = "redis"

[limits.redis]
url = "{redis}"
replicas = {REPLICAS}
key_prefix = "{prefix}"

{pools}"#,
                spill = dir.join(format!("spill-{i}")).display(),
            ),
        )
        .unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        replicas.push(Replica {
            child: Some(child),
            port,
            admin_port,
        });
        // The first applies the migrations before the others start.
        if i == 0 {
            wait_ready(port).await;
        }
    }
    for r in &replicas {
        wait_ready(r.port).await;
    }
    replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_keys_limits_and_the_request_log() {
    let Some(db) = pg_database("multi_replica").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica").await else {
        return;
    };
    let sim = sim(|a| {
        a.decode_step_ms = 10.0;
        a.decode_ms_per_seq = 0.0;
    })
    .await;
    let dir = temp_dir("multi-replica");
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = ["{sim}"]
max_in_flight_per_backend = 0
"#,
        sim = sim.url()
    );
    let mut replicas = start_replicas(&db.url, &redis, &dir, &pools).await;

    // 1. A key created on replica 0 works on every replica at once.
    let (s, created) = admin_call(
        &replicas[0],
        "POST",
        "/admin/keys",
        Some(serde_json::json!({"name": "shared", "environment": "prod"})),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    let key = created["key"].as_str().unwrap().to_owned();
    let id = created["record"]["public_id"].as_str().unwrap().to_owned();
    for (i, r) in replicas.iter().enumerate() {
        assert_eq!(chat(r, &key, 2).await.status, 200, "replica {i}");
    }

    // 2. One rate limit across replicas: 12 requests a minute (a minute's burst), asked for
    //    round robin on all three: exactly 12 pass.
    let (s, limited) = admin_call(
        &replicas[1],
        "POST",
        "/admin/keys",
        Some(serde_json::json!({"name": "limited", "environment": "stress", "requests_per_minute": 12})),
    )
    .await;
    assert_eq!(s, 201, "{limited}");
    let limited = limited["key"].as_str().unwrap().to_owned();
    let start = Instant::now();
    let mut ok_by_replica = [0u32; REPLICAS];
    let mut refused = 0;
    for n in 0..18 {
        let m = chat(&replicas[n % REPLICAS], &limited, 1).await;
        match m.status {
            200 => ok_by_replica[n % REPLICAS] += 1,
            429 => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    // The limit refills one request every 5 s: a run this short gets no refill.
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(
        ok_by_replica.iter().sum::<u32>(),
        12,
        "{ok_by_replica:?}: one shared limit"
    );
    assert_eq!(refused, 6);
    assert!(ok_by_replica.iter().all(|n| *n > 0), "{ok_by_replica:?}");

    // 3. Long streams on every replica; replica 2 is killed mid-stream. Only its streams are
    //    cut; the others finish whole.
    let mut streams = Vec::new();
    for (i, r) in replicas.iter().enumerate() {
        for _ in 0..2 {
            let (uri, key) = (r.url("/v1/chat/completions"), key.clone());
            streams.push((
                i,
                tokio::spawn(async move {
                    let mut h = http::HeaderMap::new();
                    h.insert(
                        http::header::AUTHORIZATION,
                        format!("Bearer {key}").parse().unwrap(),
                    );
                    h.insert(
                        http::header::CONTENT_TYPE,
                        "application/json".parse().unwrap(),
                    );
                    // A stream of the replica killed before its head reached the client
                    // fails outright: `Err`.
                    fleetgate_protocol::client::send(
                        &fleetgate_protocol::client::http_client(),
                        &uri,
                        &h,
                        fleetgate_protocol::client::chat_body(
                            "qwen32b",
                            "a long answer",
                            100,
                            true,
                        ),
                        true,
                    )
                    .await
                }),
            ));
        }
    }
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 6)
        .await,
        "six streams running"
    );
    let victim = replicas[2].child.take().unwrap();
    let mut victim = victim;
    victim.kill().unwrap();
    let _ = victim.wait();
    for (i, s) in streams {
        let m = s.await.unwrap();
        if i == 2 {
            assert!(
                m.as_ref()
                    .map_or(true, |m| !m.metrics.done || m.body_error.is_some()),
                "a stream of the killed replica finished?"
            );
        } else {
            let m = m.expect("the other replicas' streams complete");
            assert_eq!(m.status, 200);
            assert!(
                m.metrics.done,
                "replica {i}'s stream was cut: {:?}",
                m.body_error
            );
            assert_eq!(m.metrics.content_events, 100, "replica {i}");
        }
    }

    // 4. A revocation on replica 1 is refused by the others within a second.
    let (s, _) = admin_call(
        &replicas[1],
        "POST",
        &format!("/admin/keys/{id}/revoke"),
        Some(serde_json::json!({"reason": "multi-replica test"})),
    )
    .await;
    assert_eq!(s, 200);
    let revoked_at = Instant::now();
    for (i, r) in replicas.iter().enumerate().take(2) {
        loop {
            let m = chat(r, &key, 1).await;
            if m.status == 401 {
                let e = openai_error(&m);
                assert_eq!(e["code"], "key_revoked", "replica {i}: {e}");
                break;
            }
            assert!(
                revoked_at.elapsed() < Duration::from_secs(1),
                "replica {i} still accepts the revoked key after 1 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // 5. The request log holds rows from every replica (request ids carry a per-process
    //    prefix). The survivors' rows all arrive: 1 + 6 + 2 streams + at least one 401 each.
    //    The killed replica's rows still in its writer's memory died with it (SIGKILL).
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut per_replica: Vec<(String, i64)> = Vec::new();
    for _ in 0..100 {
        per_replica = sqlx::query_as(
            "SELECT split_part(request_id, '-', 2), COUNT(*) FROM request_log GROUP BY 1 ORDER BY 2 DESC",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        if per_replica.len() == REPLICAS && per_replica[1].1 >= 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        per_replica.len(),
        REPLICAS,
        "rows from every replica: {per_replica:?}"
    );
    assert!(
        per_replica[1].1 >= 10,
        "the survivors' rows: {per_replica:?}"
    );
    drop(conn);
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}

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

/// A key of `env` issued through replica `r`'s admin API: its secret.
async fn issue_key_on(r: &Replica, name: &str, env: &str) -> String {
    let (s, created) = admin_call(
        r,
        "POST",
        "/admin/keys",
        Some(serde_json::json!({"name": name, "environment": env})),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    created["key"].as_str().unwrap().to_owned()
}

/// Three turns of agent conversation `conv`, each resending the whole history, turn t sent to
/// replica `(first + t) % REPLICAS` (as a Service spreads them): the sim that served each turn.
/// Every turn must be answered, and within 10 s (a replica waiting on a Redis that does not
/// answer would hang here).
async fn converse(
    replicas: &[Replica],
    sims: &[fleetgate_sim::SimServer],
    key: &str,
    conv: usize,
    first: usize,
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
        tokio::time::sleep(Duration::from_millis(50)).await;
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
        let backends = converse(&replicas, &sims, &key, conv, conv).await;
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
            let backends = converse(replicas, sims, key, conv, conv).await;
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
    converse(&replicas, &sims, &key, 1, 1).await;
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
    converse(&replicas, &sims, &key, 3, 0).await;
    all_say("local").await;
    proxy = Faulty::start(port, upstream).await;
    all_say("shared").await;
    shared_again(4).await;

    // Slow: every answer late (past the limits' timeout, within the prefix records' one
    // second). Turns are answered at once all the same; the records arrive late, and all of
    // them: once the last has crossed, sharing goes on.
    let received = metric_sum(&replicas, "fleetgate_prefix_share_received_total").await;
    let published = metric_sum(&replicas, "fleetgate_prefix_share_published_total").await;
    let handled = || async {
        metric_sum(&replicas, "fleetgate_prefix_share_published_total").await
            + metric_sum(&replicas, "fleetgate_prefix_share_dropped_total").await
    };
    proxy.set(Fault::Slow(Duration::from_millis(300)));
    let before = handled().await;
    converse(&replicas, &sims, &key, 5, 2).await;
    converse(&replicas, &sims, &key, 6, 1).await;
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
    while metric_sum(&replicas, "fleetgate_prefix_share_received_total").await
        < received + 2.0 * sent
    {
        assert!(Instant::now() < deadline, "the slow records never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    all_say("shared").await;
    shared_again(7).await;
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prod first across replicas: each replica may put `max_in_flight_per_backend` (the backend's
/// one seat here) on the backend, so the backend's own queue, ordered by `[pools.priority]`,
/// decides who goes next whichever replica sent what. A gray request holds the seat (through
/// replica 0), two gray requests wait at the backend (sent by replicas 1 and 2), a third waits in
/// replica 0's own queue, and then a prod request reaches replica 0, whose one place is taken:
/// it passes the gray request waiting there and the capacity, and the backend admits it before
/// every gray request that waited before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prod_goes_first_at_the_backend_whichever_replica_holds_the_seats() {
    use std::sync::atomic::Ordering::SeqCst;
    let Some(db) = pg_database("multi_replica_priority").await else {
        return;
    };
    let Some(redis) = redis_url("multi_replica_priority").await else {
        return;
    };
    let sim = sim(|a| {
        a.max_num_seqs = 1;
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.scheduling_policy = fleetgate_sim::SchedulingPolicy::Priority;
    })
    .await;
    let dir = temp_dir("multi-replica-priority");
    let pools = format!(
        r#"[[pools]]
model = "qwen32b"
backends = ["{sim}"]
max_in_flight_per_backend = 1

[pools.priority]
"#,
        sim = sim.url()
    );
    let replicas = start_replicas(&db.url, &redis, &dir, &pools).await;
    let gray = issue_key_on(&replicas[0], "gray", "gray").await;
    let prod = issue_key_on(&replicas[0], "prod", "prod").await;
    let stats = sim.stats().clone();
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // (name, replica, key, tokens, backend running + waiting once it is sent)
    for (name, replica, key, tokens, at_backend) in [
        ("gray-holder", 0, &gray, 300, Some(0)),
        ("gray-1", 1, &gray, 10, Some(1)),
        ("gray-2", 2, &gray, 10, Some(2)),
        ("gray-3", 0, &gray, 10, None),
        ("prod", 0, &prod, 10, Some(3)),
    ] {
        let url = replicas[replica].url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let done = done.clone();
        let body = serde_json::json!({"model": "qwen32b", "max_tokens": tokens, "stream": true,
                                      "messages": [{"role": "user", "content": "hi"}]});
        tasks.push(tokio::spawn(async move {
            let m = post(&url, &[("authorization", &auth)], body.to_string()).await;
            assert_eq!(m.status, 200, "{name}: {:?}", m.body);
            done.lock().unwrap().push(name);
        }));
        match at_backend {
            Some(waiting) => {
                let engine = stats.clone();
                assert!(
                    eventually(Duration::from_secs(10), || {
                        engine.running.load(SeqCst) == 1 && engine.waiting.load(SeqCst) == waiting
                    })
                    .await,
                    "{name} reached the backend"
                );
            }
            None => {
                // It waits in replica 0's queue: the backend sees nothing new.
                assert!(
                    eventually(Duration::from_secs(10), || {
                        let text = std::process::Command::new("curl")
                            .args(["-s", "-H"])
                            .arg(format!("authorization: Bearer {}", token(Role::Admin)))
                            .arg(format!(
                                "http://127.0.0.1:{}/metrics",
                                replicas[0].admin_port
                            ))
                            .output()
                            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                            .unwrap_or_default();
                        text.lines()
                            .any(|l| l.starts_with("fleetgate_queue_depth") && l.ends_with(" 1"))
                    })
                    .await,
                    "{name} waits in replica 0's queue"
                );
                assert_eq!(
                    stats.waiting.load(SeqCst),
                    2,
                    "{name} is not at the backend"
                );
            }
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *done.lock().unwrap(),
        ["gray-holder", "prod", "gray-1", "gray-2", "gray-3"],
        "the backend admitted prod before the gray requests that waited before it, wherever they waited"
    );
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}

fn fastrand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
