//! The limiter state of one key and one environment, and the quotas it enforces: GCRA request
//! rates on a clock that paused-time tests drive, a token bucket, and in-flight counters.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64};

use governor::clock::Clock;
use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use super::bucket::TokenBucket;
use crate::config::EnvLimits;
use crate::key::KeyRecord;

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
    /// Milliseconds since `Limits::base` at the last admission (for pruning).
    pub(super) last_used: AtomicU64,
}

impl KeyLimiter {
    /// Fresh state for `quota`, each limit divided among `divisor` replicas.
    pub(super) fn new(quota: KeyQuota, divisor: u32) -> Self {
        Self {
            quota,
            requests: quota.requests_per_minute.map(|r| {
                gcra(
                    Quota::per_minute(nz(div_ceil_u32(r, divisor)))
                        .allow_burst(nz(div_ceil_u32(quota.burst, divisor))),
                )
            }),
            tokens: quota
                .tokens_per_minute
                .map(|t| TokenBucket::new(t.div_ceil(u64::from(divisor)).max(1))),
            in_flight: AtomicU32::new(0),
            last_used: AtomicU64::new(0),
        }
    }
}

#[derive(Debug)]
pub(super) struct EnvLimiter {
    pub(super) per_second: Option<(u32, u32)>,
    pub(super) requests: Option<Gcra>,
    pub(super) max_concurrent: Option<u32>,
    pub(super) in_flight: AtomicU32,
}

impl EnvLimiter {
    /// An environment's aggregate limits, each divided among `divisor` replicas.
    pub(super) fn new(e: &EnvLimits, divisor: u32) -> Self {
        let per_second = e
            .aggregate_requests_per_second
            .map(|r| (r, e.aggregate_burst.unwrap_or(r)));
        let requests = per_second.map(|(r, b)| {
            gcra(
                Quota::per_second(nz(div_ceil_u32(r, divisor)))
                    .allow_burst(nz(div_ceil_u32(b, divisor))),
            )
        });
        Self {
            per_second,
            requests,
            max_concurrent: e.aggregate_max_concurrent.map(|m| div_ceil_u32(m, divisor)),
            in_flight: AtomicU32::new(0),
        }
    }
}

fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN)
}

pub(super) fn div_ceil_u32(v: u32, d: u32) -> u32 {
    v.div_ceil(d.max(1)).max(1)
}
