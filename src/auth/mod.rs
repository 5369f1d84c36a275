//! Authentication on the request path: credentials from `Authorization: Bearer` or
//! `x-api-key`, checked against an in-memory snapshot of all keys (lock-free read). The
//! database is never touched for a known key; an unknown key may be looked up, within a
//! per-second budget and behind a short negative cache. Every failure has its own message.

pub mod key;
pub mod sync;

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use http::HeaderMap;
use prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use serde::Serialize;

use crate::config::AuthConfig;
use crate::store::{KeyStore, now_ms};
use key::{Environment, KeyFormatError};

/// One key as the gateway knows it. The secret itself is never held, only its hash.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    pub id: i64,
    pub public_id: Box<str>,
    pub name: String,
    pub environment: Environment,
    pub secret_hash: [u8; 32],
    /// The previous secret's hash and until when it is accepted (rotation grace).
    pub previous: Option<([u8; 32], i64)>,
    pub created_at: i64,
    pub created_by: String,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub revoked_by: Option<String>,
    pub revoke_reason: Option<String>,
    /// `None`: every model.
    pub allowed_models: Option<Vec<String>>,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_minute: Option<i64>,
    pub max_concurrent_streams: Option<i64>,
    pub metadata: serde_json::Value,
    pub updated_at: i64,
}

/// The listing view of a key: everything but the hashes.
#[derive(Debug, Serialize)]
pub struct KeyView<'a> {
    pub public_id: &'a str,
    pub name: &'a str,
    pub environment: Environment,
    pub status: &'static str,
    pub created_at: i64,
    pub created_by: &'a str,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub revoked_by: Option<&'a str>,
    pub revoke_reason: Option<&'a str>,
    pub previous_secret_valid_until: Option<i64>,
    pub allowed_models: Option<&'a [String]>,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_minute: Option<i64>,
    pub max_concurrent_streams: Option<i64>,
    pub metadata: &'a serde_json::Value,
}

impl KeyRecord {
    pub fn status(&self, now: i64) -> &'static str {
        if self.revoked_at.is_some() {
            "revoked"
        } else if self.expires_at.is_some_and(|e| e <= now) {
            "expired"
        } else {
            "active"
        }
    }

    pub fn view(&self) -> KeyView<'_> {
        KeyView {
            public_id: &self.public_id,
            name: &self.name,
            environment: self.environment,
            status: self.status(now_ms()),
            created_at: self.created_at,
            created_by: &self.created_by,
            expires_at: self.expires_at,
            revoked_at: self.revoked_at,
            revoked_by: self.revoked_by.as_deref(),
            revoke_reason: self.revoke_reason.as_deref(),
            previous_secret_valid_until: self.previous.map(|(_, until)| until),
            allowed_models: self.allowed_models.as_deref(),
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent_streams: self.max_concurrent_streams,
            metadata: &self.metadata,
        }
    }

    /// May this key use the model clients know as `model`?
    pub fn allows_model(&self, model: &str) -> bool {
        self.allowed_models
            .as_ref()
            .is_none_or(|m| m.iter().any(|a| a == model))
    }
}

/// Why a request was not let in. Each cause has its own message and code.
#[derive(Debug, Clone, PartialEq)]
pub enum AuthFailure {
    Missing,
    NoSpaceAfterBearer,
    Quoted,
    Whitespace,
    BasicScheme,
    OAuthToken,
    OtherScheme(String),
    NotFleetgate {
        openai_style: bool,
    },
    UnknownEnvironment,
    Mistyped,
    UnknownKey,
    Revoked {
        at: i64,
        reason: String,
    },
    Expired {
        at: i64,
    },
    RotatedOut {
        at: i64,
    },
    ModelNotAllowed {
        model: String,
        allowed: Vec<String>,
    },
    EnvironmentNotAllowed {
        env: Environment,
        model: String,
        allowed: Vec<Environment>,
    },
    TooManyFailures {
        retry_after: Duration,
    },
}

