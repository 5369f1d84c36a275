//! The key store's audit trail: `AuditEntry`, `AuditSearch`, the `KeyStore` methods that read
//! it (audit_log, audit_search) or record an event that is not a key change (audit_event), and
//! `audit`, which writes an entry inside a key change's transaction.

use serde::Serialize;
use sqlx::{Connection as _, Row};

use super::{KeyStore, StoreError, WriteConn};
use crate::clock::wall_ms;

/// One audit entry.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub id: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub key_public_id: Option<String>,
    pub(crate) detail: serde_json::Value,
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
pub(crate) struct AuditSearch<'a> {
    pub(crate) key: Option<&'a str>,
    pub(crate) actor: Option<&'a str>,
    pub(crate) action: Option<&'a str>,
    pub(crate) limit: i64,
}

impl KeyStore {
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
    pub(crate) async fn audit_search(
        &self,
        s: &AuditSearch<'_>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
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
    pub(crate) async fn audit_event(
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
}

/// Write one audit entry inside `tx`, the transaction of the change it records.
pub(super) async fn audit(
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
