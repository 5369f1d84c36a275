//! Writing batches into the store: PostgreSQL's binary `COPY`, SQLite's prepared multi-row
//! `INSERT`s, and the replay of spilled rows that skips rows already stored.

use std::io::Write;

use super::row::{COLUMNS, Pending, RowId, SpillRow};
use crate::config::DbKind;
use crate::store::{BulkPool, KeyStore};

/// Columns per row.
pub(super) const WIDTH: usize = 35;

/// Rows per SQLite statement, largest first: a batch is cut into statements of these sizes,
/// so at most a few distinct statements exist, each prepared once and then cached. 64 rows, not
/// more: SQLite allocates with glibc's malloc, which keeps up to twice the largest block it
/// has unmapped before it gives freed memory back, and a larger statement prepares larger
/// blocks. After a burst, with the writer's connection closed, its heap kept 1.8 MB with
/// 256-row statements and 0.9 MB with 64-row ones, for the same CPU per row (32 rows cost
/// 0.5 µs more per row; docs/benchmarks.md, "What the request log's writer keeps").
pub(super) const SQLITE_ROWS: [usize; 4] = [64, 16, 4, 1];

/// Fresh batches into the store, in the engine's own bulk form (replayed spill rows take
/// `insert`, which skips rows already stored).
pub(super) enum Sink {
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
    pub(super) fn new(pool: BulkPool, batch_rows: usize) -> Self {
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

    pub(super) async fn write(
        &mut self,
        prefix: &str,
        rows: &[Pending],
    ) -> Result<(), sqlx::Error> {
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
                            .bind(f.endpoint)
                            .bind(
                                f.trace_id
                                    .as_ref()
                                    .map(|h| String::from_utf8_lossy(h).into_owned()),
                            )
                            .bind(f.predicted_cached_tokens)
                            .bind(f.cached_tokens)
                            .bind(f.resumes)
                            .bind(f.resume_detail)
                            .bind(f.fleet_tokens)
                            .bind(f.fallback_from)
                            .bind(f.fallback_detail);
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
pub(super) fn encode_copy(buf: &mut Vec<u8>, prefix: &str, rows: &[Pending]) {
    pub(super) fn text(buf: &mut Vec<u8>, v: Option<&[u8]>) {
        match v {
            Some(b) => {
                buf.extend_from_slice(&i32::try_from(b.len()).unwrap_or(i32::MAX).to_be_bytes());
                buf.extend_from_slice(b);
            }
            None => buf.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    pub(super) fn int8(buf: &mut Vec<u8>, v: Option<i64>) {
        match v {
            Some(v) => {
                buf.extend_from_slice(&8i32.to_be_bytes());
                buf.extend_from_slice(&v.to_be_bytes());
            }
            None => buf.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    pub(super) fn int4(buf: &mut Vec<u8>, v: i32) {
        buf.extend_from_slice(&4i32.to_be_bytes());
        buf.extend_from_slice(&v.to_be_bytes());
    }
    /// Text formatted straight into the buffer; its length, known only after, goes before it.
    pub(super) fn text_fmt(buf: &mut Vec<u8>, v: std::fmt::Arguments<'_>) {
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
        text(buf, f.trace_id.as_ref().map(|h| &h[..]));
        int8(buf, f.predicted_cached_tokens);
        int8(buf, f.cached_tokens);
        match f.resumes {
            Some(n) => int4(buf, n),
            None => text(buf, None),
        }
        text(buf, f.resume_detail.map(str::as_bytes));
        int8(buf, f.fleet_tokens);
        text(buf, f.fallback_from.map(str::as_bytes));
        text(buf, f.fallback_detail.map(str::as_bytes));
    }
    buf.extend_from_slice(&(-1i16).to_be_bytes());
}

/// Insert replayed rows in one transaction (one commit, one fsync), skipping rows already
/// stored: multi-row statements of 1000 rows on PostgreSQL, 50 on SQLite.
pub(super) async fn insert(store: &KeyStore, rows: &[SpillRow]) -> Result<(), sqlx::Error> {
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
pub(super) fn insert_sql(kind: DbKind, rows: usize, replay: bool) -> String {
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
pub(super) async fn insert_rows(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    kind: DbKind,
    rows: &[SpillRow],
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
            .bind(r.endpoint.clone())
            .bind(r.trace_id.clone())
            .bind(r.predicted_cached_tokens)
            .bind(r.cached_tokens)
            .bind(r.resumes)
            .bind(r.resume_detail.clone())
            .bind(r.fleet_tokens)
            .bind(r.fallback_from.clone())
            .bind(r.fallback_detail.clone());
    }
    q.execute(&mut **tx).await?;
    Ok(())
}
