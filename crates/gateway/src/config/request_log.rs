//! `[request_log]`: the per-request rows written to the store (batching, spill file,
//! retention).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, FileErrors};

/// `[request_log]` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLogConfig {
    pub enabled: bool,
    /// Rows waiting for the writer; beyond, rows are dropped (and counted).
    pub channel_capacity: usize,
    pub batch_rows: usize,
    pub flush_interval: Duration,
    pub spill_path: PathBuf,
    pub retention_days: u32,
}

impl Default for RequestLogConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            channel_capacity: 65_536,
            batch_rows: 1000,
            flush_interval: Duration::from_millis(200),
            spill_path: PathBuf::from("fleetgate-request-log.spill"),
            retention_days: 30,
        }
    }
}

pub(super) fn validate(
    rl: RawRequestLog,
    err: FileErrors<'_>,
) -> Result<RequestLogConfig, ConfigError> {
    if rl.batch_rows == 0 || rl.batch_rows > 1000 {
        return Err(err.at("request_log.batch_rows", "must be between 1 and 1000"));
    }
    if rl.retention_days == 0 {
        return Err(err.at("request_log.retention_days", "must be ≥ 1"));
    }
    Ok(RequestLogConfig {
        enabled: rl.enabled,
        channel_capacity: rl.channel_capacity.max(1),
        batch_rows: rl.batch_rows,
        flush_interval: Duration::from_millis(rl.flush_interval_ms),
        spill_path: err.path(rl.spill_path),
        retention_days: rl.retention_days,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRequestLog {
    #[serde(default = "super::default_true")]
    pub(super) enabled: bool,
    #[serde(default = "default_log_capacity")]
    pub(super) channel_capacity: usize,
    #[serde(default = "default_batch_rows")]
    pub(super) batch_rows: usize,
    #[serde(default = "default_flush_ms")]
    pub(super) flush_interval_ms: u64,
    #[serde(default = "default_spill_path")]
    pub(super) spill_path: PathBuf,
    #[serde(default = "default_retention")]
    pub(super) retention_days: u32,
}

impl Default for RawRequestLog {
    fn default() -> Self {
        Self {
            enabled: true,
            channel_capacity: default_log_capacity(),
            batch_rows: default_batch_rows(),
            flush_interval_ms: default_flush_ms(),
            spill_path: default_spill_path(),
            retention_days: default_retention(),
        }
    }
}

fn default_log_capacity() -> usize {
    65_536
}

fn default_batch_rows() -> usize {
    1000
}

fn default_flush_ms() -> u64 {
    200
}

fn default_spill_path() -> PathBuf {
    PathBuf::from("fleetgate-request-log.spill")
}

fn default_retention() -> u32 {
    30
}
