//! Authentication on the request path: credentials from `Authorization: Bearer` or
//! `x-api-key`, checked against an in-memory snapshot of all keys (lock-free read). The
//! database is never touched for a known key; an unknown key may be looked up, within a
//! per-second budget and behind a short negative cache. Every failure has its own message.

pub mod sync;

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use http::{HeaderMap, StatusCode};
use prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::clock::{format_wall_ms, wall_ms};
use crate::config::AuthConfig;
use crate::key::KeyRecord;
use crate::key::{self, Environment, KeyFormatError};
use crate::openai::error::ErrorKind;
use crate::store::KeyStore;

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

impl AuthFailure {
    pub fn reason(&self) -> &'static str {
        FAILURE_REASONS[self.index()]
    }

    /// Position in `FAILURE_REASONS`: the failure counter's index, no search.
    fn index(&self) -> usize {
        match self {
            AuthFailure::Missing => 0,
            AuthFailure::NoSpaceAfterBearer => 1,
            AuthFailure::Quoted => 2,
            AuthFailure::Whitespace => 3,
            AuthFailure::BasicScheme => 4,
            AuthFailure::OAuthToken => 5,
            AuthFailure::OtherScheme(_) => 6,
            AuthFailure::NotFleetgate { .. } => 7,
            AuthFailure::UnknownEnvironment => 8,
            AuthFailure::Mistyped => 9,
            AuthFailure::UnknownKey => 10,
            AuthFailure::Revoked { .. } => 11,
            AuthFailure::Expired { .. } => 12,
            AuthFailure::RotatedOut { .. } => 13,
            AuthFailure::ModelNotAllowed { .. } => 14,
            AuthFailure::EnvironmentNotAllowed { .. } => 15,
            AuthFailure::TooManyFailures { .. } => 16,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status()
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            AuthFailure::ModelNotAllowed { .. } | AuthFailure::EnvironmentNotAllowed { .. } => {
                ErrorKind::Forbidden
            }
            AuthFailure::TooManyFailures { .. } => ErrorKind::AuthThrottled,
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
            | AuthFailure::RotatedOut { .. } => ErrorKind::Unauthenticated,
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
                format!("The key was revoked at {} (reason: {reason}). Ask an operator for a new key.", format_wall_ms(*at)),
            ),
            AuthFailure::Expired { at } => (
                "authentication_error",
                "key_expired",
                format!("The key expired at {}. Ask an operator for a new key.", format_wall_ms(*at)),
            ),
            AuthFailure::RotatedOut { at } => (
                "authentication_error",
                "key_rotated",
                format!("The key was rotated and this old secret stopped working at {}: use the new key issued at rotation.", format_wall_ms(*at)),
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
        Duration::from_millis(u64::try_from(wall_ms().saturating_sub(at)).unwrap_or(0))
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
        self.loaded_at.store(wall_ms(), Ordering::Relaxed);
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
        check(&record, &parsed, wall_ms()).map_err(|f| self.fail(f, peer))?;
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
        assert_eq!(format_wall_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_wall_ms(1_767_225_600_000), "2026-01-01T00:00:00Z");
        assert_eq!(
            format_wall_ms(951_782_400_000 + 3_723_000),
            "2000-02-29T01:02:03Z"
        );
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
