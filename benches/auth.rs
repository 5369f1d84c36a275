//! Key-check cost on the request path, the timing of refusals, and revocation propagation
//! between two gateways.
//!
//!   cargo bench --bench auth [-- --keys 10000 --iterations 1000000 --revocations 200]
//!
//! Part 1 times `Authenticator::authenticate` (header parse, checksum, snapshot lookup,
//! SHA-256 and constant-time compare, revocation/expiry checks) with a snapshot of many keys.
//! Part 2 sends paced, interleaved refusals through a real gateway: an unknown public id
//! against a known id with a wrong secret, p50/p90 of each, without and with the
//! `auth.failure_delay_ms` floor (`--timing-pairs 200 --timing-pace-ms 25`).
//! Part 3 starts two gateways on one store (PostgreSQL from FLEETGATE_TEST_PG or the local
//! server, and the embedded SQLite file), revokes keys through one and measures how long the
//! other takes to refuse them (its snapshot shows the revocation).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use fleetgate_gateway::auth::Authenticator;
use fleetgate_gateway::config::{AuthConfig, Config, DatabaseConfig, PoolConfig};
use fleetgate_gateway::key::{self, Environment};
use fleetgate_gateway::server::Server;
use fleetgate_gateway::store::{CreateKey, KeyStore};
use fleetgate_gateway::telemetry::Recorder;
use http::{HeaderMap, HeaderValue};

use common::{ThrowawayPg, arg, key_record as record};

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i]
}

