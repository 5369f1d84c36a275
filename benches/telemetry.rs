//! Request-log cost on the request path and the writer's throughput into the store.
//!
//!   cargo bench --bench telemetry [-- --rows 200000]
//!
//! The request side is one `RequestLog::record` (cheap clones into a bounded channel); the
//! writer side inserts batches of 1000 rows into a throwaway PostgreSQL database (from
//! FLEETGATE_TEST_PG or the local server) and into an SQLite file.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use common::{ThrowawayPg, arg};

use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetgate::config::{DatabaseConfig, RequestLogConfig};
use fleetgate::key::KeyRecord;
use fleetgate::store::KeyStore;
use fleetgate::telemetry::request_log;
use fleetgate::telemetry::{Recorder, RequestRecord};
use http::HeaderValue;

fn key() -> Arc<KeyRecord> {
    Arc::new(common::key_record("AbCdEfGhIjKl", [0; 32]))
}

fn fill(r: &mut RequestRecord, key: &Arc<KeyRecord>, model: &Arc<str>, backend: &Arc<str>) {
    let t0 = r.timeline.received();
    r.key = Some(key.clone());
    r.model = Some(model.clone());
    r.backend = Some(backend.clone());
    r.pool_slot = Some(0);
    r.backend_slot = Some(0);
    r.status = 200;
    r.stream = true;
    r.client_addr = Some("10.1.2.3:40000".parse().unwrap());
    r.timeline = common::streamed_timeline(t0);
}

async fn run(name: &str, db: DatabaseConfig, rows: usize) {
    let store = KeyStore::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let dir = std::env::temp_dir().join(format!("fleetgate-bench-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let registry = prometheus::Registry::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let tasks = tokio_util::task::TaskTracker::new();
    let config = RequestLogConfig {
        channel_capacity: rows + 1,
        spill_path: dir.join("spill"),
        ..RequestLogConfig::default()
    };
    let log = request_log::start(store.clone(), config, &registry, stop.clone(), &tasks).unwrap();
    let mut recorder = Recorder::new(false);
    recorder.set_request_log(log.clone());
    let recorder = Arc::new(recorder);
    let (key, model, backend): (_, Arc<str>, Arc<str>) =
        (key(), "qwen32b".into(), "http://10.0.0.5:8000".into());

    // Request side: build, fill and drop a record (which hands its row over).
    let start = Instant::now();
    for _ in 0..rows {
        let mut r = RequestRecord::new(
            Instant::now(),
            HeaderValue::from_static("req-0123456789"),
            recorder.clone(),
        );
        fill(&mut r, &key, &model, &backend);
        drop(r);
    }
    let per_record = start.elapsed().as_nanos() as f64 / rows as f64;
    // Writer side: until every row is stored.
    let stored = || {
        registry
            .gather()
            .iter()
            .find(|f| f.name() == "fleetgate_request_log_rows_total")
            .map_or(0.0, |f| f.get_metric()[0].get_counter().get_value())
    };
    while (stored() as usize) < rows {
        assert!(start.elapsed() < Duration::from_secs(300), "writer stalled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let total = start.elapsed();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM request_log")
        .fetch_one(store.pool())
        .await
        .unwrap();
    println!(
        "| {name} | {rows} | {per_record:.0} ns | {:.0} rows/s | {n} | {} |",
        rows as f64 / total.as_secs_f64(),
        log.dropped()
    );
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows = arg("--rows", 200_000);
    println!(
        "| store | rows | request side per row | writer throughput | rows in table | dropped |\n|---|---|---|---|---|---|"
    );
    match ThrowawayPg::create("log").await {
        Ok(pg) => {
            run("PostgreSQL", pg.config.clone(), rows).await;
            pg.drop_database().await;
        }
        Err(e) => println!("| PostgreSQL | skipped: {e} | | | | |"),
    }
    let dir =
        std::env::temp_dir().join(format!("fleetgate-bench-log-sqlite-{}", std::process::id()));
    run(
        "SQLite",
        DatabaseConfig {
            sqlite_path: dir.join("log.db"),
            ..DatabaseConfig::default()
        },
        rows,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
