//! Typed configuration: a raw serde layer that rejects unknown fields and reports the path of
//! any mistake, then validation into the structs the program uses.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Uri;
use serde::Deserialize;

pub use crate::auth::AuthConfig;
use crate::auth::key::Environment;
use crate::secret::Secret;
pub use crate::store::DatabaseConfig;
pub use crate::telemetry::request_log::RequestLogConfig;

/// A configuration problem, reported with the file and the field it concerns. `fleetgate`
/// exits with code 64 (EX_USAGE) on one of these.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
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
}

impl Config {
    /// The sections other than `[[pools]]` that differ in `next` (a reload applies only the
    /// pools; these need a restart). Secrets print redacted, so a changed secret alone is not
    /// noticed here.
    pub fn restart_needed_for(&self, next: &Config) -> Vec<&'static str> {
        let mut out = Vec::new();
        let mut diff = |name: &'static str, a: String, b: String| {
            if a != b {
                out.push(name);
            }
        };
        diff(
            "[server]",
            format!("{:?}", self.server),
            format!("{:?}", next.server),
        );
        diff(
            "[database]",
            format!("{:?}", self.database),
            format!("{:?}", next.database),
        );
        diff(
            "migrate_on_start",
            self.migrate_on_start.to_string(),
            next.migrate_on_start.to_string(),
        );
        diff(
            "[auth]",
            format!("{:?}", self.auth),
            format!("{:?}", next.auth),
        );
        diff(
            "[admin]",
            format!("{:?}", self.admin),
            format!("{:?}", next.admin),
        );
        diff(
            "[request_log]",
            format!("{:?}", self.request_log),
            format!("{:?}", next.request_log),
        );
        diff(
            "[limits]",
            format!("{:?}", self.limits),
            format!("{:?}", next.limits),
        );
        diff(
            "[queue]",
            format!("{:?}", self.queue),
            format!("{:?}", next.queue),
        );
        out
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
        }
    }
}

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

#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: Secret,
    /// Longest wait for Redis on the request path before falling back to local limits.
    pub timeout: Duration,
    /// Replicas sharing the limits: while Redis is unreachable each enforces limit/replicas.
    pub replicas: u32,
    /// Prefix of every Redis key fleetgate writes.
    pub key_prefix: String,
}

#[derive(Debug, Clone)]
pub struct LimitsConfig {
    pub shared: SharedLimits,
    pub redis: Option<RedisConfig>,
    /// Completion tokens reserved for a request that names no `max_tokens`.
    pub default_max_tokens: u32,
    /// Prompt characters per token for the admission estimate.
    pub chars_per_token: u32,
    /// Limiter state of a key unused for this long is dropped.
    pub prune_idle: Duration,
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

/// The admission queue in front of each pool's backends.
#[derive(Debug, Clone)]
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

/// Signing algorithm accepted for admin JWTs (fixed by config: a token with another `alg` is
/// rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub enum JwtAlgorithm {
    #[default]
    HS256,
    RS256,
    ES256,
}

#[derive(Debug, Clone)]
pub enum JwtKey {
    /// HS256 shared secret.
    Secret(Secret),
    /// RS256/ES256 public key (PEM), for verifying only.
    PublicKeyPem(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// The admin API listener (`None`: no admin listener).
    pub listen: Option<SocketAddr>,
    pub jwt_algorithm: JwtAlgorithm,
    /// `None`: the admin API answers 401 explaining that no JWT key is configured.
    pub jwt_key: Option<JwtKey>,
    pub jwt_audience: Option<String>,
    pub jwt_issuer: Option<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 8081))),
            jwt_algorithm: JwtAlgorithm::HS256,
            jwt_key: None,
            jwt_audience: None,
            jwt_issuer: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub shutdown_grace: Duration,
    pub tls: Option<TlsConfig>,
    pub log_format: LogFormat,
    /// Emit one structured log event per request (target `fleetgate::request`).
    pub request_log_events: bool,
    /// How often backends are probed for `/readyz`.
    pub health_interval: Duration,
    /// Request-path worker threads, each with its own event loop (0: one per CPU core).
    pub workers: usize,
    /// Re-read the config file when its content changes (checked every 2 s) and apply its
    /// `[[pools]]`, as SIGHUP does.
    pub watch_config: bool,
}

#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The model name clients send.
    pub model: String,
    /// The name the backends serve it under, when it differs (the body is rewritten).
    pub served_model_name: Option<String>,
    /// Other names clients may send for this model (listed by `/v1/models` too).
    pub aliases: Vec<String>,
    pub backends: Vec<BackendConfig>,
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
    pub gray_pin_label: Option<String>,
    pub health: HealthConfig,
    pub warmup: WarmupConfig,
    /// Read each backend's own load from its Prometheus `/metrics` (vLLM's
    /// `num_requests_running` + `num_requests_waiting`) and balance on it too.
    pub load_aware: Option<LoadAwareConfig>,
    /// Requests with the same `user` or prompt prefix prefer the same backend.
    pub affinity: Option<AffinityConfig>,
}

/// What makes two requests "the same" for backend affinity (prefix-cache reuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityBy {
    /// The OpenAI `user` field.
    User,
    /// The first `prefix_bytes` of the prompt (`messages` or `prompt`).
    Prefix,
}

#[derive(Debug, Clone, Copy)]
pub struct AffinityConfig {
    pub by: AffinityBy,
    pub prefix_bytes: usize,
    /// The preferred backend is used while its load is at most twice the least loaded one's,
    /// or at most this many requests more.
    pub slack: u32,
}

#[derive(Debug, Clone)]
pub struct LoadAwareConfig {
    pub metrics_path: String,
    pub interval: Duration,
}

