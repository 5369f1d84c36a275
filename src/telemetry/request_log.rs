//! The request log: one row per request in the store's `request_log` table, written by a
//! background task in multi-row batches. A request only hands its row to a bounded channel
//! (`try_send`, never awaited). When the database is slow or down, batches go to a local
//! append-only spill file (JSON lines) and are replayed in order when it is back; a row has a
//! unique id, so a replayed batch that had in fact landed is not stored twice. A row is lost
//! only when the channel is full or the disk is, and each such drop is counted.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge, Registry};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::RequestRecord;
use crate::clock::wall_ms;
use crate::config::{DbKind, RequestLogConfig};
use crate::store::KeyStore;

/// One row, as stored (and as spilled).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LogRow {
    pub row_id: String,
    pub at: i64,
    pub request_id: String,
    pub key_id: Option<String>,
    pub environment: Option<String>,
    pub model: Option<String>,
    pub backend: Option<String>,
    pub status: i32,
    pub error: Option<String>,
    pub stream: bool,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub usage_source: String,
    pub queue_wait_us: Option<i64>,
    pub upstream_ttft_us: Option<i64>,
    pub client_ttft_us: Option<i64>,
    pub overhead_pre_us: Option<i64>,
    pub overhead_relay_us: Option<i64>,
    /// Written by versions that record the hop cost (absent in older spill files).
    #[serde(default)]
    pub hop_us: Option<i64>,
    pub e2el_us: Option<i64>,
    pub tpot_us: Option<i64>,
    pub itl_mean_us: Option<i64>,
    pub itl_p99_us: Option<i64>,
    pub itl_max_us: Option<i64>,
    pub content_events: i32,
    pub client_addr: Option<String>,
}

const COLUMNS: &str = "row_id, at, request_id, key_id, environment, model, backend, status, error, \
    stream, prompt_tokens, completion_tokens, usage_source, queue_wait_us, upstream_ttft_us, \
    client_ttft_us, overhead_pre_us, overhead_relay_us, e2el_us, tpot_us, itl_mean_us, itl_p99_us, \
    itl_max_us, content_events, client_addr, hop_us";

fn us(d: Option<Duration>) -> Option<i64> {
    d.map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// What a request hands over: cheap clones only; the row is built on the writer's side.
struct Pending {
    row_id: u64,
    at: i64,
    record: RecordCopy,
}

struct RecordCopy {
    request_id: http::HeaderValue,
    key: Option<Arc<crate::key::KeyRecord>>,
    model: Option<Arc<str>>,
    backend: Option<Arc<str>>,
    status: u16,
    error: Option<crate::openai::error::ErrorKind>,
    stream: bool,
    timeline: super::Timeline,
    client_addr: Option<std::net::SocketAddr>,
}

impl Pending {
    fn into_row(self, prefix: &str) -> LogRow {
        let r = self.record;
        let t = &r.timeline;
        let (tokens, source) = t.stream().output_tokens();
        LogRow {
            row_id: format!("{prefix}-{:x}", self.row_id),
            at: self.at,
            request_id: String::from_utf8_lossy(r.request_id.as_bytes()).into_owned(),
            key_id: r.key.as_ref().map(|k| k.public_id.to_string()),
            environment: r.key.as_ref().map(|k| k.environment.as_str().to_owned()),
            model: r.model.as_deref().map(str::to_owned),
            backend: r.backend.as_deref().map(str::to_owned),
            status: i32::from(r.status),
            error: r.error.map(|e| e.as_str().to_owned()),
            stream: r.stream,
            prompt_tokens: t
                .stream()
                .usage
                .map(|u| i64::try_from(u.prompt_tokens).unwrap_or(i64::MAX)),
            completion_tokens: tokens.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
            usage_source: source.as_str().to_owned(),
            queue_wait_us: us(t.admitted().map(|_| t.queue_wait())),
            upstream_ttft_us: us(t.upstream_ttft()),
            client_ttft_us: us(t.client_ttft()),
            overhead_pre_us: us(t.overhead_pre()),
            overhead_relay_us: us(t.overhead_relay()),
            hop_us: us(t.hop()),
            e2el_us: us(t.e2el()),
            tpot_us: us(t.tpot()),
            itl_mean_us: us(t.stream().itl_mean()),
            itl_p99_us: us(t.stream().itl_p99()),
            itl_max_us: us(t.stream().itl_max()),
            content_events: i32::try_from(t.stream().content_events).unwrap_or(i32::MAX),
            client_addr: r.client_addr.map(|a| a.ip().to_string()),
        }
    }
}

/// The request side of the log: hands rows to the writer.
pub struct RequestLog {
    tx: mpsc::Sender<Pending>,
    next_id: AtomicU64,
    dropped: IntCounter,
    pub(crate) backlog: IntGauge,
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLog").finish_non_exhaustive()
    }
}

