//! `[[pools]]`: one pool per model name, with its backends, routing and resilience settings
//! (timeouts, retries, ejection, health probes, warm-up, load-aware balancing, affinity).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use http::Uri;
use serde::Deserialize;

use super::backends::{self, BackendConfig, RawBackend};
use super::fallbacks::{FallbackConfig, RawFallbacks};
use super::pool_health::{
    EjectionConfig, HealthConfig, LoadAwareConfig, RawEjection, RawHealth, RawLoadAware, RawResume,
    RawRetries, RawWarmup, ResumeConfig, RetryConfig, WarmupConfig,
};
use super::{ConfigError, Environment, FileErrors};
use crate::secret::Secret;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The model name clients send.
    pub model: String,
    /// The name the backends serve it under, when it differs (the body is rewritten).
    pub served_model_name: Option<String>,
    /// Other names clients may send for this model (listed by `/v1/models` too).
    pub aliases: Vec<String>,
    pub backends: Vec<BackendConfig>,
    /// What kind of model the backends serve: decides the warm-up request.
    pub kind: PoolKind,
    /// Sent upstream as `Authorization: Bearer ...` instead of the client's credentials.
    pub upstream_api_key: Option<Secret>,
    /// Extra CA certificate(s) (PEM) trusted for https backends, beside the webpki roots.
    pub ca_file: Option<PathBuf>,
    pub timeouts: Timeouts,
    /// Environments whose keys may use this pool (`None`: all).
    pub environments: Option<Vec<Environment>>,
    /// Requests one backend serves at once (vLLM's `max_num_seqs`); more wait in the
    /// admission queue. 0: no cap (and no queue). A backend's own `capacity` wins.
    pub max_in_flight_per_backend: u32,
    pub retries: RetryConfig,
    pub ejection: EjectionConfig,
    /// Requests with at least this many estimated prompt tokens go to another pool.
    pub long_prompt: Option<LongPromptConfig>,
    /// Gray keys' requests go to this pool's backends with this label (a canary) while one
    /// of them can take requests.
    pub gray_canary_label: Option<String>,
    pub(crate) health: HealthConfig,
    pub warmup: WarmupConfig,
    /// Read each backend's own load from its Prometheus `/metrics` (vLLM's
    /// `num_requests_running` + `num_requests_waiting`) and balance on it too.
    pub load_aware: Option<LoadAwareConfig>,
    /// Requests with the same `user` or prompt prefix prefer the same backend.
    pub affinity: Option<AffinityConfig>,
    /// The engines' own KV cache events, read by every replica (`engine_cache`).
    pub kv_events: Option<super::KvEventsConfig>,
    /// Send each environment's `priority` to the backends (`[pools.priority]`), for vLLM's
    /// `--scheduling-policy priority`.
    pub priority: Option<EnginePriority>,
    /// Continue a stream on another backend when its own dies mid-answer (`[pools.resume]`).
    pub resume: ResumeConfig,
    /// The pools that take what this one cannot serve, or a prompt too long for it.
    pub fallback: FallbackConfig,
    /// Clients' error messages name backends by address (`server.expose_backend_addresses`,
    /// set on every pool by the server), else as `<model>#<number>`.
    pub(crate) expose_backend_addresses: bool,
}

/// What kind of model a pool's backends serve, as `vllm serve` made it: a generative model
/// (`--runner generate`, the default), or a pooling one (`--runner pooling --convert embed`
/// or `--convert classify`). vLLM registers its routes by kind (a pooling model has no chat
/// route), so the warm-up sends each kind a request it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    #[default]
    Generate,
    Embed,
    Classify,
    /// A speech-to-text model (Whisper and the like): `/v1/audio/transcriptions`.
    Transcription,
}

impl PoolKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolKind::Generate => "generate",
            PoolKind::Embed => "embed",
            PoolKind::Classify => "classify",
            PoolKind::Transcription => "transcription",
        }
    }
}

