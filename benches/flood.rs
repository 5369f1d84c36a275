//! Does a load test hurt production? A stress key floods the gateway at a multiple of the
//! fleet's capacity while a prod key sends steady traffic; prod's TTFT is compared with a run
//! without the flood, measured in the same process against the same simulated fleet.
//!
//!   cargo bench --bench flood [-- --secs 30 --prod-rps 2 --flood-factor 5]
//!
//! The fleet: one simulated vLLM with realistic timing (16 sequences at once, 15 ms decode
//! step + 0.3 ms per running sequence, 20 µs prefill per prompt token), requests of 48 output
//! tokens; the gateway caps the backend at its 16 sequences. Phases, each `--secs` long:
//!   1. prod alone;
//!   2. prod + stress using exactly its permitted share (12 requests back to back; stress may
//!      hold at most 12 of the 16 slots: `limits.stress.aggregate_max_concurrent`);
//!   3. prod + a stress flood at `--flood-factor` × capacity, with that cap (stress waits at
//!      most 2 s in the queue);
//!   4. prod + the same flood without the cap: the queue alone orders prod before stress, but
//!      stress holds the slots prod would need;
//!   5. prod alone again (noise check: phases 1 and 5 should agree).
//!
//! The goal compares 3 with 2: the flood's excess must cost prod nothing beyond what stress's
//! permitted load costs it. The gateway's records split prod's TTFT into the backend's own
//! (upstream TTFT), queue wait and the gateway's overhead.
//!
//! Prints a markdown table and writes bench-out/flood-latest.json.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fleetgate_gateway::config::{Config, EnvLimits, PoolConfig, ServerConfig};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::server::Server;
use fleetgate_gateway::store::CreateKey;
use fleetgate_gateway::telemetry::Recorder;
use fleetgate_protocol::client::{self, HttpClient};
use fleetgate_sim::SimArgs;
use http::{HeaderMap, HeaderValue, Uri};
use serde_json::{Value, json};

use common::arg;

const SEQS: u32 = 16;
const STRESS_SLOTS: u32 = 12;
const OUTPUT_TOKENS: u32 = 48;

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i]
}

/// What the gateway recorded of each prod request: upstream TTFT (the backend's own), queue
/// wait and the gateway's own overhead, in ms.
type ProdSeen = Arc<Mutex<Vec<(f64, f64, f64)>>>;

async fn gateway(
    sim_url: &str,
    stress_cap: Option<u32>,
    dir: &std::path::Path,
    seen: ProdSeen,
) -> Server {
    let mut p = PoolConfig::new("qwen32b", vec![sim_url.parse().unwrap()]);
    p.max_in_flight_per_backend = SEQS;
    let mut c = Config::with_pools(vec![p]);
    c.server = ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        request_log_events: false,
        ..ServerConfig::default()
    };
    c.admin.listen = None;
    c.request_log.enabled = false;
    c.database.sqlite_path = dir.join("keys.db");
    c.queue.max_size = 4096;
    c.queue.max_per_key = 4096;
    c.queue.max_wait[Environment::Stress.index()] = Duration::from_secs(2);
    c.limits.environments[Environment::Stress.index()] = EnvLimits {
        aggregate_max_concurrent: stress_cap,
        ..EnvLimits::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let recorder = Recorder::new(false).with_observer(move |r| {
        let t = &r.timeline;
        if r.key.as_ref().map(|k| k.environment) == Some(Environment::Prod)
            && let (Some(up), Some(oh)) = (t.upstream_ttft(), t.overhead_total())
        {
            seen.lock().unwrap().push((
                up.as_secs_f64() * 1e3,
                t.queue_wait().as_secs_f64() * 1e3,
                oh.as_secs_f64() * 1e3,
            ));
        }
    });
    Server::start_on(listener, &c, recorder).await.unwrap()
}

async fn key(server: &Server, env: Environment) -> String {
    let (secret, record) = server
        .auth
        .store()
        .create(
            &CreateKey {
                name: format!("flood bench {env}"),
                environment: Some(env),
                ..CreateKey::default()
            },
            "bench",
        )
        .await
        .unwrap();
    server.auth.apply(&record.public_id, Some(record.clone()));
    secret
}

#[derive(Default)]
struct Outcomes {
    prod_ttft_ms: Vec<f64>,
    /// The gateway's records of the same prod requests: (upstream TTFT, queue wait, overhead).
    prod_seen: Vec<(f64, f64, f64)>,
    prod_failed: usize,
    stress_ttft_ms: Vec<f64>,
    /// Status (and error code) → count.
    stress: BTreeMap<String, usize>,
}

fn headers(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
    );
    h
}