impl RequestLog {
    /// Queue the row of a finished request. Never waits.
    pub fn record(&self, r: &RequestRecord) {
        let pending = Pending {
            row_id: self.next_id.fetch_add(1, Ordering::Relaxed),
            at: wall_ms(),
            record: RecordCopy {
                request_id: r.request_id.clone(),
                key: r.key.clone(),
                model: r.model.clone(),
                backend: r.backend.clone(),
                status: r.status,
                error: r.error,
                stream: r.stream,
                timeline: r.timeline.clone(),
                client_addr: r.client_addr,
            },
        };
        match self.tx.try_send(pending) {
            Ok(()) => self.backlog.inc(),
            Err(_) => self.dropped.inc(),
        }
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }
}

/// Start the writer; returns the request side. The writer ends when `stop` is cancelled,
/// after writing (or spilling) what it holds.
pub fn start(
    store: KeyStore,
    config: RequestLogConfig,
    registry: &Registry,
    stop: CancellationToken,
    tasks: &tokio_util::task::TaskTracker,
) -> Result<Arc<RequestLog>, prometheus::Error> {
    let dropped = IntCounter::new(
        "fleetgate_request_log_dropped_total",
        "Request-log rows lost (writer channel full, or the spill file could not be written)",
    )?;
    let backlog = IntGauge::new(
        "fleetgate_request_log_backlog",
        "Request-log rows waiting for the writer",
    )?;
    let spilled = IntGauge::new(
        "fleetgate_request_log_spilled_rows",
        "Rows in the local spill file waiting for the database",
    )?;
    let written = IntCounter::new(
        "fleetgate_request_log_rows_total",
        "Request-log rows stored",
    )?;
    for m in [
        Box::new(dropped.clone()) as Box<dyn prometheus::core::Collector>,
        Box::new(backlog.clone()),
        Box::new(spilled.clone()),
        Box::new(written.clone()),
    ] {
        registry.register(m)?;
    }
    let (tx, rx) = mpsc::channel(config.channel_capacity.max(1));
    let log = Arc::new(RequestLog {
        tx,
        next_id: AtomicU64::new(0),
        dropped: dropped.clone(),
        backlog: backlog.clone(),
    });
    let prefix = format!(
        "{:08x}{:04x}",
        rand::random::<u32>(),
        std::process::id() & 0xffff
    );
    let writer = Writer {
        store,
        config,
        prefix,
        dropped,
        backlog,
        spilled,
        written,
        spill_rows: 0,
    };
    tasks.spawn(writer.run(rx, stop));
    Ok(log)
}

