//! The key store: API keys and their audit trail in PostgreSQL (production) or an embedded
//! SQLite file (the zero-setup default), through sqlx with migrations. One set of queries runs
//! on both (sqlx's `Any` driver; times are epoch milliseconds); change notification differs:
//! PostgreSQL NOTIFY on `fleetgate_keys`, SQLite a change counter that gateways poll.
//! Nothing here is called on the request path except the bounded lookup of unknown keys.
//!
//! This file holds the store itself (`KeyStore`: connect, migrate, and its pool, kind and config), its
//! errors
//! (`StoreError`), the embedded migrations and `WriteConn`, on which every write transaction
//! runs. The rest is a file per concern, each adding its own `impl KeyStore` methods:
//! - `keys.rs`: the keys: `CreateKey`, create, revoke, rotate, get, list, load_all, change_seq;
//! - `audit.rs`: the audit trail: `AuditEntry`, `AuditSearch`, audit_log, audit_search,
//!   audit_event;
//! - `bulk.rs`: `BulkPool`, the engine's own pool for the request log's bulk writes.

use std::time::Duration;

use sqlx::any::AnyPoolOptions;
use sqlx::pool::PoolConnection;
use sqlx::{AnyPool, Database, Pool};

use crate::config::{DatabaseConfig, DbKind};

mod audit;
mod bulk;
mod keys;

pub(crate) use audit::{AuditEntry, AuditSearch};
pub use bulk::{BULK_IDLE, BulkPool};
pub use keys::CreateKey;

use bulk::bulk_pool;

/// Migrations embedded in the binary, one set per engine.
pub(crate) static PG_MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/postgres");
pub(crate) static SQLITE_MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/sqlite");

/// The PostgreSQL channel the key trigger notifies.
pub(crate) const KEYS_CHANNEL: &str = "fleetgate_keys";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("key `{0}` not found")]
    NotFound(String),
    #[error("key `{0}` is already revoked")]
    AlreadyRevoked(String),
    #[error("{0}")]
    Invalid(String),
    /// No connection could be opened: the server's host and port (never the URL's password)
    /// and why.
    #[error(
        "the key store's server at {at} is unreachable ({cause}): check the URL ([database] url, --database-url or FLEETGATE_DATABASE_URL) and that PostgreSQL runs there and accepts connections from this host"
    )]
    Unreachable { at: String, cause: String },
    /// The change was committed, yet reading it back shows the old state: it is not taken
    /// as done (nothing is applied in memory).
    #[error("the change to key `{0}` did not reach the database (read back unchanged)")]
    NotDurable(String),
}

/// A connection taken from a pool for one write transaction. It goes back to the pool only
/// when `keep` is called after the commit (or a clean rollback); dropped otherwise — the write
/// failed, or was cancelled — it is closed, and the pool opens a fresh one. A connection whose
/// write failed may still be inside its transaction: SQLite leaves it open when `COMMIT` fails
/// (a read-only file, a full disk), sqlx then nests the next `begin` as a SAVEPOINT whose
/// release commits nothing, and the open transaction holds the write lock, so every other
/// writer gets "database is locked" until the process restarts.
pub(crate) struct WriteConn<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> WriteConn<DB> {
    pub(crate) async fn acquire(pool: &Pool<DB>) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    /// The connection (present until `keep` or drop).
    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        match self.0.as_mut() {
            Some(c) => c,
            None => unreachable!("a WriteConn is used only before `keep` consumes it"),
        }
    }

    /// The transaction ended cleanly: the connection goes back to the pool.
    pub(crate) fn keep(mut self) {
        drop(self.0.take());
    }
}

impl<DB: Database> Drop for WriteConn<DB> {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            c.close_on_drop();
        }
    }
}

#[derive(Debug, Clone)]
pub struct KeyStore {
    pool: AnyPool,
    /// A pool of the engine's own driver for bulk writes (the request log): `Any` converts and
    /// copies every bound value and cannot `COPY`. Connects on first use.
    bulk: BulkPool,
    kind: DbKind,
    config: DatabaseConfig,
}