/// Active health probes of a pool's backends (the interval is `server.health_interval_ms`).
#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub path: String,
    pub timeout: Duration,
    /// Consecutive good probes that bring a down backend back.
    pub healthy_threshold: u32,
    /// Consecutive failed probes that take a backend down.
    pub unhealthy_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            timeout: Duration::from_secs(2),
            healthy_threshold: 1,
            unhealthy_threshold: 1,
        }
    }
}

/// Warm-up of a backend that is new or comes back from down: `requests` small completions
/// that must all succeed before it takes traffic, then its share ramps up over `slow_start`.
#[derive(Debug, Clone)]
pub struct WarmupConfig {
    pub requests: u32,
    pub prompt: String,
    pub slow_start: Duration,
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

#[derive(Debug, Clone)]
pub struct LongPromptConfig {
    pub min_prompt_tokens: u64,
    /// The model name of the pool that takes them.
    pub pool: String,
}

/// One backend of a pool.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub url: Uri,
    /// Share of new requests relative to the pool's other backends (≥ 1).
    pub weight: u32,
    /// Requests this backend serves at once (`None`: the pool's `max_in_flight_per_backend`).
    pub capacity: Option<u32>,
    /// Free-form labels (e.g. `canary`), shown by the admin API.
    pub labels: Vec<String>,
    /// Sent to this backend instead of the pool's `upstream_api_key`.
    pub upstream_api_key: Option<Secret>,
    pub discover: Discover,
}

/// How a backend entry becomes backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discover {
    /// The URL is one backend.
    Static,
    /// The URL's host is re-resolved every `interval`; each address is one backend (a
    /// Kubernetes headless Service).
    Dns { interval: Duration },
}

pub const DEFAULT_DNS_INTERVAL: Duration = Duration::from_secs(5);

impl BackendConfig {
    pub fn new(url: Uri) -> Self {
        Self {
            url,
            weight: 1,
            capacity: None,
            labels: Vec::new(),
            upstream_api_key: None,
            discover: Discover::Static,
        }
    }
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

pub const DEFAULT_MAX_IN_FLIGHT: u32 = 256;

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    /// From sending the request until the response head (non-streaming) or the first
    /// token (streaming) arrives.
    pub first_token: Duration,
    /// Longest silence between two chunks of a response body.
    pub idle: Duration,
    /// Whole request, first byte sent to last byte received.
    pub total: Duration,
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

pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace: Duration::from_secs(30),
            tls: None,
            log_format: LogFormat::Text,
            request_log_events: true,
            health_interval: Duration::from_secs(5),
            workers: 0,
            watch_config: false,
        }
    }
}

impl PoolConfig {
    /// A pool with default timeouts and no rename or upstream key.
    pub fn new(model: impl Into<String>, backends: Vec<Uri>) -> Self {
        Self {
            model: model.into(),
            served_model_name: None,
            aliases: Vec::new(),
            backends: backends.into_iter().map(BackendConfig::new).collect(),
            upstream_api_key: None,
            ca_file: None,
            timeouts: Timeouts::default(),
            environments: None,
            max_in_flight_per_backend: DEFAULT_MAX_IN_FLIGHT,
            retries: RetryConfig::default(),
            ejection: EjectionConfig::default(),
            long_prompt: None,
            gray_pin_label: None,
            health: HealthConfig::default(),
            warmup: WarmupConfig::default(),
            load_aware: None,
            affinity: None,
        }
    }
}

// ---- raw layer -------------------------------------------------------------------------

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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    #[serde(default)]
    shared: SharedLimits,
    redis: Option<RawRedis>,
    #[serde(default = "default_max_tokens")]
    default_max_tokens: u32,
    #[serde(default = "default_chars_per_token")]
    chars_per_token: u32,
    #[serde(default = "default_prune_idle")]
    prune_idle_seconds: u64,
    #[serde(default)]
    stress: RawEnvLimits,
    #[serde(default)]
    gray: RawEnvLimits,
    #[serde(default)]
    prod: RawEnvLimits,
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

