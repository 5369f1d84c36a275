//! `[queue]`: the admission queue in front of each pool's backends (size, per-key share,
//! longest wait per environment, keep-alives for waiting streams).

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Environment, FileErrors};

/// The admission queue in front of each pool's backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Requests waiting per pool; beyond it a request is refused at once.
    pub max_size: usize,
    /// Queue slots one key may hold.
    pub max_per_key: usize,
    /// Longest wait by `Environment::index()`.
    pub max_wait: [Duration; 3],
    /// SSE comment (`: queued`) interval for waiting streams; `None`: off.
    pub keepalive_interval: Option<Duration>,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_size: 1024,
            max_per_key: 128,
            max_wait: [
                Duration::from_secs(5),
                Duration::from_secs(15),
                Duration::from_secs(30),
            ],
            keepalive_interval: None,
        }
    }
}

pub(super) fn validate(raw: RawQueue, err: FileErrors<'_>) -> Result<QueueConfig, ConfigError> {
    if raw.max_size == 0 {
        return Err(err.at(
            "queue.max_size",
            "must be > 0 (set pools[].max_in_flight_per_backend = 0 to turn queueing off)",
        ));
    }
    if raw.max_per_key == 0 {
        return Err(err.at("queue.max_per_key", "must be > 0"));
    }
    let w = raw.max_wait_seconds;
    let mut max_wait = [Duration::ZERO; 3];
    for (env, secs) in [
        (Environment::Stress, w.stress),
        (Environment::Gray, w.gray),
        (Environment::Prod, w.prod),
    ] {
        if !(secs.is_finite() && (0.0..=3600.0).contains(&secs)) {
            return Err(err.at(
                format!("queue.max_wait_seconds.{env}"),
                "must be a number of seconds between 0 and 3600",
            ));
        }
        max_wait[env.index()] = Duration::from_secs_f64(secs);
    }
    Ok(QueueConfig {
        max_size: raw.max_size,
        max_per_key: raw.max_per_key.min(raw.max_size),
        max_wait,
        keepalive_interval: (raw.keepalive_interval_ms > 0)
            .then(|| Duration::from_millis(raw.keepalive_interval_ms)),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueue {
    #[serde(default = "default_queue_size")]
    pub(super) max_size: usize,
    #[serde(default = "default_queue_per_key")]
    pub(super) max_per_key: usize,
    #[serde(default)]
    pub(super) max_wait_seconds: RawQueueWait,
    #[serde(default)]
    pub(super) keepalive_interval_ms: u64,
}

impl Default for RawQueue {
    fn default() -> Self {
        Self {
            max_size: default_queue_size(),
            max_per_key: default_queue_per_key(),
            max_wait_seconds: RawQueueWait::default(),
            keepalive_interval_ms: 0,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueueWait {
    #[serde(default = "default_wait_stress")]
    pub(super) stress: f64,
    #[serde(default = "default_wait_gray")]
    pub(super) gray: f64,
    #[serde(default = "default_wait_prod")]
    pub(super) prod: f64,
}

impl Default for RawQueueWait {
    fn default() -> Self {
        Self {
            stress: default_wait_stress(),
            gray: default_wait_gray(),
            prod: default_wait_prod(),
        }
    }
}

fn default_queue_size() -> usize {
    1024
}

fn default_queue_per_key() -> usize {
    128
}

fn default_wait_stress() -> f64 {
    5.0
}

fn default_wait_gray() -> f64 {
    15.0
}

fn default_wait_prod() -> f64 {
    30.0
}
