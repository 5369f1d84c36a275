//! Typed configuration: a raw serde layer that rejects unknown fields and reports the path of
//! any mistake, then validation into the structs the program uses. Each section's raw type, its
//! defaults and its validation into the checked type live in the section's module (`server`,
//! `pools`, ...); this module holds `Config`, the file's top-level raw shape (`RawConfig`) and
//! the load/parse entry points.

mod admin;
mod auth;
mod backends;
mod database;
mod fallbacks;
mod interpolate;
mod kv_events;
mod limits;
mod otel;
mod pool_health;
mod pools;
mod queue;
mod request_log;
mod server;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use serde::Deserialize;

use admin::RawAdmin;
use auth::RawAuth;
use database::RawDatabase;
use limits::RawLimits;
use otel::RawTracing;
use pools::RawPool;
use queue::RawQueue;
use request_log::RawRequestLog;
use server::RawServer;

pub use admin::{AdminConfig, JwtKey};

pub use admin::JwtAlgorithm;
pub use auth::AuthConfig;
pub use backends::{BackendConfig, Discover};
pub use database::{DatabaseConfig, DbKind};
pub use fallbacks::FallbackConfig;
pub(crate) use interpolate::interpolate_env;
pub use kv_events::KvEventsConfig;
pub use limits::{EnvLimits, LimitsConfig, RedisConfig, SharedLimits};
pub use otel::TracingConfig;
pub(crate) use otel::{OtlpExport, SamplerChoice};
pub(crate) use pool_health::{EjectionConfig, RetryConfig};
pub use pool_health::{LoadAwareConfig, ResumeConfig};
pub use pools::Timeouts;
pub use pools::{
    AffinityBy, AffinityConfig, EnginePriority, LongPromptConfig, PoolConfig, PoolKind,
};
pub use queue::QueueConfig;
pub use request_log::RequestLogConfig;
pub use server::{LogFormat, ServerConfig, TlsConfig};

use crate::key::Environment;

/// A configuration problem, reported with the file and the field it concerns (`-`: the
/// whole file, e.g. it cannot be read or is not TOML; the message then names no field).
/// `fleetgate` exits with code 64 (EX_USAGE) on one of these.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.field.as_str() {
            "-" | "" => write!(f, "{}: {}", self.file, self.message),
            field => write!(f, "{}: {field}: {}", self.file, self.message),
        }
    }
}

/// Errors of one file: the sections name the field, this adds which file it was. It also
/// knows the file's directory, against which a relative path in the file resolves.
#[derive(Clone, Copy)]
struct FileErrors<'a> {
    file: &'a str,
    /// The config file's directory (none: text given without a file, paths stay as written).
    dir: Option<&'a Path>,
}

impl FileErrors<'_> {
    /// A path written in the file: a relative one resolves against the file's directory, so
    /// that every command reading the file (`serve`, `keys`, `migrate`, from any working
    /// directory) means the same file.
    fn path(self, p: PathBuf) -> PathBuf {
        match self.dir {
            Some(dir) if p.is_relative() && !p.as_os_str().is_empty() => dir.join(p),
            _ => p,
        }
    }

    fn at(self, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            field: field.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub pools: Vec<PoolConfig>,
    pub database: DatabaseConfig,
    /// Apply pending migrations when `serve` starts.
    pub migrate_on_start: bool,
    pub auth: AuthConfig,
    pub admin: AdminConfig,
    pub request_log: RequestLogConfig,
    pub limits: LimitsConfig,
    pub queue: QueueConfig,
    /// `[tracing]` with the `OTEL_*` environment over it.
    pub tracing: TracingConfig,
}

impl Config {
    /// The sections other than `[[pools]]` that differ in `next` (a reload applies only the
    /// pools; these need a restart). Values are compared, secrets included: their printed
    /// form is redacted, so it cannot tell two credentials apart.
    pub(crate) fn restart_needed_for(&self, next: &Config) -> Vec<&'static str> {
        [
            ("[server]", self.server != next.server),
            ("[database]", self.database != next.database),
            (
                "migrate_on_start",
                self.migrate_on_start != next.migrate_on_start,
            ),
            ("[auth]", self.auth != next.auth),
            ("[admin]", self.admin != next.admin),
            ("[request_log]", self.request_log != next.request_log),
            ("[limits]", self.limits != next.limits),
            ("[queue]", self.queue != next.queue),
            ("[tracing]", self.tracing != next.tracing),
        ]
        .into_iter()
        .filter_map(|(section, changed)| changed.then_some(section))
        .collect()
    }

    /// A config with defaults for everything but the pools (tests, the demo).
    pub fn with_pools(pools: Vec<PoolConfig>) -> Self {
        Self {
            server: ServerConfig::default(),
            pools,
            database: DatabaseConfig::default(),
            migrate_on_start: true,
            auth: AuthConfig::default(),
            admin: AdminConfig::default(),
            request_log: RequestLogConfig::default(),
            limits: LimitsConfig::default(),
            queue: QueueConfig::default(),
            tracing: TracingConfig::default(),
        }
    }
}

impl Config {
    /// Read, interpolate, parse and validate a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            field: "-".into(),
            message: format!("cannot read the file: {e}"),
        })?;
        // `fleetgate.toml` alone: its directory is the working directory, and the paths stay
        // relative as written.
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        Self::parse_in(&file, &text, |name| std::env::var(name).ok(), dir)
    }

    /// Parse config text (`file` only names it in errors).
    pub fn parse(
        file: &str,
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        Self::parse_in(file, text, env, None)
    }

    fn parse_in(
        file: &str,
        text: &str,
        env: impl Fn(&str) -> Option<String>,
        dir: Option<&Path>,
    ) -> Result<Config, ConfigError> {
        let err = FileErrors { file, dir };
        let text = interpolate_env(text, &env).map_err(|e| err.at("-", e.to_string()))?;
        validate(parse(&text, err)?, &env, err)
    }
}

/// Section by section; with several mistakes this order decides which one is reported.
fn validate(
    raw: RawConfig,
    env: &dyn Fn(&str) -> Option<String>,
    err: FileErrors<'_>,
) -> Result<Config, ConfigError> {
    let server = server::validate(raw.server, err)?;
    let pools = pools::validate(raw.pools, err)?;
    let migrate_on_start = raw.database.migrate_on_start;
    let database = database::validate(raw.database, err)?;
    let auth = auth::validate(raw.auth, err)?;
    let admin = admin::validate(raw.admin, err)?;
    let request_log = request_log::validate(raw.request_log, err)?;
    let limits = limits::validate(raw.limits, err)?;
    let queue = queue::validate(raw.queue, err)?;
    let tracing = otel::validate(raw.tracing, env, err)?;
    Ok(Config {
        server,
        pools,
        database,
        migrate_on_start,
        auth,
        admin,
        request_log,
        limits,
        queue,
        tracing,
    })
}

/// Deserialize interpolated TOML text, naming the path of the first field that does not fit
/// (`server.lisen`, `pools[0].backends[1]`).
fn parse(text: &str, err: FileErrors<'_>) -> Result<RawConfig, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| err.at("-", e.to_string()))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        err.at(path, e.into_inner().message())
    })
}

/// The file as written: its tables, each read by its section's raw type.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    pools: Vec<RawPool>,
    #[serde(default)]
    database: RawDatabase,
    #[serde(default)]
    auth: RawAuth,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    request_log: RawRequestLog,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    queue: RawQueue,
    #[serde(default)]
    tracing: RawTracing,
}

/// `#[serde(default = "super::default_true")]` for the sections' switches that default on.
fn default_true() -> bool {
    true
}
