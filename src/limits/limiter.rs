//! The limiter state of one key and one environment, and the quotas it enforces: GCRA request
//! rates on a clock that paused-time tests drive, a token bucket, and in-flight counters.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64};

use governor::clock::Clock;
use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use super::bucket::TokenBucket;

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

pub(super) type Gcra = RateLimiter<NotKeyed, InMemoryState, TokioClock, StateInformationMiddleware>;

pub(super) fn gcra(quota: Quota) -> Gcra {
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

#[derive(Debug)]
pub(super) struct EnvLimiter {
    pub(super) per_second: Option<(u32, u32)>,
    pub(super) requests: Option<Gcra>,
    pub(super) max_concurrent: Option<u32>,
    pub(super) in_flight: AtomicU32,
}

pub(super) fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN)
}

pub(super) fn div_ceil_u32(v: u32, d: u32) -> u32 {
    v.div_ceil(d.max(1)).max(1)
}
