//! The raw serde layer: the file's shape exactly as written, with every table refusing
//! unknown keys so a typo is reported (with its path) instead of silently ignored. Defaults
//! live here; the section modules turn these into the validated types.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

use super::admin::JwtAlgorithm;
use super::limits::SharedLimits;
use super::pools::{AffinityBy, PoolKind};
use super::server::{
    DEFAULT_MAX_AUDIO_BODY_BYTES, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_REQUEST_HEAD_BYTES,
    DEFAULT_MAX_UPSTREAM_HEAD_BYTES, DEFAULT_MAX_UPSTREAM_HEADER_VALUE_BYTES, LogFormat,
};
use super::{ConfigError, Environment, FileErrors};

/// Deserialize interpolated TOML text, naming the path of the first field that does not fit
/// (`server.lisen`, `pools[0].backends[1]`).
pub(super) fn parse(text: &str, err: FileErrors<'_>) -> Result<RawConfig, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| err.at("-", e.to_string()))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        err.at(path, e.into_inner().message())
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    #[serde(default)]
    pub(super) pools: Vec<RawPool>,
    #[serde(default)]
    pub(super) database: RawDatabase,
    #[serde(default)]
    pub(super) auth: RawAuth,
    #[serde(default)]
    pub(super) admin: RawAdmin,
    #[serde(default)]
    pub(super) request_log: RawRequestLog,
    #[serde(default)]
    pub(super) limits: RawLimits,
    #[serde(default)]
    pub(super) queue: RawQueue,
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

fn default_queue_size() -> usize {
    1024
}
fn default_queue_per_key() -> usize {
    128
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
pub(super) struct RawRequestLog {
    #[serde(default = "default_true")]
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDatabase {
    pub(super) url: Option<String>,
    #[serde(default = "default_sqlite_path")]
    pub(super) sqlite_path: PathBuf,
    #[serde(default = "default_max_connections")]
    pub(super) max_connections: u32,
    #[serde(default = "default_db_connect_ms")]
    pub(super) connect_timeout_ms: u64,
    #[serde(default = "default_true")]
    pub(super) migrate_on_start: bool,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    pub(super) listen: String,
    #[serde(default)]
    pub(super) jwt_algorithm: JwtAlgorithm,
    pub(super) jwt_secret: Option<String>,
    pub(super) jwt_public_key_file: Option<PathBuf>,
    pub(super) jwt_audience: Option<String>,
    pub(super) jwt_issuer: Option<String>,
    /// Longest accepted time from now to a token's `exp`, in seconds.
    pub(super) jwt_max_lifetime_s: Option<u64>,
    /// TLS on the admin listener (the API, `/metrics` and the console).
    #[serde(default)]
    pub(super) tls: Option<RawTls>,
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
            jwt_max_lifetime_s: None,
            tls: None,
        }
    }
}

fn default_admin_listen() -> String {
    "127.0.0.1:8081".to_owned()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    #[serde(default = "default_listen")]
    pub(super) listen: String,
    #[serde(default = "default_max_body")]
    pub(super) max_body_bytes: u64,
    #[serde(default = "default_max_audio_body")]
    pub(super) max_audio_body_bytes: u64,
    #[serde(default = "default_max_request_head")]
    pub(super) max_request_head_bytes: u64,
    #[serde(default = "default_max_upstream_head")]
    pub(super) max_upstream_head_bytes: u64,
    #[serde(default = "default_max_upstream_header_value")]
    pub(super) max_upstream_header_value_bytes: u64,
    #[serde(default = "default_grace")]
    pub(super) shutdown_grace_seconds: f64,
    pub(super) tls: Option<RawTls>,
    #[serde(default)]
    pub(super) log_format: LogFormat,
    #[serde(default = "default_true")]
    pub(super) request_log_events: bool,
    #[serde(default = "default_health_interval")]
    pub(super) health_interval_ms: u64,
    #[serde(default)]
    pub(super) workers: usize,
    #[serde(default)]
    pub(super) watch_config: bool,
    #[serde(default)]
    pub(super) max_connections: usize,
    #[serde(default)]
    pub(super) max_connections_per_address: u32,
    #[serde(default = "default_max_stream_line")]
    pub(super) max_stream_line_bytes: u64,
    #[serde(default = "default_response_pin_capacity")]
    pub(super) response_pin_capacity: usize,
    #[serde(default = "default_response_pin_ttl")]
    pub(super) response_pin_ttl_s: u64,
    #[serde(default = "default_header_timeout")]
    pub(super) header_timeout_seconds: f64,
    #[serde(default = "default_keepalive_timeout")]
    pub(super) keepalive_timeout_seconds: f64,
    #[serde(default = "default_body_timeout")]
    pub(super) body_timeout_seconds: f64,
    #[serde(default = "default_body_idle_timeout")]
    pub(super) body_idle_timeout_seconds: f64,
    #[serde(default = "default_max_pending_body")]
    pub(super) max_pending_body_bytes: u64,
    #[serde(default = "default_max_pending_body_per_key")]
    pub(super) max_pending_body_bytes_per_key: u64,
    #[serde(default = "default_true")]
    pub(super) forwarded_headers: bool,
    #[serde(default)]
    pub(super) trusted_proxies: Vec<String>,
    #[serde(default)]
    pub(super) expose_backend_addresses: bool,
}

fn default_body_timeout() -> f64 {
    30.0
}

fn default_body_idle_timeout() -> f64 {
    10.0
}

fn default_max_pending_body() -> u64 {
    super::server::DEFAULT_MAX_PENDING_BODY_BYTES as u64
}

fn default_max_pending_body_per_key() -> u64 {
    super::server::DEFAULT_MAX_PENDING_BODY_BYTES_PER_KEY as u64
}

fn default_header_timeout() -> f64 {
    10.0
}

fn default_keepalive_timeout() -> f64 {
    60.0
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            max_body_bytes: default_max_body(),
            max_audio_body_bytes: default_max_audio_body(),
            max_request_head_bytes: default_max_request_head(),
            max_upstream_head_bytes: default_max_upstream_head(),
            max_upstream_header_value_bytes: default_max_upstream_header_value(),
            shutdown_grace_seconds: default_grace(),
            tls: None,
            log_format: LogFormat::Text,
            request_log_events: true,
            health_interval_ms: default_health_interval(),
            workers: 0,
            watch_config: false,
            max_connections: 0,
            max_connections_per_address: 0,
            max_stream_line_bytes: default_max_stream_line(),
            response_pin_capacity: default_response_pin_capacity(),
            response_pin_ttl_s: default_response_pin_ttl(),
            header_timeout_seconds: default_header_timeout(),
            keepalive_timeout_seconds: default_keepalive_timeout(),
            body_timeout_seconds: default_body_timeout(),
            body_idle_timeout_seconds: default_body_idle_timeout(),
            max_pending_body_bytes: default_max_pending_body(),
            max_pending_body_bytes_per_key: default_max_pending_body_per_key(),
            forwarded_headers: true,
            trusted_proxies: Vec::new(),
            expose_backend_addresses: false,
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:8080".to_owned()
}
fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY_BYTES as u64
}
fn default_max_audio_body() -> u64 {
    DEFAULT_MAX_AUDIO_BODY_BYTES as u64
}
fn default_max_request_head() -> u64 {
    DEFAULT_MAX_REQUEST_HEAD_BYTES as u64
}
fn default_max_upstream_head() -> u64 {
    DEFAULT_MAX_UPSTREAM_HEAD_BYTES as u64
}
fn default_max_upstream_header_value() -> u64 {
    DEFAULT_MAX_UPSTREAM_HEADER_VALUE_BYTES as u64
}
fn default_response_pin_capacity() -> usize {
    100_000
}
fn default_response_pin_ttl() -> u64 {
    24 * 3600
}
fn default_max_stream_line() -> u64 {
    fleetgate_protocol::sse::DEFAULT_MAX_LINE as u64
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
pub(super) struct RawTls {
    pub(super) cert: PathBuf,
    pub(super) key: PathBuf,
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
    pub(super) gray_pin_label: Option<String>,
    #[serde(default)]
    pub(super) health: RawHealth,
    #[serde(default)]
    pub(super) warmup: RawWarmup,
    pub(super) load_aware: Option<RawLoadAware>,
    pub(super) affinity: Option<RawAffinity>,
    pub(super) priority: Option<RawEnginePriority>,
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

fn default_priority_prod() -> i64 {
    0
}
fn default_priority_gray() -> i64 {
    10
}
fn default_priority_stress() -> i64 {
    20
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLoadAware {
    #[serde(default = "default_metrics_path")]
    pub(super) metrics_path: String,
    #[serde(default = "default_scrape_ms")]
    pub(super) interval_ms: u64,
}

fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_scrape_ms() -> u64 {
    1000
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
pub(super) struct RawWarmup {
    #[serde(default)]
    pub(super) requests: u32,
    pub(super) prompt: Option<String>,
    #[serde(default)]
    pub(super) slow_start_seconds: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLongPrompt {
    pub(super) min_prompt_tokens: u64,
    pub(super) pool: String,
}

/// A backend: its base URL, or a table with the URL and its weight, capacity, labels, key.
pub(super) enum RawBackend {
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
pub(super) struct RawBackendTable {
    pub(super) url: String,
    #[serde(default = "default_weight")]
    pub(super) weight: u32,
    pub(super) capacity: Option<u32>,
    #[serde(default)]
    pub(super) labels: Vec<String>,
    pub(super) upstream_api_key: Option<String>,
    pub(super) discover: Option<String>,
    pub(super) refresh_interval_ms: Option<u64>,
}

fn default_weight() -> u32 {
    1
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

fn default_max_retries() -> u32 {
    2
}
fn default_budget_percent() -> f64 {
    20.0
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
pub(super) struct RawTimeouts {
    pub(super) connect_ms: Option<u64>,
    pub(super) first_token_ms: Option<u64>,
    pub(super) idle_ms: Option<u64>,
    pub(super) total_ms: Option<u64>,
}
