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
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::RequestRecord;
use crate::clock::wall_ms;
use crate::config::{DbKind, RequestLogConfig};
use crate::store::{BulkPool, KeyStore};

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
    /// The endpoint (`chat`, `responses`, `messages`, …); absent in older spill files.
    #[serde(default)]
    pub endpoint: Option<String>,
}

const COLUMNS: &str = "row_id, at, request_id, key_id, environment, model, backend, status, error, \
    stream, prompt_tokens, completion_tokens, usage_source, queue_wait_us, upstream_ttft_us, \
    client_ttft_us, overhead_pre_us, overhead_relay_us, e2el_us, tpot_us, itl_mean_us, itl_p99_us, \
    itl_max_us, content_events, client_addr, hop_us, endpoint";

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
    error: Option<fleetgate_protocol::error::ErrorKind>,
    stream: bool,
    timeline: super::Timeline,
    client_addr: Option<std::net::SocketAddr>,
    endpoint: Option<fleetgate_protocol::Endpoint>,
}

/// A row's values, borrowed from its `Pending` (nothing allocated, except a request id that
/// is not UTF-8). Every store encoding reads this, in `COLUMNS` order.
struct Fields<'a> {
    at: i64,
    request_id: std::borrow::Cow<'a, str>,
    key_id: Option<&'a str>,
    environment: Option<&'static str>,
    model: Option<&'a str>,
    backend: Option<&'a str>,
    status: i32,
    error: Option<&'static str>,
    stream: bool,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    usage_source: &'static str,
    /// `queue_wait_us` … `itl_max_us`, in `COLUMNS` order.
    times: [Option<i64>; 10],
    content_events: i32,
    client_addr: Option<std::net::IpAddr>,
    hop_us: Option<i64>,
    endpoint: Option<&'static str>,
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Pending {
    fn fields(&self) -> Fields<'_> {
        let r = &self.record;
        let t = &r.timeline;
        let (tokens, source) = t.stream().output_tokens();
        Fields {
            at: self.at,
            request_id: String::from_utf8_lossy(r.request_id.as_bytes()),
            key_id: r.key.as_ref().map(|k| &*k.public_id),
            environment: r.key.as_ref().map(|k| k.environment.as_str()),
            model: r.model.as_deref(),
            backend: r.backend.as_deref(),
            status: i32::from(r.status),
            error: r.error.map(|e| e.as_str()),
            stream: r.stream,
            prompt_tokens: t.stream().usage.map(|u| count(u.prompt_tokens)),
            completion_tokens: tokens.map(count),
            usage_source: source.as_str(),
            times: [
                us(t.admitted().map(|_| t.queue_wait())),
                us(t.upstream_ttft()),
                us(t.client_ttft()),
                us(t.overhead_pre()),
                us(t.overhead_relay()),
                us(t.e2el()),
                us(t.tpot()),
                us(t.stream().itl_mean()),
                us(t.stream().itl_p99()),
                us(t.stream().itl_max()),
            ],
            content_events: i32::try_from(t.stream().content_events).unwrap_or(i32::MAX),
            client_addr: r.client_addr.map(|a| a.ip()),
            hop_us: us(t.hop()),
            endpoint: r.endpoint.map(fleetgate_protocol::Endpoint::as_str),
        }
    }

    /// The row as spilled (and replayed).
    fn into_row(self, prefix: &str) -> LogRow {
        let f = self.fields();
        let [
            queue_wait_us,
            upstream_ttft_us,
            client_ttft_us,
            overhead_pre_us,
            overhead_relay_us,
            e2el_us,
            tpot_us,
            itl_mean_us,
            itl_p99_us,
            itl_max_us,
        ] = f.times;
        LogRow {
            row_id: RowId(prefix, self.row_id).to_string(),
            at: f.at,
            request_id: f.request_id.into_owned(),
            key_id: f.key_id.map(str::to_owned),
            environment: f.environment.map(str::to_owned),
            model: f.model.map(str::to_owned),
            backend: f.backend.map(str::to_owned),
            status: f.status,
            error: f.error.map(str::to_owned),
            stream: f.stream,
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
            usage_source: f.usage_source.to_owned(),
            queue_wait_us,
            upstream_ttft_us,
            client_ttft_us,
            overhead_pre_us,
            overhead_relay_us,
            hop_us: f.hop_us,
            e2el_us,
            tpot_us,
            itl_mean_us,
            itl_p99_us,
            itl_max_us,
            content_events: f.content_events,
            client_addr: f.client_addr.map(|a| a.to_string()),
            endpoint: f.endpoint.map(str::to_owned),
        }
    }
}

/// A row id: `<process prefix>-<sequence in hex>`.
struct RowId<'a>(&'a str, u64);

