//! Rate limits, token budgets and concurrency caps, checked after the route is chosen and
//! before the backend queue (the limits step of docs/architecture.md's table).
//!
//! Per key: requests per minute with a burst (GCRA, `limiter::Gcra`), tokens per minute (a bucket
//! that reserves an estimate at the check and settles against the backend's usage when the
//! response ends, see `bucket`), and concurrent requests. Per environment: an aggregate request
//! rate and concurrency over all of its keys. A key's own values win over its environment's
//! defaults. With `limits.shared = "redis"` the rate and token counters live in Redis (one
//! script round trip per request, see `shared`); concurrency stays in process.
//!
//! A request the limits let through takes a [`Hold`] on them: dropped, it gives the
//! concurrency back and settles the token reservation, whatever ended the request.

pub(crate) mod bucket;
mod hold;
mod limiter;
mod refusal;
pub mod shared;

pub use hold::Hold;
pub(crate) use limiter::{Floors, KeyQuota};
pub(crate) use refusal::{LimitKind, LimitMetrics};
pub use refusal::{Refusal, Window};

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dashmap::DashMap;

use crate::config::{LimitsConfig, SharedLimits};
use crate::key::Environment;
use crate::key::KeyRecord;
use limiter::{EnvLimiter, KeyLimiter};

/// What the check needs to know of a request.
#[derive(Debug, Clone, Copy)]
pub struct Demand {
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens asked for (`max_tokens` × `n`, or the configured default).
    pub max_tokens: u64,
}

impl Demand {
    pub(crate) fn total(&self) -> u64 {
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
impl Limits {
    /// Local limits only (no shared store).
    pub fn new(cfg: LimitsConfig, metrics: Option<LimitMetrics>) -> Self {
        Self::build(cfg, None, metrics)
    }

    /// With `limits.shared = "redis"`: connect (or start in fallback and keep trying). The
    /// Redis tasks run on `tasks`; see `shared::Shared::start` for `stop` and `settle_stop`.
    pub(crate) async fn start(
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
        let envs =
            Environment::ALL.map(|env| EnvLimiter::new(&cfg.environments[env.index()], divisor));
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

    /// Estimated prompt tokens of `prompt_chars` characters.
    pub(crate) fn prompt_tokens(&self, prompt_chars: usize) -> u64 {
        (prompt_chars as u64).div_ceil(u64::from(self.cfg.chars_per_token.max(1)))
    }

    /// The request's demand on the token budget.
    pub(crate) fn demand(&self, prompt_chars: usize, max_tokens: Option<u64>, n: u32) -> Demand {
        let per = u64::from(self.cfg.chars_per_token.max(1));
        Demand {
            prompt_tokens: (prompt_chars as u64).div_ceil(per),
            max_tokens: max_tokens
                .unwrap_or(u64::from(self.cfg.default_max_tokens))
                .saturating_mul(u64::from(n.max(1))),
        }
    }

    /// The limits that apply to `key`.
    pub(crate) fn quota(&self, key: &KeyRecord) -> KeyQuota {
        KeyQuota::resolve(key, &self.cfg.environments[key.environment.index()])
    }

    fn key_limiter(&self, key: &KeyRecord, quota: KeyQuota) -> Arc<KeyLimiter> {
        if let Some(l) = self.keys.get(&key.id)
            && l.quota == quota
        {
            return l.clone();
        }
        let limiter = Arc::new(KeyLimiter::new(quota, self.divisor));
        // A changed limit starts afresh (its counters no longer mean the same); requests in
        // flight keep their places on the old state.
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

    /// Drop the state of keys idle for `limits.prune_idle` with nothing in flight.
    pub(crate) fn prune(&self) -> usize {
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
    #[cfg(test)]
    pub(crate) fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// Prune on an interval until `stop`.
    pub(crate) async fn prune_loop(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
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
    pub(crate) fn shared(&self) -> Option<&shared::Shared> {
        self.shared.as_ref()
    }
}

#[cfg(test)]
mod tests;