/// What makes two requests "the same" for backend affinity (prefix-cache reuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityBy {
    /// The OpenAI `user` field.
    User,
    /// The first `prefix_bytes` of the prompt (`messages` or `prompt`).
    Prefix,
    /// The longest prompt prefix a backend was sent (`pool::prefix`): a conversation's turns
    /// follow their KV cache.
    #[serde(rename = "longest_prefix")]
    LongestPrefix,
    /// The backend whose engine holds the longest prefix of the prompt, as its own KV events
    /// say (`[pools.kv_events]` with a `tokenizer`), within the load bound.
    #[serde(rename = "kv_events")]
    KvEvents,
}

#[derive(Debug, Clone, Copy)]
pub struct AffinityConfig {
    pub by: AffinityBy,
    pub prefix_bytes: usize,
    /// The preferred backend is used while its load is at most twice the least loaded one's,
    /// or at most this many requests more.
    pub slack: u32,
    /// `longest_prefix`: the prompt is remembered in blocks of this many bytes, at most
    /// `max_blocks` of them, each for at most `max_age` after its last use.
    pub block_bytes: usize,
    pub max_blocks: usize,
    pub max_age: Duration,
}

#[derive(Debug, Clone)]
pub struct LongPromptConfig {
    pub min_prompt_tokens: u64,
    /// The model name of the pool that takes them.
    pub pool: String,
}

pub(crate) const DEFAULT_MAX_IN_FLIGHT: u32 = 256;

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub(crate) connect: Duration,
    /// From sending the request until the response head (non-streaming) or the first
    /// token (streaming) arrives.
    pub first_token: Duration,
    /// Longest silence between two chunks of a response body.
    pub idle: Duration,
    /// Whole request, first byte sent to last byte received.
    pub(crate) total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(3),
            first_token: Duration::from_secs(120),
            idle: Duration::from_secs(60),
            total: Duration::from_secs(1800),
        }
    }
}

impl PoolConfig {
    /// Read the backends' `GET /v1/models` (their cards and LoRA adapters) this often.
    pub fn set_models_interval(&mut self, every: Duration) {
        self.health.models_interval = every;
    }

    /// A pool with default timeouts and no rename or upstream key.
    pub fn new(model: impl Into<String>, backends: Vec<Uri>) -> Self {
        Self {
            model: model.into(),
            served_model_name: None,
            aliases: Vec::new(),
            backends: backends.into_iter().map(BackendConfig::new).collect(),
            kind: PoolKind::Generate,
            upstream_api_key: None,
            ca_file: None,
            timeouts: Timeouts::default(),
            environments: None,
            max_in_flight_per_backend: DEFAULT_MAX_IN_FLIGHT,
            retries: RetryConfig::default(),
            ejection: EjectionConfig::default(),
            long_prompt: None,
            gray_canary_label: None,
            health: HealthConfig::default(),
            warmup: WarmupConfig::default(),
            load_aware: None,
            affinity: None,
            kv_events: None,
            priority: None,
            resume: ResumeConfig::default(),
            fallback: FallbackConfig::default(),
            expose_backend_addresses: false,
        }
    }
}

/// Each environment's vLLM `priority` (lower goes first in vLLM's waiting queue when it runs
/// with `--scheduling-policy priority`), spliced into every generation request the pool sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePriority {
    /// By `Environment::index`: stress, gray, prod.
    pub by_env: [i64; 3],
    /// Replace a client's own `priority` too (otherwise only one better than its
    /// environment's is replaced).
    pub override_client: bool,
}

impl EnginePriority {
    /// What goes to the backend for a request of `env` whose client sent `client`: the
    /// environment's value, or the client's own when it asks for no better (`None`: leave the
    /// body as it is).
    pub(crate) fn for_request(&self, env: Environment, client: Option<i64>) -> Option<i64> {
        let mine = self.by_env[env.index()];
        match client {
            Some(c) if !self.override_client && c >= mine => None,
            Some(c) if c == mine => None,
            _ => Some(mine),
        }
    }

    /// `env` is the one the backends put first (its value lower than every other
    /// environment's): its requests may pass the gateway's capacity, since every slot they find
    /// taken is held by a request the backend will put behind them. A tie at the lowest value
    /// gives no environment that right: the slots a tied environment takes are not put behind
    /// the other's (with `prod = gray = 0`, gray would otherwise ride prod's overflow).
    pub(crate) fn goes_first(&self, env: Environment) -> bool {
        let mine = self.by_env[env.index()];
        Environment::ALL
            .iter()
            .filter(|e| **e != env)
            .all(|e| self.by_env[e.index()] > mine)
    }
}

