//! `[limits]`: per-key and per-environment rate, token and concurrency limits, and whether
//! their counters are shared between replicas through Redis.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Environment, FileErrors};
use crate::secret::Secret;

/// Limits of one environment: defaults for its keys (a key's own value wins) and caps on all
/// of its keys together. `None`: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnvLimits {
    pub requests_per_minute: Option<u32>,
    /// Requests a key may send at once before the per-minute rate applies (default: the
    /// per-minute value, i.e. a minute's allowance).
    pub request_burst: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent_streams: Option<u32>,
    /// All keys of the environment together.
    pub aggregate_requests_per_second: Option<u32>,
    pub aggregate_burst: Option<u32>,
    pub aggregate_max_concurrent: Option<u32>,
}

/// Where rate-limit counters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SharedLimits {
    /// In this process: each replica enforces the whole limit.
    #[default]
    Local,
    /// In Redis: all replicas enforce one limit.
    Redis,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub url: Secret,
    /// Longest wait for Redis on the request path before falling back to local limits.
    pub timeout: Duration,
    /// Replicas sharing the limits: while Redis is unreachable each enforces limit/replicas.
    pub replicas: u32,
    /// Prefix of every Redis key fleetgate writes.
    pub key_prefix: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsConfig {
    pub shared: SharedLimits,
    pub redis: Option<RedisConfig>,
    /// Completion tokens reserved for a request that names no `max_tokens`.
    pub(crate) default_max_tokens: u32,
    /// Prompt characters per token for the admission estimate.
    pub(crate) chars_per_token: u32,
    /// Limiter state of a key unused for this long is dropped.
    pub(crate) prune_idle: Duration,
    /// By `Environment::index()`.
    pub environments: [EnvLimits; 3],
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            shared: SharedLimits::Local,
            redis: None,
            default_max_tokens: 1024,
            chars_per_token: 4,
            prune_idle: Duration::from_secs(600),
            environments: [EnvLimits::default(); 3],
        }
    }
}

pub(super) fn validate(raw: RawLimits, err: FileErrors<'_>) -> Result<LimitsConfig, ConfigError> {
    let redis = match (raw.shared, raw.redis) {
        (SharedLimits::Redis, None) => {
            return Err(err.at(
                "limits.redis",
                "limits.shared = \"redis\" needs a [limits.redis] table with `url` (e.g. \"redis://127.0.0.1:6379\")",
            ));
        }
        (_, Some(r)) => Some(redis(r, err)?),
        (SharedLimits::Local, None) => None,
    };
    if raw.default_max_tokens == 0 {
        return Err(err.at("limits.default_max_tokens", "must be > 0"));
    }
    if raw.chars_per_token == 0 {
        return Err(err.at("limits.chars_per_token", "must be > 0"));
    }
    let mut environments = [EnvLimits::default(); 3];
    for (env, limits) in [
        (Environment::Stress, raw.stress),
        (Environment::Gray, raw.gray),
        (Environment::Prod, raw.prod),
    ] {
        environments[env.index()] = env_limits(env, limits, err)?;
    }
    Ok(LimitsConfig {
        shared: raw.shared,
        redis,
        default_max_tokens: raw.default_max_tokens,
        chars_per_token: raw.chars_per_token,
        prune_idle: Duration::from_secs(raw.prune_idle_seconds.max(1)),
        environments,
    })
}

fn redis(r: RawRedis, err: FileErrors<'_>) -> Result<RedisConfig, ConfigError> {
    if !(r.url.starts_with("redis://")
        || r.url.starts_with("rediss://")
        || r.url.starts_with("unix://")
        || r.url.starts_with("redis+unix://"))
    {
        return Err(err.at(
            "limits.redis.url",
            "must be a redis://, rediss:// or unix:// URL",
        ));
    }
    if r.replicas == 0 {
        return Err(err.at(
            "limits.redis.replicas",
            "must be ≥ 1 (the number of gateway replicas sharing these limits)",
        ));
    }
    if r.timeout_ms == 0 {
        return Err(err.at("limits.redis.timeout_ms", "must be > 0"));
    }
    Ok(RedisConfig {
        url: Secret::new(r.url),
        timeout: Duration::from_millis(r.timeout_ms),
        replicas: r.replicas,
        key_prefix: r.key_prefix,
    })
}