struct Writer {
    store: KeyStore,
    config: RequestLogConfig,
    prefix: String,
    dropped: IntCounter,
    backlog: IntGauge,
    spilled: IntGauge,
    written: IntCounter,
    spill_rows: usize,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Pending>, stop: CancellationToken) {
        let path = self.config.spill_path.clone();
        self.spill_rows = tokio::task::spawn_blocking(move || count_lines(&path))
            .await
            .unwrap_or(0);
        self.spilled.set(self.spill_rows as i64);
        let mut batch: Vec<LogRow> = Vec::with_capacity(self.config.batch_rows);
        let mut maintenance = tokio::time::interval(Duration::from_secs(60));
        let mut retry = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                biased;
                got = rx.recv() => match got {
                    Some(p) => {
                        self.backlog.dec();
                        batch.push(p.into_row(&self.prefix));
                        // Take what is already queued, up to a batch, then write.
                        while batch.len() < self.config.batch_rows {
                            match rx.try_recv() {
                                Ok(p) => {
                                    self.backlog.dec();
                                    batch.push(p.into_row(&self.prefix));
                                }
                                Err(_) => break,
                            }
                        }
                        if batch.len() >= self.config.batch_rows {
                            self.flush(&mut batch).await;
                        } else {
                            // Let a partial batch fill a little, without holding it long.
                            let until = tokio::time::sleep(self.config.flush_interval);
                            tokio::pin!(until);
                            loop {
                                tokio::select! {
                                    _ = &mut until => break,
                                    more = rx.recv() => match more {
                                        Some(p) => {
                                            self.backlog.dec();
                                            batch.push(p.into_row(&self.prefix));
                                            if batch.len() >= self.config.batch_rows { break; }
                                        }
                                        None => break,
                                    },
                                }
                            }
                            self.flush(&mut batch).await;
                        }
                    }
                    None => break,
                },
                _ = retry.tick(), if self.spill_rows > 0 => self.replay().await,
                _ = maintenance.tick() => self.maintain().await,
                _ = stop.cancelled() => break,
            }
        }
        // Shutdown: what is queued goes to the database, or to the spill file.
        while let Ok(p) = rx.try_recv() {
            self.backlog.dec();
            batch.push(p.into_row(&self.prefix));
        }
        if !batch.is_empty() {
            self.flush(&mut batch).await;
        }
    }

    async fn flush(&mut self, batch: &mut Vec<LogRow>) {
        if batch.is_empty() {
            return;
        }
        // Older spilled rows first: the log stays in order.
        if self.spill_rows > 0 {
            self.replay().await;
        }
        if self.spill_rows == 0 {
            match tokio::time::timeout(Duration::from_secs(5), insert(&self.store, batch)).await {
                Ok(Ok(())) => {
                    self.written.inc_by(batch.len() as u64);
                    batch.clear();
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, rows = batch.len(), "request log: database write failed; spilling to disk")
                }
                Err(_) => tracing::warn!(
                    rows = batch.len(),
                    "request log: database write timed out; spilling to disk"
                ),
            }
        }
        self.spill(batch).await;
        batch.clear();
    }

    async fn spill(&mut self, batch: &[LogRow]) {
        let mut buf = Vec::with_capacity(batch.len() * 400);
        let encoded = batch.iter().try_for_each(|row| {
            serde_json::to_writer(&mut buf, row)?;
            buf.push(b'\n');
            Ok::<(), serde_json::Error>(())
        });
        let result = match encoded {
            Ok(()) => {
                let path = self.config.spill_path.clone();
                tokio::task::spawn_blocking(move || append(&path, &buf))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            }
            Err(e) => Err(std::io::Error::other(e)),
        };
        match result {
            Ok(()) => {
                self.spill_rows += batch.len();
                self.spilled.set(self.spill_rows as i64);
            }
            Err(e) => {
                tracing::error!(error = %e, rows = batch.len(), path = %self.config.spill_path.display(), "request log: cannot spill; rows lost");
                self.dropped.inc_by(batch.len() as u64);
            }
        }
    }

    /// Send the spill file to the database, in order; remove it when all of it is stored.
    async fn replay(&mut self) {
        let path = self.config.spill_path.clone();
        let read = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || read_spill(&path)).await
        };
        let Ok(Ok(rows)) = read else {
            self.spill_rows = 0;
            self.spilled.set(0);
            return;
        };
        for chunk in rows.chunks(self.config.batch_rows.max(1)) {
            match tokio::time::timeout(Duration::from_secs(5), insert(&self.store, chunk)).await {
                Ok(Ok(())) => self.written.inc_by(chunk.len() as u64),
                _ => return, // still down: keep the file, try again later
            }
        }
        if let Err(e) = tokio::fs::remove_file(&path).await {
            tracing::warn!(error = %e, "request log: cannot remove the replayed spill file");
        }
        tracing::info!(
            rows = rows.len(),
            "request log: spilled rows replayed into the database"
        );
        self.spill_rows = 0;
        self.spilled.set(0);
    }

    /// Partitions ahead and retention.
    async fn maintain(&self) {
        let day_ms = 86_400_000i64;
        let today = wall_ms().div_euclid(day_ms);
        let cutoff = (today - i64::from(self.config.retention_days)) * day_ms;
        let result = match self.store.kind() {
            DbKind::Postgres => {
                let mut r = Ok(());
                for d in today..=today + 1 {
                    let sql = format!(
                        "CREATE TABLE IF NOT EXISTS request_log_d{d} PARTITION OF request_log FOR VALUES FROM ({}) TO ({})",
                        d * day_ms,
                        (d + 1) * day_ms
                    );
                    if let Err(e) = sqlx::query(&sql).execute(self.store.pool()).await {
                        r = Err(e);
                    }
                }
                let old: Result<Vec<String>, _> = sqlx::query_scalar(
                    "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                     JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'request_log' AND c.relname LIKE 'request_log_d%'",
                )
                .fetch_all(self.store.pool())
                .await;
                for name in old.unwrap_or_default() {
                    let Some(day) = name
                        .strip_prefix("request_log_d")
                        .and_then(|d| d.parse::<i64>().ok())
                    else {
                        continue; // the default partition
                    };
                    if day.saturating_add(1).saturating_mul(day_ms) <= cutoff {
                        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {name}"))
                            .execute(self.store.pool())
                            .await;
                    }
                }
                let _ = sqlx::query("DELETE FROM request_log_default WHERE at < $1")
                    .bind(cutoff)
                    .execute(self.store.pool())
                    .await;
                r
            }
            DbKind::Sqlite => sqlx::query("DELETE FROM request_log WHERE at < $1")
                .bind(cutoff)
                .execute(self.store.pool())
                .await
                .map(|_| ()),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "request log: partition/retention maintenance failed");
        }
    }
}

