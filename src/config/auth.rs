//! `[auth]`: the budget and caches around API-key checks, and how often the key snapshot is
//! fully reloaded.

use std::time::Duration;

use super::raw::RawAuth;
use super::{ConfigError, FileErrors};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// Unknown-key database lookups allowed per second (all clients together).
    pub lookups_per_second: u32,
    /// How long a key found unknown in the database is not looked up again.
    pub negative_cache: Duration,
    /// Failed attempts allowed per client address per minute before 429.
    pub failures_per_minute: u32,
    /// Full reload of the snapshot at this interval (covers missed notifications).
    pub resync_interval: Duration,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            lookups_per_second: 20,
            negative_cache: Duration::from_secs(10),
            failures_per_minute: 30,
            resync_interval: Duration::from_secs(30),
        }
    }
}

pub(super) fn validate(a: RawAuth, err: FileErrors<'_>) -> Result<AuthConfig, ConfigError> {
    if a.resync_interval_seconds == 0 {
        return Err(err.at("auth.resync_interval_seconds", "must be > 0"));
    }
    Ok(AuthConfig {
        lookups_per_second: a.lookups_per_second,
        negative_cache: Duration::from_secs(a.negative_cache_seconds),
        failures_per_minute: a.failures_per_minute,
        resync_interval: Duration::from_secs(a.resync_interval_seconds),
    })
}