fn env_limits(
    env: Environment,
    raw: RawEnvLimits,
    err: FileErrors<'_>,
) -> Result<EnvLimits, ConfigError> {
    let at = |f: &str| format!("limits.{env}.{f}");
    let nonzero32 = [
        ("requests_per_minute", raw.requests_per_minute),
        ("request_burst", raw.request_burst),
        ("max_concurrent_streams", raw.max_concurrent_streams),
        (
            "aggregate_requests_per_second",
            raw.aggregate_requests_per_second,
        ),
        ("aggregate_burst", raw.aggregate_burst),
        ("aggregate_max_concurrent", raw.aggregate_max_concurrent),
    ];
    for (f, v) in nonzero32 {
        if v == Some(0) {
            return Err(err.at(at(f), "must be > 0 (leave it out for no limit)"));
        }
    }
    if raw.tokens_per_minute == Some(0) {
        return Err(err.at(
            at("tokens_per_minute"),
            "must be > 0 (leave it out for no limit)",
        ));
    }
    if raw.request_burst.is_some() && raw.requests_per_minute.is_none() {
        return Err(err.at(
            at("request_burst"),
            "is the burst of requests_per_minute: set that too",
        ));
    }
    if raw.aggregate_burst.is_some() && raw.aggregate_requests_per_second.is_none() {
        return Err(err.at(
            at("aggregate_burst"),
            "is the burst of aggregate_requests_per_second: set that too",
        ));
    }
    Ok(EnvLimits {
        requests_per_minute: raw.requests_per_minute,
        request_burst: raw.request_burst,
        tokens_per_minute: raw.tokens_per_minute,
        max_concurrent_streams: raw.max_concurrent_streams,
        aggregate_requests_per_second: raw.aggregate_requests_per_second,
        aggregate_burst: raw.aggregate_burst,
        aggregate_max_concurrent: raw.aggregate_max_concurrent,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    #[serde(default)]
    pub(super) shared: SharedLimits,
    pub(super) redis: Option<RawRedis>,
    #[serde(default = "default_max_tokens")]
    pub(super) default_max_tokens: u32,
    #[serde(default = "default_chars_per_token")]
    pub(super) chars_per_token: u32,
    #[serde(default = "default_prune_idle")]
    pub(super) prune_idle_seconds: u64,
    #[serde(default)]
    pub(super) stress: RawEnvLimits,
    #[serde(default)]
    pub(super) gray: RawEnvLimits,
    #[serde(default)]
    pub(super) prod: RawEnvLimits,
}

impl Default for RawLimits {
    fn default() -> Self {
        Self {
            shared: SharedLimits::Local,
            redis: None,
            default_max_tokens: default_max_tokens(),
            chars_per_token: default_chars_per_token(),
            prune_idle_seconds: default_prune_idle(),
            stress: RawEnvLimits::default(),
            gray: RawEnvLimits::default(),
            prod: RawEnvLimits::default(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnvLimits {
    pub(super) requests_per_minute: Option<u32>,
    pub(super) request_burst: Option<u32>,
    pub(super) tokens_per_minute: Option<u64>,
    pub(super) max_concurrent_streams: Option<u32>,
    pub(super) aggregate_requests_per_second: Option<u32>,
    pub(super) aggregate_burst: Option<u32>,
    pub(super) aggregate_max_concurrent: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: String,
    #[serde(default = "default_redis_timeout")]
    pub(super) timeout_ms: u64,
    #[serde(default = "default_replicas")]
    pub(super) replicas: u32,
    #[serde(default = "default_key_prefix")]
    pub(super) key_prefix: String,
}

fn default_max_tokens() -> u32 {
    1024
}

fn default_chars_per_token() -> u32 {
    4
}

fn default_prune_idle() -> u64 {
    600
}

fn default_redis_timeout() -> u64 {
    50
}

fn default_replicas() -> u32 {
    1
}

fn default_key_prefix() -> String {
    "fleetgate".into()
}