fn default_max_tokens() -> u32 {
    1024
}
fn default_chars_per_token() -> u32 {
    4
}
fn default_prune_idle() -> u64 {
    600
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawEnvLimits {
    requests_per_minute: Option<u32>,
    request_burst: Option<u32>,
    tokens_per_minute: Option<u64>,
    max_concurrent_streams: Option<u32>,
    aggregate_requests_per_second: Option<u32>,
    aggregate_burst: Option<u32>,
    aggregate_max_concurrent: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    url: String,
    #[serde(default = "default_redis_timeout")]
    timeout_ms: u64,
    #[serde(default = "default_replicas")]
    replicas: u32,
    #[serde(default = "default_key_prefix")]
    key_prefix: String,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    #[serde(default = "default_queue_size")]
    max_size: usize,
    #[serde(default = "default_queue_per_key")]
    max_per_key: usize,
    #[serde(default)]
    max_wait_seconds: RawQueueWait,
    #[serde(default)]
    keepalive_interval_ms: u64,
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

fn default_queue_size() -> usize {
    1024
}
fn default_queue_per_key() -> usize {
    128
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueueWait {
    #[serde(default = "default_wait_stress")]
    stress: f64,
    #[serde(default = "default_wait_gray")]
    gray: f64,
    #[serde(default = "default_wait_prod")]
    prod: f64,
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

fn default_wait_stress() -> f64 {
    5.0
}
fn default_wait_gray() -> f64 {
    15.0
}
fn default_wait_prod() -> f64 {
    30.0
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequestLog {
    #[serde(default = "default_true")]
    enabled: bool,
    #[serde(default = "default_log_capacity")]
    channel_capacity: usize,
    #[serde(default = "default_batch_rows")]
    batch_rows: usize,
    #[serde(default = "default_flush_ms")]
    flush_interval_ms: u64,
    #[serde(default = "default_spill_path")]
    spill_path: PathBuf,
    #[serde(default = "default_retention")]
    retention_days: u32,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDatabase {
    url: Option<String>,
    #[serde(default = "default_sqlite_path")]
    sqlite_path: PathBuf,
    #[serde(default = "default_max_connections")]
    max_connections: u32,
    #[serde(default = "default_db_connect_ms")]
    connect_timeout_ms: u64,
    #[serde(default = "default_true")]
    migrate_on_start: bool,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    #[serde(default = "default_lookups")]
    lookups_per_second: u32,
    #[serde(default = "default_negative_cache")]
    negative_cache_seconds: u64,
    #[serde(default = "default_failures")]
    failures_per_minute: u32,
    #[serde(default = "default_resync")]
    resync_interval_seconds: u64,
}

impl Default for RawAuth {
    fn default() -> Self {
        Self {
            lookups_per_second: default_lookups(),
            negative_cache_seconds: default_negative_cache(),
            failures_per_minute: default_failures(),
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
fn default_resync() -> u64 {
    30
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    listen: String,
    #[serde(default)]
    jwt_algorithm: JwtAlgorithm,
    jwt_secret: Option<String>,
    jwt_public_key_file: Option<PathBuf>,
    jwt_audience: Option<String>,
    jwt_issuer: Option<String>,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: default_admin_listen(),
            jwt_algorithm: JwtAlgorithm::HS256,
            jwt_secret: None,
            jwt_public_key_file: None,
            jwt_audience: None,
            jwt_issuer: None,
        }
    }
}

fn default_admin_listen() -> String {
    "127.0.0.1:8081".to_owned()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    #[serde(default = "default_listen")]
    listen: String,
    #[serde(default = "default_max_body")]
    max_body_bytes: u64,
    #[serde(default = "default_grace")]
    shutdown_grace_seconds: f64,
    tls: Option<RawTls>,
    #[serde(default)]
    log_format: LogFormat,
    #[serde(default = "default_true")]
    request_log_events: bool,
    #[serde(default = "default_health_interval")]
    health_interval_ms: u64,
    #[serde(default)]
    workers: usize,
    #[serde(default)]
    watch_config: bool,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            max_body_bytes: default_max_body(),
            shutdown_grace_seconds: default_grace(),
            tls: None,
            log_format: LogFormat::Text,
            request_log_events: true,
            health_interval_ms: default_health_interval(),
            workers: 0,
            watch_config: false,
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:8080".to_owned()
}
fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY_BYTES as u64
}
fn default_grace() -> f64 {
    30.0
}
fn default_true() -> bool {
    true
}
fn default_health_interval() -> u64 {
    5000
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert: PathBuf,
    key: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    model: String,
    served_model_name: Option<String>,
    #[serde(default)]
    aliases: Vec<String>,
    backends: Vec<RawBackend>,
    upstream_api_key: Option<String>,
    ca_file: Option<PathBuf>,
    #[serde(default)]
    timeouts: RawTimeouts,
    environments: Option<Vec<Environment>>,
    max_in_flight_per_backend: Option<u32>,
    #[serde(default)]
    retries: RawRetries,
    #[serde(default)]
    ejection: RawEjection,
    long_prompt: Option<RawLongPrompt>,
    gray_pin_label: Option<String>,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    warmup: RawWarmup,
    load_aware: Option<RawLoadAware>,
    affinity: Option<RawAffinity>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAffinity {
    by: AffinityBy,
    #[serde(default = "default_prefix_bytes")]
    prefix_bytes: usize,
    #[serde(default = "default_slack")]
    slack: u32,
}

fn default_prefix_bytes() -> usize {
    512
}
fn default_slack() -> u32 {
    4
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoadAware {
    #[serde(default = "default_metrics_path")]
    metrics_path: String,
    #[serde(default = "default_scrape_ms")]
    interval_ms: u64,
}

fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_scrape_ms() -> u64 {
    1000
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    #[serde(default = "default_health_path")]
    path: String,
    #[serde(default = "default_health_timeout")]
    timeout_ms: u64,
    #[serde(default = "default_one")]
    healthy_threshold: u32,
    #[serde(default = "default_one")]
    unhealthy_threshold: u32,
}

impl Default for RawHealth {
    fn default() -> Self {
        Self {
            path: default_health_path(),
            timeout_ms: default_health_timeout(),
            healthy_threshold: 1,
            unhealthy_threshold: 1,
        }
    }
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

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawWarmup {
    #[serde(default)]
    requests: u32,
    prompt: Option<String>,
    #[serde(default)]
    slow_start_seconds: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLongPrompt {
    min_prompt_tokens: u64,
    pool: String,
}

/// A backend: its base URL, or a table with the URL and its weight, capacity, labels, key.
enum RawBackend {
    Url(String),
    Table(RawBackendTable),
}

impl<'de> Deserialize<'de> for RawBackend {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawBackend;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a backend base URL, or a table { url = \"...\", weight, capacity, labels, upstream_api_key }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawBackend, E> {
                Ok(RawBackend::Url(v.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<RawBackend, A::Error> {
                // Through the table's own Deserialize: unknown keys are named.
                RawBackendTable::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(RawBackend::Table)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackendTable {
    url: String,
    #[serde(default = "default_weight")]
    weight: u32,
    capacity: Option<u32>,
    #[serde(default)]
    labels: Vec<String>,
    upstream_api_key: Option<String>,
    discover: Option<String>,
    refresh_interval_ms: Option<u64>,
}

fn default_weight() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetries {
    #[serde(default = "default_max_retries")]
    max_retries: u32,
    #[serde(default = "default_budget_percent")]
    budget_percent: f64,
}

impl Default for RawRetries {
    fn default() -> Self {
        Self {
            max_retries: default_max_retries(),
            budget_percent: default_budget_percent(),
        }
    }
}

fn default_max_retries() -> u32 {
    2
}
fn default_budget_percent() -> f64 {
    20.0
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEjection {
    #[serde(default = "default_consecutive_failures")]
    consecutive_failures: u32,
    #[serde(default = "default_eject_base")]
    base_ms: u64,
    #[serde(default = "default_eject_max")]
    max_ms: u64,
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

fn default_consecutive_failures() -> u32 {
    3
}
fn default_eject_base() -> u64 {
    1000
}
fn default_eject_max() -> u64 {
    60_000
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    connect_ms: Option<u64>,
    first_token_ms: Option<u64>,
    idle_ms: Option<u64>,
    total_ms: Option<u64>,
}

/// Replace `${VAR}` and `${VAR:-default}` with the environment's values. A missing variable
/// without a default is an error, so a typo cannot silently become an empty key. Comment
/// lines are left alone.
pub fn interpolate_env(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                return Err("unterminated `${` in config".to_owned());
            };
            let expr = &after[..end];
            let (name, default) = match expr.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (expr, None),
            };
            match (lookup(name), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(format!(
                        "environment variable `{name}` is not set (write `${{{name}:-default}}` to allow a default)"
                    ));
                }
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
    }
    Ok(out)
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
        Self::parse(&file, &text, |name| std::env::var(name).ok())
    }

    /// Parse config text (`file` only names it in errors).
    pub fn parse(
        file: &str,
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let err = |field: &str, message: String| ConfigError {
            file: file.to_owned(),
            field: field.to_owned(),
            message,
        };
        let text = interpolate_env(text, env).map_err(|m| err("-", m))?;
        let de = toml::Deserializer::parse(&text).map_err(|e| err("-", e.to_string()))?;
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            err(&path, e.into_inner().message().to_owned())
        })?;
        raw.validate(file)
    }
}

impl RawConfig {
    fn validate(self, file: &str) -> Result<Config, ConfigError> {
        let err = |field: String, message: String| ConfigError {
            file: file.to_owned(),
            field,
            message,
        };
        let s = self.server;
        let listen: SocketAddr = s.listen.parse().map_err(|_| {
            err(
                "server.listen".into(),
                format!(
                    "`{}` is not an address:port (for example \"127.0.0.1:8080\" or \"0.0.0.0:8080\")",
                    s.listen
                ),
            )
        })?;
        if s.max_body_bytes < 1024 {
            return Err(err(
                "server.max_body_bytes".into(),
                "must be at least 1024".into(),
            ));
        }
        if !(s.shutdown_grace_seconds.is_finite() && s.shutdown_grace_seconds >= 0.0) {
            return Err(err(
                "server.shutdown_grace_seconds".into(),
                "must be a number of seconds ≥ 0".into(),
            ));
        }
        if s.health_interval_ms == 0 {
            return Err(err(
                "server.health_interval_ms".into(),
                "must be > 0".into(),
            ));
        }
        let tls = s.tls.map(|t| TlsConfig {
            cert: t.cert,
            key: t.key,
        });
        let server = ServerConfig {
            listen,
            max_body_bytes: usize::try_from(s.max_body_bytes).unwrap_or(usize::MAX),
            shutdown_grace: Duration::from_secs_f64(s.shutdown_grace_seconds),
            tls,
            log_format: s.log_format,
            request_log_events: s.request_log_events,
            health_interval: Duration::from_millis(s.health_interval_ms),
            workers: s.workers,
            watch_config: s.watch_config,
        };

        if self.pools.is_empty() {
            return Err(err(
                "pools".into(),
                "no pool is configured: add a [[pools]] table with `model` and `backends`".into(),
            ));
        }
        let mut seen = HashSet::new();
        let mut pools = Vec::with_capacity(self.pools.len());
        for (i, p) in self.pools.into_iter().enumerate() {
            let at = |f: &str| format!("pools[{i}].{f}");
            if p.model.trim().is_empty() {
                return Err(err(at("model"), "must not be empty".into()));
            }
            if !seen.insert(p.model.clone()) {
                return Err(err(
                    at("model"),
                    format!("model `{}` is configured twice", p.model),
                ));
            }
            if p.backends.is_empty() {
                return Err(err(
                    at("backends"),
                    "needs at least one backend base URL, e.g. \"http://10.0.0.5:8000\"".into(),
                ));
            }
            let mut backends = Vec::with_capacity(p.backends.len());
            for (j, b) in p.backends.into_iter().enumerate() {
                let bat = |f: &str| at(&format!("backends[{j}]{f}"));
                let backend = match b {
                    RawBackend::Url(u) => {
                        BackendConfig::new(parse_backend_url(&u).map_err(|m| err(bat(""), m))?)
                    }
                    RawBackend::Table(t) => {
                        if t.weight == 0 {
                            return Err(err(
                                bat(".weight"),
                                "must be ≥ 1 (remove the backend, or drain it through the admin API, to stop its traffic)".into(),
                            ));
                        }
                        let url = parse_backend_url(&t.url).map_err(|m| err(bat(".url"), m))?;
                        let discover = match t.discover.as_deref() {
                            None | Some("static") => {
                                if t.refresh_interval_ms.is_some() {
                                    return Err(err(
                                        bat(".refresh_interval_ms"),
                                        "applies only with discover = \"dns\"".into(),
                                    ));
                                }
                                Discover::Static
                            }
                            Some("dns") => {
                                check_dns_entry(&url).map_err(|m| err(bat(".url"), m))?;
                                let ms = t
                                    .refresh_interval_ms
                                    .unwrap_or(DEFAULT_DNS_INTERVAL.as_millis() as u64);
                                if ms < 100 {
                                    return Err(err(
                                        bat(".refresh_interval_ms"),
                                        "must be at least 100 (milliseconds)".into(),
                                    ));
                                }
                                Discover::Dns {
                                    interval: Duration::from_millis(ms),
                                }
                            }
                            Some(other) => {
                                return Err(err(
                                    bat(".discover"),
                                    format!(
                                        "`{other}` is not a discovery mode: use \"dns\" (re-resolve the host, one backend per address) or leave it out"
                                    ),
                                ));
                            }
                        };
                        BackendConfig {
                            url,
                            weight: t.weight,
                            capacity: t.capacity,
                            labels: t.labels,
                            upstream_api_key: t.upstream_api_key.map(Secret::new),
                            discover,
                        }
                    }
                };
                if backends
                    .iter()
                    .any(|o: &BackendConfig| o.url == backend.url)
                {
                    return Err(err(
                        bat(""),
                        format!("backend {} is listed twice", backend.url),
                    ));
                }
                backends.push(backend);
            }
            for (k, a) in p.aliases.iter().enumerate() {
                if a.trim().is_empty() {
                    return Err(err(
                        at(&format!("aliases[{k}]")),
                        "must not be empty".into(),
                    ));
                }
                if !seen.insert(a.clone()) {
                    return Err(err(
                        at(&format!("aliases[{k}]")),
                        format!("`{a}` already names another pool or alias"),
                    ));
                }
            }
            if !(p.retries.budget_percent.is_finite()
                && (0.0..=100.0).contains(&p.retries.budget_percent))
            {
                return Err(err(
                    at("retries.budget_percent"),
                    "must be between 0 and 100".into(),
                ));
            }
            if !p.health.path.starts_with('/') {
                return Err(err(at("health.path"), "must start with `/`".into()));
            }
            if p.health.timeout_ms == 0
                || p.health.healthy_threshold == 0
                || p.health.unhealthy_threshold == 0
            {
                return Err(err(
                    at("health"),
                    "timeout_ms, healthy_threshold and unhealthy_threshold must be > 0".into(),
                ));
            }
            if !(p.warmup.slow_start_seconds.is_finite()
                && (0.0..=3600.0).contains(&p.warmup.slow_start_seconds))
            {
                return Err(err(
                    at("warmup.slow_start_seconds"),
                    "must be between 0 and 3600".into(),
                ));
            }
            if p.ejection.base_ms == 0 || p.ejection.max_ms < p.ejection.base_ms {
                return Err(err(
                    at("ejection"),
                    "base_ms must be > 0 and max_ms ≥ base_ms".into(),
                ));
            }
            if let Some(name) = &p.served_model_name
                && name.trim().is_empty()
            {
                return Err(err(
                    at("served_model_name"),
                    "must not be empty (leave it out to send the model name unchanged)".into(),
                ));
            }
            if let Some(ca) = &p.ca_file
                && !ca.exists()
            {
                return Err(err(
                    at("ca_file"),
                    format!("{} does not exist", ca.display()),
                ));
            }
            let d = Timeouts::default();
            let ms =
                |v: Option<u64>, dflt: Duration, name: &str| -> Result<Duration, ConfigError> {
                    match v {
                        None => Ok(dflt),
                        Some(0) => Err(err(at(&format!("timeouts.{name}")), "must be > 0".into())),
                        Some(v) => Ok(Duration::from_millis(v)),
                    }
                };
            let timeouts = Timeouts {
                connect: ms(p.timeouts.connect_ms, d.connect, "connect_ms")?,
                first_token: ms(p.timeouts.first_token_ms, d.first_token, "first_token_ms")?,
                idle: ms(p.timeouts.idle_ms, d.idle, "idle_ms")?,
                total: ms(p.timeouts.total_ms, d.total, "total_ms")?,
            };
            if let Some(envs) = &p.environments
                && envs.is_empty()
            {
                return Err(err(
                    at("environments"),
                    "must name at least one of stress, gray, prod (leave it out to allow all)"
                        .into(),
                ));
            }
            pools.push(PoolConfig {
                model: p.model,
                served_model_name: p.served_model_name,
                aliases: p.aliases,
                backends,
                upstream_api_key: p.upstream_api_key.map(Secret::new),
                ca_file: p.ca_file,
                timeouts,
                environments: p.environments,
                max_in_flight_per_backend: p
                    .max_in_flight_per_backend
                    .unwrap_or(DEFAULT_MAX_IN_FLIGHT),
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
                gray_pin_label: p.gray_pin_label,
                health: HealthConfig {
                    path: p.health.path,
                    timeout: Duration::from_millis(p.health.timeout_ms),
                    healthy_threshold: p.health.healthy_threshold,
                    unhealthy_threshold: p.health.unhealthy_threshold,
                },
                warmup: WarmupConfig {
                    requests: p.warmup.requests,
                    prompt: p.warmup.prompt.unwrap_or_else(|| "Hello".into()),
                    slow_start: Duration::from_secs_f64(p.warmup.slow_start_seconds),
                },
                load_aware: match p.load_aware {
                    Some(l) if !l.metrics_path.starts_with('/') || l.interval_ms == 0 => {
                        return Err(err(
                            at("load_aware"),
                            "metrics_path must start with `/` and interval_ms must be > 0".into(),
                        ));
                    }
                    Some(l) => Some(LoadAwareConfig {
                        metrics_path: l.metrics_path,
                        interval: Duration::from_millis(l.interval_ms),
                    }),
                    None => None,
                },
                affinity: p.affinity.map(|a| AffinityConfig {
                    by: a.by,
                    prefix_bytes: a.prefix_bytes.max(1),
                    slack: a.slack,
                }),
            });
        }

        for (i, p) in pools.iter().enumerate() {
            if let Some(lp) = &p.long_prompt {
                if lp.pool == p.model || p.aliases.contains(&lp.pool) {
                    return Err(err(
                        format!("pools[{i}].long_prompt.pool"),
                        "must name another pool (the one that takes long prompts)".into(),
                    ));
                }
                if !pools.iter().any(|o| o.model == lp.pool) {
                    return Err(err(
                        format!("pools[{i}].long_prompt.pool"),
                        format!("no pool has model `{}`", lp.pool),
                    ));
                }
                if lp.min_prompt_tokens == 0 {
                    return Err(err(
                        format!("pools[{i}].long_prompt.min_prompt_tokens"),
                        "must be > 0".into(),
                    ));
                }
            }
            if let Some(label) = &p.gray_pin_label
                && !p.backends.iter().any(|b| b.labels.contains(label))
            {
                return Err(err(
                    format!("pools[{i}].gray_pin_label"),
                    format!("no backend of this pool has the label `{label}`"),
                ));
            }
        }

        let d = self.database;
        let url = d.url.filter(|u| !u.trim().is_empty());
        if let Some(u) = &url
            && !(u.starts_with("postgres://") || u.starts_with("postgresql://"))
        {
            return Err(err(
                "database.url".into(),
                "must be a postgres:// URL (leave it out to use the embedded SQLite file at database.sqlite_path)".into(),
            ));
        }
        if d.max_connections == 0 {
            return Err(err("database.max_connections".into(), "must be > 0".into()));
        }
        let database = DatabaseConfig {
            url: url.map(Secret::new),
            sqlite_path: d.sqlite_path,
            max_connections: d.max_connections,
            connect_timeout: Duration::from_millis(d.connect_timeout_ms.max(1)),
        };

        let a = self.auth;
        if a.resync_interval_seconds == 0 {
            return Err(err(
                "auth.resync_interval_seconds".into(),
                "must be > 0".into(),
            ));
        }
        let auth = AuthConfig {
            lookups_per_second: a.lookups_per_second,
            negative_cache: Duration::from_secs(a.negative_cache_seconds),
            failures_per_minute: a.failures_per_minute,
            resync_interval: Duration::from_secs(a.resync_interval_seconds),
        };

        let ad = self.admin;
        let admin_listen = if ad.listen.trim().is_empty() {
            None
        } else {
            Some(ad.listen.parse::<SocketAddr>().map_err(|_| {
                err(
                    "admin.listen".into(),
                    format!(
                        "`{}` is not an address:port (\"\" disables the admin listener)",
                        ad.listen
                    ),
                )
            })?)
        };
        let secret = ad.jwt_secret.filter(|s| !s.is_empty());
        let jwt_key = match (ad.jwt_algorithm, secret, ad.jwt_public_key_file) {
            (JwtAlgorithm::HS256, Some(s), None) => {
                if s.len() < 32 {
                    return Err(err(
                        "admin.jwt_secret".into(),
                        "must be at least 32 characters (e.g. `openssl rand -base64 48`)".into(),
                    ));
                }
                Some(JwtKey::Secret(Secret::new(s)))
            }
            (JwtAlgorithm::HS256, None, None) => None,
            (JwtAlgorithm::HS256, _, Some(_)) => {
                return Err(err(
                    "admin.jwt_public_key_file".into(),
                    "HS256 uses admin.jwt_secret; set jwt_algorithm = \"RS256\" or \"ES256\" to use a public key".into(),
                ));
            }
            (_, Some(_), _) => {
                return Err(err(
                    "admin.jwt_secret".into(),
                    "RS256/ES256 verify with admin.jwt_public_key_file, not a shared secret".into(),
                ));
            }
            (_, None, Some(path)) => {
                Some(JwtKey::PublicKeyPem(std::fs::read(&path).map_err(|e| {
                    err(
                        "admin.jwt_public_key_file".into(),
                        format!("{}: {e}", path.display()),
                    )
                })?))
            }
            (_, None, None) => None,
        };
        let admin = AdminConfig {
            listen: admin_listen,
            jwt_algorithm: ad.jwt_algorithm,
            jwt_key,
            jwt_audience: ad.jwt_audience,
            jwt_issuer: ad.jwt_issuer,
        };
        let rl = self.request_log;
        if rl.batch_rows == 0 || rl.batch_rows > 1000 {
            return Err(err(
                "request_log.batch_rows".into(),
                "must be between 1 and 1000 (one INSERT carries 25 values per row)".into(),
            ));
        }
        if rl.retention_days == 0 {
            return Err(err(
                "request_log.retention_days".into(),
                "must be ≥ 1".into(),
            ));
        }
        let request_log = RequestLogConfig {
            enabled: rl.enabled,
            channel_capacity: rl.channel_capacity.max(1),
            batch_rows: rl.batch_rows,
            flush_interval: Duration::from_millis(rl.flush_interval_ms),
            spill_path: rl.spill_path,
            retention_days: rl.retention_days,
        };
        let limits = self.limits.validate(&err)?;
        let queue = self.queue.validate(&err)?;
        Ok(Config {
            server,
            pools,
            database,
            migrate_on_start: d.migrate_on_start,
            auth,
            admin,
            request_log,
            limits,
            queue,
        })
    }
}

type ErrFn<'a> = &'a dyn Fn(String, String) -> ConfigError;

impl RawLimits {
    fn validate(self, err: ErrFn<'_>) -> Result<LimitsConfig, ConfigError> {
        let redis = match (self.shared, self.redis) {
            (SharedLimits::Redis, None) => {
                return Err(err(
                    "limits.redis".into(),
                    "limits.shared = \"redis\" needs a [limits.redis] table with `url` (e.g. \"redis://127.0.0.1:6379\")".into(),
                ));
            }
            (_, Some(r)) => {
                if !(r.url.starts_with("redis://")
                    || r.url.starts_with("rediss://")
                    || r.url.starts_with("unix://")
                    || r.url.starts_with("redis+unix://"))
                {
                    return Err(err(
                        "limits.redis.url".into(),
                        "must be a redis://, rediss:// or unix:// URL".into(),
                    ));
                }
                if r.replicas == 0 {
                    return Err(err(
                        "limits.redis.replicas".into(),
                        "must be ≥ 1 (the number of gateway replicas sharing these limits)".into(),
                    ));
                }
                if r.timeout_ms == 0 {
                    return Err(err("limits.redis.timeout_ms".into(), "must be > 0".into()));
                }
                Some(RedisConfig {
                    url: Secret::new(r.url),
                    timeout: Duration::from_millis(r.timeout_ms),
                    replicas: r.replicas,
                    key_prefix: r.key_prefix,
                })
            }
            (SharedLimits::Local, None) => None,
        };
        if self.default_max_tokens == 0 {
            return Err(err(
                "limits.default_max_tokens".into(),
                "must be > 0".into(),
            ));
        }
        if self.chars_per_token == 0 {
            return Err(err("limits.chars_per_token".into(), "must be > 0".into()));
        }
        let mut environments = [EnvLimits::default(); 3];
        for (env, raw) in [
            (Environment::Stress, self.stress),
            (Environment::Gray, self.gray),
            (Environment::Prod, self.prod),
        ] {
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
                    return Err(err(at(f), "must be > 0 (leave it out for no limit)".into()));
                }
            }
            if raw.tokens_per_minute == Some(0) {
                return Err(err(
                    at("tokens_per_minute"),
                    "must be > 0 (leave it out for no limit)".into(),
                ));
            }
            if raw.request_burst.is_some() && raw.requests_per_minute.is_none() {
                return Err(err(
                    at("request_burst"),
                    "is the burst of requests_per_minute: set that too".into(),
                ));
            }
            if raw.aggregate_burst.is_some() && raw.aggregate_requests_per_second.is_none() {
                return Err(err(
                    at("aggregate_burst"),
                    "is the burst of aggregate_requests_per_second: set that too".into(),
                ));
            }
            environments[env.index()] = EnvLimits {
                requests_per_minute: raw.requests_per_minute,
                request_burst: raw.request_burst,
                tokens_per_minute: raw.tokens_per_minute,
                max_concurrent_streams: raw.max_concurrent_streams,
                aggregate_requests_per_second: raw.aggregate_requests_per_second,
                aggregate_burst: raw.aggregate_burst,
                aggregate_max_concurrent: raw.aggregate_max_concurrent,
            };
        }
        Ok(LimitsConfig {
            shared: self.shared,
            redis,
            default_max_tokens: self.default_max_tokens,
            chars_per_token: self.chars_per_token,
            prune_idle: Duration::from_secs(self.prune_idle_seconds.max(1)),
            environments,
        })
    }
}

impl RawQueue {
    fn validate(self, err: ErrFn<'_>) -> Result<QueueConfig, ConfigError> {
        if self.max_size == 0 {
            return Err(err(
                "queue.max_size".into(),
                "must be > 0 (set pools[].max_in_flight_per_backend = 0 to turn queueing off)"
                    .into(),
            ));
        }
        if self.max_per_key == 0 {
            return Err(err("queue.max_per_key".into(), "must be > 0".into()));
        }
        let w = self.max_wait_seconds;
        let mut max_wait = [Duration::ZERO; 3];
        for (env, secs) in [
            (Environment::Stress, w.stress),
            (Environment::Gray, w.gray),
            (Environment::Prod, w.prod),
        ] {
            if !(secs.is_finite() && (0.0..=3600.0).contains(&secs)) {
                return Err(err(
                    format!("queue.max_wait_seconds.{env}"),
                    "must be a number of seconds between 0 and 3600".into(),
                ));
            }
            max_wait[env.index()] = Duration::from_secs_f64(secs);
        }
        Ok(QueueConfig {
            max_size: self.max_size,
            max_per_key: self.max_per_key.min(self.max_size),
            max_wait,
            keepalive_interval: (self.keepalive_interval_ms > 0)
                .then(|| Duration::from_millis(self.keepalive_interval_ms)),
        })
    }
}

/// A backend is a base URL: scheme http or https, a host, an optional path prefix (a trailing
/// `/v1` is accepted and dropped, since clients' base URLs often carry it).
/// A `discover = "dns"` entry names a host to resolve, reached over plain HTTP.
fn check_dns_entry(url: &Uri) -> Result<(), String> {
    if url.scheme_str() != Some("http") {
        return Err(format!(
            "`{url}`: discover = \"dns\" dials each address directly, so it needs http:// (a TLS certificate names the Service, not the pods' addresses)"
        ));
    }
    let host = url.host().unwrap_or_default();
    if host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
    {
        return Err(format!(
            "`{url}`: discover = \"dns\" needs a host name to resolve (e.g. a headless Service, vllm.default.svc.cluster.local), not an address"
        ));
    }
    Ok(())
}

pub fn parse_backend_url(text: &str) -> Result<Uri, String> {
    let uri: Uri = text
        .parse()
        .map_err(|e| format!("`{text}` is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => {
            return Err(format!(
                "`{text}` needs a scheme: http://host:port or https://host:port"
            ));
        }
    }
    if uri.host().is_none() {
        return Err(format!("`{text}` has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("`{text}` must not carry a query string"));
    }
    let mut path = uri.path().trim_end_matches('/');
    if let Some(p) = path.strip_suffix("/v1") {
        path = p;
    }
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    let scheme = uri.scheme_str().unwrap_or("http");
    format!("{scheme}://{authority}{path}")
        .parse()
        .map_err(|e| format!("`{text}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse("t.toml", text, |n| {
            (n == "KEY").then(|| "sekrit".to_owned())
        })
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse("[[pools]]\nmodel='m'\nbackends=['http://127.0.0.1:8001/v1/']\n").unwrap();
        assert_eq!(c.server.listen.port(), 8080);
        assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(
            c.pools[0].backends[0].url.to_string(),
            "http://127.0.0.1:8001/"
        );
        assert_eq!(c.pools[0].timeouts.connect, Duration::from_secs(3));
    }

    #[test]
    fn dns_discovery_entries_and_their_mistakes() {
        let c = parse(
            "[[pools]]\nmodel='m'\nbackends=[{url='http://vllm.ns.svc:8000', discover='dns', refresh_interval_ms=2000, labels=['a']}]\n",
        )
        .unwrap();
        assert_eq!(
            c.pools[0].backends[0].discover,
            Discover::Dns {
                interval: Duration::from_secs(2)
            }
        );
        let d =
            parse("[[pools]]\nmodel='m'\nbackends=[{url='http://vllm:8000', discover='dns'}]\n")
                .unwrap();
        assert_eq!(
            d.pools[0].backends[0].discover,
            Discover::Dns {
                interval: DEFAULT_DNS_INTERVAL
            }
        );
        for (backend, field, says) in [
            (
                "{url='https://vllm:8000', discover='dns'}",
                ".url",
                "needs http://",
            ),
            (
                "{url='http://10.0.0.5:8000', discover='dns'}",
                ".url",
                "host name",
            ),
            (
                "{url='http://vllm:8000', discover='srv'}",
                ".discover",
                "not a discovery mode",
            ),
            (
                "{url='http://vllm:8000', refresh_interval_ms=100}",
                ".refresh_interval_ms",
                "only with discover",
            ),
            (
                "{url='http://vllm:8000', discover='dns', refresh_interval_ms=5}",
                ".refresh_interval_ms",
                "at least 100",
            ),
        ] {
            let e = parse(&format!("[[pools]]\nmodel='m'\nbackends=[{backend}]\n")).unwrap_err();
            assert_eq!(e.field, format!("pools[0].backends[0]{field}"), "{backend}");
            assert!(e.message.contains(says), "{backend}: {}", e.message);
        }
    }

    #[test]
    fn a_reload_names_the_sections_that_need_a_restart() {
        let a = parse("[[pools]]\nmodel='m'\nbackends=['http://a:1']\n").unwrap();
        let b =
            parse("[queue]\nmax_size=9\n[[pools]]\nmodel='n'\nbackends=['http://b:1']\n").unwrap();
        assert_eq!(a.restart_needed_for(&b), ["[queue]"]);
        assert!(a.restart_needed_for(&a).is_empty());
    }

    #[test]
    fn unknown_field_names_its_path() {
        let e = parse("[server]\nlisen='x'\n[[pools]]\nmodel='m'\nbackends=['http://a']\n")
            .unwrap_err();
        assert_eq!(e.field, "server.lisen");
        assert!(e.message.contains("lisen"), "{e}");
    }

    #[test]
    fn bad_backend_names_index() {
        let e =
            parse("[[pools]]\nmodel='m'\nbackends=['http://a', '10.0.0.1:8000']\n").unwrap_err();
        assert_eq!(e.field, "pools[0].backends[1]");
        assert!(e.message.contains("scheme"), "{e}");
    }

    #[test]
    fn env_interpolation_and_secret_hidden() {
        let c = parse("[[pools]]\nmodel='m'\nbackends=['http://a']\nupstream_api_key='${KEY}'\n")
            .unwrap();
        let key = c.pools[0].upstream_api_key.as_ref().unwrap();
        assert_eq!(key.expose(), "sekrit");
        assert_eq!(format!("{key:?} {key}"), "***** *****");
        let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a']\nupstream_api_key='${NOPE}'\n")
            .unwrap_err();
        assert!(e.message.contains("NOPE"));
        let c = parse("[server]\nlisten='${NOPE:-127.0.0.1:9}'\n[[pools]]\nmodel='m'\nbackends=['http://a']\n").unwrap();
        assert_eq!(c.server.listen.port(), 9);
    }

    #[test]
    fn duplicate_model_and_empty_pools_rejected() {
        assert_eq!(parse("").unwrap_err().field, "pools");
        let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a']\n[[pools]]\nmodel='m'\nbackends=['http://b']\n").unwrap_err();
        assert_eq!(e.field, "pools[1].model");
    }

    #[test]
    fn backend_tables_aliases_retries_and_ejection() {
        let c = parse(
            "[[pools]]\nmodel='m'\naliases=['old-m']\nbackends=['http://a:1', {url='http://b:2/v1', weight=3, capacity=8, labels=['canary'], upstream_api_key='k'}]\n[pools.retries]\nmax_retries=1\nbudget_percent=10\n[pools.ejection]\nconsecutive_failures=5\nbase_ms=200\nmax_ms=400\n",
        )
        .unwrap();
        let p = &c.pools[0];
        assert_eq!(p.aliases, ["old-m"]);
        assert_eq!(p.backends[0].weight, 1);
        let b = &p.backends[1];
        assert_eq!(b.url.to_string(), "http://b:2/");
        assert_eq!((b.weight, b.capacity), (3, Some(8)));
        assert_eq!(b.labels, ["canary"]);
        assert_eq!(b.upstream_api_key.as_ref().map(Secret::expose), Some("k"));
        assert_eq!(p.retries.max_retries, 1);
        assert!((p.retries.budget_ratio - 0.1).abs() < 1e-9);
        assert_eq!(p.ejection.consecutive_failures, 5);
        let e = parse("[[pools]]\nmodel='m'\nbackends=[{url='http://a', weight=0}]\n").unwrap_err();
        assert_eq!(e.field, "pools[0].backends[0].weight");
        let e = parse("[[pools]]\nmodel='m'\nbackends=['http://a', 'http://a/']\n").unwrap_err();
        assert!(e.message.contains("listed twice"), "{e}");
        let e = parse(
            "[[pools]]\nmodel='m'\nbackends=['http://a']\n[[pools]]\nmodel='n'\naliases=['m']\nbackends=['http://b']\n",
        )
        .unwrap_err();
        assert_eq!(e.field, "pools[1].aliases[0]");
        let e = parse("[[pools]]\nmodel='m'\nbackends=[{url='http://a', wieght=2}]\n").unwrap_err();
        assert!(e.field.starts_with("pools[0].backends"), "{e}");
        assert!(e.message.contains("wieght"), "the typo is named: {e}");
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/fleetgate.toml");
        let c = Config::load(&path).unwrap();
        assert_eq!(c.server.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
        assert_eq!(c.pools[0].backends.len(), 2);
    }
}