/// Label for the failure counter: a fixed set.
pub const FAILURE_REASONS: [&str; 17] = [
    "missing",
    "no_space_after_bearer",
    "quoted",
    "whitespace",
    "basic_scheme",
    "oauth_token",
    "other_scheme",
    "not_fleetgate",
    "unknown_environment",
    "mistyped",
    "unknown_key",
    "revoked",
    "expired",
    "rotated_out",
    "model_not_allowed",
    "environment_not_allowed",
    "too_many_failures",
];

fn iso(ms: i64) -> String {
    // RFC 3339 in UTC without a date crate: days from the epoch to a civil date.
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60
    )
}

/// RFC 3339 (UTC) for an epoch-millisecond time.
pub fn format_time(ms: i64) -> String {
    iso(ms)
}

impl AuthFailure {
    pub fn reason(&self) -> &'static str {
        match self {
            AuthFailure::Missing => FAILURE_REASONS[0],
            AuthFailure::NoSpaceAfterBearer => FAILURE_REASONS[1],
            AuthFailure::Quoted => FAILURE_REASONS[2],
            AuthFailure::Whitespace => FAILURE_REASONS[3],
            AuthFailure::BasicScheme => FAILURE_REASONS[4],
            AuthFailure::OAuthToken => FAILURE_REASONS[5],
            AuthFailure::OtherScheme(_) => FAILURE_REASONS[6],
            AuthFailure::NotFleetgate { .. } => FAILURE_REASONS[7],
            AuthFailure::UnknownEnvironment => FAILURE_REASONS[8],
            AuthFailure::Mistyped => FAILURE_REASONS[9],
            AuthFailure::UnknownKey => FAILURE_REASONS[10],
            AuthFailure::Revoked { .. } => FAILURE_REASONS[11],
            AuthFailure::Expired { .. } => FAILURE_REASONS[12],
            AuthFailure::RotatedOut { .. } => FAILURE_REASONS[13],
            AuthFailure::ModelNotAllowed { .. } => FAILURE_REASONS[14],
            AuthFailure::EnvironmentNotAllowed { .. } => FAILURE_REASONS[15],
            AuthFailure::TooManyFailures { .. } => FAILURE_REASONS[16],
        }
    }

    fn index(&self) -> usize {
        let r = self.reason();
        FAILURE_REASONS.iter().position(|x| *x == r).unwrap_or(0)
    }

    pub fn status(&self) -> u16 {
        match self {
            AuthFailure::ModelNotAllowed { .. } | AuthFailure::EnvironmentNotAllowed { .. } => 403,
            AuthFailure::TooManyFailures { .. } => 429,
            AuthFailure::Missing
            | AuthFailure::NoSpaceAfterBearer
            | AuthFailure::Quoted
            | AuthFailure::Whitespace
            | AuthFailure::BasicScheme
            | AuthFailure::OAuthToken
            | AuthFailure::OtherScheme(_)
            | AuthFailure::NotFleetgate { .. }
            | AuthFailure::UnknownEnvironment
            | AuthFailure::Mistyped
            | AuthFailure::UnknownKey
            | AuthFailure::Revoked { .. }
            | AuthFailure::Expired { .. }
            | AuthFailure::RotatedOut { .. } => 401,
        }
    }

    /// (type, code, message) for the OpenAI error body.
    pub fn describe(&self) -> (&'static str, &'static str, String) {
        const HOW: &str = "send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a fleetgate key `fg-<env>-...`";
        match self {
            AuthFailure::Missing => (
                "authentication_error",
                "missing_api_key",
                format!("No API key was sent: {HOW}."),
            ),
            AuthFailure::NoSpaceAfterBearer => (
                "authentication_error",
                "invalid_authorization_header",
                "The Authorization header needs a space after `Bearer`: `Authorization: Bearer <key>`.".into(),
            ),
            AuthFailure::Quoted => (
                "authentication_error",
                "invalid_authorization_header",
                "The key is wrapped in quotes: send it bare, `Authorization: Bearer fg-...` (check the client's config file or environment variable).".into(),
            ),
            AuthFailure::Whitespace => (
                "authentication_error",
                "invalid_authorization_header",
                "The key has extra whitespace in or around it (a copied line break or double space?): send exactly `Authorization: Bearer <key>`.".into(),
            ),
            AuthFailure::BasicScheme => (
                "authentication_error",
                "invalid_authorization_header",
                "HTTP Basic authentication is not supported: send `Authorization: Bearer <key>`.".into(),
            ),
            AuthFailure::OAuthToken => (
                "authentication_error",
                "oauth_not_supported",
                "Only static API keys are accepted; OAuth is not supported. Configure the client with an API key (`fg-<env>-...`) instead of an OAuth login.".into(),
            ),
            AuthFailure::OtherScheme(s) => (
                "authentication_error",
                "invalid_authorization_header",
                format!("The Authorization scheme `{s}` is not supported: send `Authorization: Bearer <key>`."),
            ),
            AuthFailure::NotFleetgate { openai_style: true } => (
                "authentication_error",
                "invalid_api_key",
                "That looks like an OpenAI (`sk-...`) key, not a fleetgate key: use the `fg-<env>-...` key issued for this gateway.".into(),
            ),
            AuthFailure::NotFleetgate { openai_style: false } => (
                "authentication_error",
                "invalid_api_key",
                "That is not a fleetgate key: keys look like `fg-<env>-<id>-<secret>`. Check that the client uses the key issued for this gateway.".into(),
            ),
            AuthFailure::UnknownEnvironment => (
                "authentication_error",
                "invalid_api_key",
                "The key names an environment this gateway does not issue (stress, gray, prod): the key is mistyped or from another system.".into(),
            ),
            AuthFailure::Mistyped => (
                "authentication_error",
                "invalid_api_key",
                "The key is mistyped or truncated (its checksum does not match): copy the whole key again.".into(),
            ),
            AuthFailure::UnknownKey => (
                "authentication_error",
                "invalid_api_key",
                "The key is not valid on this gateway (unknown, or its secret does not match): ask an operator for a current key.".into(),
            ),
            AuthFailure::Revoked { at, reason } => (
                "authentication_error",
                "key_revoked",
                format!("The key was revoked at {} (reason: {reason}). Ask an operator for a new key.", iso(*at)),
            ),
            AuthFailure::Expired { at } => (
                "authentication_error",
                "key_expired",
                format!("The key expired at {}. Ask an operator for a new key.", iso(*at)),
            ),
            AuthFailure::RotatedOut { at } => (
                "authentication_error",
                "key_rotated",
                format!("The key was rotated and this old secret stopped working at {}: use the new key issued at rotation.", iso(*at)),
            ),
            AuthFailure::ModelNotAllowed { model, allowed } => (
                "permission_error",
                "model_not_allowed",
                format!(
                    "This key may not use model `{model}`; it may use: {}.",
                    allowed.iter().map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", ")
                ),
            ),
            AuthFailure::EnvironmentNotAllowed { env, model, allowed } => (
                "permission_error",
                "environment_not_allowed",
                format!(
                    "Keys of environment `{env}` may not use model `{model}`; its pool serves: {}.",
                    allowed.iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ")
                ),
            ),
            AuthFailure::TooManyFailures { retry_after } => (
                "rate_limit_error",
                "too_many_auth_failures",
                format!(
                    "Too many failed authentication attempts from your address; retry in {} s with a valid key.",
                    retry_after.as_secs().max(1)
                ),
            ),
        }
    }
}