/// Send `rate` requests per second for `secs`, open loop (a late answer never delays the
/// next request), recording each outcome with `record`.
async fn open_loop(
    client: HttpClient,
    uri: Uri,
    h: HeaderMap,
    body: Bytes,
    rate: f64,
    secs: f64,
    record: impl Fn(&client::Measured) + Send + Sync + 'static,
) {
    let record = Arc::new(record);
    let n = (rate * secs).round() as usize;
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let (client, uri, h, body, record) = (
            client.clone(),
            uri.clone(),
            h.clone(),
            body.clone(),
            record.clone(),
        );
        tasks.push(tokio::spawn(async move {
            if let Ok(m) = client::send(&client, &uri, &h, body, true).await {
                record(&m);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// `workers` requests at a time, back to back, for `secs`.
async fn closed_loop(
    client: HttpClient,
    uri: Uri,
    h: HeaderMap,
    body: Bytes,
    workers: u32,
    secs: f64,
    record: impl Fn(&client::Measured) + Send + Sync + 'static,
) {
    let record = Arc::new(record);
    let end = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (client, uri, h, body, record) = (
            client.clone(),
            uri.clone(),
            h.clone(),
            body.clone(),
            record.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < end {
                if let Ok(m) = client::send(&client, &uri, &h, body.clone(), true).await {
                    record(&m);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// How stress loads the fleet in a phase.
#[derive(Clone, Copy)]
enum Stress {
    None,
    /// Exactly its permitted share, back to back.
    Share(u32),
    /// Open loop at this many requests per second.
    Flood(f64),
}

async fn phase(
    server: &Server,
    seen: &ProdSeen,
    prod_key: &str,
    stress_key: &str,
    prod_rps: f64,
    load: Stress,
    secs: f64,
) -> Outcomes {
    seen.lock().unwrap().clear();
    let out = Arc::new(Mutex::new(Outcomes::default()));
    let uri: Uri = format!("http://{}/v1/chat/completions", server.local_addr)
        .parse()
        .unwrap();
    let prompt =
        "Summarise the history of the printing press in three sentences, please. ".repeat(6);
    let body = client::chat_body("qwen32b", &prompt, OUTPUT_TOKENS, true);
    let o = out.clone();
    let prod = open_loop(
        client::http_client(),
        uri.clone(),
        headers(prod_key),
        body.clone(),
        prod_rps,
        secs,
        move |m| {
            let mut o = o.lock().unwrap();
            match (m.status, m.metrics.first_content) {
                (200, Some(t)) if !m.metrics.error => o.prod_ttft_ms.push(t.as_secs_f64() * 1e3),
                _ => o.prod_failed += 1,
            }
        },
    );
    let o = out.clone();
    let record_stress = move |m: &client::Measured| {
        let mut o = o.lock().unwrap();
        let label = if m.status == 200 {
            if let Some(t) = m.metrics.first_content {
                o.stress_ttft_ms.push(t.as_secs_f64() * 1e3);
            }
            "200".to_owned()
        } else {
            let code = m
                .body
                .as_ref()
                .and_then(|b| serde_json::from_slice::<Value>(b).ok())
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
                .unwrap_or_default();
            format!("{} {code}", m.status)
        };
        *o.stress.entry(label).or_default() += 1;
    };
    let stress = async {
        match load {
            Stress::None => {}
            Stress::Share(n) => {
                closed_loop(
                    client::http_client(),
                    uri.clone(),
                    headers(stress_key),
                    body.clone(),
                    n,
                    secs,
                    record_stress,
                )
                .await;
            }
            Stress::Flood(rps) => {
                open_loop(
                    client::http_client(),
                    uri.clone(),
                    headers(stress_key),
                    body.clone(),
                    rps,
                    secs,
                    record_stress,
                )
                .await;
            }
        }
    };
    tokio::join!(prod, stress);
    let mut o = Arc::try_unwrap(out)
        .ok()
        .expect("all requests done")
        .into_inner()
        .unwrap();
    o.prod_seen = std::mem::take(&mut *seen.lock().unwrap());
    o
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let secs = arg("--secs", 30) as f64;
    let prod_rps = arg("--prod-rps", 2) as f64;
    let factor = arg("--flood-factor", 5) as f64;
    let dir = std::env::temp_dir().join(format!("fleetgate-bench-flood-{}", std::process::id()));
    let sim = fleetgate_sim::start(SimArgs {
        port: 0,
        max_num_seqs: SEQS,
        decode_step_ms: 15.0,
        decode_ms_per_seq: 0.3,
        prefill_us_per_token: 20.0,
        ..SimArgs::default()
    })
    .await
    .unwrap();
    // Capacity: SEQS sequences, each OUTPUT_TOKENS steps of (15 + 0.3 × SEQS) ms.
    let service_s = f64::from(OUTPUT_TOKENS) * (15.0 + 0.3 * f64::from(SEQS)) / 1e3;
    let capacity_rps = f64::from(SEQS) / service_s;
    let flood_rps = factor * capacity_rps;

    let seen_a: ProdSeen = Arc::default();
    let seen_b: ProdSeen = Arc::default();
    let protected = gateway(
        &sim.url(),
        Some(STRESS_SLOTS),
        &dir.join("a"),
        seen_a.clone(),
    )
    .await;
    let open = gateway(&sim.url(), None, &dir.join("b"), seen_b.clone()).await;
    let keys_a = (
        key(&protected, Environment::Prod).await,
        key(&protected, Environment::Stress).await,
    );
    let keys_b = (
        key(&open, Environment::Prod).await,
        key(&open, Environment::Stress).await,
    );
    println!(
        "## Prod under a stress flood\n\nfleet: 1 sim, {SEQS} sequences, {OUTPUT_TOKENS}-token streams ≈ {capacity_rps:.1} req/s capacity; prod {prod_rps} req/s; flood {flood_rps:.0} req/s ({factor}× capacity); {secs} s per phase\n"
    );
    let t0 = Instant::now();
    let mut results: Vec<(&str, Outcomes)> = Vec::new();
    for (name, server, seen, keys, load) in [
        ("1. prod alone", &protected, &seen_a, &keys_a, Stress::None),
        (
            "2. prod + stress at its permitted 12 slots",
            &protected,
            &seen_a,
            &keys_a,
            Stress::Share(STRESS_SLOTS),
        ),
        (
            "3. prod + 5× flood, stress capped at 12/16",
            &protected,
            &seen_a,
            &keys_a,
            Stress::Flood(flood_rps),
        ),
        (
            "4. prod + 5× flood, queue priority only",
            &open,
            &seen_b,
            &keys_b,
            Stress::Flood(flood_rps),
        ),
        (
            "5. prod alone again",
            &protected,
            &seen_a,
            &keys_a,
            Stress::None,
        ),
    ] {
        // Let the previous phase's streams drain.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let o = phase(server, seen, &keys.0, &keys.1, prod_rps, load, secs).await;
        results.push((name, o));
    }
    println!(
        "| phase | prod n | prod TTFT p50 | prod TTFT p99 | of which backend (upstream TTFT) p50 / p99 | prod queue wait p99 | gateway overhead p50 | prod failed | stress outcomes | stress TTFT p50 / p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut json_phases = Vec::new();
    for (name, o) in &results {
        let stress: Vec<String> = o.stress.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let up: Vec<f64> = o.prod_seen.iter().map(|s| s.0).collect();
        let queue: Vec<f64> = o.prod_seen.iter().map(|s| s.1).collect();
        let overhead: Vec<f64> = o.prod_seen.iter().map(|s| s.2 * 1e3).collect();
        println!(
            "| {name} | {} | {:.1} ms | {:.1} ms | {:.1} / {:.1} ms | {:.2} ms | {:.0} µs | {} | {} | {:.0} / {:.0} ms |",
            o.prod_ttft_ms.len(),
            pct(&o.prod_ttft_ms, 50.0),
            pct(&o.prod_ttft_ms, 99.0),
            pct(&up, 50.0),
            pct(&up, 99.0),
            pct(&queue, 99.0),
            pct(&overhead, 50.0),
            o.prod_failed,
            if stress.is_empty() {
                "-".to_owned()
            } else {
                stress.join(", ")
            },
            pct(&o.stress_ttft_ms, 50.0),
            pct(&o.stress_ttft_ms, 99.0),
        );
        json_phases.push(json!({
            "phase": name,
            "prod_n": o.prod_ttft_ms.len(),
            "prod_ttft_p50_ms": pct(&o.prod_ttft_ms, 50.0),
            "prod_ttft_p99_ms": pct(&o.prod_ttft_ms, 99.0),
            "prod_failed": o.prod_failed,
            "prod_upstream_ttft_p50_ms": pct(&up, 50.0),
            "prod_upstream_ttft_p99_ms": pct(&up, 99.0),
            "prod_queue_wait_p99_ms": pct(&queue, 99.0),
            "prod_gateway_overhead_p50_us": pct(&overhead, 50.0),
            "stress": o.stress,
            "stress_ttft_p50_ms": pct(&o.stress_ttft_ms, 50.0),
            "stress_ttft_p99_ms": pct(&o.stress_ttft_ms, 99.0),
        }));
    }
    let p99 = |i: usize| pct(&results[i].1.prod_ttft_ms, 99.0);
    let ratio = p99(2) / p99(1);
    let vs_alone = p99(2) / p99(0);
    println!(
        "\nprod p99 TTFT, capped 5× flood / stress at its permitted share: {ratio:.3} (goal ≤ 1.10: {}); / prod alone: {vs_alone:.3}; run took {:.0} s",
        if ratio <= 1.10 { "met" } else { "NOT met" },
        t0.elapsed().as_secs_f64()
    );
    let _ = std::fs::create_dir_all("bench-out");
    let report = json!({
        "capacity_rps": capacity_rps,
        "prod_rps": prod_rps,
        "flood_rps": flood_rps,
        "secs_per_phase": secs,
        "phases": json_phases,
        "prod_p99_ratio_flood_over_permitted_share": ratio,
        "prod_p99_ratio_flood_over_prod_alone": vs_alone,
    });
    std::fs::write(
        "bench-out/flood-latest.json",
        serde_json::to_vec_pretty(&report).unwrap(),
    )
    .unwrap();
    protected.shutdown().await;
    open.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
