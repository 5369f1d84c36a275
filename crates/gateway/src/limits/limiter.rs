//! The limiter state of one key and one environment, and the quotas it enforces: GCRA request
//! rates on a clock that paused-time tests drive, a token bucket, and in-flight counters.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::bucket::TokenBucket;
use crate::config::EnvLimits;
use crate::key::KeyRecord;

/// A request rate as GCRA, the algorithm governor runs and the Redis script (`shared`) runs:
/// one atomic theoretical arrival time (TAT) on tokio's clock (paused-time tests drive it;
/// outside tests it is `std::time::Instant`). Our own rather than governor's
/// because the shared mode must read how far ahead of now the TAT is (`debt`) and move it
/// (`owe_at_least`): across a failover between Redis and the local limits the key's state
/// carries over instead of a fresh burst.
#[derive(Debug)]
pub(super) struct Gcra {
    /// Emission interval in ns: one request per `t`.
    t: u64,
    /// Tolerance in ns: `t × (burst − 1)`, how far ahead of now the TAT may be.
    tau: u64,
    burst: u32,
    /// The TAT in ns since `base`; at or before now: the whole burst is there.
    tat: AtomicU64,
    base: tokio::time::Instant,
}

/// A request the rate admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RateRoom {
    /// Requests the burst still holds.
    pub(super) remaining: u32,
    /// Until the whole burst is back.
    pub(super) reset: Duration,
}

impl Gcra {
    /// `count` requests per `per`, `burst` of them at once.
    pub(super) fn new(per: Duration, count: NonZeroU32, burst: NonZeroU32) -> Self {
        let per = u64::try_from(per.as_nanos()).unwrap_or(u64::MAX);
        let t = (per / u64::from(count.get())).max(1);
        Self {
            t,
            tau: t.saturating_mul(u64::from(burst.get() - 1)),
            burst: burst.get(),
            tat: AtomicU64::new(0),
            base: tokio::time::Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(
            tokio::time::Instant::now()
                .saturating_duration_since(self.base)
                .as_nanos(),
        )
        .unwrap_or(u64::MAX)
    }

    /// Admit one request, or say how long until one would pass.
    pub(super) fn check(&self) -> Result<RateRoom, Duration> {
        let now = self.now();
        let mut cur = self.tat.load(Ordering::Acquire);
        loop {
            let tat = cur.max(now);
            if tat - now > self.tau {
                return Err(Duration::from_nanos(tat - now - self.tau));
            }
            let next = tat + self.t;
            match self
                .tat
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // (tat − now ≤ tau, so this is at least 0.)
                    let room = (now + self.tau - tat).min(self.tau) / self.t;
                    let remaining = u32::try_from(room).unwrap_or(u32::MAX);
                    let missing = u64::from(self.burst.saturating_sub(remaining));
                    return Ok(RateRoom {
                        remaining,
                        reset: Duration::from_nanos(self.t.saturating_mul(missing)),
                    });
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// How far ahead of now the TAT is: the time this rate needs to be whole again.
    pub(super) fn debt(&self) -> Duration {
        let now = self.now();
        Duration::from_nanos(self.tat.load(Ordering::Acquire).saturating_sub(now))
    }

    /// Count what was used elsewhere: the TAT at least `debt` ahead of now (at most as far as
    /// one check can put it).
    pub(super) fn owe_at_least(&self, debt: Duration) {
        let debt = u64::try_from(debt.as_nanos())
            .unwrap_or(u64::MAX)
            .min(self.tau + self.t);
        let at_least = self.now().saturating_add(debt);
        // (A read first: mostly it is already there, and the line stays shared.)
        if self.tat.load(Ordering::Acquire) < at_least {
            self.tat.fetch_max(at_least, Ordering::AcqRel);
        }
    }
}

/// The local view of a key (or an environment) that the shared store has not taken yet, as the
/// time each limit needs to be whole again; zero: nothing to carry over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Floors {
    pub(crate) requests: Duration,
    pub(crate) tokens: Duration,
}

/// One key's effective limits (its own values, else its environment's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyQuota {
    pub(crate) requests_per_minute: Option<u32>,
    pub(crate) burst: u32,
    pub(crate) tokens_per_minute: Option<u64>,
    pub(crate) max_concurrent: Option<u32>,
}

impl KeyQuota {
    /// The limits that apply to `key` in an environment with defaults `e`.
    pub(super) fn resolve(key: &KeyRecord, e: &EnvLimits) -> Self {
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

    pub(super) fn is_unlimited(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.max_concurrent.is_none()
    }
}

/// A key's limiter state. Rebuilt when the key's limits change.
#[derive(Debug)]
pub(super) struct KeyLimiter {
    pub(super) quota: KeyQuota,
    pub(super) requests: Option<Gcra>,
    pub(super) tokens: Option<TokenBucket>,
    pub(super) in_flight: AtomicU32,
    /// Milliseconds since `Limits::base` at the last check (for pruning).
    pub(super) last_used: AtomicU64,
    /// Shared mode: admitted here, on the local limits, since Redis last took this key's local
    /// view (`floors`).
    pub(super) unsynced: AtomicBool,
}

impl KeyLimiter {
    /// Fresh state for `quota`, each limit divided among `divisor` replicas.
    pub(super) fn new(quota: KeyQuota, divisor: u32) -> Self {
        Self {
            quota,
            requests: quota.requests_per_minute.map(|r| {
                Gcra::new(
                    Duration::from_secs(60),
                    nz(div_ceil_u32(r, divisor)),
                    nz(div_ceil_u32(quota.burst, divisor)),
                )
            }),
            tokens: quota
                .tokens_per_minute
                .map(|t| TokenBucket::new(t.div_ceil(u64::from(divisor)).max(1))),
            in_flight: AtomicU32::new(0),
            last_used: AtomicU64::new(0),
            unsynced: AtomicBool::new(false),
        }
    }

