//! `[auth]`: the budget and caches around API-key checks, and how often the key snapshot is
//! fully reloaded.

use std::time::Duration;

use super::raw::RawAuth;
use super::{AuthConfig, ConfigError, FileErrors};

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