/// A PostgreSQL server that gave no connection, said as such. sqlx's pool retries until its
/// acquire timeout and then says only "pool timed out": one direct attempt, bounded by the
/// same timeout, finds the cause (connection refused, no such host, a timeout).
async fn unreachable(config: &DatabaseConfig, e: sqlx::Error) -> StoreError {
    use sqlx::ConnectOptions;
    let url = config.connect_url();
    let Ok(options) = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
    else {
        return e.into();
    };
    let at = format!("{}:{}", options.get_host(), options.get_port());
    let cause = match e {
        sqlx::Error::PoolTimedOut => {
            match tokio::time::timeout(config.connect_timeout, options.connect()).await {
                Err(_) => format!(
                    "no connection within {} s",
                    config.connect_timeout.as_secs_f64()
                ),
                Ok(Err(sqlx::Error::Io(io))) => io.to_string(),
                // It answers now (or fails past the connection: a password, a database):
                // that error is the one to show.
                Ok(Err(other)) => return other.into(),
                Ok(Ok(_)) => return e.into(),
            }
        }
        sqlx::Error::Io(io) => io.to_string(),
        other => return other.into(),
    };
    StoreError::Unreachable { at, cause }
}

impl KeyStore {
    /// Connect (creating the SQLite file if needed). Does not migrate.
    pub async fn connect(config: &DatabaseConfig) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let kind = config.kind();
        if kind == DbKind::Sqlite
            && let Some(dir) = config.sqlite_path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Invalid(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let max = match kind {
            DbKind::Postgres => config.max_connections,
            // One writer at a time anyway; a few readers.
            DbKind::Sqlite => config.max_connections.min(4),
        };
        let pool = match AnyPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(config.connect_timeout)
            .connect(&config.connect_url())
            .await
        {
            Ok(pool) => pool,
            Err(e) if kind == DbKind::Postgres => return Err(unreachable(config, e).await),
            Err(e) => return Err(e.into()),
        };
        if kind == DbKind::Sqlite {
            // WAL lets the gateway read while the CLI writes; wait instead of failing on a lock.
            // The wait is set first: switching a fresh file to WAL takes its write lock, and
            // several processes opening it at once (a `migrate` beside a `serve`) meet there.
            sqlx::query("PRAGMA busy_timeout=5000")
                .execute(&pool)
                .await?;
            // SQLite does not always call the busy handler for the journal-mode switch: it is
            // retried while another connection holds the lock, within the same 5 s.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                match sqlx::query("PRAGMA journal_mode=WAL").execute(&pool).await {
                    Ok(_) => break,
                    Err(e)
                        if std::time::Instant::now() < deadline
                            && e.as_database_error()
                                .is_some_and(|d| d.message().contains("locked")) =>
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let bulk = bulk_pool(config, kind)?;
        Ok(Self {
            pool,
            bulk,
            kind,
            config: config.clone(),
        })
    }

    pub fn kind(&self) -> DbKind {
        self.kind
    }

    pub(crate) fn config(&self) -> &DatabaseConfig {
        &self.config
    }

    /// Apply pending migrations; returns how many were applied.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        let migrator = match self.kind {
            DbKind::Postgres => &PG_MIGRATOR,
            DbKind::Sqlite => &SQLITE_MIGRATOR,
        };
        let before = self.applied_migrations().await.unwrap_or(0);
        let mut attempt = 0;
        loop {
            match migrator.run(&self.pool).await {
                Ok(()) => break,
                // SQLite has no migration lock (PostgreSQL's is an advisory lock): a `serve`
                // starting while `keys create` opens the same new file migrate it at the same
                // moment, and the slower one fails on a step the other already applied (its
                // transaction rolls back). Run again: what the other applied is skipped, and a
                // genuine failure fails again.
                Err(e) if self.kind == DbKind::Sqlite && attempt < 5 => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "sqlite migration raced; running again");
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let after = self.applied_migrations().await.unwrap_or(before);
        Ok(after.saturating_sub(before))
    }

    async fn applied_migrations(&self) -> Result<usize, StoreError> {
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations WHERE success = true")
                .fetch_one(&self.pool)
                .await
                .or_else(|e| match e {
                    sqlx::Error::Database(_) => Ok(0),
                    e => Err(e),
                })?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }
}
