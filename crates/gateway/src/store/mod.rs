//! The key store: API keys and their audit trail in PostgreSQL (production) or an embedded
//! SQLite file (the zero-setup default), through sqlx with migrations. One set of queries runs
//! on both (sqlx's `Any` driver; times are epoch milliseconds); change notification differs:
//! PostgreSQL NOTIFY on `fleetgate_keys`, SQLite a change counter that gateways poll.
//! Nothing here is called on the request path except the bounded lookup of unknown keys.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::pool::PoolConnection;
use sqlx::{AnyPool, Connection as _, Database, Pool, Row};

use crate::clock::wall_ms;
use crate::config::{DatabaseConfig, DbKind};
use crate::key::KeyRecord;
use crate::key::{self, Environment};
use fleetgate_protocol::endpoint::Families;

/// Migrations embedded in the binary, one set per engine.
pub static PG_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/postgres");
pub static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/sqlite");

/// The PostgreSQL channel the key trigger notifies.
pub const KEYS_CHANNEL: &str = "fleetgate_keys";

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
pub struct WriteConn<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> WriteConn<DB> {
    pub async fn acquire(pool: &Pool<DB>) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    /// The connection (present until `keep` or drop).
    pub fn conn(&mut self) -> &mut DB::Connection {
        match self.0.as_mut() {
            Some(c) => c,
            None => unreachable!("a WriteConn is used only before `keep` consumes it"),
        }
    }

    /// The transaction ended cleanly: the connection goes back to the pool.
    pub fn keep(mut self) {
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

/// What `keys create` / `POST /admin/keys` ask for.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    pub name: String,
    pub environment: Option<Environment>,
    #[serde(default)]
    pub allowed_models: Option<Vec<String>>,
    /// The endpoint families the key may call (`chat`, `embeddings`, …; default all).
    #[serde(default)]
    pub allowed_endpoints: Option<Vec<String>>,
    #[serde(default)]
    pub requests_per_minute: Option<i64>,
    #[serde(default)]
    pub tokens_per_minute: Option<i64>,
    #[serde(default)]
    pub max_concurrent_streams: Option<i64>,
    /// Lifetime from now, in seconds.
    #[serde(default)]
    pub expires_in_seconds: Option<i64>,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
}

/// One audit entry.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub id: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub key_public_id: Option<String>,
    pub detail: serde_json::Value,
}

impl AuditEntry {
    /// `detail` for people: an instant stored as epoch milliseconds (a field named `*_at`)
    /// written as ISO 8601 (`"expires_at": "2027-03-02T10:00:00Z"`, not `1803966450046`).
    /// The stored entry and `--json` keep the number.
    pub fn detail_for_people(&self) -> serde_json::Value {
        fn walk(v: &serde_json::Value) -> serde_json::Value {
            match v {
                serde_json::Value::Object(map) => map
                    .iter()
                    .map(|(k, v)| {
                        let v = match v.as_i64() {
                            Some(ms) if k.ends_with("_at") => {
                                serde_json::Value::String(crate::clock::format_wall_ms(ms))
                            }
                            _ => walk(v),
                        };
                        (k.clone(), v)
                    })
                    .collect(),
                serde_json::Value::Array(items) => items.iter().map(walk).collect(),
                other => other.clone(),
            }
        }
        walk(&self.detail)
    }
}

/// What `audit_search` looks for (`None`: any).
#[derive(Debug, Clone, Copy)]
pub struct AuditSearch<'a> {
    pub key: Option<&'a str>,
    pub actor: Option<&'a str>,
    pub action: Option<&'a str>,
    pub limit: i64,
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

/// The store's engine-specific pool, for writers that need what `Any` cannot do.
#[derive(Debug, Clone)]
pub enum BulkPool {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

const KEY_COLUMNS: &str = "id, public_id, name, environment, secret_hash, previous_secret_hash, \
    previous_valid_until, created_at, created_by, expires_at, revoked_at, revoked_by, revoke_reason, \
    allowed_models, allowed_endpoints, requests_per_minute, tokens_per_minute, max_concurrent_streams, \
    metadata, updated_at";

fn hash_from(bytes: Vec<u8>) -> Result<[u8; 32], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Invalid("secret hash is not 32 bytes".into()))
}

