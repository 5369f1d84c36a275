//! `[database]`: where the key store lives (PostgreSQL by URL, or the embedded SQLite file).

use std::time::Duration;

use super::raw::RawDatabase;
use super::{ConfigError, DatabaseConfig, FileErrors};
use crate::secret::Secret;

pub(super) fn validate(d: RawDatabase, err: FileErrors<'_>) -> Result<DatabaseConfig, ConfigError> {
    let url = d.url.filter(|u| !u.trim().is_empty());
    if let Some(u) = &url
        && !(u.starts_with("postgres://") || u.starts_with("postgresql://"))
    {
        return Err(err.at(
            "database.url",
            "must be a postgres:// URL (leave it out to use the embedded SQLite file at database.sqlite_path)",
        ));
    }
    if d.max_connections == 0 {
        return Err(err.at("database.max_connections", "must be > 0"));
    }
    Ok(DatabaseConfig {
        url: url.map(Secret::new),
        sqlite_path: d.sqlite_path,
        max_connections: d.max_connections,
        connect_timeout: Duration::from_millis(d.connect_timeout_ms.max(1)),
    })
}
