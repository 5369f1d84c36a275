//! The queue step and the queue wait: a backend slot now, under the route's preferences
//! (longest prefix, affinity, the priority environment's overflow), or a place in the pool's
//! queue (`crate::queue`: prod before gray before stress, keys in turn, bounded), or, for a
//! continuation of a stored response, room on the one backend that holds it. The wait turns
//! the place into a slot; it is the Timeline's queue wait (`admitted − body_read`). A retry
//! that finds every other backend full waits here too (`requeue`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::ApiError;
use super::exchange::Exchange;
use super::route::{self, Asked};
use super::state::ProxyState;
use super::stored::{self, Continued};
use crate::key::Environment;
use crate::pool::{Balancer, Generation, InFlight, Pool};
use crate::queue::{self, Asker, Claim, QueueError, Waiting};
use crate::route::Route;
use crate::telemetry::RequestRecord;

/// Where the queue step leaves a request.
pub(super) enum Place {
    /// A slot on a backend, now.
    Now(InFlight),
    /// A place in the pool's queue.
    Wait(Waiting<Balancer>),
    /// A continuation: room on the backend holding the response it continues.
    Pinned(Continued),
}

/// Who asks the queue: the key (its turn, its share, its environment's order) and the pool.
pub(super) fn asker<'a>(
    state: &'a ProxyState,
    pool: &'a Pool,
    record: &'a RequestRecord,
) -> Asker<'a> {
    let key = record.key.as_deref();
    Asker {
        key,
        model: &pool.model,
        metrics: state.queue_metrics.as_ref(),
        // Only where the backend is told who goes first: elsewhere an overflowing request
        // would wait in the engine's queue beside the ones it passed.
        goes_first: record.endpoint.is_some_and(|e| e.needs().engine_priority)
            && key.is_some_and(|k| {
                pool.config()
                    .priority
                    .is_some_and(|p| p.goes_first(k.environment))
            }),
    }
}

/// The generation a request was routed in, and where a newer one is kept should a reload
/// force it to be routed again.
pub(super) type Generations<'g> = (&'g Arc<Generation>, &'g mut Option<Arc<Generation>>);

/// The queue step. A reload that retired every backend this request could use, between its
/// routing and its claim, is not the client's problem: it is routed once more, in the
/// generation that replaced the old one. Answers the generation and route the place is in.
pub(super) fn claim<'g>(
    state: &ProxyState,
    (asked, headers): (Asked<'_>, &http::HeaderMap),
    (generation, newer): Generations<'g>,
    route: Route<'g>,
    continued: Option<Continued>,
    record: &mut RequestRecord,
) -> Result<(&'g Arc<Generation>, Route<'g>, Place), ApiError> {
    if let Some(continued) = continued {
        return Ok((generation, route, Place::Pinned(continued)));
    }
    match claim_in(state, &route, record) {
        Ok(claim) => Ok((generation, route, place(claim))),
        Err(QueueError::NoUsableBackend) if !Arc::ptr_eq(generation, &*state.generation.load()) => {
            let newer: &'g Arc<Generation> = newer.insert(state.generation.load_full());
            let route = route::route(state, asked, headers, newer, record)?;
            let claim =
                claim_in(state, &route, record).map_err(|e| ApiError::from_queue(e, route.pool))?;
            Ok((newer, route, place(claim)))
        }
        Err(e) => Err(ApiError::from_queue(e, route.pool)),
    }
}

fn place(claim: Claim<Balancer>) -> Place {
    match claim {
        Claim::Now(slot) => Place::Now(slot),
        Claim::Wait(waiting) => Place::Wait(waiting),
    }
}