/// Read the credentials of a request: the key text, or why there is none usable.
pub fn credentials(headers: &HeaderMap) -> Result<&str, AuthFailure> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION) {
        let v = v.to_str().map_err(|_| AuthFailure::Whitespace)?;
        let v = v.trim_matches(|c| c == ' ' || c == '\t');
        let (scheme, rest) = match v.find([' ', '\t']) {
            Some(i) => (&v[..i], &v[i + 1..]),
            None => (v, ""),
        };
        if scheme.eq_ignore_ascii_case("bearer") {
            return token(rest);
        }
        if scheme.len() > 6 && scheme[..6].eq_ignore_ascii_case("bearer") {
            return Err(AuthFailure::NoSpaceAfterBearer);
        }
        if scheme.eq_ignore_ascii_case("basic") {
            return Err(AuthFailure::BasicScheme);
        }
        if looks_like_oauth(v) || scheme.eq_ignore_ascii_case("oauth") {
            return Err(AuthFailure::OAuthToken);
        }
        if rest.is_empty() && (v.starts_with("fg-") || v.starts_with("sk-")) {
            // A bare key without a scheme.
            return Err(AuthFailure::OtherScheme("(none)".into()));
        }
        return Err(AuthFailure::OtherScheme(scheme.chars().take(20).collect()));
    }
    if let Some(v) = headers.get("x-api-key") {
        let v = v.to_str().map_err(|_| AuthFailure::Whitespace)?;
        return token(v.trim_matches(|c| c == ' ' || c == '\t'));
    }
    Err(AuthFailure::Missing)
}

