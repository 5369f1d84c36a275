//! Request-log cost: CPU per row at a steady rate, the request side alone, and the writer's
//! top throughput, into PostgreSQL and into SQLite.
//!
//!   cargo bench --bench telemetry [-- --rate 20000 --secs 5 --rows 200000]
//!
//! 1. **CPU per row at `--rate` rows/s** (paced for `--secs`): the process's CPU time
//!    (`getrusage`, user + system, every thread: the request side, the writer task, sqlx and
//!    SQLite's own work) with the request log on, minus the same paced loop with the log off,
//!    divided by the rows, counted until every row is in the table. For PostgreSQL the server's
//!    own CPU per row is shown beside it (all `postgres` processes, from /proc).
//! 2. **Request side**: creating, filling and dropping a record (which hands its row over),
//!    per row, unpaced.
//! 3. **Writer throughput**: `--rows` rows queued at once, until all are stored.
//!
//! The PostgreSQL database is a throwaway one on FLEETGATE_TEST_PG or the local server.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use common::{ThrowawayPg, arg};

use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetgate_gateway::config::{DatabaseConfig, RequestLogConfig};
use fleetgate_gateway::key::KeyRecord;
use fleetgate_gateway::store::KeyStore;
use fleetgate_gateway::telemetry::request_log;
use fleetgate_gateway::telemetry::{Recorder, RequestRecord};
use http::HeaderValue;

struct Shared {
    key: Arc<KeyRecord>,
    model: Arc<str>,
    backend: Arc<str>,
}

impl Shared {
    fn new() -> Self {
        Self {
            key: Arc::new(common::key_record("AbCdEfGhIjKl", [0; 32])),
            model: "qwen32b".into(),
            backend: "http://10.0.0.5:8000".into(),
        }
    }

    /// Build, fill and drop one record: what a finished request pays.
    fn one(&self, recorder: &Arc<Recorder>) {
        let mut r = RequestRecord::new(
            Instant::now(),
            HeaderValue::from_static("req-0123456789"),
            recorder.clone(),
        );
        let t0 = r.timeline.received();
        r.key = Some(self.key.clone());
        r.model = Some(self.model.clone());
        r.backend = Some(self.backend.clone());
        r.pool_metrics_index = Some(0);
        r.backend_metrics_index = Some(0);
        r.status = 200;
        r.stream = true;
        r.client_addr = Some("10.1.2.3:40000".parse().unwrap());
        r.timeline = common::streamed_timeline(t0);
        drop(r);
    }
}

/// CPU time of this process so far (user + system, all threads).
fn cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let d = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    d(u.user_time()) + d(u.system_time())
}

/// CPU time of every `postgres` process on the machine (the server's share), from /proc.
fn postgres_cpu() -> Duration {
    let tick = 100u64; // USER_HZ on Linux
    let mut ticks = 0u64;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some((name, rest)) = stat.split_once(") ") else {
            continue;
        };
        if !name.ends_with("(postgres") {
            continue;
        }
        // After the name: state is field 3; utime and stime are fields 14 and 15.
        let f: Vec<&str> = rest.split(' ').collect();
        ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Duration::from_micros(ticks * 1_000_000 / tick)
}

/// Submit `rate` records a second for `secs`, in 1 ms steps.
async fn paced(shared: &Shared, recorder: &Arc<Recorder>, rate: usize, secs: usize) -> usize {
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let steps = secs * 1000;
    let mut sent = 0usize;
    for step in 1..=steps {
        tick.tick().await;
        let due = rate * step / 1000;
        while sent < due {
            shared.one(recorder);
            sent += 1;
        }
    }
    sent
}

struct Log {
    log: Arc<request_log::RequestLog>,
    recorder: Arc<Recorder>,
    registry: prometheus::Registry,
    stop: tokio_util::sync::CancellationToken,
    tasks: tokio_util::task::TaskTracker,
    dir: std::path::PathBuf,
}