impl std::fmt::Display for RowId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{:x}", self.0, self.1)
    }
}

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
                endpoint: r.endpoint,
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
        let rows: Vec<LogRow> = batch.drain(..).map(|p| p.into_row(&self.prefix)).collect();
        self.spill(&rows).await;
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
fn read_spill(path: &Path) -> std::io::Result<(Vec<LogRow>, usize)> {
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

/// Columns per row.
const WIDTH: usize = 27;

/// Rows per SQLite statement, largest first: a batch is cut into statements of these sizes,
/// so at most a few distinct statements exist, each prepared once and then cached.
const SQLITE_ROWS: [usize; 5] = [256, 64, 16, 4, 1];

/// Fresh batches into the store, in the engine's own bulk form (replayed spill rows take
/// `insert`, which skips rows already stored).
enum Sink {
    /// One `COPY … FROM STDIN (FORMAT binary)` per batch: a single statement (all or
    /// nothing), its rows encoded into one buffer that is reused.
    Postgres {
        pool: sqlx::PgPool,
        buf: Vec<u8>,
        statement: String,
    },
    /// Prepared multi-row `INSERT` statements of `SQLITE_ROWS` sizes, one transaction (one
    /// commit) per batch. Fresh rows cannot be stored already: only the replay checks.
    Sqlite {
        pool: sqlx::SqlitePool,
        /// One statement per entry of `SQLITE_ROWS`.
        statements: Vec<String>,
    },
}

impl Sink {
    fn new(pool: BulkPool, batch_rows: usize) -> Self {
        match pool {
            BulkPool::Postgres(pool) => Sink::Postgres {
                pool,
                buf: Vec::with_capacity(batch_rows.min(10_000) * 256),
                statement: format!("COPY request_log ({COLUMNS}) FROM STDIN (FORMAT binary)"),
            },
            BulkPool::Sqlite(pool) => Sink::Sqlite {
                pool,
                statements: SQLITE_ROWS
                    .iter()
                    .map(|&n| insert_sql(DbKind::Sqlite, n, false))
                    .collect(),
            },
        }
    }

    async fn write(&mut self, prefix: &str, rows: &[Pending]) -> Result<(), sqlx::Error> {
        match self {
            Sink::Postgres {
                pool,
                buf,
                statement,
            } => {
                buf.clear();
                encode_copy(buf, prefix, rows);
                let mut conn = pool.acquire().await?;
                let mut copy = conn.copy_in_raw(statement).await?;
                copy.send(buf.as_slice()).await?;
                copy.finish().await?;
                Ok(())
            }
            Sink::Sqlite { pool, statements } => {
                // A write that fails (or is cancelled by the timeout) closes its connection
                // (`WriteConn`): one left inside its transaction would take every later batch
                // and replay with it, committing nothing.
                let mut w = crate::store::WriteConn::acquire(pool).await?;
                let mut tx = sqlx::Connection::begin(w.conn()).await?;
                let mut rest = rows;
                while !rest.is_empty() {
                    let i = SQLITE_ROWS
                        .iter()
                        .position(|&n| n <= rest.len())
                        .unwrap_or(SQLITE_ROWS.len() - 1);
                    let (chunk, tail) = rest.split_at(SQLITE_ROWS[i].min(rest.len()));
                    let mut q = sqlx::query::<sqlx::Sqlite>(&statements[i]);
                    for p in chunk {
                        let f = p.fields();
                        q = q
                            .bind(RowId(prefix, p.row_id).to_string())
                            .bind(f.at)
                            .bind(f.request_id)
                            .bind(f.key_id)
                            .bind(f.environment)
                            .bind(f.model)
                            .bind(f.backend)
                            .bind(f.status)
                            .bind(f.error)
                            .bind(i32::from(f.stream))
                            .bind(f.prompt_tokens)
                            .bind(f.completion_tokens)
                            .bind(f.usage_source);
                        for t in f.times {
                            q = q.bind(t);
                        }
                        q = q
                            .bind(f.content_events)
                            .bind(f.client_addr.map(|a| a.to_string()))
                            .bind(f.hop_us)
                            .bind(f.endpoint);
                    }
                    q.execute(&mut *tx).await?;
                    rest = tail;
                }
                tx.commit().await?;
                w.keep();
                Ok(())
            }
        }
    }
}

/// PostgreSQL's binary `COPY` format: signature, flags and header extension, then per row
/// the field count and each field as a length (−1 for NULL) and its bytes in network order,
/// then −1 as the trailer.
fn encode_copy(buf: &mut Vec<u8>, prefix: &str, rows: &[Pending]) {
    fn text(buf: &mut Vec<u8>, v: Option<&[u8]>) {
        match v {
            Some(b) => {
                buf.extend_from_slice(&i32::try_from(b.len()).unwrap_or(i32::MAX).to_be_bytes());
                buf.extend_from_slice(b);
            }
            None => buf.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    fn int8(buf: &mut Vec<u8>, v: Option<i64>) {
        match v {
            Some(v) => {
                buf.extend_from_slice(&8i32.to_be_bytes());
                buf.extend_from_slice(&v.to_be_bytes());
            }
            None => buf.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    fn int4(buf: &mut Vec<u8>, v: i32) {
        buf.extend_from_slice(&4i32.to_be_bytes());
        buf.extend_from_slice(&v.to_be_bytes());
    }
    /// Text formatted straight into the buffer; its length, known only after, goes before it.
    fn text_fmt(buf: &mut Vec<u8>, v: std::fmt::Arguments<'_>) {
        let at = buf.len();
        buf.extend_from_slice(&[0; 4]);
        let _ = buf.write_fmt(v);
        let len = i32::try_from(buf.len() - at - 4).unwrap_or(0);
        buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }
    buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    buf.extend_from_slice(&[0; 8]);
    for p in rows {
        let f = p.fields();
        buf.extend_from_slice(&(WIDTH as i16).to_be_bytes());
        text_fmt(buf, format_args!("{}", RowId(prefix, p.row_id)));
        int8(buf, Some(f.at));
        text(buf, Some(f.request_id.as_bytes()));
        text(buf, f.key_id.map(str::as_bytes));
        text(buf, f.environment.map(str::as_bytes));
        text(buf, f.model.map(str::as_bytes));
        text(buf, f.backend.map(str::as_bytes));
        int4(buf, f.status);
        text(buf, f.error.map(str::as_bytes));
        int4(buf, i32::from(f.stream));
        int8(buf, f.prompt_tokens);
        int8(buf, f.completion_tokens);
        text(buf, Some(f.usage_source.as_bytes()));
        for t in f.times {
            int8(buf, t);
        }
        int4(buf, f.content_events);
        match f.client_addr {
            Some(ip) => text_fmt(buf, format_args!("{ip}")),
            None => text(buf, None),
        }
        int8(buf, f.hop_us);
        text(buf, f.endpoint.map(str::as_bytes));
    }
    buf.extend_from_slice(&(-1i16).to_be_bytes());
}

/// Insert replayed rows in one transaction (one commit, one fsync), skipping rows already
/// stored: multi-row statements of 1000 rows on PostgreSQL, 50 on SQLite.
async fn insert(store: &KeyStore, rows: &[LogRow]) -> Result<(), sqlx::Error> {
    let per_statement = match store.kind() {
        DbKind::Postgres => 1000,
        DbKind::Sqlite => 50,
    };
    let mut w = crate::store::WriteConn::acquire(store.pool()).await?;
    let mut tx = sqlx::Connection::begin(w.conn()).await?;
    for chunk in rows.chunks(per_statement) {
        insert_rows(&mut tx, store.kind(), chunk).await?;
    }
    tx.commit().await?;
    w.keep();
    Ok(())
}

/// `INSERT INTO request_log (…) VALUES (…), …` for `rows` rows; `replay` makes it skip rows
/// already stored (same row id). PostgreSQL gets numbered placeholders (`$1`, `$2`, …) and
/// `ON CONFLICT DO NOTHING` on its row-id key; SQLite anonymous ones (`?`) — sqlx looks each
/// numbered one up by name, and SQLite's name lookup walks the statement's parameter list,
/// which made a 64-row statement cost ~50 µs per row — and, as its table has no unique index
/// on the row id (one B-tree fewer for every row written), a `NOT EXISTS` check that finds a
/// stored row through the `at` index.
fn insert_sql(kind: DbKind, rows: usize, replay: bool) -> String {
    let mut sql = String::with_capacity(240 + rows * WIDTH * 6);
    sql.push_str("INSERT INTO request_log (");
    sql.push_str(COLUMNS);
    sql.push(')');
    let sqlite_replay = replay && kind == DbKind::Sqlite;
    sql.push_str(if sqlite_replay {
        " SELECT * FROM (VALUES "
    } else {
        " VALUES "
    });
    let mut n = 0usize;
    for i in 0..rows {
        sql.push_str(if i == 0 { "(" } else { ", (" });
        for c in 0..WIDTH {
            n += 1;
            if c > 0 {
                sql.push(',');
            }
            match kind {
                DbKind::Postgres => {
                    sql.push('$');
                    sql.push_str(itoa::Buffer::new().format(n));
                }
                DbKind::Sqlite => sql.push('?'),
            }
        }
        sql.push(')');
    }
    if sqlite_replay {
        // VALUES names its columns column1, column2, …: row_id and at are the first two.
        sql.push_str(
            ") AS v WHERE NOT EXISTS \
             (SELECT 1 FROM request_log r WHERE r.at = v.column2 AND r.row_id = v.column1)",
        );
    } else if replay {
        sql.push_str(" ON CONFLICT DO NOTHING");
    }
    sql
}

/// One multi-row INSERT (placeholders as `insert_sql` writes them for the engine); rows already
/// stored (same row id) are skipped.
async fn insert_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    kind: DbKind,
    rows: &[LogRow],
) -> Result<(), sqlx::Error> {
    let sql = insert_sql(kind, rows.len(), true);
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
            .bind(r.hop_us)
            .bind(r.endpoint.clone());
    }
    q.execute(&mut **tx).await?;
    Ok(())
}