fn token(t: &str) -> Result<&str, AuthFailure> {
    if t.is_empty() {
        return Err(AuthFailure::Missing);
    }
    let quoted = |q: char| t.len() >= 2 && t.starts_with(q) && t.ends_with(q);
    if quoted('"') || quoted('\'') || t.starts_with('"') || t.ends_with('"') {
        return Err(AuthFailure::Quoted);
    }
    if t.chars().any(char::is_whitespace) {
        return Err(AuthFailure::Whitespace);
    }
    if looks_like_oauth(t) {
        return Err(AuthFailure::OAuthToken);
    }
    Ok(t)
}

/// A JWT (three base64url parts, header starting `eyJ`) or a well-known OAuth access token.
fn looks_like_oauth(t: &str) -> bool {
    let t = t.rsplit([' ', '\t']).next().unwrap_or(t);
    (t.starts_with("eyJ") && t.matches('.').count() == 2)
        || t.starts_with("ya29.")
        || t.starts_with("gho_")
}

/// All keys, by public id.
#[derive(Debug, Default)]
pub struct KeySnapshot {
    pub keys: HashMap<Box<str>, Arc<KeyRecord>>,
}

/// State of the key store connection, for readiness and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreHealth {
    Unknown = 0,
    Up = 1,
    Down = 2,
}

const NEGATIVE_CACHE_CAP: usize = 10_000;

pub struct Authenticator {
    snapshot: ArcSwap<KeySnapshot>,
    store: KeyStore,
    config: AuthConfig,
    lookup_budget: DefaultDirectRateLimiter,
    negative: Mutex<HashMap<Box<str>, Instant>>,
    failures_by_peer: DefaultKeyedRateLimiter<IpAddr>,
    store_health: AtomicU8,
    /// Epoch ms of the last successful full load.
    loaded_at: AtomicI64,
    metrics: AuthMetrics,
}

/// Prometheus handles, resolved once (no label lookup on the request path).
struct AuthMetrics {
    failures: [IntCounter; FAILURE_REASONS.len()],
    store_up: IntGauge,
    keys: IntGauge,
    snapshot_age: Gauge,
    db_lookups: IntCounter,
}

impl AuthMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let failures = IntCounterVec::new(
            Opts::new(
                "fleetgate_auth_failures_total",
                "Requests refused by authentication, by reason",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(failures.clone()))?;
        let store_up = IntGauge::new(
            "fleetgate_key_store_up",
            "1 when the key store (database) is reachable; 0 while the gateway authenticates from its last snapshot",
        )?;
        let keys = IntGauge::new("fleetgate_keys_loaded", "Keys in the in-memory snapshot")?;
        let snapshot_age = Gauge::new(
            "fleetgate_key_snapshot_age_seconds",
            "Seconds since the key snapshot was last fully reloaded from the store",
        )?;
        let db_lookups = IntCounter::new(
            "fleetgate_key_store_lookups_total",
            "Unknown keys looked up in the store (bounded by auth.lookups_per_second)",
        )?;
        registry.register(Box::new(store_up.clone()))?;
        registry.register(Box::new(keys.clone()))?;
        registry.register(Box::new(snapshot_age.clone()))?;
        registry.register(Box::new(db_lookups.clone()))?;
        Ok(Self {
            failures: std::array::from_fn(|i| failures.with_label_values(&[FAILURE_REASONS[i]])),
            store_up,
            keys,
            snapshot_age,
            db_lookups,
        })
    }
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("keys", &self.snapshot.load().keys.len())
            .field("store", &self.store.kind())
            .finish()
    }
}

fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v.max(1)).unwrap_or(NonZeroU32::MIN)
}

