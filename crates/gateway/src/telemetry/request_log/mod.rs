//! The request log: one row per request in the store's `request_log` table, written by a
//! background task on the control-plane runtime in batches. A request only hands its row to a
//! bounded channel (`try_send`, never awaited, no wake-up: the writer sleeps out
//! `flush_interval`, or until a full batch is queued, then takes everything queued at once).
//! The writer encodes rows straight from what the request handed over, with no per-row string
//! formatting or JSON: PostgreSQL gets one binary `COPY` per batch from a reused buffer, SQLite
//! prepared multi-row statements in one transaction. When the database is slow or down,
//! batches go to a local append-only spill file (JSON lines) and are replayed in order when it
//! is back; a row has a unique id and replay skips ids already stored, so a batch whose write
//! timed out after landing is not stored twice. A row is lost only when the channel is full or
//! the disk is, and each such drop is counted.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge, Registry};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

pub mod row;
mod sink;

use row::{Pending, RecordCopy, SpillRow};
use sink::{Sink, insert};

use super::RequestRecord;
use crate::clock::wall_ms;
use crate::config::{DbKind, RequestLogConfig};
use crate::store::KeyStore;

/// The request side of the log: hands rows to the writer.
pub struct RequestLog {
    tx: mpsc::Sender<Pending>,
    next_id: AtomicU64,
    dropped: IntCounter,
    pub(crate) backlog: IntGauge,
    /// Rows queued at which the writer is woken before its flush interval ends (a full batch).
    wake_at: i64,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLog").finish_non_exhaustive()
    }
}

impl RequestLog {
    /// Queue the row of a finished request. Never waits, and does not wake the writer for
    /// each row: the writer sleeps out its flush interval (or until a full batch is queued)
    /// and then takes everything at once.
    pub(crate) fn record(&self, r: &RequestRecord) {
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
                endpoint: r.endpoint,
                trace_id: r.trace_id,
                predicted_cached: r.predicted_cached_tokens(),
                resume: r.resume.as_ref().map(|log| {
                    let fleet = r.timeline.stream().usage.map(|u| {
                        u.prompt_tokens
                            .saturating_add(u.completion_tokens)
                            .saturating_add(log.continuation_prompt_tokens)
                    });
                    (
                        i32::try_from(log.resumes()).unwrap_or(i32::MAX),
                        log.detail(),
                        fleet,
                    )
                }),
                fallback: r
                    .fallback
                    .as_ref()
                    .and_then(|log| Some((log.first()?.clone(), log.detail()))),
            },
        };
        match self.tx.try_send(pending) {
            Ok(()) => {
                self.backlog.inc();
                if self.backlog.get() >= self.wake_at {
                    self.wake.notify_one();
                }
            }
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
    let capacity = config.channel_capacity.max(1);
    let (tx, rx) = mpsc::channel(capacity);
    let wake = Arc::new(Notify::new());
    let log = Arc::new(RequestLog {
        tx,
        next_id: AtomicU64::new(0),
        dropped: dropped.clone(),
        backlog: backlog.clone(),
        // A full batch, or half the channel when that is smaller: never wait into drops.
        wake_at: i64::try_from(config.batch_rows.clamp(1, capacity.div_ceil(2)))
            .unwrap_or(i64::MAX),
        wake: wake.clone(),
    });
    let prefix = format!(
        "{:08x}{:04x}",
        rand::random::<u32>(),
        std::process::id() & 0xffff
    );
    let writer = Writer {
        sink: Sink::new(store.bulk().clone(), config.batch_rows),
        store,
        config,
        prefix,
        dropped,
        backlog,
        spilled,
        written,
        spill_rows: 0,
        wake,
    };
    tasks.spawn(writer.run(rx, stop));
    Ok(log)
}

