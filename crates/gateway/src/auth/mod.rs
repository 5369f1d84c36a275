//! Authentication on the request path: credentials from `Authorization: Bearer` or
//! `x-api-key`, checked against an in-memory snapshot of all keys (lock-free read). The
//! database is never touched for a known key; an unknown key may be looked up, within a
//! per-second budget and behind a short negative cache. Every failure has its own message.
//!
//! Guessing is braked three ways (`throttle`): an address past its failure allowance is
//! refused before its key is looked at; every refusal is answered no sooner than
//! `auth.failure_delay` after the request arrived, so an unknown public id and a wrong secret
//! take the same time; a throttled address waits `auth.throttle_delay`.

mod alarm;
mod credentials;
mod failure;
pub mod sync;
mod throttle;

pub use credentials::credentials;
pub(crate) use failure::{AuthFailure, FAILURE_REASONS, ForeignKey, OAuthIssuer};

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use http::HeaderMap;
use prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::clock::wall_ms;
use crate::config::AuthConfig;
use crate::key::KeyRecord;
use crate::key::{self, KeyFormatError};
use crate::store::KeyStore;
use alarm::Alarm;
use throttle::{DelayedAnswers, FailureThrottle, TRACKED_ADDRESSES_CAP};

/// All keys, by public id.
#[derive(Debug, Default)]
pub(crate) struct KeySnapshot {
    pub(crate) keys: HashMap<Box<str>, Arc<KeyRecord>>,
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
    throttle: FailureThrottle,
    delayed: DelayedAnswers,
    alarm: Alarm,
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
    delayed: IntGauge,
    delays_skipped: IntCounter,
    throttle_tracked: IntGauge,
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
        let delayed = IntGauge::new(
            "fleetgate_auth_delayed_answers",
            "Refused authentications waiting out their delay (auth.failure_delay_ms, auth.throttle_delay_ms)",
        )?;
        let delays_skipped = IntCounter::new(
            "fleetgate_auth_delays_skipped_total",
            "Refused authentications answered without their delay because auth.max_delayed_answers were already waiting",
        )?;
        let throttle_tracked = IntGauge::new(
            "fleetgate_auth_failure_addresses",
            "Client addresses (IPv6: /64s) with recent authentication failures being counted",
        )?;
        registry.register(Box::new(store_up.clone()))?;
        registry.register(Box::new(keys.clone()))?;
        registry.register(Box::new(snapshot_age.clone()))?;
        registry.register(Box::new(db_lookups.clone()))?;
        registry.register(Box::new(delayed.clone()))?;
        registry.register(Box::new(delays_skipped.clone()))?;
        registry.register(Box::new(throttle_tracked.clone()))?;
        Ok(Self {
            failures: std::array::from_fn(|i| failures.with_label_values(&[FAILURE_REASONS[i]])),
            store_up,
            keys,
            snapshot_age,
            db_lookups,
            delayed,
            delays_skipped,
            throttle_tracked,
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
            throttle: FailureThrottle::new(config.failures_per_minute, TRACKED_ADDRESSES_CAP),
            delayed: DelayedAnswers::new(config.max_delayed_answers),
            alarm: Alarm::default(),
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
        self.metrics.delayed.set(self.delayed.waiting() as i64);
        self.metrics
            .throttle_tracked
            .set(self.throttle.tracked() as i64);
    }

    pub fn store(&self) -> &KeyStore {
        &self.store
    }

    pub(crate) fn config(&self) -> &AuthConfig {
        &self.config
    }

    /// The snapshot's record of a key (no I/O).
    pub fn cached(&self, public_id: &str) -> Option<Arc<KeyRecord>> {
        self.snapshot.load().keys.get(public_id).cloned()
    }

    pub(crate) fn key_count(&self) -> usize {
        self.snapshot.load().keys.len()
    }

    /// Seconds since the snapshot was last fully loaded.
    pub(crate) fn snapshot_age(&self) -> Duration {
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

    pub(crate) fn set_store_health(&self, h: StoreHealth) {
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
    pub(crate) fn count(&self, failure: &AuthFailure) {
        self.metrics.failures[failure.index()].inc();
    }

    /// Replace the whole snapshot (start, and a resync that found it changing under it).
    pub fn replace_all(&self, keys: Vec<KeyRecord>) {
        self.snapshot.store(snapshot_of(keys));
        self.reloaded();
    }

    /// The snapshot now: a full reload taken from the store after this call replaces it only
    /// through `replace_all_since`.
    pub(crate) fn current(&self) -> Arc<KeySnapshot> {
        self.snapshot.load_full()
    }

    /// Replace the snapshot with `keys`, read from the store while `before` was current; false
    /// (nothing replaced) when the snapshot changed meanwhile: a key applied from a
    /// notification or an admin call while the store was being read, which the read may
    /// predate (a revocation would come back to life until the next poll).
    pub(crate) fn replace_all_since(
        &self,
        before: &Arc<KeySnapshot>,
        keys: Vec<KeyRecord>,
    ) -> bool {
        let prev = self.snapshot.compare_and_swap(before, snapshot_of(keys));
        let replaced = Arc::ptr_eq(&prev, before);
        if replaced {
            self.reloaded();
        }
        replaced
    }

    /// After a full reload: its time, and no remembered unknown ids.
    fn reloaded(&self) {
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

    /// Count a failure against the metrics and `peer`'s allowance.
    fn fail(&self, failure: AuthFailure, peer: IpAddr) -> AuthFailure {
        self.throttle.record(peer, Instant::now());
        self.metrics.failures[failure.index()].inc();
        failure
    }

    /// Drop failure counters of addresses that went quiet (bounded memory).
    pub(crate) fn prune(&self) {
        self.throttle.prune(Instant::now());
        if let Ok(mut n) = self.negative.lock() {
            let now = Instant::now();
            n.retain(|_, until| *until > now);
        }
    }

    /// Authenticate a request that arrived at `arrived`. Known keys are decided from the
    /// snapshot without I/O; a refusal is answered no sooner than its delay after `arrived`.
    pub async fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        arrived: Instant,
    ) -> Result<Arc<KeyRecord>, Refused> {
        let decided = self.decide(headers, peer).await;
        if let Err(refused) = &decided {
            self.hold(&refused.failure, arrived).await;
        }
        decided
    }

    /// Wait until `arrived` + the failure's delay: the request's own future waits for the
    /// shared `Alarm` (precise to well under a millisecond, unlike the runtime's timer); past
    /// `auth.max_delayed_answers` waiting (half of it for throttled addresses), the answer goes
    /// out at once (counted).
    async fn hold(&self, failure: &AuthFailure, arrived: Instant) {
        let throttled = matches!(failure, AuthFailure::TooManyFailures { .. });
        let delay = if throttled {
            self.config.throttle_delay
        } else {
            self.config.failure_delay
        };
        let until = arrived + delay;
        if until <= Instant::now() {
            return;
        }
        match self.delayed.try_hold(throttled) {
            Some(_waiting) => self.alarm.at(until).await,
            None => self.metrics.delays_skipped.inc(),
        }
    }

    async fn decide(&self, headers: &HeaderMap, peer: IpAddr) -> Result<Arc<KeyRecord>, Refused> {
        // Before anything about the key is looked at: a throttled address gets no key checked,
        // a correct one included, so guessing faster than the allowance gains nothing.
        if let Some(retry_after) = self.throttle.throttled(peer, Instant::now()) {
            let failure = AuthFailure::TooManyFailures { retry_after };
            self.metrics.failures[failure.index()].inc();
            return Err(failure.into());
        }
        let text = credentials(headers).map_err(|f| self.fail(f, peer))?;
        let parsed = key::parse(text).map_err(|e| {
            let f = match e {
                KeyFormatError::NotFleetgate => AuthFailure::NotFleetgate(ForeignKey::of(text)),
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
                None => {
                    check_unknown(&parsed);
                    return Err(self.fail(AuthFailure::UnknownKey, peer).into());
                }
            },
        };
        match check(&record, &parsed, wall_ms()) {
            Ok(()) => Ok(record),
            // The secret matched: the refusal is this key's (revoked, expired, rotated out),
            // and is logged and counted as its own.
            Err(AuthFailure::UnknownKey) => Err(self.fail(AuthFailure::UnknownKey, peer).into()),
            Err(f) => Err(Refused {
                failure: self.fail(f, peer),
                key: Some(record),
            }),
        }
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

/// A refused authentication: why, and the key when it was identified (its secret matched, but
/// it is revoked, expired or rotated out): such a refusal is that key's in the request log.
#[derive(Debug)]
pub struct Refused {
    pub failure: AuthFailure,
    pub(crate) key: Option<Arc<KeyRecord>>,
}

impl From<AuthFailure> for Refused {
    fn from(failure: AuthFailure) -> Self {
        Refused { failure, key: None }
    }
}

/// Secret, revocation, expiry and rotation checks of a known key. The secret is hashed and
/// compared whatever else is wrong, so every `UnknownKey` costs the same.
fn check(record: &KeyRecord, parsed: &key::ParsedKey<'_>, now: i64) -> Result<(), AuthFailure> {
    let hash = key::hash_secret(parsed.secret);
    let current = key::ct_eq(&hash, &record.secret_hash);
    let previous = record.previous.filter(|(h, _)| key::ct_eq(&hash, h));
    if record.environment != parsed.env || (!current && previous.is_none()) {
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

/// What `check` does for a wrong secret, done for a public id that does not exist (hash the
/// secret, compare it against a hash): refusing an unknown id is no cheaper.
fn check_unknown(parsed: &key::ParsedKey<'_>) {
    const NO_KEY: [u8; 32] = [0; 32];
    let hash = key::hash_secret(parsed.secret);
    std::hint::black_box(key::ct_eq(&hash, std::hint::black_box(&NO_KEY)));
}

/// A snapshot of every key in `keys`, by public id.
fn snapshot_of(keys: Vec<KeyRecord>) -> Arc<KeySnapshot> {
    let keys = keys
        .into_iter()
        .map(|k| (k.public_id.clone(), Arc::new(k)))
        .collect();
    Arc::new(KeySnapshot { keys })
}