impl Log {
    fn start(store: &KeyStore, tag: &str, capacity: usize) -> Self {
        let dir =
            std::env::temp_dir().join(format!("fleetgate-bench-log-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let registry = prometheus::Registry::new();
        let stop = tokio_util::sync::CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        let config = RequestLogConfig {
            channel_capacity: capacity,
            spill_path: dir.join("spill"),
            ..RequestLogConfig::default()
        };
        let log =
            request_log::start(store.clone(), config, &registry, stop.clone(), &tasks).unwrap();
        let mut recorder = Recorder::new(false);
        recorder.set_request_log(log.clone());
        Self {
            log,
            recorder: Arc::new(recorder),
            registry,
            stop,
            tasks,
            dir,
        }
    }

    fn stored(&self) -> usize {
        self.registry
            .gather()
            .iter()
            .find(|f| f.name() == "fleetgate_request_log_rows_total")
            .map_or(0.0, |f| f.get_metric()[0].get_counter().get_value()) as usize
    }

    async fn wait_stored(&self, rows: usize, since: Instant) {
        while self.stored() < rows {
            assert!(since.elapsed() < Duration::from_secs(300), "writer stalled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn count(store: &KeyStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM request_log")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

async fn run(name: &str, db: DatabaseConfig, rate: usize, secs: usize, rows: usize) {
    let store = KeyStore::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let shared = Shared::new();
    let is_pg = db.url.is_some();

    // 1. Paced, log off, then log on.
    let off = Arc::new(Recorder::new(false));
    let c0 = cpu();
    let base_rows = paced(&shared, &off, rate, secs).await;
    let base = cpu() - c0;

    let log = Log::start(&store, "paced", rate * secs + 1);
    // The first write opens the writer's connection: not part of the steady state.
    shared.one(&log.recorder);
    log.wait_stored(1, Instant::now()).await;
    let (c0, pg0, t0) = (cpu(), postgres_cpu(), Instant::now());
    let sent = paced(&shared, &log.recorder, rate, secs).await;
    log.wait_stored(sent + 1, t0).await;
    let (with, pg) = (cpu() - c0, postgres_cpu() - pg0);
    let dropped = log.log.dropped();
    log.stop().await;
    let per_row = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    let log_cpu = per_row(with, sent) - per_row(base, base_rows);

    // 2 and 3. Unpaced: the request side, then the writer at full speed.
    let log = Log::start(&store, "burst", rows + 1);
    let start = Instant::now();
    for _ in 0..rows {
        shared.one(&log.recorder);
    }
    let request_side = start.elapsed().as_nanos() as f64 / rows as f64;
    log.wait_stored(rows, start).await;
    let throughput = rows as f64 / start.elapsed().as_secs_f64();
    let dropped = dropped + log.log.dropped();
    log.stop().await;

    let in_table = count(&store).await;
    let pg_col = if is_pg {
        format!("{:.2} µs", per_row(pg, sent))
    } else {
        "– (in-process)".to_owned()
    };
    println!(
        "| {name} | {sent} at {rate}/s | **{log_cpu:.2} µs** | {:.2} µs | {pg_col} | {request_side:.0} ns | {throughput:.0} rows/s | {in_table} | {dropped} |",
        per_row(base, base_rows),
    );
    assert_eq!(in_table as usize, sent + 1 + rows, "{name}: rows missing");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rate = arg("--rate", 20_000);
    let secs = arg("--secs", 5);
    let rows = arg("--rows", 200_000);
    println!(
        "| store | rows paced | gateway CPU per row (log on − off) | paced loop, log off, per row | PostgreSQL server CPU per row | request side per row | writer throughput (unpaced, {rows} rows) | rows in table | dropped |\n|---|---|---|---|---|---|---|---|---|"
    );
    match ThrowawayPg::create("log").await {
        Ok(pg) => {
            run("PostgreSQL", pg.config.clone(), rate, secs, rows).await;
            pg.drop_database().await;
        }
        Err(e) => println!("| PostgreSQL | skipped: {e} | | | | | | | |"),
    }
    let dir =
        std::env::temp_dir().join(format!("fleetgate-bench-log-sqlite-{}", std::process::id()));
    run(
        "SQLite",
        DatabaseConfig {
            sqlite_path: dir.join("log.db"),
            ..DatabaseConfig::default()
        },
        rate,
        secs,
        rows,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
