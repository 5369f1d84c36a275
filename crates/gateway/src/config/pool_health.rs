//! A pool's backend health settings: `[pools.health]` (probes), `[pools.warmup]` (a recovered
//! backend's ramp), `[pools.retries]`, `[pools.ejection]` and `[pools.load_aware]` (the
//! backends' own load, scraped) and `[pools.resume]` (a stream continued on another backend
//! when its own dies mid-answer): each raw table, its defaults and its checked type.

use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, Clone)]
pub struct LoadAwareConfig {
    pub metrics_path: String,
    pub interval: Duration,
}

/// Active health probes of a pool's backends (the interval is `server.health_interval_ms`).
#[derive(Debug, Clone)]
pub(crate) struct HealthConfig {
    pub(crate) path: String,
    pub(crate) timeout: Duration,
    /// Consecutive good probes that bring a down backend back.
    pub(crate) healthy_threshold: u32,
    /// Consecutive failed probes that take a backend down.
    pub(crate) unhealthy_threshold: u32,
    /// How often `GET /v1/models` is read again (its card, its LoRA adapters).
    pub(crate) models_interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            timeout: Duration::from_secs(2),
            healthy_threshold: 1,
            unhealthy_threshold: 1,
            models_interval: Duration::from_millis(default_models_interval()),
        }
    }
}

/// Warm-up of a backend that is new or comes back from down: `requests` small completions
/// that must all succeed before it takes traffic, then its share ramps up over `slow_start`.
#[derive(Debug, Clone)]
pub struct WarmupConfig {
    pub requests: u32,
    pub(crate) prompt: String,
    pub(crate) slow_start: Duration,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        Self {
            requests: 0,
            prompt: "Hello".into(),
            slow_start: Duration::ZERO,
        }
    }
}

/// `[pools.resume]`: a stream whose backend dies, says its engine died, or stalls mid-answer is
/// continued on another backend of the pool (`proxy::relay::resume`).
#[derive(Debug, Clone, Copy)]
pub struct ResumeConfig {
    pub enabled: bool,
    /// Continuations per request at most.
    pub max_resumes: u8,
    /// A stream silent this long after its first token has stalled: it is resumed elsewhere
    /// (the pool's idle limit still ends what cannot be resumed).
    pub stall: Duration,
}

impl Default for ResumeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_resumes: 2,
            stall: Duration::from_millis(DEFAULT_STALL_MS),
        }
    }
}

const DEFAULT_STALL_MS: u64 = 15_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawResume {
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    #[serde(default = "default_max_resumes")]
    pub(super) max_resumes: u8,
    #[serde(default = "default_stall_ms")]
    pub(super) stall_ms: u64,
}

impl Default for RawResume {
    fn default() -> Self {
        Self {
            enabled: true,
            max_resumes: default_max_resumes(),
            stall_ms: DEFAULT_STALL_MS,
        }
    }
}

impl RawResume {
    pub(super) fn check(self) -> Result<ResumeConfig, &'static str> {
        if self.stall_ms == 0 {
            return Err("stall_ms must be > 0 (set enabled = false to turn resuming off)");
        }
        Ok(ResumeConfig {
            enabled: self.enabled && self.max_resumes > 0,
            max_resumes: self.max_resumes,
            stall: Duration::from_millis(self.stall_ms),
        })
    }
}

fn yes() -> bool {
    true
}

fn default_max_resumes() -> u8 {
    2
}

fn default_stall_ms() -> u64 {
    DEFAULT_STALL_MS
}

/// Retries on another backend, before any byte of the answer reached the client.
#[derive(Debug, Clone, Copy)]
pub struct RetryConfig {
    /// Extra attempts per request (0: no retries).
    pub max_retries: u32,
    /// Retries allowed as a share of the pool's requests (0.2: at most one retry per five
    /// requests over time), so a failing fleet is not hit twice as hard.
    pub budget_ratio: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_retries: 2,
            budget_ratio: 0.2,
        }
    }
}

/// Passive ejection of a backend that keeps failing.
#[derive(Debug, Clone, Copy)]
pub struct EjectionConfig {
    /// Consecutive connect errors or 5xx answers that eject a backend (0: never).
    pub consecutive_failures: u32,
    /// First ejection; each further one doubles it (with ±20 % jitter), up to `max`.
    pub base: Duration,
    pub max: Duration,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 3,
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLoadAware {
    #[serde(default = "default_metrics_path")]
    pub(super) metrics_path: String,
    #[serde(default = "default_scrape_ms")]
    pub(super) interval_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealth {
    #[serde(default = "default_health_path")]
    pub(super) path: String,
    #[serde(default = "default_health_timeout")]
    pub(super) timeout_ms: u64,
    #[serde(default = "default_one")]
    pub(super) healthy_threshold: u32,
    #[serde(default = "default_one")]
    pub(super) unhealthy_threshold: u32,
    #[serde(default = "default_models_interval")]
    pub(super) models_interval_ms: u64,
}

pub(super) fn default_models_interval() -> u64 {
    10_000
}

impl Default for RawHealth {
    fn default() -> Self {
        Self {
            path: default_health_path(),
            timeout_ms: default_health_timeout(),
            healthy_threshold: 1,
            unhealthy_threshold: 1,
            models_interval_ms: default_models_interval(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWarmup {
    #[serde(default)]
    pub(super) requests: u32,
    pub(super) prompt: Option<String>,
    #[serde(default)]
    pub(super) slow_start_seconds: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetries {
    #[serde(default = "default_max_retries")]
    pub(super) max_retries: u32,
    #[serde(default = "default_budget_percent")]
    pub(super) budget_percent: f64,
}

impl Default for RawRetries {
    fn default() -> Self {
        Self {
            max_retries: default_max_retries(),
            budget_percent: default_budget_percent(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEjection {
    #[serde(default = "default_consecutive_failures")]
    pub(super) consecutive_failures: u32,
    #[serde(default = "default_eject_base")]
    pub(super) base_ms: u64,
    #[serde(default = "default_eject_max")]
    pub(super) max_ms: u64,
}

impl Default for RawEjection {
    fn default() -> Self {
        Self {
            consecutive_failures: default_consecutive_failures(),
            base_ms: default_eject_base(),
            max_ms: default_eject_max(),
        }
    }
}

fn default_metrics_path() -> String {
    "/metrics".into()
}

fn default_scrape_ms() -> u64 {
    1000
}

fn default_health_path() -> String {
    "/health".into()
}

fn default_health_timeout() -> u64 {
    2000
}

fn default_one() -> u32 {
    1
}

fn default_max_retries() -> u32 {
    2
}

fn default_budget_percent() -> f64 {
    20.0
}

fn default_consecutive_failures() -> u32 {
    3
}

fn default_eject_base() -> u64 {
    1000
}

fn default_eject_max() -> u64 {
    60_000
}