fn key_from_row(row: &AnyRow) -> Result<KeyRecord, StoreError> {
    let env: String = row.try_get("environment")?;
    let environment = Environment::parse(&env)
        .ok_or_else(|| StoreError::Invalid(format!("unknown environment `{env}` in api_keys")))?;
    let allowed: Option<String> = row.try_get("allowed_models")?;
    let allowed_models = match allowed {
        Some(text) => Some(
            serde_json::from_str::<Vec<String>>(&text)
                .map_err(|e| StoreError::Invalid(format!("allowed_models: {e}")))?,
        ),
        None => None,
    };
    let endpoints: Option<String> = row.try_get("allowed_endpoints")?;
    let allowed_endpoints = match endpoints {
        Some(text) => {
            let names = serde_json::from_str::<Vec<String>>(&text)
                .map_err(|e| StoreError::Invalid(format!("allowed_endpoints: {e}")))?;
            Some(
                Families::parse(&names)
                    .map_err(|e| StoreError::Invalid(format!("allowed_endpoints: {e}")))?,
            )
        }
        None => None,
    };
    let previous = match (
        row.try_get::<Option<Vec<u8>>, _>("previous_secret_hash")?,
        row.try_get::<Option<i64>, _>("previous_valid_until")?,
    ) {
        (Some(h), Some(until)) => Some((hash_from(h)?, until)),
        _ => None,
    };
    let metadata: String = row.try_get("metadata")?;
    Ok(KeyRecord {
        id: row.try_get("id")?,
        public_id: row.try_get::<String, _>("public_id")?.into_boxed_str(),
        name: row.try_get("name")?,
        environment,
        secret_hash: hash_from(row.try_get("secret_hash")?)?,
        previous,
        created_at: row.try_get("created_at")?,
        created_by: row.try_get("created_by")?,
        expires_at: row.try_get("expires_at")?,
        revoked_at: row.try_get("revoked_at")?,
        revoked_by: row.try_get("revoked_by")?,
        revoke_reason: row.try_get("revoke_reason")?,
        allowed_models,
        allowed_endpoints,
        requests_per_minute: row.try_get("requests_per_minute")?,
        tokens_per_minute: row.try_get("tokens_per_minute")?,
        max_concurrent_streams: row.try_get("max_concurrent_streams")?,
        metadata: serde_json::from_str(&metadata).unwrap_or(serde_json::Value::Null),
        updated_at: row.try_get("updated_at")?,
    })
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
fn bulk_pool(config: &DatabaseConfig, kind: DbKind) -> Result<BulkPool, StoreError> {
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

    /// The engine's own pool for bulk writes: one connection, opened on first use and closed
    /// after `BULK_IDLE` without a batch.
    pub fn bulk(&self) -> &BulkPool {
        &self.bulk
    }

    pub fn kind(&self) -> DbKind {
        self.kind
    }

    pub fn config(&self) -> &DatabaseConfig {
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

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub async fn load_all(&self) -> Result<Vec<KeyRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys ORDER BY id"))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(key_from_row).collect()
    }

    pub async fn list(&self, env: Option<Environment>) -> Result<Vec<KeyRecord>, StoreError> {
        let mut keys = self.load_all().await?;
        if let Some(env) = env {
            keys.retain(|k| k.environment == env);
        }
        Ok(keys)
    }

    pub async fn get(&self, public_id: &str) -> Result<Option<KeyRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE public_id = $1"
        ))
        .bind(public_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(key_from_row).transpose()
    }

    /// SQLite: the change counter bumped by every key change.
    pub async fn change_seq(&self) -> Result<i64, StoreError> {
        match self.kind {
            DbKind::Sqlite => Ok(
                sqlx::query_scalar("SELECT seq FROM key_changes WHERE id = 1")
                    .fetch_one(&self.pool)
                    .await?,
            ),
            DbKind::Postgres => Ok(0),
        }
    }

    /// Create a key; returns the full key (to show once) and the stored record.
    pub async fn create(
        &self,
        req: &CreateKey,
        actor: &str,
    ) -> Result<(String, KeyRecord), StoreError> {
        let name = req.name.trim();
        if name.is_empty() {
            return Err(StoreError::Invalid(
                "`name` must not be empty: say what the key is for".into(),
            ));
        }
        let env = req.environment.ok_or_else(|| {
            StoreError::Invalid("`environment` is required: stress, gray or prod".into())
        })?;
        for (what, v) in [
            ("requests_per_minute", req.requests_per_minute),
            ("tokens_per_minute", req.tokens_per_minute),
            ("max_concurrent_streams", req.max_concurrent_streams),
        ] {
            if v.is_some_and(|v| v <= 0) {
                return Err(StoreError::Invalid(format!("`{what}` must be > 0")));
            }
        }
        if let Some(models) = &req.allowed_models
            && (models.is_empty() || models.iter().any(|m| m.trim().is_empty()))
        {
            return Err(StoreError::Invalid(
                "`allowed_models` must name at least one model (leave it out to allow all)".into(),
            ));
        }
        let endpoints = match &req.allowed_endpoints {
            Some(names) if names.is_empty() => {
                return Err(StoreError::Invalid(
                    "`allowed_endpoints` must name at least one endpoint family (leave it out to allow all)".into(),
                ));
            }
            Some(names) => {
                let set = Families::parse(names)
                    .map_err(|e| StoreError::Invalid(format!("`allowed_endpoints`: {e}")))?;
                Some(serde_json::to_string(&set.names()).unwrap_or_else(|_| "[]".into()))
            }
            None => None,
        };
        let now = wall_ms();
        let expires_at = match req.expires_in_seconds {
            Some(s) if s <= 0 => {
                return Err(StoreError::Invalid(
                    "`expires_in_seconds` must be > 0".into(),
                ));
            }
            Some(s) => Some(now.saturating_add(s.saturating_mul(1000))),
            None => None,
        };
        let new = key::generate(env, None);
        let allowed = req
            .allowed_models
            .as_ref()
            .map(|m| serde_json::to_string(m).unwrap_or_else(|_| "[]".into()));
        let metadata = req
            .metadata
            .as_ref()
            .map_or_else(|| "{}".to_owned(), |m| m.to_string());
        let mut w = WriteConn::acquire(&self.pool).await?;
        let mut tx = w.conn().begin().await?;
        sqlx::query(
            "INSERT INTO api_keys (public_id, name, environment, secret_hash, created_at, created_by, \
             expires_at, allowed_models, requests_per_minute, tokens_per_minute, max_concurrent_streams, \
             metadata, updated_at, allowed_endpoints) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(&new.public_id)
        .bind(name)
        .bind(env.as_str())
        .bind(new.secret_hash.to_vec())
        .bind(now)
        .bind(actor)
        .bind(expires_at)
        .bind(allowed)
        .bind(req.requests_per_minute)
        .bind(req.tokens_per_minute)
        .bind(req.max_concurrent_streams)
        .bind(metadata)
        .bind(now)
        .bind(endpoints)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            actor,
            "create",
            Some(&new.public_id),
            serde_json::json!({"name": name, "environment": env, "expires_at": expires_at}),
        )
        .await?;
        tx.commit().await?;
        w.keep();
        let record = self
            .get(&new.public_id)
            .await?
            .ok_or_else(|| StoreError::NotFound(new.public_id.clone()))?;
        Ok((new.full, record))
    }

    /// Revoke a key at once. Revoking twice is an error (the first reason stays).
    pub async fn revoke(
        &self,
        public_id: &str,
        reason: &str,
        actor: &str,
    ) -> Result<KeyRecord, StoreError> {
        let reason = reason.trim();
        if reason.is_empty() {
            return Err(StoreError::Invalid(
                "a revoke reason is required (it is shown to the key's users)".into(),
            ));
        }
        let now = wall_ms();
        let mut w = WriteConn::acquire(&self.pool).await?;
        let mut tx = w.conn().begin().await?;
        let done = sqlx::query(
            "UPDATE api_keys SET revoked_at = $1, revoked_by = $2, revoke_reason = $3, updated_at = $1 \
             WHERE public_id = $4 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(actor)
        .bind(reason)
        .bind(public_id)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            w.keep();
            return Err(match self.get(public_id).await? {
                Some(_) => StoreError::AlreadyRevoked(public_id.to_owned()),
                None => StoreError::NotFound(public_id.to_owned()),
            });
        }
        audit(
            &mut tx,
            actor,
            "revoke",
            Some(public_id),
            serde_json::json!({"reason": reason}),
        )
        .await?;
        tx.commit().await?;
        w.keep();
        let record = self
            .get(public_id)
            .await?
            .ok_or_else(|| StoreError::NotFound(public_id.to_owned()))?;
        // Never report the old state as done: a revoke read back unrevoked did not happen.
        if record.revoked_at.is_none() {
            return Err(StoreError::NotDurable(public_id.to_owned()));
        }
        Ok(record)
    }

    /// Give a key a new secret; the old one keeps working for `grace`.
    pub async fn rotate(
        &self,
        public_id: &str,
        grace: Duration,
        actor: &str,
    ) -> Result<(String, KeyRecord), StoreError> {
        let current = self
            .get(public_id)
            .await?
            .ok_or_else(|| StoreError::NotFound(public_id.to_owned()))?;
        if current.revoked_at.is_some() {
            return Err(StoreError::AlreadyRevoked(public_id.to_owned()));
        }
        let now = wall_ms();
        let until = now.saturating_add(i64::try_from(grace.as_millis()).unwrap_or(i64::MAX));
        let new = key::generate(current.environment, Some(public_id));
        let mut w = WriteConn::acquire(&self.pool).await?;
        let mut tx = w.conn().begin().await?;
        sqlx::query(
            "UPDATE api_keys SET previous_secret_hash = secret_hash, previous_valid_until = $1, \
             secret_hash = $2, updated_at = $3 WHERE public_id = $4 AND revoked_at IS NULL",
        )
        .bind(until)
        .bind(new.secret_hash.to_vec())
        .bind(now)
        .bind(public_id)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            actor,
            "rotate",
            Some(public_id),
            serde_json::json!({"grace_seconds": grace.as_secs(), "old_secret_valid_until": until}),
        )
        .await?;
        tx.commit().await?;
        w.keep();
        let record = self
            .get(public_id)
            .await?
            .ok_or_else(|| StoreError::NotFound(public_id.to_owned()))?;
        if record.previous.map(|(_, u)| u) != Some(until) {
            return Err(StoreError::NotDurable(public_id.to_owned()));
        }
        Ok((new.full, record))
    }

    /// Audit entries, newest first (of one key, or all).
    pub async fn audit_log(
        &self,
        public_id: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        self.audit_search(&AuditSearch {
            key: public_id,
            actor: None,
            action: None,
            limit,
        })
        .await
    }

    /// The audit trail, newest first, filtered by key, actor and action (each exact).
    pub async fn audit_search(&self, s: &AuditSearch<'_>) -> Result<Vec<AuditEntry>, StoreError> {
        let mut sql = String::from(
            "SELECT id, at, actor, action, key_public_id, detail FROM key_audit WHERE 1 = 1",
        );
        let mut binds = Vec::new();
        for (column, value) in [
            ("key_public_id", s.key),
            ("actor", s.actor),
            ("action", s.action),
        ] {
            if let Some(v) = value {
                binds.push(v.to_owned());
                sql.push_str(&format!(" AND {column} = ${}", binds.len()));
            }
        }
        sql.push_str(&format!(" ORDER BY id DESC LIMIT ${}", binds.len() + 1));
        let mut q = sqlx::query(&sql);
        for b in binds {
            q = q.bind(b);
        }
        let rows = q.bind(s.limit).fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                let detail: String = r.try_get("detail")?;
                Ok(AuditEntry {
                    id: r.try_get("id")?,
                    at: r.try_get("at")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    key_public_id: r.try_get("key_public_id")?,
                    detail: serde_json::from_str(&detail).unwrap_or(serde_json::Value::Null),
                })
            })
            .collect()
    }

    /// Record an action that is not a key change (e.g. a failed admin attempt).
    pub async fn audit_event(
        &self,
        actor: &str,
        action: &str,
        public_id: Option<&str>,
        detail: serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut w = WriteConn::acquire(&self.pool).await?;
        let mut tx = w.conn().begin().await?;
        audit(&mut tx, actor, action, public_id, detail).await?;
        tx.commit().await?;
        w.keep();
        Ok(())
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }
}

async fn audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    actor: &str,
    action: &str,
    public_id: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO key_audit (at, actor, action, key_public_id, detail) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(wall_ms())
    .bind(actor)
    .bind(action)
    .bind(public_id)
    .bind(detail.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}