pub(super) fn validate(
    raw: Vec<RawPool>,
    err: FileErrors<'_>,
) -> Result<Vec<PoolConfig>, ConfigError> {
    if raw.is_empty() {
        return Err(err.at(
            "pools",
            "no pool is configured: add a [[pools]] table with `model` and `backends`",
        ));
    }
    // Model names and aliases together: a client's model name must pick one pool.
    let mut seen = HashSet::new();
    let mut pools = Vec::with_capacity(raw.len());
    for (i, p) in raw.into_iter().enumerate() {
        pools.push(pool(i, p, &mut seen, err)?);
    }
    check_references(&pools, err)?;
    super::fallbacks::check_names(&pools, err)?;
    Ok(pools)
}

fn pool(
    i: usize,
    mut p: RawPool,
    seen: &mut HashSet<String>,
    err: FileErrors<'_>,
) -> Result<PoolConfig, ConfigError> {
    let at = |f: &str| format!("pools[{i}].{f}");
    if p.model.trim().is_empty() {
        return Err(err.at(at("model"), "must not be empty"));
    }
    if !seen.insert(p.model.clone()) {
        return Err(err.at(
            at("model"),
            format!("model `{}` is configured twice", p.model),
        ));
    }
    if p.backends.is_empty() {
        return Err(err.at(
            at("backends"),
            "needs at least one backend base URL, e.g. \"http://10.0.0.5:8000\"",
        ));
    }
    let backends = backends::validate(&at("backends"), std::mem::take(&mut p.backends), err)?;
    for (k, a) in p.aliases.iter().enumerate() {
        if a.trim().is_empty() {
            return Err(err.at(at(&format!("aliases[{k}]")), "must not be empty"));
        }
        if !seen.insert(a.clone()) {
            return Err(err.at(
                at(&format!("aliases[{k}]")),
                format!("`{a}` already names another pool or alias"),
            ));
        }
    }
    check_settings(&p, &at, err)?;
    let timeouts = timeouts(&p.timeouts, &at, err)?;
    if let Some(envs) = &p.environments
        && envs.is_empty()
    {
        return Err(err.at(
            at("environments"),
            "must name at least one of stress, gray, prod (leave it out to allow all)",
        ));
    }
    let priority = match p.priority {
        Some(e) if !(e.prod <= e.gray && e.gray <= e.stress) => {
            return Err(err.at(
                at("priority"),
                format!(
                    "prod ({}) ≤ gray ({}) ≤ stress ({}) is required: vLLM runs a lower priority first, and production must never wait behind a load test",
                    e.prod, e.gray, e.stress
                ),
            ));
        }
        Some(e) => Some(EnginePriority {
            by_env: [e.stress, e.gray, e.prod],
            override_client: e.override_client,
        }),
        None => None,
    };
    let gray_canary_label = match (p.gray_canary_label, p.gray_pin_label) {
        (Some(_), Some(_)) => {
            return Err(err.at(
                at("gray_pin_label"),
                "is the former name of gray_canary_label: give only gray_canary_label",
            ));
        }
        (None, Some(label)) => {
            tracing::warn!(
                key = %at("gray_pin_label"),
                "`gray_pin_label` is now `gray_canary_label`: rename it in the config (the old name is still read)"
            );
            Some(label)
        }
        (label, None) => label,
    };
    let load_aware = match p.load_aware {
        Some(l) if !l.metrics_path.starts_with('/') || l.interval_ms == 0 => {
            return Err(err.at(
                at("load_aware"),
                "metrics_path must start with `/` and interval_ms must be > 0",
            ));
        }
        Some(l) => Some(LoadAwareConfig {
            metrics_path: l.metrics_path,
            interval: Duration::from_millis(l.interval_ms),
        }),
        None => None,
    };
    let kv_events = p.kv_events.map(|k| k.check(&at, err)).transpose()?;
    let resume = p.resume.check().map_err(|m| err.at(at("resume"), m))?;
    let fallback = RawFallbacks {
        fallbacks: std::mem::take(&mut p.fallbacks),
        context_window_fallbacks: std::mem::take(&mut p.context_window_fallbacks),
        fallback_environments: p.fallback_environments.take(),
        max_model_len: p.max_model_len,
    }
    .check(&at, err)?;
    if let Some(k) = &kv_events
        && k.port.is_none()
        && let Some(i) = backends
            .iter()
            .position(|b| b.kv_events && b.kv_events_port.is_none())
    {
        return Err(err.at(
            at(&format!("backends[{i}]")),
            "has no KV event publisher port: give [pools.kv_events] a `port` (vLLM's default endpoint is tcp://*:5557), this backend a `kv_events_port`, or `kv_events = false` if its engine publishes none",
        ));
    }
    if p.affinity
        .as_ref()
        .is_some_and(|a| a.by == AffinityBy::KvEvents)
        && kv_events.as_ref().is_none_or(|k| k.tokenizer.is_none())
    {
        return Err(err.at(
            at("affinity.by"),
            "\"kv_events\" routes on what the engines' KV events say they hold: give the pool a [pools.kv_events] table with the engines' `port` and the model's `tokenizer` directory",
        ));
    }
    Ok(PoolConfig {
        model: p.model,
        served_model_name: p.served_model_name,
        aliases: p.aliases,
        backends,
        kind: p.kind,
        upstream_api_key: p.upstream_api_key.map(Secret::new),
        ca_file: p.ca_file.map(|c| err.path(c)),
        timeouts,
        environments: p.environments,
        max_in_flight_per_backend: p.max_in_flight_per_backend.unwrap_or(DEFAULT_MAX_IN_FLIGHT),
        retries: RetryConfig {
            max_retries: p.retries.max_retries,
            budget_ratio: p.retries.budget_percent / 100.0,
        },
        ejection: EjectionConfig {
            consecutive_failures: p.ejection.consecutive_failures,
            base: Duration::from_millis(p.ejection.base_ms),
            max: Duration::from_millis(p.ejection.max_ms),
        },
        long_prompt: p.long_prompt.map(|l| LongPromptConfig {
            min_prompt_tokens: l.min_prompt_tokens,
            pool: l.pool,
        }),
        gray_canary_label,
        health: HealthConfig {
            path: p.health.path,
            timeout: Duration::from_millis(p.health.timeout_ms),
            healthy_threshold: p.health.healthy_threshold,
            unhealthy_threshold: p.health.unhealthy_threshold,
            models_interval: Duration::from_millis(p.health.models_interval_ms.max(100)),
        },
        warmup: WarmupConfig {
            requests: p.warmup.requests,
            prompt: p.warmup.prompt.unwrap_or_else(|| "Hello".into()),
            slow_start: Duration::from_secs_f64(p.warmup.slow_start_seconds),
        },
        load_aware,
        priority,
        affinity: p.affinity.map(|a| AffinityConfig {
            by: a.by,
            prefix_bytes: a.prefix_bytes.max(1),
            slack: a.slack,
            block_bytes: a.block_bytes.max(16),
            max_blocks: a.max_blocks.max(1024),
            max_age: Duration::from_secs(a.max_age_seconds.max(1)),
        }),
        kv_events,
        resume,
        fallback,
        expose_backend_addresses: false,
    })
}

