//! The request log's bulk pool: `BulkPool`, a pool of the engine's own driver (not `Any`) with
//! one lazily opened connection, closed after `BULK_IDLE` without a batch.

use std::time::Duration;

use super::{KeyStore, StoreError};
use crate::config::{DatabaseConfig, DbKind};

/// The store's engine-specific pool, for writers that need what `Any` cannot do.
#[derive(Debug, Clone)]
pub enum BulkPool {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

/// How long the bulk writer's connection stays open without a batch. Past it the pool closes
/// the connection (sqlx checks every `BULK_IDLE`, so it closes 1–2 × `BULK_IDLE` after the last
/// batch) and the next batch opens another. A burst fills SQLite's page cache (2 MB by
/// default) and prepares the multi-row `INSERT`s, in SQLite's own memory, which is given back
/// only when the connection closes; on PostgreSQL an idle replica's writer holds no server
/// backend. Under steady traffic a batch comes every `flush_interval`, so the connection stays;
/// opening one is part of the batch's write and its 5 s timeout (past it, the batch spills).
pub const BULK_IDLE: Duration = Duration::from_secs(5);

/// One lazily connected connection of the engine's own driver, to the same database, closed
/// after `BULK_IDLE` without use.
pub(super) fn bulk_pool(config: &DatabaseConfig, kind: DbKind) -> Result<BulkPool, StoreError> {
    use std::str::FromStr;
    let url = config.connect_url();
    Ok(match kind {
        DbKind::Postgres => BulkPool::Postgres(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .idle_timeout(BULK_IDLE)
                .acquire_timeout(config.connect_timeout)
                .connect_lazy_with(sqlx::postgres::PgConnectOptions::from_str(&url)?),
        ),
        DbKind::Sqlite => BulkPool::Sqlite(
            sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .idle_timeout(BULK_IDLE)
                .acquire_timeout(config.connect_timeout)
                .connect_lazy_with(
                    sqlx::sqlite::SqliteConnectOptions::from_str(&url)?
                        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                        // The request log only: a commit is not synced to disk (the WAL is at
                        // each checkpoint). A power cut can lose the last commits' rows, never
                        // corrupt the file; keys and the audit trail stay fully synchronous.
                        .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                        .busy_timeout(Duration::from_secs(5)),
                ),
        ),
    })
}

impl KeyStore {
    /// The engine's own pool for bulk writes: one connection, opened on first use and closed
    /// after `BULK_IDLE` without a batch.
    pub fn bulk(&self) -> &BulkPool {
        &self.bulk
    }
}