    /// What the local limits hold that the shared store has not seen (`unsynced`): how long
    /// each needs to be whole again. A share of limit/replicas refills at its share of the
    /// rate, so the time is the same for the whole limit: that is what goes to Redis.
    pub(super) fn floors(&self) -> Floors {
        Floors {
            requests: self.requests.as_ref().map_or(Duration::ZERO, Gcra::debt),
            tokens: self
                .tokens
                .as_ref()
                .map_or(Duration::ZERO, TokenBucket::until_full),
        }
    }

    /// Carry the shared store's view of the key into the local limits (the times each needs
    /// to be whole again), so that a fallback starts from what the key has used, not from a
    /// full share.
    pub(super) fn sync(&self, requests: Option<Duration>, tokens: Option<Duration>) {
        if let (Some(g), Some(debt)) = (&self.requests, requests) {
            g.owe_at_least(debt);
        }
        if let (Some(b), Some(until_full)) = (&self.tokens, tokens) {
            b.set_until_full(until_full);
        }
    }
}

#[derive(Debug)]
pub(super) struct EnvLimiter {
    pub(super) per_second: Option<(u32, u32)>,
    pub(super) requests: Option<Gcra>,
    pub(super) max_concurrent: Option<u32>,
    pub(super) in_flight: AtomicU32,
    /// Shared mode: admitted here since Redis last took the local view, as for a key.
    pub(super) unsynced: AtomicBool,
}

impl EnvLimiter {
    /// An environment's aggregate limits, each divided among `divisor` replicas.
    pub(super) fn new(e: &EnvLimits, divisor: u32) -> Self {
        let per_second = e
            .aggregate_requests_per_second
            .map(|r| (r, e.aggregate_burst.unwrap_or(r)));
        let requests = per_second.map(|(r, b)| {
            Gcra::new(
                Duration::from_secs(1),
                nz(div_ceil_u32(r, divisor)),
                nz(div_ceil_u32(b, divisor)),
            )
        });
        Self {
            per_second,
            requests,
            max_concurrent: e.aggregate_max_concurrent.map(|m| div_ceil_u32(m, divisor)),
            in_flight: AtomicU32::new(0),
            unsynced: AtomicBool::new(false),
        }
    }

    /// The aggregate rate's local view the shared store has not seen (see `KeyLimiter`).
    pub(super) fn floor(&self) -> Duration {
        self.requests.as_ref().map_or(Duration::ZERO, Gcra::debt)
    }

    /// Carry the shared store's view of the aggregate rate into the local one.
    pub(super) fn sync(&self, debt: Option<Duration>) {
        if let (Some(g), Some(debt)) = (&self.requests, debt) {
            g.owe_at_least(debt);
        }
    }
}

fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN)
}

pub(super) fn div_ceil_u32(v: u32, d: u32) -> u32 {
    v.div_ceil(d.max(1)).max(1)
}
