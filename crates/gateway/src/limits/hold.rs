//! Checking a request against its limits: concurrency first, then rates and tokens (in Redis
//! when shared and reachable, else in process), and the [`Hold`] that gives it all back when
//! dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::bucket::{Shortfall, TokenBucket};
use super::limiter::{EnvLimiter, Floors, KeyLimiter, KeyQuota, div_ceil_u32};
use super::refusal::{LimitKind, RateHeaders, Refusal, Window};
use super::{Demand, Limits, shared};
use crate::key::{Environment, KeyRecord};

/// Builds the refusal of one request by `kind`, with the limit's value, when to come back and
/// the `x-ratelimit-*` headers.
trait RefusalOf: Fn(LimitKind, u64, Option<Duration>, RateHeaders) -> Refusal {}

impl<F: Fn(LimitKind, u64, Option<Duration>, RateHeaders) -> Refusal> RefusalOf for F {}

impl Limits {
    /// Hold the limits for an inference request of `key`, or say which limit refuses it.
    pub async fn hold(self: &Arc<Self>, key: &KeyRecord, demand: Demand) -> Result<Hold, Refusal> {
        self.hold_as(key, Some(demand)).await
    }

    /// Hold the limits for a request that is not inference (tokenization): it counts against the key's and
    /// the environment's request rates, but takes no concurrency place and neither reserves nor
    /// needs tokens — it generates none, and a key out of tokens may still count its prompts.
    pub(crate) async fn hold_request(self: &Arc<Self>, key: &KeyRecord) -> Result<Hold, Refusal> {
        self.hold_as(key, None).await
    }

    /// `demand`: the tokens an inference request may use; `None` for a request that only
    /// counts as a request.
    async fn hold_as(
        self: &Arc<Self>,
        key: &KeyRecord,
        demand: Option<Demand>,
    ) -> Result<Hold, Refusal> {
        let quota = self.quota(key);
        let env = key.environment;
        let e = &self.envs[env.index()];
        let unlimited = match demand {
            Some(_) => quota.is_unlimited() && e.requests.is_none() && e.max_concurrent.is_none(),
            None => quota.requests_per_minute.is_none() && e.requests.is_none(),
        };
        if unlimited {
            return Ok(Hold::unlimited(env));
        }
        // What this request is checked against: without a demand, the rates only. (The key's
        // limiter is still looked up by its whole quota: a different one would replace it.)
        let checked = match demand {
            Some(_) => quota,
            None => KeyQuota {
                tokens_per_minute: None,
                max_concurrent: None,
                ..quota
            },
        };
        let requested = demand.map_or(0, |d| d.total());
        let refusal = |kind, limit, retry_after, headers| Refusal {
            kind,
            key_id: key.public_id.clone(),
            environment: env,
            limit,
            requested,
            retry_after,
            headers,
        };
        let limiter = self.key_limiter(key, quota);
        limiter.last_used.store(self.now_ms(), Ordering::Relaxed);
        let prompt_estimate = demand.map_or(0, |d| d.prompt_tokens);
        let mut hold = Hold::held(self.clone(), limiter.clone(), env, prompt_estimate);

        // 1. Concurrency (in process; in shared mode each replica holds its share).
        if demand.is_some() {
            self.take_places(&mut hold, &limiter, &checked, e, &refusal)?;
        }

        // 2. Rates and tokens: in Redis when shared and reachable, else here.
        if let Some(shared) = &self.shared
            && shared.is_up()
        {
            // What the local limits admitted while Redis was away goes along as floors, so
            // Redis does not admit it again.
            let key_unsynced = limiter.unsynced.load(Ordering::Acquire);
            let env_unsynced = e.unsynced.load(Ordering::Acquire);
            let check = shared::Check::new(key, &checked, e.per_second, requested).with_floors(
                if key_unsynced {
                    limiter.floors()
                } else {
                    Floors::default()
                },
                if env_unsynced {
                    e.floor()
                } else {
                    Duration::ZERO
                },
            );
            match shared.check(&check).await {
                Ok(shared::Outcome::Passed {
                    requests,
                    tokens,
                    env,
                }) => {
                    // Redis's view, floors included, is the local limits' from now on: a
                    // fallback starts from what the key has used.
                    limiter.sync(requests.map(|r| r.1), tokens.map(|t| t.1));
                    e.sync(env);
                    // (A check without the key's token budget, tokenization, did not carry
                    // the bucket's floor: the key stays unsynced until one does.)
                    if key_unsynced
                        && (checked.tokens_per_minute.is_some() || limiter.tokens.is_none())
                    {
                        limiter.unsynced.store(false, Ordering::Release);
                    }
                    if env_unsynced {
                        e.unsynced.store(false, Ordering::Release);
                    }
                    hold.headers = shared_headers(&checked, requests, tokens);
                    if checked.tokens_per_minute.is_some() {
                        hold.reserved = requested;
                        hold.reserved_in = Reserved::Shared(key.id);
                    }
                    return Ok(hold);
                }
                Ok(shared::Outcome::Refused { which, retry_after }) => {
                    let (kind, limit) = shared_refused(which, &checked, e);
                    let retry = (kind != LimitKind::KeyTokensTooLarge).then_some(retry_after);
                    let headers = refusal_headers(kind, &checked, retry_after);
                    return Err(self.refuse(refusal(kind, limit, retry, headers)));
                }
                // Unreachable or too slow: this request and the next ones use local limits
                // (limit / replicas) until Redis answers again; `shared` logs and counts it.
                Err(()) => {}
            }
        }
        self.hold_local(hold, &limiter, &checked, e, demand, refusal)
    }