impl Authenticator {
    pub fn new(
        store: KeyStore,
        config: AuthConfig,
        keys: Vec<KeyRecord>,
        registry: &Registry,
    ) -> Result<Self, prometheus::Error> {
        let this = Self {
            snapshot: ArcSwap::from_pointee(KeySnapshot::default()),
            store,
            lookup_budget: RateLimiter::direct(Quota::per_second(nz(config.lookups_per_second))),
            failures_by_peer: RateLimiter::keyed(Quota::per_minute(nz(config.failures_per_minute))),
            config,
            negative: Mutex::new(HashMap::new()),
            store_health: AtomicU8::new(StoreHealth::Up as u8),
            loaded_at: AtomicI64::new(0),
            metrics: AuthMetrics::new(registry)?,
        };
        this.metrics.store_up.set(1);
        this.replace_all(keys);
        Ok(this)
    }

    /// Refresh the gauges that are computed at scrape time.
    pub fn update_gauges(&self) {
        self.metrics
            .snapshot_age
            .set(self.snapshot_age().as_secs_f64());
        self.metrics.keys.set(self.key_count() as i64);
    }

    pub fn store(&self) -> &KeyStore {
        &self.store
    }

    pub fn config(&self) -> &AuthConfig {
        &self.config
    }

    /// The snapshot's record of a key (no I/O).
    pub fn cached(&self, public_id: &str) -> Option<Arc<KeyRecord>> {
        self.snapshot.load().keys.get(public_id).cloned()
    }

    pub fn key_count(&self) -> usize {
        self.snapshot.load().keys.len()
    }

    /// Seconds since the snapshot was last fully loaded.
    pub fn snapshot_age(&self) -> Duration {
        let at = self.loaded_at.load(Ordering::Relaxed);
        Duration::from_millis(u64::try_from(now_ms().saturating_sub(at)).unwrap_or(0))
    }

    pub fn store_health(&self) -> StoreHealth {
        match self.store_health.load(Ordering::Relaxed) {
            1 => StoreHealth::Up,
            2 => StoreHealth::Down,
            _ => StoreHealth::Unknown,
        }
    }

    pub fn set_store_health(&self, h: StoreHealth) {
        let before = self.store_health.swap(h as u8, Ordering::Relaxed);
        self.metrics.store_up.set(i64::from(h == StoreHealth::Up));
        if before != h as u8 {
            match h {
                StoreHealth::Down => tracing::error!(
                    store = %self.store.config().describe(),
                    keys = self.key_count(),
                    "key store unreachable: degraded, authenticating from the last snapshot"
                ),
                StoreHealth::Up => {
                    tracing::info!(store = %self.store.config().describe(), "key store reachable")
                }
                StoreHealth::Unknown => {}
            }
        }
    }