struct Writer {
    store: KeyStore,
    sink: Sink,
    config: RequestLogConfig,
    prefix: String,
    dropped: IntCounter,
    backlog: IntGauge,
    spilled: IntGauge,
    written: IntCounter,
    spill_rows: usize,
    wake: Arc<Notify>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Pending>, stop: CancellationToken) {
        let path = self.config.spill_path.clone();
        self.spill_rows = tokio::task::spawn_blocking(move || count_lines(&path))
            .await
            .unwrap_or(0);
        self.spilled.set(self.spill_rows as i64);
        let mut batch: Vec<Pending> = Vec::with_capacity(self.config.batch_rows);
        let mut maintenance = tokio::time::interval(Duration::from_secs(60));
        let mut retry = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                biased;
                got = rx.recv() => match got {
                    Some(p) => {
                        batch.push(p);
                        // Let rows gather without a wake-up per row: the channel is not
                        // polled while this waits, so a request's `try_send` wakes nobody.
                        tokio::select! {
                            () = tokio::time::sleep(self.config.flush_interval) => {}
                            () = self.wake.notified() => {}
                            () = stop.cancelled() => {}
                        }
                        self.drain(&mut rx, &mut batch).await;
                    }
                    None => break,
                },
                _ = retry.tick(), if self.spill_rows > 0 => self.replay().await,
                _ = maintenance.tick() => self.maintain().await,
                () = stop.cancelled() => break,
            }
        }
        // Shutdown: what is queued goes to the database, or to the spill file.
        self.drain(&mut rx, &mut batch).await;
    }

    /// Write what is queued, a batch at a time, until the channel is empty.
    async fn drain(&mut self, rx: &mut mpsc::Receiver<Pending>, batch: &mut Vec<Pending>) {
        loop {
            while batch.len() < self.config.batch_rows {
                match rx.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            // Every row leaves the backlog here, in the one batch that writes (or spills) it.
            self.backlog.sub(batch.len() as i64);
            let full = batch.len() >= self.config.batch_rows;
            self.flush(batch).await;
            if !full {
                return;
            }
        }
    }

    async fn flush(&mut self, batch: &mut Vec<Pending>) {
        if batch.is_empty() {
            return;
        }
        // Older spilled rows first: the log stays in order.
        if self.spill_rows > 0 {
            self.replay().await;
        }
        if self.spill_rows == 0 {
            let write = self.sink.write(&self.prefix, batch);
            match tokio::time::timeout(Duration::from_secs(5), write).await {
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
        let rows: Vec<SpillRow> = batch.drain(..).map(|p| p.into_row(&self.prefix)).collect();
        self.spill(&rows).await;
    }

    async fn spill(&mut self, batch: &[SpillRow]) {
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
    /// Replayed rows skip row ids already stored (`insert_sql`): a batch whose write timed out
    /// may have landed after all, and is not stored twice.
    async fn replay(&mut self) {
        let path = self.config.spill_path.clone();
        let read = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || read_spill(&path)).await
        };
        let Ok(Ok((rows, unreadable))) = read else {
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
        // Counted once, when the file goes (a failed replay reads it again later).
        if unreadable > 0 {
            tracing::error!(lines = unreadable, path = %path.display(), "request log: spill-file lines that are not rows; counted as dropped");
            self.dropped.inc_by(unreadable as u64);
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

/// The spilled rows, in order, and how many lines could not be read back as rows (a line cut short when
/// the disk filled up, or edited by hand): those are counted as dropped, never skipped silently.
fn read_spill(path: &Path) -> std::io::Result<(Vec<SpillRow>, usize)> {
    let f = std::fs::File::open(path)?;
    let mut rows = Vec::new();
    let mut unreadable = 0;
    for line in std::io::BufReader::new(f).split(b'\n') {
        match serde_json::from_slice(&line?) {
            Ok(row) => rows.push(row),
            Err(_) => unreadable += 1,
        }
    }
    Ok((rows, unreadable))
}

fn count_lines(path: &Path) -> usize {
    std::fs::File::open(path)
        .map(|f| std::io::BufReader::new(f).lines().count())
        .unwrap_or(0)
}