    /// Take the key's and then the environment's concurrency place; a place taken stays with
    /// `hold`, so a refusal by the environment gives the key's back when `hold` is dropped.
    fn take_places(
        &self,
        hold: &mut Hold,
        limiter: &KeyLimiter,
        quota: &KeyQuota,
        e: &EnvLimiter,
        refusal: &impl RefusalOf,
    ) -> Result<(), Refusal> {
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
            hold.key_place = true;
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
            hold.env_place = true;
        }
        Ok(())
    }

    fn hold_local(
        &self,
        mut hold: Hold,
        limiter: &KeyLimiter,
        quota: &KeyQuota,
        e: &EnvLimiter,
        demand: Option<Demand>,
        refusal: impl RefusalOf,
    ) -> Result<Hold, Refusal> {
        let d = self.divisor;
        let mut headers = RateHeaders::default();
        if let (Some(bucket), Some(demand)) = (&limiter.tokens, demand) {
            headers.tokens = Some(self.reserve_tokens(&mut hold, bucket, demand, &refusal)?);
        }
        if let Some(g) = &limiter.requests {
            let rpm = u64::from(div_ceil_u32(quota.requests_per_minute.unwrap_or(1), d));
            match g.check() {
                Ok(room) => {
                    headers.requests = Some(Window {
                        limit: rpm,
                        remaining: u64::from(room.remaining),
                        reset: room.reset,
                    });
                }
                Err(wait) => {
                    hold.set_used(0);
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
            && let Err(wait) = g.check()
        {
            hold.set_used(0);
            let limit = u64::from(div_ceil_u32(e.per_second.map_or(1, |p| p.0), d));
            return Err(self.refuse(refusal(LimitKind::EnvRequests, limit, Some(wait), headers)));
        }
        // In shared mode Redis has not seen this check: its next check for the key (and
        // the environment) takes the local view along.
        if self.shared.is_some() {
            limiter.unsynced.store(true, Ordering::Release);
            e.unsynced.store(true, Ordering::Release);
        }
        hold.headers = headers;
        Ok(hold)
    }

    /// Reserve the request's tokens in the key's local bucket; the reservation is `hold`'s.
    fn reserve_tokens(
        &self,
        hold: &mut Hold,
        bucket: &TokenBucket,
        demand: Demand,
        refusal: &impl RefusalOf,
    ) -> Result<Window, Refusal> {
        let need = demand.total();
        match bucket.reserve(need) {
            Ok(s) => {
                hold.reserved = need;
                hold.reserved_in = Reserved::Local;
                Ok(Window {
                    limit: bucket.per_minute(),
                    remaining: s.remaining,
                    reset: s.reset,
                })
            }
            Err(Shortfall::TooLarge) => Err(self.refuse(refusal(
                LimitKind::KeyTokensTooLarge,
                bucket.per_minute(),
                None,
                bucket_headers(bucket),
            ))),
            Err(Shortfall::Wait(wait)) => Err(self.refuse(refusal(
                LimitKind::KeyTokens,
                bucket.per_minute(),
                Some(wait),
                bucket_headers(bucket),
            ))),
        }
    }
}

/// The tokens window of a refusal by the key's local bucket, as it stands.
fn bucket_headers(bucket: &TokenBucket) -> RateHeaders {
    let now = bucket.peek();
    RateHeaders {
        tokens: Some(Window {
            limit: bucket.per_minute(),
            remaining: now.remaining,
            reset: now.reset,
        }),
        requests: None,
    }
}

/// The `x-ratelimit-*` windows of a request the shared store admitted.
fn shared_headers(
    quota: &KeyQuota,
    requests: Option<(u64, Duration)>,
    tokens: Option<(u64, Duration)>,
) -> RateHeaders {
    RateHeaders {
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
    }
}

/// Which limit the shared store refused by, and that limit's value.
fn shared_refused(which: shared::Which, quota: &KeyQuota, e: &EnvLimiter) -> (LimitKind, u64) {
    match which {
        shared::Which::KeyRequests => (
            LimitKind::KeyRequests,
            u64::from(quota.requests_per_minute.unwrap_or(0)),
        ),
        shared::Which::KeyTokens => (LimitKind::KeyTokens, quota.tokens_per_minute.unwrap_or(0)),
        shared::Which::KeyTokensTooLarge => (
            LimitKind::KeyTokensTooLarge,
            quota.tokens_per_minute.unwrap_or(0),
        ),
        shared::Which::EnvRequests => (
            LimitKind::EnvRequests,
            u64::from(e.per_second.map_or(0, |p| p.0)),
        ),
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
        LimitKind::KeyTokens | LimitKind::KeyTokensTooLarge => RateHeaders {
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

/// A request's hold on its limits: its places in the concurrency caps and a token reservation.
/// Dropping it releases the places and settles the reservation with what `set_used` said the
/// request used (the whole reservation when nothing was said).
#[must_use]
pub struct Hold {
    /// `None` for a key and environment without limits: nothing to release (and no shared
    /// reference count touched on the request path).
    limits: Option<Arc<Limits>>,
    key: Option<Arc<KeyLimiter>>,
    env: Environment,
    key_place: bool,
    env_place: bool,
    reserved: u64,
    reserved_in: Reserved,
    prompt_estimate: u64,
    used: Option<u64>,
    /// `x-ratelimit-*` values for the response.
    pub(crate) headers: RateHeaders,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("env", &self.env)
            .field("reserved", &self.reserved)
            .field("used", &self.used)
            .finish()
    }
}

impl Hold {
    /// A hold on `key`'s limiter state, with no place taken and nothing reserved yet.
    fn held(
        limits: Arc<Limits>,
        key: Arc<KeyLimiter>,
        env: Environment,
        prompt_estimate: u64,
    ) -> Self {
        Self {
            limits: Some(limits),
            key: Some(key),
            env,
            key_place: false,
            env_place: false,
            reserved: 0,
            reserved_in: Reserved::Nowhere,
            prompt_estimate,
            used: None,
            headers: RateHeaders::default(),
        }
    }

    fn unlimited(env: Environment) -> Self {
        Self {
            limits: None,
            key: None,
            env,
            key_place: false,
            env_place: false,
            reserved: 0,
            reserved_in: Reserved::Nowhere,
            prompt_estimate: 0,
            used: None,
            headers: RateHeaders::default(),
        }
    }

    /// Tokens reserved at the check.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The prompt-token estimate made at the check.
    pub(crate) fn prompt_estimate(&self) -> u64 {
        self.prompt_estimate
    }

    /// What the request really used; settled when the hold is dropped.
    pub fn set_used(&mut self, tokens: u64) {
        self.used = Some(tokens);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(k) = &self.key
            && self.key_place
        {
            k.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        if self.env_place
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