async fn key_check(n_keys: usize, iterations: usize) {
    let dir = std::env::temp_dir().join(format!("fleetgate-bench-auth-{}", std::process::id()));
    let db = DatabaseConfig {
        sqlite_path: dir.join("keys.db"),
        ..DatabaseConfig::default()
    };
    let store = KeyStore::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let mut keys = Vec::with_capacity(n_keys);
    let mut texts = Vec::with_capacity(n_keys);
    for _ in 0..n_keys {
        let k = key::generate(Environment::Prod, None);
        keys.push(record(&k.public_id, k.secret_hash));
        texts.push(k.full);
    }
    let registry = prometheus::Registry::new();
    let auth = Authenticator::new(store, AuthConfig::default(), keys, &registry).unwrap();
    let headers: Vec<HeaderMap> = texts
        .iter()
        .take(1024)
        .map(|t| {
            let mut h = HeaderMap::new();
            h.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
            );
            h
        })
        .collect();
    let peer = IpAddr::V4(Ipv4Addr::LOCALHOST);
    // Warm up, then time batches to get a distribution of per-check cost.
    for h in &headers {
        auth.authenticate(h, peer, Instant::now()).await.unwrap();
    }
    let batch = 1000;
    let mut per_check_ns = Vec::new();
    let start = Instant::now();
    let mut done = 0;
    while done < iterations {
        let t = Instant::now();
        for i in 0..batch {
            let h = &headers[(done + i) % headers.len()];
            std::hint::black_box(auth.authenticate(h, peer, Instant::now()).await.unwrap());
        }
        per_check_ns.push(t.elapsed().as_nanos() as f64 / batch as f64);
        done += batch;
    }
    let total = start.elapsed();
    println!("## Key check on the request path ({n_keys} keys in the snapshot)\n");
    println!("| measure | value |\n|---|---|");
    println!("| checks | {done} |");
    println!(
        "| mean per check | {:.0} ns |",
        total.as_nanos() as f64 / done as f64
    );
    println!(
        "| p50 of 1000-check batches | {:.0} ns |",
        pct(&mut per_check_ns, 50.0)
    );
    println!(
        "| p99 of 1000-check batches | {:.0} ns |",
        pct(&mut per_check_ns, 99.0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cost of recording one finished streamed request: Timeline derivations and the
/// Prometheus observations done when its record drops (log events off).
fn record_cost(iterations: usize) {
    use fleetgate_gateway::telemetry::metrics::RequestMetrics;
    use fleetgate_gateway::telemetry::{Recorder, RequestRecord};
    let pools = fleetgate_gateway::pool::Generation::new(
        &[PoolConfig::new(
            "m",
            vec!["http://127.0.0.1:9".parse().unwrap()],
        )],
        &fleetgate_gateway::config::QueueConfig::default(),
    )
    .unwrap();
    let registry = prometheus::Registry::new();
    let mut recorder = Recorder::new(false);
    recorder.set_metrics(std::sync::Arc::new(
        RequestMetrics::new(&registry, &pools).unwrap(),
    ));
    let recorder = std::sync::Arc::new(recorder);
    let t0 = Instant::now();
    let timeline = common::streamed_timeline(t0);
    let start = Instant::now();
    for _ in 0..iterations {
        let mut r = RequestRecord::new(t0, HeaderValue::from_static("req-1"), recorder.clone());
        r.timeline = timeline.clone();
        r.key = None;
        r.pool_metrics_index = Some(0);
        r.backend_metrics_index = Some(0);
        r.status = 200;
        drop(std::hint::black_box(r));
    }
    let per = start.elapsed().as_nanos() as f64 / iterations as f64;
    println!("\n## Recording a finished request (metrics on, log event off)\n");
    println!("| measure | value |\n|---|---|");
    println!("| records | {iterations} |");
    println!("| mean per record (creating, filling and dropping it) | {per:.0} ns |");
}

async fn start_gateway(db: &DatabaseConfig) -> Server {
    start_gateway_with(db, |_| {}).await
}

async fn start_gateway_with(db: &DatabaseConfig, f: impl FnOnce(&mut Config)) -> Server {
    let mut config = Config::with_pools(vec![PoolConfig::new(
        "m",
        vec!["http://127.0.0.1:9".parse().unwrap()],
    )]);
    config.database = db.clone();
    config.admin.listen = None;
    config.server.request_log_events = false;
    config.server.health_interval = Duration::from_secs(3600);
    f(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Server::start_on(listener, &config, Recorder::new(false))
        .await
        .unwrap()
}

async fn propagation(name: &str, db: DatabaseConfig, n: usize) {
    let a = start_gateway(&db).await;
    let b = start_gateway(&db).await;
    let mut ms = Vec::with_capacity(n);
    for i in 0..n {
        let (_, rec) = a
            .auth
            .store()
            .create(
                &CreateKey {
                    name: format!("p{i}"),
                    environment: Some(Environment::Stress),
                    ..CreateKey::default()
                },
                "bench",
            )
            .await
            .unwrap();
        let id = rec.public_id.to_string();
        // B must know the key first, so only the revocation is timed.
        let wait = Instant::now();
        while b.auth.cached(&id).is_none() {
            assert!(
                wait.elapsed() < Duration::from_secs(10),
                "B never saw the new key"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let t0 = Instant::now();
        a.auth.store().revoke(&id, "bench", "bench").await.unwrap();
        while b.auth.cached(&id).is_none_or(|r| r.revoked_at.is_none()) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "B never saw the revocation"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let mean = ms.iter().sum::<f64>() / ms.len() as f64;
    println!(
        "| {name} | {n} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms |",
        pct(&mut ms, 50.0),
        pct(&mut ms, 99.0),
        ms.last().copied().unwrap_or(0.0),
        mean
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Paced, interleaved refusals through a real gateway: a well-formed key whose public id does
/// not exist (a new one each time, so the store is asked within its lookup budget) against the
/// gateway's own public id with a wrong secret. Prints one table row: p50 and p90 of each as
/// the client sees them, and how many lookups reached the store.
async fn refusal_timing(name: &str, pairs: usize, pace: Duration, f: impl FnOnce(&mut Config)) {
    let dir = std::env::temp_dir().join(format!(
        "fleetgate-bench-timing-{}-{}",
        std::process::id(),
        name.len()
    ));
    let db = DatabaseConfig {
        sqlite_path: dir.join("keys.db"),
        ..DatabaseConfig::default()
    };
    let gw = start_gateway_with(&db, |c| {
        // Every refusal here is a measurement, none a reason to throttle.
        c.auth.failures_per_minute = 1_000_000;
        c.server.workers = 1;
        f(c);
    })
    .await;
    let (_, rec) = gw
        .auth
        .store()
        .create(
            &CreateKey {
                name: "timing".into(),
                environment: Some(Environment::Prod),
                ..CreateKey::default()
            },
            "bench",
        )
        .await
        .unwrap();
    gw.auth.apply(&rec.public_id, Some(rec.clone()));
    let wrong_secret = key::generate(Environment::Prod, Some(&rec.public_id)).full;
    let uri: http::Uri = format!("http://{}/v1/chat/completions", gw.local_addr)
        .parse()
        .unwrap();
    let client = fleetgate_protocol::client::http_client();
    let body = fleetgate_protocol::client::chat_body("m", "hi", 1, false);
    let send = async |key: &str| {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
        );
        let t = Instant::now();
        let m = fleetgate_protocol::client::send(&client, &uri, &h, body.clone(), false)
            .await
            .unwrap();
        assert_eq!(m.status, 401);
        t.elapsed().as_secs_f64() * 1e6
    };
    // Warm the connection and both paths.
    send(&wrong_secret).await;
    send(&key::generate(Environment::Prod, None).full).await;
    let lookups_before = gw.auth.db_lookups();
    let (mut unknown_us, mut wrong_us) = (Vec::new(), Vec::new());
    for i in 0..pairs {
        let unknown = key::generate(Environment::Prod, None).full;
        // Alternate which goes first, so neither always follows the other.
        if i % 2 == 0 {
            unknown_us.push(send(&unknown).await);
            tokio::time::sleep(pace).await;
            wrong_us.push(send(&wrong_secret).await);
        } else {
            wrong_us.push(send(&wrong_secret).await);
            tokio::time::sleep(pace).await;
            unknown_us.push(send(&unknown).await);
        }
        tokio::time::sleep(pace).await;
    }
    let lookups = gw.auth.db_lookups() - lookups_before;
    let (u50, w50) = (pct(&mut unknown_us, 50.0), pct(&mut wrong_us, 50.0));
    println!(
        "| {name} | {pairs} | {u50:.0} µs | {:.0} µs | {w50:.0} µs | {:.0} µs | {:+.0} µs | {lookups} |",
        pct(&mut unknown_us, 90.0),
        pct(&mut wrong_us, 90.0),
        u50 - w50,
    );
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n_keys = arg("--keys", 10_000);
    let iterations = arg("--iterations", 1_000_000);
    let revocations = arg("--revocations", 200);
    let pairs = arg("--timing-pairs", 200);
    let pace = Duration::from_millis(arg("--timing-pace-ms", 25) as u64);
    key_check(n_keys, iterations).await;
    record_cost(iterations);

    println!(
        "\n## Refusal timing: unknown public id vs known id with a wrong secret ({} ms apart, interleaved)\n",
        pace.as_millis()
    );
    println!(
        "| gateway | pairs | unknown p50 | unknown p90 | wrong secret p50 | wrong secret p90 | p50 difference | store lookups |\n|---|---|---|---|---|---|---|---|"
    );
    refusal_timing("`failure_delay_ms = 0` (no floor)", pairs, pace, |c| {
        c.auth.failure_delay = Duration::ZERO;
        c.auth.throttle_delay = Duration::ZERO;
    })
    .await;
    refusal_timing("`failure_delay_ms = 100` (default)", pairs, pace, |_| {}).await;

    println!("\n## Revocation propagation: revoked through gateway A, refused by gateway B\n");
    println!("| store | revocations | p50 | p99 | max | mean |\n|---|---|---|---|---|---|");
    match ThrowawayPg::create("auth").await {
        Ok(pg) => {
            propagation("PostgreSQL (LISTEN/NOTIFY)", pg.config.clone(), revocations).await;
            pg.drop_database().await;
        }
        Err(e) => println!("| PostgreSQL | skipped: {e} | | | | |"),
    }
    let dir = std::env::temp_dir().join(format!("fleetgate-bench-prop-{}", std::process::id()));
    propagation(
        "SQLite (change counter, 250 ms poll)",
        DatabaseConfig {
            sqlite_path: dir.join("keys.db"),
            ..DatabaseConfig::default()
        },
        (revocations / 4).max(10),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
