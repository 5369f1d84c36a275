//! The keys in the store: `CreateKey` (what a new key asks for), reading a key from its row,
//! and the `KeyStore` methods that read keys (load_all, list, get, change_seq) and change them
//! (create, revoke, rotate), each change audited in the same transaction.

use std::time::Duration;

use serde::Deserialize;
use sqlx::any::AnyRow;
use sqlx::{Connection as _, Row};

use super::audit::audit;
use super::{KeyStore, StoreError, WriteConn};
use crate::clock::wall_ms;
use crate::config::DbKind;
use crate::key::KeyRecord;
use crate::key::{self, Environment};
use fleetgate_protocol::endpoint::Families;

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

impl KeyStore {
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
    pub(crate) async fn change_seq(&self) -> Result<i64, StoreError> {
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
}