/// The ranges of a pool's retry, health, warm-up and ejection settings, and the files and
/// names it refers to.
fn check_settings(
    p: &RawPool,
    at: &dyn Fn(&str) -> String,
    err: FileErrors<'_>,
) -> Result<(), ConfigError> {
    if !(p.retries.budget_percent.is_finite() && (0.0..=100.0).contains(&p.retries.budget_percent))
    {
        return Err(err.at(at("retries.budget_percent"), "must be between 0 and 100"));
    }
    if !p.health.path.starts_with('/') {
        return Err(err.at(at("health.path"), "must start with `/`"));
    }
    if p.health.timeout_ms == 0
        || p.health.healthy_threshold == 0
        || p.health.unhealthy_threshold == 0
    {
        return Err(err.at(
            at("health"),
            "timeout_ms, healthy_threshold and unhealthy_threshold must be > 0",
        ));
    }
    if !(p.warmup.slow_start_seconds.is_finite()
        && (0.0..=3600.0).contains(&p.warmup.slow_start_seconds))
    {
        return Err(err.at(
            at("warmup.slow_start_seconds"),
            "must be between 0 and 3600",
        ));
    }
    if p.ejection.base_ms == 0 || p.ejection.max_ms < p.ejection.base_ms {
        return Err(err.at(at("ejection"), "base_ms must be > 0 and max_ms ≥ base_ms"));
    }
    if let Some(name) = &p.served_model_name
        && name.trim().is_empty()
    {
        return Err(err.at(
            at("served_model_name"),
            "must not be empty (leave it out to send the model name unchanged)",
        ));
    }
    if let Some(ca) = p.ca_file.clone().map(|c| err.path(c))
        && !ca.exists()
    {
        return Err(err.at(at("ca_file"), format!("{} does not exist", ca.display())));
    }
    Ok(())
}

