//! Rate limits, token budgets and concurrency caps, checked after auth and before routing.
//!
//! Per key: requests per minute with a burst (governor's GCRA), tokens per minute (a bucket
//! that reserves an estimate at admission and settles against the backend's usage when the
//! response ends, see `bucket`), and concurrent requests. Per environment: an aggregate request
//! rate and concurrency over all of its keys. A key's own values win over its environment's
//! defaults. With `limits.shared = "redis"` the rate and token counters live in Redis (one
//! script round trip per request, see `shared`); concurrency stays in process.
//!
//! An admitted request holds an [`Admission`]: it releases the concurrency slots and settles
//! the token reservation when dropped, whatever ended the request.

pub mod bucket;
pub mod shared;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use governor::clock::Clock;
use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::openai::error::ErrorKind;
use prometheus::{IntCounter, IntCounterVec};

use crate::config::{EnvLimits, LimitsConfig, SharedLimits};
use crate::key::Environment;
use crate::key::KeyRecord;
use bucket::{Shortfall, TokenBucket};

/// governor's clock, read through tokio so paused-time tests drive it. (Outside tests tokio's
/// `Instant::now` is `std::time::Instant::now`.)
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    type Instant = std::time::Instant;
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
}

type Gcra = RateLimiter<NotKeyed, InMemoryState, TokioClock, StateInformationMiddleware>;

fn gcra(quota: Quota) -> Gcra {
    RateLimiter::direct_with_clock(quota, TokioClock)
        .with_middleware::<StateInformationMiddleware>()
}

/// One key's effective limits (its own values, else its environment's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyQuota {
    pub requests_per_minute: Option<u32>,
    pub burst: u32,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
}

impl KeyQuota {
    fn is_unlimited(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.max_concurrent.is_none()
    }
}

/// A key's limiter state. Rebuilt when the key's limits change.
#[derive(Debug)]
struct KeyLimiter {
    quota: KeyQuota,
    requests: Option<Gcra>,
    tokens: Option<TokenBucket>,
    in_flight: AtomicU32,
    /// Milliseconds since `Limits::base` at the last admission (for pruning).
    last_used: AtomicU64,
}

#[derive(Debug)]
struct EnvLimiter {
    per_second: Option<(u32, u32)>,
    requests: Option<Gcra>,
    max_concurrent: Option<u32>,
    in_flight: AtomicU32,
}

/// Which limit refused a request (a metric label and the error's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    KeyRequests,
    KeyTokens,
    KeyTokensTooLarge,
    KeyConcurrency,
    EnvRequests,
    EnvConcurrency,
}

impl LimitKind {
    pub const ALL: [LimitKind; 6] = [
        LimitKind::KeyRequests,
        LimitKind::KeyTokens,
        LimitKind::KeyTokensTooLarge,
        LimitKind::KeyConcurrency,
        LimitKind::EnvRequests,
        LimitKind::EnvConcurrency,
    ];

    /// The error kind (and so the status) of a refusal by this limit.
    pub fn error_kind(self) -> ErrorKind {
        match self {
            LimitKind::KeyRequests
            | LimitKind::KeyTokens
            | LimitKind::KeyTokensTooLarge
            | LimitKind::KeyConcurrency
            | LimitKind::EnvRequests
            | LimitKind::EnvConcurrency => ErrorKind::RateLimited,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::KeyRequests => "key_requests",
            LimitKind::KeyTokens => "key_tokens",
            LimitKind::KeyTokensTooLarge => "key_tokens_too_large",
            LimitKind::KeyConcurrency => "key_concurrency",
            LimitKind::EnvRequests => "env_requests",
            LimitKind::EnvConcurrency => "env_concurrency",
        }
    }
}

/// One rate window as OpenAI's `x-ratelimit-*` headers state it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub limit: u64,
    pub remaining: u64,
    /// Until the window is full again.
    pub reset: Duration,
}