    /// Failures counted for `reason` so far.
    pub fn failure_count(&self, reason: &str) -> u64 {
        FAILURE_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.metrics.failures[i].get())
    }

    /// Unknown-key lookups that reached the store.
    pub fn db_lookups(&self) -> u64 {
        self.metrics.db_lookups.get()
    }

    /// Count a refusal decided outside `authenticate` (model or environment not allowed).
    pub fn count(&self, failure: &AuthFailure) {
        self.metrics.failures[failure.index()].inc();
    }

    /// Replace the whole snapshot (start, periodic resync).
    pub fn replace_all(&self, keys: Vec<KeyRecord>) {
        let map = keys
            .into_iter()
            .map(|k| (k.public_id.clone(), Arc::new(k)))
            .collect();
        self.snapshot.store(Arc::new(KeySnapshot { keys: map }));
        self.loaded_at.store(now_ms(), Ordering::Relaxed);
        if let Ok(mut n) = self.negative.lock() {
            n.clear();
        }
    }

    /// Apply one key's new state (a notification), or its deletion.
    pub fn apply(&self, public_id: &str, record: Option<KeyRecord>) {
        self.snapshot.rcu(|old| {
            let mut keys = old.keys.clone();
            match &record {
                Some(r) => {
                    keys.insert(r.public_id.clone(), Arc::new(r.clone()));
                }
                None => {
                    keys.remove(public_id);
                }
            }
            KeySnapshot { keys }
        });
        if let Ok(mut n) = self.negative.lock() {
            n.remove(public_id);
        }
    }

    /// Count a failure; past the per-address allowance it becomes a 429.
    fn fail(&self, failure: AuthFailure, peer: IpAddr) -> AuthFailure {
        let failure = match self.failures_by_peer.check_key(&peer) {
            Ok(()) => failure,
            Err(not_until) => AuthFailure::TooManyFailures {
                retry_after: not_until.wait_time_from(governor::clock::Clock::now(
                    &governor::clock::DefaultClock::default(),
                )),
            },
        };
        self.metrics.failures[failure.index()].inc();
        failure
    }

    /// Drop failure counters of addresses that went quiet (bounded memory).
    pub fn prune(&self) {
        self.failures_by_peer.retain_recent();
        self.failures_by_peer.shrink_to_fit();
        if let Ok(mut n) = self.negative.lock() {
            let now = Instant::now();
            n.retain(|_, until| *until > now);
        }
    }

    /// Authenticate a request. Known keys are decided from the snapshot without I/O.
    pub async fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
    ) -> Result<Arc<KeyRecord>, AuthFailure> {
        let text = credentials(headers).map_err(|f| self.fail(f, peer))?;
        let parsed = key::parse(text).map_err(|e| {
            let f = match e {
                KeyFormatError::NotFleetgate => AuthFailure::NotFleetgate {
                    openai_style: text.starts_with("sk-"),
                },
                KeyFormatError::UnknownEnvironment => AuthFailure::UnknownEnvironment,
                KeyFormatError::Mistyped => AuthFailure::Mistyped,
            };
            self.fail(f, peer)
        })?;
        let found = self.snapshot.load().keys.get(parsed.public_id).cloned();
        let record = match found {
            Some(r) => r,
            None => match self.lookup(parsed.public_id).await {
                Some(r) => r,
                None => return Err(self.fail(AuthFailure::UnknownKey, peer)),
            },
        };
        check(&record, &parsed, now_ms()).map_err(|f| self.fail(f, peer))?;
        Ok(record)
    }

    /// A key the snapshot does not know: maybe created on another replica a moment ago.
    async fn lookup(&self, public_id: &str) -> Option<Arc<KeyRecord>> {
        if let Ok(n) = self.negative.lock()
            && n.get(public_id)
                .is_some_and(|until| *until > Instant::now())
        {
            return None;
        }
        self.lookup_budget.check().ok()?;
        self.metrics.db_lookups.inc();
        let result = tokio::time::timeout(Duration::from_secs(2), self.store.get(public_id)).await;
        match result {
            Ok(Ok(Some(record))) => {
                self.set_store_health(StoreHealth::Up);
                let record = Arc::new(record);
                self.apply(public_id, Some((*record).clone()));
                Some(record)
            }
            Ok(Ok(None)) => {
                if let Ok(mut n) = self.negative.lock() {
                    if n.len() >= NEGATIVE_CACHE_CAP {
                        n.clear();
                    }
                    n.insert(
                        public_id.into(),
                        Instant::now() + self.config.negative_cache,
                    );
                }
                None
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "unknown-key lookup failed");
                self.set_store_health(StoreHealth::Down);
                None
            }
            Err(_) => {
                self.set_store_health(StoreHealth::Down);
                None
            }
        }
    }
}