// The spill file's own I/O is blocking (std::fs): these run on the blocking pool, never on
// the writer's event loop.

/// Append encoded rows (JSON lines) to the spill file, creating it if needed.
fn append(path: &Path, buf: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    f.write_all(buf)?;
    f.flush()
}

/// The spilled rows, in order; a line that does not parse is skipped, and reading stops at the
/// first line that cannot be read.
fn read_spill(path: &Path) -> std::io::Result<Vec<LogRow>> {
    let f = std::fs::File::open(path)?;
    Ok(std::io::BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect())
}

fn count_lines(path: &Path) -> usize {
    std::fs::File::open(path)
        .map(|f| std::io::BufReader::new(f).lines().count())
        .unwrap_or(0)
}

/// Columns per row.
const WIDTH: usize = 26;

/// Insert a batch in one transaction. PostgreSQL takes it as one multi-row statement; SQLite's
/// statement preparation grows badly with thousands of placeholders, so it gets statements of
/// 50 rows (still one commit, one fsync).
async fn insert(store: &KeyStore, rows: &[LogRow]) -> Result<(), sqlx::Error> {
    let per_statement = match store.kind() {
        DbKind::Postgres => 1000,
        DbKind::Sqlite => 50,
    };
    let mut tx = store.pool().begin().await?;
    for chunk in rows.chunks(per_statement) {
        insert_rows(&mut tx, chunk).await?;
    }
    tx.commit().await
}

/// One multi-row INSERT with numbered placeholders (`$1`, `$2`, ... — what both PostgreSQL and
/// SQLite accept); rows already stored (same row id) are skipped.
async fn insert_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    rows: &[LogRow],
) -> Result<(), sqlx::Error> {
    let mut sql = String::with_capacity(120 + rows.len() * WIDTH * 6);
    sql.push_str("INSERT INTO request_log (");
    sql.push_str(COLUMNS);
    sql.push_str(") VALUES ");
    let mut n = 0usize;
    for i in 0..rows.len() {
        sql.push_str(if i == 0 { "(" } else { ", (" });
        for c in 0..WIDTH {
            n += 1;
            if c > 0 {
                sql.push(',');
            }
            sql.push('$');
            sql.push_str(itoa::Buffer::new().format(n));
        }
        sql.push(')');
    }
    sql.push_str(" ON CONFLICT DO NOTHING");
    let mut q = sqlx::query(&sql);
    for r in rows {
        q = q
            .bind(r.row_id.clone())
            .bind(r.at)
            .bind(r.request_id.clone())
            .bind(r.key_id.clone())
            .bind(r.environment.clone())
            .bind(r.model.clone())
            .bind(r.backend.clone())
            .bind(r.status)
            .bind(r.error.clone())
            .bind(i32::from(r.stream))
            .bind(r.prompt_tokens)
            .bind(r.completion_tokens)
            .bind(r.usage_source.clone())
            .bind(r.queue_wait_us)
            .bind(r.upstream_ttft_us)
            .bind(r.client_ttft_us)
            .bind(r.overhead_pre_us)
            .bind(r.overhead_relay_us)
            .bind(r.e2el_us)
            .bind(r.tpot_us)
            .bind(r.itl_mean_us)
            .bind(r.itl_p99_us)
            .bind(r.itl_max_us)
            .bind(r.content_events)
            .bind(r.client_addr.clone())
            .bind(r.hop_us);
    }
    q.execute(&mut **tx).await?;
    Ok(())
}
