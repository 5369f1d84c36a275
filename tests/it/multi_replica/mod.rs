//! Several replicas on one machine: three `fleetgate serve` processes on their own ports, one
//! PostgreSQL database (keys, request log), one Redis (limits), one simulated backend. A key
//! created on one replica works on all, a revocation on one is refused by all within a second,
//! a rate limit is one limit across replicas, the request log holds every replica's rows, and
//! killing one replica mid-stream cuts only that replica's streams. Submodules: the prefix index
//! through Redis, prod first across replicas, and routing by the engines' KV events.

mod kv_events;
mod prefix_sharing;
mod priority;

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
    let mut sum = 0.0;
    for r in replicas {
        let uri = format!("http://127.0.0.1:{}/metrics", r.admin_port);
        let auth = format!("Bearer {}", token(Role::Admin));
        let (_, text) = get_body(&uri.parse().unwrap(), &[("authorization", &auth)]).await;
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
    // The answer names the key's id as the CLI does (`keys revoke <id>`).
    assert_eq!(created["id"], created["record"]["public_id"]);
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

fn fastrand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