/// A slot now or a place in the route's pool's queue. Tokenization gets a backend now,
/// without a capacity slot, or none.
fn claim_in(
    state: &ProxyState,
    route: &Route<'_>,
    record: &RequestRecord,
) -> Result<Claim<Balancer>, QueueError> {
    let pool = route.pool;
    let balancer = &pool.balancer;
    // A LoRA adapter's request: only the backends holding it (the gray canary's first), in the
    // pool's queue when they are full.
    if route.only != 0 {
        let outside = !route.only;
        if record.endpoint.is_some_and(|e| !e.needs().takes_slot) {
            return balancer
                .pick_uncounted(outside)
                .map(Claim::Now)
                .ok_or(QueueError::NoUsableBackend);
        }
        let asker = asker(state, pool, record);
        let first = || {
            (route.avoid != 0)
                .then(|| balancer.try_acquire_excluding(outside | route.avoid))
                .flatten()
                .or_else(|| balancer.try_acquire_excluding(outside))
        };
        return queue::claim_only(balancer, first, &asker, route.only);
    }
    if record.endpoint.is_some_and(|e| !e.needs().takes_slot) {
        return balancer
            .try_acquire_uncounted(route.avoid)
            .map(Claim::Now)
            .ok_or(QueueError::NoUsableBackend);
    }
    let asker = asker(state, pool, record);
    // With `[pools.priority]`, the environment the backends put first may pass the capacity
    // (up to twice it) when every backend is full: the slots it finds taken are held by
    // requests vLLM will put behind it, whichever replica sent them.
    let overflow = |slot: Option<InFlight>| {
        slot.or_else(|| {
            asker
                .goes_first
                .then(|| balancer.try_acquire_overflow(route.avoid))
                .flatten()
        })
    };
    // A request preferring some backends (`pick`, given the backends to avoid: the gray
    // canary's first while one can take it, as on every pool) is claimed there when it can
    // be; one that waits for any slot, or falls back, counts as a miss.
    let preferring = |pick: &dyn Fn(u64) -> Option<(InFlight, bool)>| {
        let hit = std::cell::Cell::new(false);
        let claimed = queue::claim(
            balancer,
            || {
                overflow(
                    pick(route.avoid)
                        .or_else(|| (route.avoid != 0).then(|| pick(0)).flatten())
                        .map(|(slot, preferred)| {
                            hit.set(preferred);
                            slot
                        }),
                )
            },
            &asker,
        );
        (claimed, hit.get())
    };
    // KV-event routing: where the request would start soonest, by what each engine holds of
    // the prompt (its own events) and what it is already busy with.
    if let (Some(blocks), Some(a)) = (&route.engine_blocks, pool.affinity) {
        use std::sync::atomic::Ordering::Relaxed;
        let held: Vec<usize> = pool
            .backends
            .iter()
            .map(|b| {
                b.engine_cache
                    .load()
                    .as_ref()
                    .map_or(0, |c| c.held(&blocks.blocks))
            })
            .collect();
        let prompt = u64::from(blocks.prompt_tokens);
        let uncached: Vec<u64> = held
            .iter()
            .map(|h| prompt - u64::from(blocks.cached_tokens(*h)))
            .collect();
        let cost = crate::pool::PrefillCost {
            held: &held,
            uncached: &uncached,
            session: route.affinity,
        };
        let (claimed, hit) = preferring(&|avoid| balancer.try_acquire_held(&cost, avoid, a.slack));
        pool.kv_counts[usize::from(!hit)].fetch_add(1, Relaxed);
        return claimed;
    }
    // Longest-prefix routing: where the request starts soonest, by the prefixes this fleet
    // of gateways sent each backend (a block of text counted as a quarter its bytes in
    // tokens, the estimate of a prompt's size) and the prompts sent there not yet prefilled.
    if let (Some(names), Some(index), Some(a)) = (&route.prefix, &pool.prefix, pool.affinity) {
        let found = index.lookup(names);
        let per_block = (index.block_bytes() as u64 / 4).max(1);
        let (claimed, hit) = preferring(&|avoid| {
            balancer.try_acquire_prefix(&found, names.len(), per_block, avoid, a.slack)
        });
        index.count(hit);
        return claimed;
    }
    let affinity = route
        .affinity
        .zip(pool.affinity)
        .map(|(key, a)| (key, a.slack));
    queue::claim(
        balancer,
        || overflow(balancer.try_acquire_routed(route.avoid, affinity)),
        &asker,
    )
}

/// The longest the key's environment waits in a queue (`queue.max_wait_seconds`).
pub(super) fn max_wait(state: &ProxyState, record: &RequestRecord) -> Duration {
    let env = record
        .key
        .as_ref()
        .map_or(Environment::Stress, |k| k.environment);
    state.queue.max_wait[env.index()]
}

/// The queue wait: the place becomes a slot, within the environment's longest wait.
pub(super) async fn wait(
    state: &ProxyState,
    pool: &Pool,
    place: Place,
    body_read: Instant,
    ex: &mut Exchange,
) -> Result<InFlight, ApiError> {
    let max_wait = max_wait(state, &ex.record);
    match place {
        // Tokenization never queues: it has no queue wait to record (not even a zero one).
        Place::Now(slot) if !slot.is_counted() => Ok(slot),
        Place::Now(slot) => {
            ex.record.timeline.stamp_admitted(body_read);
            Ok(slot)
        }
        Place::Wait(waiting) => {
            let queued_at = Instant::now();
            let result = queue::wait(waiting, max_wait, &asker(state, pool, &ex.record)).await;
            ex.record
                .timeline
                .stamp_admitted(body_read + queued_at.elapsed());
            result.map_err(|e| ApiError::from_queue(e, pool))
        }
        Place::Pinned(continued) => {
            stored::wait_pinned(state, pool, continued, body_read, max_wait, ex).await
        }
    }
}

/// A retry's slot: on a backend not yet `tried` when one is free, else the next one the
/// queue hands out, as a new request would get it, rather than failing a request that a slot
/// freed a moment later would serve. The wait joins the Timeline's queue wait.
pub(super) async fn requeue(
    state: &ProxyState,
    pool: &Pool,
    balancer: &Arc<Balancer>,
    (tried, only): (u64, u64),
    ex: &mut Exchange,
) -> Result<InFlight, ApiError> {
    let max_wait = max_wait(state, &ex.record);
    let asker = Asker {
        // A retry takes a slot within the capacity, in the queue's order.
        goes_first: false,
        ..asker(state, pool, &ex.record)
    };
    let started = Instant::now();
    let first = || balancer.try_acquire_excluding(tried);
    let claimed = queue::claim_only(balancer, first, &asker, only)
        .map_err(|e| ApiError::from_queue(e, pool))?;
    let slot = match claimed {
        Claim::Now(slot) => slot,
        Claim::Wait(waiting) => queue::wait(waiting, max_wait, &asker)
            .await
            .map_err(|e| ApiError::from_queue(e, pool))?,
    };
    let waited = started.elapsed();
    let timeline = &mut ex.record.timeline;
    if let Some(admitted) = timeline.admitted() {
        timeline.stamp_admitted(admitted + waited);
    }
    Ok(slot)
}