fn timeouts(
    t: &RawTimeouts,
    at: &dyn Fn(&str) -> String,
    err: FileErrors<'_>,
) -> Result<Timeouts, ConfigError> {
    let d = Timeouts::default();
    let ms = |v: Option<u64>, dflt: Duration, name: &str| -> Result<Duration, ConfigError> {
        match v {
            None => Ok(dflt),
            Some(0) => Err(err.at(at(&format!("timeouts.{name}")), "must be > 0")),
            Some(v) => Ok(Duration::from_millis(v)),
        }
    };
    Ok(Timeouts {
        connect: ms(t.connect_ms, d.connect, "connect_ms")?,
        first_token: ms(t.first_token_ms, d.first_token, "first_token_ms")?,
        idle: ms(t.idle_ms, d.idle, "idle_ms")?,
        total: ms(t.total_ms, d.total, "total_ms")?,
    })
}

/// What pools say about each other: a long-prompt pool must exist, a gray canary must name a
/// label of the pool's own backends.
fn check_references(pools: &[PoolConfig], err: FileErrors<'_>) -> Result<(), ConfigError> {
    for (i, p) in pools.iter().enumerate() {
        if let Some(lp) = &p.long_prompt {
            if lp.pool == p.model || p.aliases.contains(&lp.pool) {
                return Err(err.at(
                    format!("pools[{i}].long_prompt.pool"),
                    "must name another pool (the one that takes long prompts)",
                ));
            }
            if !pools.iter().any(|o| o.model == lp.pool) {
                return Err(err.at(
                    format!("pools[{i}].long_prompt.pool"),
                    format!("no pool has model `{}`", lp.pool),
                ));
            }
            if lp.min_prompt_tokens == 0 {
                return Err(err.at(
                    format!("pools[{i}].long_prompt.min_prompt_tokens"),
                    "must be > 0",
                ));
            }
        }
        if let Some(label) = &p.gray_canary_label
            && !p.backends.iter().any(|b| b.labels.contains(label))
        {
            return Err(err.at(
                format!("pools[{i}].gray_canary_label"),
                format!("no backend of this pool has the label `{label}`"),
            ));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub(super) model: String,
    pub(super) served_model_name: Option<String>,
    #[serde(default)]
    pub(super) aliases: Vec<String>,
    pub(super) backends: Vec<RawBackend>,
    #[serde(default)]
    pub(super) kind: PoolKind,
    pub(super) upstream_api_key: Option<String>,
    pub(super) ca_file: Option<PathBuf>,
    #[serde(default)]
    pub(super) timeouts: RawTimeouts,
    pub(super) environments: Option<Vec<Environment>>,
    pub(super) max_in_flight_per_backend: Option<u32>,
    #[serde(default)]
    pub(super) retries: RawRetries,
    #[serde(default)]
    pub(super) ejection: RawEjection,
    pub(super) long_prompt: Option<RawLongPrompt>,
    pub(super) gray_canary_label: Option<String>,
    /// `gray_canary_label`'s former name, still read (a warning says to rename it): "pin" now
    /// names only a stored response's backend.
    pub(super) gray_pin_label: Option<String>,
    #[serde(default)]
    pub(super) health: RawHealth,
    #[serde(default)]
    pub(super) warmup: RawWarmup,
    pub(super) load_aware: Option<RawLoadAware>,
    pub(super) affinity: Option<RawAffinity>,
    pub(super) kv_events: Option<super::kv_events::RawKvEvents>,
    pub(super) priority: Option<RawEnginePriority>,
    #[serde(default)]
    pub(super) resume: RawResume,
    #[serde(default)]
    pub(super) fallbacks: Vec<String>,
    #[serde(default)]
    pub(super) context_window_fallbacks: Vec<String>,
    pub(super) fallback_environments: Option<Vec<Environment>>,
    pub(super) max_model_len: Option<u32>,
}

/// `[pools.priority]`: each environment's vLLM `priority`, sent to the backends.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnginePriority {
    #[serde(default = "default_priority_prod")]
    pub(super) prod: i64,
    #[serde(default = "default_priority_gray")]
    pub(super) gray: i64,
    #[serde(default = "default_priority_stress")]
    pub(super) stress: i64,
    #[serde(default)]
    pub(super) override_client: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAffinity {
    pub(super) by: AffinityBy,
    #[serde(default = "default_prefix_bytes")]
    pub(super) prefix_bytes: usize,
    #[serde(default = "default_slack")]
    pub(super) slack: u32,
    #[serde(default = "default_block_bytes")]
    pub(super) block_bytes: usize,
    #[serde(default = "default_max_blocks")]
    pub(super) max_blocks: usize,
    #[serde(default = "default_max_age")]
    pub(super) max_age_seconds: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLongPrompt {
    pub(super) min_prompt_tokens: u64,
    pub(super) pool: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTimeouts {
    pub(super) connect_ms: Option<u64>,
    pub(super) first_token_ms: Option<u64>,
    pub(super) idle_ms: Option<u64>,
    pub(super) total_ms: Option<u64>,
}

fn default_priority_prod() -> i64 {
    0
}

fn default_priority_gray() -> i64 {
    10
}

fn default_priority_stress() -> i64 {
    20
}

fn default_block_bytes() -> usize {
    256
}

fn default_max_blocks() -> usize {
    262_144
}

fn default_max_age() -> u64 {
    600
}

fn default_prefix_bytes() -> usize {
    512
}

fn default_slack() -> u32 {
    4
}

#[cfg(test)]
mod priority_tests {
    use super::*;

    /// A client keeps its own priority when it asks for no better than its environment's;
    /// a better one is replaced, and with `override_client` every one is.
    #[test]
    fn a_client_never_gets_a_better_priority_than_its_environment() {
        let p = EnginePriority {
            by_env: [20, 10, 0],
            override_client: false,
        };
        assert_eq!(p.for_request(Environment::Prod, None), Some(0));
        assert_eq!(p.for_request(Environment::Stress, None), Some(20));
        assert_eq!(p.for_request(Environment::Stress, Some(-5)), Some(20));
        assert_eq!(p.for_request(Environment::Gray, Some(50)), None, "kept");
        assert_eq!(p.for_request(Environment::Gray, Some(10)), None);
        let always = EnginePriority {
            override_client: true,
            ..p
        };
        assert_eq!(always.for_request(Environment::Gray, Some(50)), Some(10));
        assert_eq!(
            always.for_request(Environment::Gray, Some(10)),
            None,
            "already so"
        );
    }

    /// Only the environment the backends strictly put first passes the gateway's capacity.
    #[test]
    fn only_the_strictly_first_environment_goes_first() {
        let p = |by_env| EnginePriority {
            by_env,
            override_client: false,
        };
        let first = |by_env| {
            Environment::ALL
                .into_iter()
                .filter(|e| p(by_env).goes_first(*e))
                .collect::<Vec<_>>()
        };
        assert_eq!(first([20, 10, 0]), [Environment::Prod]);
        assert!(
            first([10, 0, 0]).is_empty(),
            "prod = gray: neither rides an overflow the backends would not order"
        );
        assert_eq!(first([10, 10, 0]), [Environment::Prod], "gray = stress");
        assert!(first([5, 5, 5]).is_empty(), "nothing is ordered");
    }
}
