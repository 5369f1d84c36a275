//! The queue phase (phase 5): a backend slot now, under the route's preferences (gray
//! pinning, longest prefix, affinity, the priority environment's overflow), or a place in the
//! pool's admission queue, waited for before the upstream phase sends.

use std::time::Instant;

use super::error::ApiError;
use super::exchange::Exchange;
use super::retry::{Requeue, send_with_retries};
use super::state::ProxyState;
use super::upstream::{Prepared, Sent};
use crate::key::Environment;
use crate::pool::{Balancer, InFlight, Pool};
use crate::queue::{self, Asker, Claim, QueueError};
use crate::route::Route;
use crate::telemetry::RequestRecord;

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

/// Phase 5, first half: a slot now or a place in the queue. Tokenization gets a backend now,
/// without a capacity slot, or none.
pub(super) fn claim(
    state: &ProxyState,
    route: &Route<'_>,
    record: &RequestRecord,
) -> Result<Claim<Balancer>, QueueError> {
    let pool = route.pool;
    if record.endpoint.is_some_and(|e| !e.needs().takes_slot) {
        return pool
            .balancer
            .try_acquire_uncounted(route.avoid)
            .map(Claim::Now)
            .ok_or(QueueError::NoUsableBackend);
    }
    let balancer = &pool.balancer;
    let asker = asker(state, pool, record);
    // With `[pools.priority]`, the environment the backends put first may pass the capacity
    // (up to twice it) when every backend is full: the seats it finds taken are held by
    // requests vLLM will put behind it, whichever replica sent them.
    let overflow = |slot: Option<InFlight>| {
        slot.or_else(|| {
            asker
                .goes_first
                .then(|| balancer.try_acquire_overflow(route.avoid))
                .flatten()
        })
    };
    // Longest-prefix routing: the backends holding the prompt's longest known prefix first;
    // a request that waits for any slot, or falls back, counts as a miss.
    if let (Some(names), Some(index), Some(a)) = (&route.prefix, &pool.prefix, pool.affinity) {
        let found = index.lookup(names);
        let hit = std::cell::Cell::new(false);
        let claimed = queue::claim(
            balancer,
            || {
                overflow(
                    // Gray pinning first (its backends while one can take it), as on every pool.
                    balancer
                        .try_acquire_prefix(&found, route.avoid, a.slack)
                        .or_else(|| {
                            (route.avoid != 0)
                                .then(|| balancer.try_acquire_prefix(&found, 0, a.slack))
                                .flatten()
                        })
                        .map(|(slot, on_prefix)| {
                            hit.set(on_prefix);
                            slot
                        }),
                )
            },
            &asker,
        );
        index.count(hit.get());
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

/// Phase 5, second half, and phase 6: wait for the slot if there is none yet (the wait
/// becomes the Timeline's queue wait, `admitted − body_read`), then send.
pub(super) async fn wait_and_send(
    state: &ProxyState,
    pool: &Pool,
    claim: Claim<Balancer>,
    prepared: Prepared,
    ex: &mut Exchange,
) -> Result<Sent, ApiError> {
    let body_read = prepared.body_read;
    let env = ex
        .record
        .key
        .as_ref()
        .map_or(Environment::Stress, |k| k.environment);
    let max_wait = state.queue.max_wait[env.index()];
    let slot = match claim {
        // Tokenization never queues: it has no queue wait to record (not even a zero one).
        Claim::Now(slot) if !slot.is_counted() => slot,
        Claim::Now(slot) => {
            ex.record.timeline.stamp_admitted(body_read);
            slot
        }
        Claim::Wait(waiting) => {
            let queued_at = Instant::now();
            let result = queue::wait(waiting, max_wait, &asker(state, pool, &ex.record)).await;
            ex.record
                .timeline
                .stamp_admitted(body_read + queued_at.elapsed());
            result.map_err(|e| ApiError::from_queue(e, pool))?
        }
    };
    let requeue = Requeue {
        max_wait,
        metrics: state.queue_metrics.as_ref(),
    };
    send_with_retries(pool, slot, prepared, ex, requeue).await
}
