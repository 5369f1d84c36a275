//! `[auth]`: the budget and caches around API-key checks, the brake on guessing (per-address
//! failure allowance, delayed refusals), and how often the key snapshot is fully reloaded.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, FileErrors};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// Unknown-key database lookups allowed per second (all clients together).
    pub(crate) lookups_per_second: u32,
    /// How long a key found unknown in the database is not looked up again.
    pub(crate) negative_cache: Duration,
    /// Failed attempts allowed per client address (IPv6: per /64) at once and per minute;
    /// past them the address is refused without its key being checked.
    pub failures_per_minute: u32,
    /// Every refused authentication is answered no sooner than this after the request
    /// arrived: an unknown key and a wrong secret take the same time.
    pub failure_delay: Duration,
    /// A throttled address's refusal is answered after this (and its HTTP/1 connection closed).
    pub throttle_delay: Duration,
    /// Refusals held back by a delay at once, at most; past it they are answered at once.
    pub max_delayed_answers: usize,
    /// Full reload of the snapshot at this interval (covers missed notifications).
    pub resync_interval: Duration,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            lookups_per_second: 20,
            negative_cache: Duration::from_secs(10),
            failures_per_minute: 30,
            failure_delay: Duration::from_millis(100),
            throttle_delay: Duration::from_millis(1000),
            max_delayed_answers: 10_000,
            resync_interval: Duration::from_secs(30),
        }
    }
}

/// Longest delays accepted: beyond them a refusal holds its connection for nothing.
const MAX_FAILURE_DELAY_MS: u64 = 5_000;
const MAX_THROTTLE_DELAY_MS: u64 = 30_000;

pub(super) fn validate(a: RawAuth, err: FileErrors<'_>) -> Result<AuthConfig, ConfigError> {
    if a.resync_interval_seconds == 0 {
        return Err(err.at("auth.resync_interval_seconds", "must be > 0"));
    }
    if a.failures_per_minute == 0 {
        return Err(err.at(
            "auth.failures_per_minute",
            "must be > 0: it is how many failed attempts an address may make before it is refused (the limit cannot be turned off; set it high instead)",
        ));
    }
    if a.failure_delay_ms > MAX_FAILURE_DELAY_MS {
        return Err(err.at(
            "auth.failure_delay_ms",
            format!("must be at most {MAX_FAILURE_DELAY_MS}: a refusal only needs to outlast the slowest key check (tens of ms); 100 is the default"),
        ));
    }
    if a.throttle_delay_ms > MAX_THROTTLE_DELAY_MS {
        return Err(err.at(
            "auth.throttle_delay_ms",
            format!("must be at most {MAX_THROTTLE_DELAY_MS}: longer only holds the connection; 1000 is the default"),
        ));
    }
    if a.throttle_delay_ms < a.failure_delay_ms {
        return Err(err.at(
            "auth.throttle_delay_ms",
            format!(
                "must be at least auth.failure_delay_ms ({}): a throttled address must not be answered sooner than a failed key",
                a.failure_delay_ms
            ),
        ));
    }
    if a.max_delayed_answers == 0 {
        return Err(err.at(
            "auth.max_delayed_answers",
            "must be > 0 (to answer refusals at once, set failure_delay_ms and throttle_delay_ms to 0)",
        ));
    }
    Ok(AuthConfig {
        lookups_per_second: a.lookups_per_second,
        negative_cache: Duration::from_secs(a.negative_cache_seconds),
        failures_per_minute: a.failures_per_minute,
        failure_delay: Duration::from_millis(a.failure_delay_ms),
        throttle_delay: Duration::from_millis(a.throttle_delay_ms),
        max_delayed_answers: a.max_delayed_answers,
        resync_interval: Duration::from_secs(a.resync_interval_seconds),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    #[serde(default = "default_lookups")]
    pub(super) lookups_per_second: u32,
    #[serde(default = "default_negative_cache")]
    pub(super) negative_cache_seconds: u64,
    #[serde(default = "default_failures")]
    pub(super) failures_per_minute: u32,
    #[serde(default = "default_failure_delay")]
    pub(super) failure_delay_ms: u64,
    #[serde(default = "default_throttle_delay")]
    pub(super) throttle_delay_ms: u64,
    #[serde(default = "default_max_delayed")]
    pub(super) max_delayed_answers: usize,
    #[serde(default = "default_resync")]
    pub(super) resync_interval_seconds: u64,
}

impl Default for RawAuth {
    fn default() -> Self {
        Self {
            lookups_per_second: default_lookups(),
            negative_cache_seconds: default_negative_cache(),
            failures_per_minute: default_failures(),
            failure_delay_ms: default_failure_delay(),
            throttle_delay_ms: default_throttle_delay(),
            max_delayed_answers: default_max_delayed(),
            resync_interval_seconds: default_resync(),
        }
    }
}

fn default_lookups() -> u32 {
    20
}

fn default_negative_cache() -> u64 {
    10
}

fn default_failures() -> u32 {
    30
}

fn default_failure_delay() -> u64 {
    100
}

fn default_throttle_delay() -> u64 {
    1000
}

fn default_max_delayed() -> usize {
    10_000
}

fn default_resync() -> u64 {
    30
}