/// Secret, revocation, expiry and rotation checks of a known key.
fn check(record: &KeyRecord, parsed: &key::ParsedKey<'_>, now: i64) -> Result<(), AuthFailure> {
    if record.environment != parsed.env {
        return Err(AuthFailure::UnknownKey);
    }
    let hash = key::hash_secret(parsed.secret);
    let current = key::ct_eq(&hash, &record.secret_hash);
    let previous = record.previous.filter(|(h, _)| key::ct_eq(&hash, h));
    if !current && previous.is_none() {
        return Err(AuthFailure::UnknownKey);
    }
    if let Some(at) = record.revoked_at {
        return Err(AuthFailure::Revoked {
            at,
            reason: record.revoke_reason.clone().unwrap_or_default(),
        });
    }
    if let Some(at) = record.expires_at
        && at <= now
    {
        return Err(AuthFailure::Expired { at });
    }
    if !current
        && let Some((_, until)) = previous
        && until <= now
    {
        return Err(AuthFailure::RotatedOut { at: until });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn creds(auth: Option<&str>, xkey: Option<&str>) -> Result<String, AuthFailure> {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(a).unwrap(),
            );
        }
        if let Some(k) = xkey {
            h.insert("x-api-key", HeaderValue::from_str(k).unwrap());
        }
        credentials(&h).map(str::to_owned)
    }

    #[test]
    fn header_forms() {
        assert_eq!(creds(Some("Bearer fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(Some("bearer fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(Some("BEARER fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(None, Some("fg-a")), Ok("fg-a".into()));
        assert_eq!(creds(None, None), Err(AuthFailure::Missing));
        assert_eq!(creds(Some("Bearer"), None), Err(AuthFailure::Missing));
        assert_eq!(
            creds(Some("Bearerfg-a"), None),
            Err(AuthFailure::NoSpaceAfterBearer)
        );
        assert_eq!(
            creds(Some("Bearer \"fg-a\""), None),
            Err(AuthFailure::Quoted)
        );
        assert_eq!(creds(Some("Bearer 'fg-a'"), None), Err(AuthFailure::Quoted));
        assert_eq!(
            creds(Some("Bearer  fg-a"), None),
            Err(AuthFailure::Whitespace)
        );
        assert_eq!(
            creds(Some("Bearer fg-a extra"), None),
            Err(AuthFailure::Whitespace)
        );
        assert_eq!(
            creds(Some("Basic Zm9vOmJhcg=="), None),
            Err(AuthFailure::BasicScheme)
        );
        assert_eq!(
            creds(
                Some("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig"),
                None
            ),
            Err(AuthFailure::OAuthToken)
        );
        assert_eq!(
            creds(Some("Token abc"), None),
            Err(AuthFailure::OtherScheme("Token".into()))
        );
        assert_eq!(
            creds(Some("fg-prod-x"), None),
            Err(AuthFailure::OtherScheme("(none)".into()))
        );
    }

    #[test]
    fn every_failure_has_its_own_message() {
        let all = [
            AuthFailure::Missing,
            AuthFailure::NoSpaceAfterBearer,
            AuthFailure::Quoted,
            AuthFailure::Whitespace,
            AuthFailure::BasicScheme,
            AuthFailure::OAuthToken,
            AuthFailure::OtherScheme("Token".into()),
            AuthFailure::NotFleetgate { openai_style: true },
            AuthFailure::UnknownEnvironment,
            AuthFailure::Mistyped,
            AuthFailure::UnknownKey,
            AuthFailure::Revoked {
                at: 0,
                reason: "leak".into(),
            },
            AuthFailure::Expired { at: 0 },
            AuthFailure::RotatedOut { at: 0 },
            AuthFailure::ModelNotAllowed {
                model: "m".into(),
                allowed: vec!["a".into()],
            },
            AuthFailure::EnvironmentNotAllowed {
                env: Environment::Stress,
                model: "m".into(),
                allowed: vec![Environment::Prod],
            },
            AuthFailure::TooManyFailures {
                retry_after: Duration::from_secs(3),
            },
        ];
        let messages: std::collections::HashSet<String> =
            all.iter().map(|f| f.describe().2).collect();
        assert_eq!(messages.len(), all.len());
        let reasons: std::collections::HashSet<&str> = all.iter().map(|f| f.reason()).collect();
        assert_eq!(reasons.len(), FAILURE_REASONS.len());
    }

    #[test]
    fn times_render_as_rfc3339() {
        assert_eq!(iso(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso(1_767_225_600_000), "2026-01-01T00:00:00Z");
        assert_eq!(iso(951_782_400_000 + 3_723_000), "2000-02-29T01:02:03Z");
    }

    proptest! {
        #[test]
        fn credentials_never_panic(a in "\\PC{0,60}", x in "\\PC{0,60}") {
            let mut h = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&a) { h.insert(http::header::AUTHORIZATION, v); }
            if let Ok(v) = HeaderValue::from_str(&x) { h.insert("x-api-key", v); }
            let _ = credentials(&h);
        }
    }
}