/// The `x-ratelimit-*` values of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<Window>,
    pub tokens: Option<Window>,
}

static LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
static REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
static RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
static LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
static REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
static RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");

impl RateHeaders {
    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }

    pub fn write(&self, h: &mut HeaderMap) {
        for (w, names) in [
            (
                self.requests,
                [&LIMIT_REQUESTS, &REMAINING_REQUESTS, &RESET_REQUESTS],
            ),
            (
                self.tokens,
                [&LIMIT_TOKENS, &REMAINING_TOKENS, &RESET_TOKENS],
            ),
        ] {
            if let Some(w) = w {
                h.insert(names[0].clone(), HeaderValue::from(w.limit));
                h.insert(names[1].clone(), HeaderValue::from(w.remaining));
                h.insert(names[2].clone(), reset_value(w.reset));
            }
        }
    }
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*`: `120ms`, `1.5s`, `6m0s`.
pub fn reset_value(d: Duration) -> HeaderValue {
    let mut buf = [0u8; 32];
    let n = format_reset(&mut buf, d);
    HeaderValue::from_bytes(&buf[..n]).unwrap_or_else(|_| HeaderValue::from_static("0s"))
}

fn format_reset(buf: &mut [u8; 32], d: Duration) -> usize {
    let mut ib = itoa::Buffer::new();
    let mut n = 0;
    let mut put = |s: &[u8], n: &mut usize| {
        buf[*n..*n + s.len()].copy_from_slice(s);
        *n += s.len();
    };
    let ms = d.as_millis().min(u128::from(u64::MAX)) as u64;
    if ms < 1000 {
        put(ib.format(ms).as_bytes(), &mut n);
        put(b"ms", &mut n);
    } else if ms < 60_000 {
        put(ib.format(ms / 1000).as_bytes(), &mut n);
        let tenths = ms % 1000 / 100;
        if tenths > 0 {
            put(&[b'.', b'0' + tenths as u8], &mut n);
        }
        put(b"s", &mut n);
    } else {
        put(ib.format(ms / 60_000).as_bytes(), &mut n);
        put(b"m", &mut n);
        put(ib.format(ms % 60_000 / 1000).as_bytes(), &mut n);
        put(b"s", &mut n);
    }
    n
}

/// A refused request: which limit, its numbers, and when to come back.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub kind: LimitKind,
    pub key_id: Box<str>,
    pub environment: Environment,
    /// The limit's value (per minute, per second, or concurrent requests).
    pub limit: u64,
    /// Tokens this request would reserve (token limits only).
    pub requested: u64,
    pub retry_after: Option<Duration>,
    pub headers: RateHeaders,
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        self.kind.error_kind().status()
    }

    pub fn code(&self) -> &'static str {
        match self.kind {
            LimitKind::KeyRequests => "requests_per_minute_exceeded",
            LimitKind::KeyTokens => "tokens_per_minute_exceeded",
            LimitKind::KeyTokensTooLarge => "request_exceeds_token_budget",
            LimitKind::KeyConcurrency => "concurrency_limit_exceeded",
            LimitKind::EnvRequests => "environment_rate_limit_exceeded",
            LimitKind::EnvConcurrency => "environment_concurrency_exceeded",
        }
    }

    pub fn message(&self) -> String {
        let key = &self.key_id;
        let env = self.environment;
        let retry = match self.retry_after {
            Some(d) => format!(" Retry after {:.1} s.", d.as_secs_f64().max(0.1)),
            None => String::new(),
        };
        match self.kind {
            LimitKind::KeyRequests => format!(
                "Rate limit reached for key {key} on requests per minute (RPM): limit {}.{retry}",
                self.limit
            ),
            LimitKind::KeyTokens => format!(
                "Rate limit reached for key {key} on tokens per minute (TPM): limit {}, this request reserves {} (prompt estimate + max_tokens).{retry} A smaller max_tokens reserves less.",
                self.limit, self.requested
            ),
            LimitKind::KeyTokensTooLarge => format!(
                "Request too large for key {key} on tokens per minute (TPM): limit {}, this request needs {} (prompt estimate + max_tokens). Lower max_tokens or shorten the prompt; it can never pass as it is.",
                self.limit, self.requested
            ),
            LimitKind::KeyConcurrency => format!(
                "Too many concurrent requests for key {key}: limit {} in flight. Wait for one to finish.",
                self.limit
            ),
            LimitKind::EnvRequests => format!(
                "Rate limit reached for the {env} environment (all {env} keys together): {} requests per second.{retry}",
                self.limit
            ),
            LimitKind::EnvConcurrency => format!(
                "Too many concurrent requests in the {env} environment (all {env} keys together): limit {} in flight.",
                self.limit
            ),
        }
    }
}

/// Counters per refusal kind, resolved once.
#[derive(Debug, Clone)]
pub struct LimitMetrics {
    rejections: Vec<IntCounter>,
}

impl LimitMetrics {
    pub fn new(rejections: &IntCounterVec) -> Self {
        Self {
            rejections: LimitKind::ALL
                .iter()
                .map(|k| rejections.with_label_values(&[k.as_str()]))
                .collect(),
        }
    }

    pub fn rejected(&self, kind: LimitKind) {
        if let Some(c) = self.rejections.get(kind as usize) {
            c.inc();
        }
    }
}

/// What admission needs to know of a request.
#[derive(Debug, Clone, Copy)]
pub struct Demand {
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens asked for (`max_tokens` × `n`, or the configured default).
    pub max_tokens: u64,
}

impl Demand {
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.max_tokens)
    }
}

/// All limiter state of one gateway process.
pub struct Limits {
    cfg: LimitsConfig,
    /// Limits are divided by this while a shared store is unreachable (1: local mode).
    divisor: u32,
    keys: DashMap<i64, Arc<KeyLimiter>>,
    envs: [EnvLimiter; 3],
    shared: Option<shared::Shared>,
    metrics: Option<LimitMetrics>,
    base: tokio::time::Instant,
}

impl std::fmt::Debug for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limits")
            .field("keys", &self.keys.len())
            .field("shared", &self.shared.is_some())
            .finish()
    }
}

fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN)
}

fn div_ceil_u32(v: u32, d: u32) -> u32 {
    v.div_ceil(d.max(1)).max(1)
}

impl Limits {
    /// Local limits only (no shared store).
    pub fn new(cfg: LimitsConfig, metrics: Option<LimitMetrics>) -> Self {
        Self::build(cfg, None, metrics)
    }

    /// With `limits.shared = "redis"`: connect (or start in fallback and keep trying). The
    /// Redis tasks run on `tasks`; see `shared::Shared::start` for `stop` and `settle_stop`.
    pub async fn start(
        cfg: LimitsConfig,
        metrics: Option<LimitMetrics>,
        registry: Option<&prometheus::Registry>,
        tasks: &tokio_util::task::TaskTracker,
        stop: tokio_util::sync::CancellationToken,
        settle_stop: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<Arc<Self>> {
        let shared = match (&cfg.shared, &cfg.redis) {
            (SharedLimits::Redis, Some(r)) => {
                Some(shared::Shared::start(r, registry, tasks, stop, settle_stop).await?)
            }
            _ => None,
        };
        Ok(Arc::new(Self::build(cfg, shared, metrics)))
    }

    fn build(
        cfg: LimitsConfig,
        shared: Option<shared::Shared>,
        metrics: Option<LimitMetrics>,
    ) -> Self {
        let divisor = match (&shared, &cfg.redis) {
            (Some(_), Some(r)) => r.replicas.max(1),
            _ => 1,
        };
        let envs = Environment::ALL.map(|env| {
            let e = &cfg.environments[env.index()];
            let per_second = e
                .aggregate_requests_per_second
                .map(|r| (r, e.aggregate_burst.unwrap_or(r)));
            let requests = per_second.map(|(r, b)| {
                gcra(
                    Quota::per_second(nz(div_ceil_u32(r, divisor)))
                        .allow_burst(nz(div_ceil_u32(b, divisor))),
                )
            });
            EnvLimiter {
                per_second,
                requests,
                max_concurrent: e.aggregate_max_concurrent.map(|m| div_ceil_u32(m, divisor)),
                in_flight: AtomicU32::new(0),
            }
        });
        Self {
            cfg,
            divisor,
            keys: DashMap::new(),
            envs,
            shared,
            metrics,
            base: tokio::time::Instant::now(),
        }
    }

    pub fn config(&self) -> &LimitsConfig {
        &self.cfg
    }

    /// Estimated prompt tokens of `prompt_chars` characters.
    pub fn prompt_tokens(&self, prompt_chars: usize) -> u64 {
        (prompt_chars as u64).div_ceil(u64::from(self.cfg.chars_per_token.max(1)))
    }

    /// The request's demand on the token budget.
    pub fn demand(&self, prompt_chars: usize, max_tokens: Option<u64>, n: u32) -> Demand {
        let per = u64::from(self.cfg.chars_per_token.max(1));
        Demand {
            prompt_tokens: (prompt_chars as u64).div_ceil(per),
            max_tokens: max_tokens
                .unwrap_or(u64::from(self.cfg.default_max_tokens))
                .saturating_mul(u64::from(n.max(1))),
        }
    }

    /// The limits that apply to `key`.
    pub fn quota(&self, key: &KeyRecord) -> KeyQuota {
        let e: &EnvLimits = &self.cfg.environments[key.environment.index()];
        let clamp = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
        let rpm = key.requests_per_minute.map(clamp).or(e.requests_per_minute);
        KeyQuota {
            requests_per_minute: rpm,
            burst: match (key.requests_per_minute, e.request_burst, rpm) {
                // A key's own rate comes with a minute's allowance as its burst.
                (Some(_), _, Some(r)) => r,
                (None, Some(b), _) => b,
                (_, _, Some(r)) => r,
                _ => 1,
            },
            tokens_per_minute: key
                .tokens_per_minute
                .map(|v| u64::try_from(v).unwrap_or(u64::MAX))
                .or(e.tokens_per_minute),
            max_concurrent: key
                .max_concurrent_streams
                .map(clamp)
                .or(e.max_concurrent_streams),
        }
    }

    fn key_limiter(&self, key: &KeyRecord, quota: KeyQuota) -> Arc<KeyLimiter> {
        if let Some(l) = self.keys.get(&key.id)
            && l.quota == quota
        {
            return l.clone();
        }
        let d = self.divisor;
        let limiter = Arc::new(KeyLimiter {
            quota,
            requests: quota.requests_per_minute.map(|r| {
                gcra(
                    Quota::per_minute(nz(div_ceil_u32(r, d)))
                        .allow_burst(nz(div_ceil_u32(quota.burst, d))),
                )
            }),
            tokens: quota
                .tokens_per_minute
                .map(|t| TokenBucket::new(t.div_ceil(u64::from(d)).max(1))),
            in_flight: AtomicU32::new(0),
            last_used: AtomicU64::new(0),
        });
        // A changed limit starts afresh (its counters no longer mean the same); requests in
        // flight keep their slots on the old state.
        self.keys.insert(key.id, limiter.clone());
        limiter
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(
            tokio::time::Instant::now()
                .saturating_duration_since(self.base)
                .as_millis(),
        )
        .unwrap_or(u64::MAX)
    }

    fn refuse(&self, r: Refusal) -> Refusal {
        if let Some(m) = &self.metrics {
            m.rejected(r.kind);
        }
        r
    }

    /// Count a refusal made elsewhere (the admission queue).
    pub fn count(&self, kind: LimitKind) {
        if let Some(m) = &self.metrics {
            m.rejected(kind);
        }
    }

    /// Admit a request of `key` or say which limit refuses it.
    pub async fn admit(
        self: &Arc<Self>,
        key: &KeyRecord,
        demand: Demand,
    ) -> Result<Admission, Refusal> {
        let quota = self.quota(key);
        let env = key.environment;
        let e = &self.envs[env.index()];
        if quota.is_unlimited() && e.requests.is_none() && e.max_concurrent.is_none() {
            return Ok(Admission::unlimited(env));
        }
        let refusal = |kind, limit, retry_after, headers| Refusal {
            kind,
            key_id: key.public_id.clone(),
            environment: env,
            limit,
            requested: demand.total(),
            retry_after,
            headers,
        };
        let limiter = self.key_limiter(key, quota);
        limiter.last_used.store(self.now_ms(), Ordering::Relaxed);
        let mut adm = Admission {
            limits: Some(self.clone()),
            key: Some(limiter.clone()),
            env,
            key_slot: false,
            env_slot: false,
            reserved: 0,
            reserved_in: Reserved::Nowhere,
            prompt_estimate: demand.prompt_tokens,
            used: None,
            headers: RateHeaders::default(),
        };

        // 1. Concurrency (in process; in shared mode each replica holds its share).
        if let Some(max) = quota.max_concurrent {
            let max = div_ceil_u32(max, self.divisor);
            if !try_inc(&limiter.in_flight, max) {
                return Err(self.refuse(refusal(
                    LimitKind::KeyConcurrency,
                    u64::from(max),
                    Some(Duration::from_secs(1)),
                    RateHeaders::default(),
                )));
            }
            adm.key_slot = true;
        }
        if let Some(max) = e.max_concurrent {
            if !try_inc(&e.in_flight, max) {
                return Err(self.refuse(refusal(
                    LimitKind::EnvConcurrency,
                    u64::from(max),
                    Some(Duration::from_secs(1)),
                    RateHeaders::default(),
                )));
            }
            adm.env_slot = true;
        }

        // 2. Rates and tokens: in Redis when shared and reachable, else here.
        if let Some(shared) = &self.shared
            && shared.is_up()
        {
            let check = shared::Check::new(key, &quota, e.per_second, demand.total());
            match shared.admit(&check).await {
                Ok(shared::Outcome::Admitted { requests, tokens }) => {
                    adm.headers = RateHeaders {
                        requests: requests.map(|(remaining, reset)| Window {
                            limit: u64::from(quota.requests_per_minute.unwrap_or(0)),
                            remaining,
                            reset,
                        }),
                        tokens: tokens.map(|(remaining, reset)| Window {
                            limit: quota.tokens_per_minute.unwrap_or(0),
                            remaining,
                            reset,
                        }),
                    };
                    if quota.tokens_per_minute.is_some() {
                        adm.reserved = demand.total();
                        adm.reserved_in = Reserved::Shared(key.id);
                    }
                    return Ok(adm);
                }
                Ok(shared::Outcome::Refused { which, retry_after }) => {
                    let (kind, limit) = match which {
                        shared::Which::KeyRequests => (
                            LimitKind::KeyRequests,
                            u64::from(quota.requests_per_minute.unwrap_or(0)),
                        ),
                        shared::Which::KeyTokens => {
                            (LimitKind::KeyTokens, quota.tokens_per_minute.unwrap_or(0))
                        }
                        shared::Which::KeyTokensTooLarge => (
                            LimitKind::KeyTokensTooLarge,
                            quota.tokens_per_minute.unwrap_or(0),
                        ),
                        shared::Which::EnvRequests => (
                            LimitKind::EnvRequests,
                            u64::from(e.per_second.map_or(0, |p| p.0)),
                        ),
                    };
                    let retry = (kind != LimitKind::KeyTokensTooLarge).then_some(retry_after);
                    let headers = refusal_headers(kind, &quota, retry_after);
                    return Err(self.refuse(refusal(kind, limit, retry, headers)));
                }
                // Unreachable or too slow: this request and the next ones use local limits
                // (limit / replicas) until Redis answers again; `shared` logs and counts it.
                Err(()) => {}
            }
        }
        self.admit_local(adm, &limiter, &quota, e, demand, refusal)
    }

    fn admit_local(
        &self,
        mut adm: Admission,
        limiter: &KeyLimiter,
        quota: &KeyQuota,
        e: &EnvLimiter,
        demand: Demand,
        refusal: impl Fn(LimitKind, u64, Option<Duration>, RateHeaders) -> Refusal,
    ) -> Result<Admission, Refusal> {
        let d = self.divisor;
        let mut headers = RateHeaders::default();
        if let Some(bucket) = &limiter.tokens {
            let need = demand.total();
            match bucket.reserve(need) {
                Ok(s) => {
                    adm.reserved = need;
                    adm.reserved_in = Reserved::Local;
                    headers.tokens = Some(Window {
                        limit: bucket.per_minute(),
                        remaining: s.remaining,
                        reset: s.reset,
                    });
                }
                Err(Shortfall::TooLarge) => {
                    return Err(self.refuse(refusal(
                        LimitKind::KeyTokensTooLarge,
                        bucket.per_minute(),
                        None,
                        RateHeaders::default(),
                    )));
                }
                Err(Shortfall::Wait(wait)) => {
                    let h = RateHeaders {
                        tokens: Some(Window {
                            limit: bucket.per_minute(),
                            remaining: bucket.peek().remaining,
                            reset: bucket.peek().reset,
                        }),
                        requests: None,
                    };
                    return Err(self.refuse(refusal(
                        LimitKind::KeyTokens,
                        bucket.per_minute(),
                        Some(wait),
                        h,
                    )));
                }
            }
        }
        if let Some(g) = &limiter.requests {
            let rpm = u64::from(div_ceil_u32(quota.requests_per_minute.unwrap_or(1), d));
            match g.check() {
                Ok(snap) => {
                    let q = snap.quota();
                    let remaining = snap.remaining_burst_capacity();
                    let missing = q.burst_size().get().saturating_sub(remaining);
                    headers.requests = Some(Window {
                        limit: rpm,
                        remaining: u64::from(remaining),
                        reset: q.replenish_interval() * missing,
                    });
                }
                Err(not_until) => {
                    adm.set_used(0);
                    let wait = not_until.wait_time_from(TokioClock.now());
                    headers.requests = Some(Window {
                        limit: rpm,
                        remaining: 0,
                        reset: wait,
                    });
                    return Err(self.refuse(refusal(
                        LimitKind::KeyRequests,
                        rpm,
                        Some(wait),
                        headers,
                    )));
                }
            }
        }
        if let Some(g) = &e.requests
            && let Err(not_until) = g.check()
        {
            adm.set_used(0);
            let wait = not_until.wait_time_from(TokioClock.now());
            let limit = u64::from(div_ceil_u32(e.per_second.map_or(1, |p| p.0), d));
            return Err(self.refuse(refusal(LimitKind::EnvRequests, limit, Some(wait), headers)));
        }
        adm.headers = headers;
        Ok(adm)
    }

    /// Drop the state of keys idle for `limits.prune_idle` with nothing in flight.
    pub fn prune(&self) -> usize {
        let now = self.now_ms();
        let idle = u64::try_from(self.cfg.prune_idle.as_millis()).unwrap_or(u64::MAX);
        let before = self.keys.len();
        self.keys.retain(|_, l| {
            Arc::strong_count(l) > 1
                || l.in_flight.load(Ordering::Relaxed) > 0
                || now.saturating_sub(l.last_used.load(Ordering::Relaxed)) < idle
        });
        before - self.keys.len()
    }

    /// Keys with limiter state (a gauge, and the pruning test).
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// Prune on an interval until `stop`.
    pub async fn prune_loop(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let every = self.cfg.prune_idle.min(Duration::from_secs(60));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let n = self.prune();
            if n > 0 {
                tracing::debug!(pruned = n, "dropped limiter state of idle keys");
            }
        }
    }

    /// The shared store (`None` in local mode).
    pub fn shared(&self) -> Option<&shared::Shared> {
        self.shared.as_ref()
    }
}

fn refusal_headers(kind: LimitKind, quota: &KeyQuota, retry: Duration) -> RateHeaders {
    match kind {
        LimitKind::KeyRequests => RateHeaders {
            requests: quota.requests_per_minute.map(|r| Window {
                limit: u64::from(r),
                remaining: 0,
                reset: retry,
            }),
            tokens: None,
        },
        LimitKind::KeyTokens => RateHeaders {
            requests: None,
            tokens: quota.tokens_per_minute.map(|t| Window {
                limit: t,
                remaining: 0,
                reset: retry,
            }),
        },
        _ => RateHeaders::default(),
    }
}

/// Increment `c` unless it is at `max`.
fn try_inc(c: &AtomicU32, max: u32) -> bool {
    c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < max).then_some(n + 1)
    })
    .is_ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reserved {
    Nowhere,
    Local,
    /// In the shared store, for this key id.
    Shared(i64),
}

/// An admitted request's hold on its limits: concurrency slots and a token reservation.
/// Dropping it releases the slots and settles the reservation with what `set_used` said the
/// request used (the whole reservation when nothing was said).
#[must_use]
pub struct Admission {
    /// `None` for a key and environment without limits: nothing to release (and no shared
    /// reference count touched on the request path).
    limits: Option<Arc<Limits>>,
    key: Option<Arc<KeyLimiter>>,
    env: Environment,
    key_slot: bool,
    env_slot: bool,
    reserved: u64,
    reserved_in: Reserved,
    prompt_estimate: u64,
    used: Option<u64>,
    /// `x-ratelimit-*` values for the response.
    pub headers: RateHeaders,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("env", &self.env)
            .field("reserved", &self.reserved)
            .field("used", &self.used)
            .finish()
    }
}

impl Admission {
    fn unlimited(env: Environment) -> Self {
        Self {
            limits: None,
            key: None,
            env,
            key_slot: false,
            env_slot: false,
            reserved: 0,
            reserved_in: Reserved::Nowhere,
            prompt_estimate: 0,
            used: None,
            headers: RateHeaders::default(),
        }
    }

    /// Tokens reserved at admission.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The prompt-token estimate made at admission.
    pub fn prompt_estimate(&self) -> u64 {
        self.prompt_estimate
    }

    /// What the request really used; settled when the admission is dropped.
    pub fn set_used(&mut self, tokens: u64) {
        self.used = Some(tokens);
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(k) = &self.key
            && self.key_slot
        {
            k.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        if self.env_slot
            && let Some(l) = &self.limits
        {
            l.envs[self.env.index()]
                .in_flight
                .fetch_sub(1, Ordering::AcqRel);
        }
        let used = self.used.unwrap_or(self.reserved);
        let delta = i64::try_from(self.reserved)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(used).unwrap_or(i64::MAX));
        match self.reserved_in {
            Reserved::Nowhere => {}
            Reserved::Local => {
                if let Some(b) = self.key.as_ref().and_then(|k| k.tokens.as_ref()) {
                    b.settle(delta);
                }
            }
            Reserved::Shared(id) => {
                if let (Some(s), Some(k)) = (
                    self.limits.as_ref().and_then(|l| l.shared.as_ref()),
                    &self.key,
                ) && let Some(tpm) = k.quota.tokens_per_minute
                {
                    s.settle(id, tpm, delta);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
