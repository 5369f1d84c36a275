//! `[database]`: where the key store lives (PostgreSQL by URL, or the embedded SQLite file).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, FileErrors};
use crate::secret::Secret;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbKind {
    Postgres,
    Sqlite,
}

impl DbKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DbKind::Postgres => "postgres",
            DbKind::Sqlite => "sqlite",
        }
    }
}

/// Where the store lives, from `[database]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseConfig {
    /// `postgres://...` (TLS via `sslmode=` in the URL), or `None` for SQLite at `sqlite_path`.
    pub url: Option<Secret>,
    pub sqlite_path: PathBuf,
    pub max_connections: u32,
    pub connect_timeout: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: None,
            sqlite_path: PathBuf::from("fleetgate.db"),
            max_connections: 8,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl DatabaseConfig {
    pub fn kind(&self) -> DbKind {
        if self.url.is_some() {
            DbKind::Postgres
        } else {
            DbKind::Sqlite
        }
    }

    /// The connection URL (contains credentials: never log it).
    pub(crate) fn connect_url(&self) -> String {
        match &self.url {
            Some(u) => u.expose().to_owned(),
            None => format!("sqlite://{}?mode=rwc", self.sqlite_path.display()),
        }
    }

    /// Where the store is, safe to print (no password).
    pub fn describe(&self) -> String {
        match &self.url {
            Some(u) => redact_url(u.expose()),
            None => format!("sqlite file {}", self.sqlite_path.display()),
        }
    }
}

/// `postgres://user:pass@host/db` → `postgres://user:*****@host/db`.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:*****{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

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
        sqlite_path: err.path(d.sqlite_path),
        max_connections: d.max_connections,
        connect_timeout: Duration::from_millis(d.connect_timeout_ms.max(1)),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDatabase {
    pub(super) url: Option<String>,
    #[serde(default = "default_sqlite_path")]
    pub(super) sqlite_path: PathBuf,
    #[serde(default = "default_max_connections")]
    pub(super) max_connections: u32,
    #[serde(default = "default_db_connect_ms")]
    pub(super) connect_timeout_ms: u64,
    #[serde(default = "super::default_true")]
    pub(super) migrate_on_start: bool,
}

impl Default for RawDatabase {
    fn default() -> Self {
        Self {
            url: None,
            sqlite_path: default_sqlite_path(),
            max_connections: default_max_connections(),
            connect_timeout_ms: default_db_connect_ms(),
            migrate_on_start: true,
        }
    }
}

fn default_sqlite_path() -> PathBuf {
    PathBuf::from("fleetgate.db")
}

fn default_max_connections() -> u32 {
    8
}

fn default_db_connect_ms() -> u64 {
    5000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("postgres://fg:s3cret@db:5432/fleet"),
            "postgres://fg:*****@db:5432/fleet"
        );
        assert_eq!(redact_url("postgres://db/fleet"), "postgres://db/fleet");
    }
}
