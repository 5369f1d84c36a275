//! Retries before the first byte: a backend that could not be reached, or answered 502/503,
//! before the client had a byte gets the request sent to another one, within the pool's retry
//! budget; nothing is retried once the client has a byte, nor a request that must reach one
//! backend (a stored response's).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::ApiError;
use super::exchange::Exchange;
use super::upstream::{Prepared, Sent, send};
use crate::pool::{InFlight, Pool};

/// Send, and when the backend could not be reached or answered 502/503 before any byte went
/// to the client, send again to another backend — at most `retries.max_retries` times and
/// within the pool's retry budget. Nothing is retried once the client has a byte.
pub async fn send_with_retries(
    pool: &Pool,
    mut slot: InFlight,
    prepared: Prepared,
    ex: &mut Exchange,
    requeue: Requeue<'_>,
) -> Result<Sent, ApiError> {
    // Retries draw from the generation the slot came from (a queued request may have been
    // handed a slot by a newer one), so the exclusion bits name the same backends.
    let can_retry = {
        let balancer = slot.balancer();
        balancer.retries.max_retries > 0 && balancer.backends.len() > 1 && !prepared.pinned
    };
    if !can_retry {
        return send(pool, slot, prepared, ex).await;
    }
    // (Cloned only in that rare case: the count is shared by every worker.)
    let newer;
    let balancer = if Arc::ptr_eq(slot.balancer(), &pool.balancer) {
        &pool.balancer
    } else {
        newer = slot.balancer().clone();
        &newer
    };
    balancer.retry_budget.deposit();
    // A retry takes the same kind of slot (tokenization takes no capacity slot).
    let counted = slot.is_counted();
    let mut tried = 0u64;
    let mut attempt = 0;
    loop {
        tried |= crate::pool::bit(slot.position());
        if attempt >= balancer.retries.max_retries {
            return send(pool, slot, prepared, ex).await;
        }
        let this = Prepared {
            headers: prepared.headers.clone(),
            body: prepared.body.clone(),
            rename: prepared.rename.clone(),
            method: prepared.method.clone(),
            target: prepared.target.clone(),
            pin: prepared.pin.clone(),
            prefix: prepared.prefix.clone(),
            prefix_share: prepared.prefix_share.clone(),
            ..prepared
        };
        let result = send(pool, slot, this, ex).await;
        let retryable = match &result {
            Err(ApiError::BackendUnreachable { .. }) => true,
            Ok(Sent::Full(resp)) => matches!(resp.status().as_u16(), 502 | 503),
            _ => false,
        };
        if !retryable {
            return result;
        }
        let next = if counted {
            balancer.try_acquire_excluding(tried)
        } else {
            balancer.pick_uncounted(tried)
        };
        if next.is_none() && !counted {
            return result;
        }
        if !balancer.retry_budget.try_spend() {
            return result;
        }
        let next = match next {
            Some(next) => next,
            // Every other backend is at capacity: the retry waits for a slot in the pool's
            // queue, as a new request would, rather than failing a request that a free slot
            // a moment later would serve.
            None if counted => match requeue.wait(pool, balancer, tried, ex).await {
                Ok(next) => next,
                Err(e) => return Err(ApiError::from_queue(e, pool)),
            },
            None => return result,
        };
        tracing::debug!(request_id = ?ex.record.request_id, from = ?ex.record.backend, to = %next.backend().base, "retrying on another backend");
        // The failed attempt ends its span; its stamps are forgotten: the Timeline describes
        // the one that answers.
        if let Some(scope) = ex.record.otel.as_deref_mut() {
            let (status, error) = match &result {
                Ok(Sent::Full(resp)) => (resp.status().as_u16(), ex.record.error),
                Err(e) => (0, Some(e.kind())),
                Ok(Sent::Relay(..)) => (0, None),
            };
            scope.attempt_failed(Instant::now(), status, error);
        }
        ex.record.error = None;
        ex.record.timeline.forget_attempt();
        ex.record.retries = ex.record.retries.saturating_add(1);
        slot = next;
        attempt += 1;
    }
}

/// What a retry needs to wait in the pool's queue: the key's environment's longest wait.
pub struct Requeue<'a> {
    pub max_wait: Duration,
    pub metrics: Option<&'a crate::queue::QueueMetrics>,
}

impl Requeue<'_> {
    /// A slot on a backend not yet `tried` when one is free, else the next one the queue
    /// hands out; the wait joins the Timeline's queue wait.
    async fn wait(
        &self,
        pool: &Pool,
        balancer: &Arc<crate::pool::Balancer>,
        tried: u64,
        ex: &mut Exchange,
    ) -> Result<InFlight, crate::queue::QueueError> {
        use crate::queue::{self, Asker, Claim};
        let key = ex.record.key.clone();
        let asker = Asker {
            key: key.as_deref(),
            model: &pool.model,
            metrics: self.metrics,
            // A retry takes a slot within the capacity, in the queue's order.
            goes_first: false,
        };
        let started = Instant::now();
        let claimed = queue::claim(balancer, || balancer.try_acquire_excluding(tried), &asker)?;
        let slot = match claimed {
            Claim::Now(slot) => slot,
            Claim::Wait(waiting) => queue::wait(waiting, self.max_wait, &asker).await?,
        };
        let waited = started.elapsed();
        let timeline = &mut ex.record.timeline;
        if let Some(admitted) = timeline.admitted() {
            timeline.stamp_admitted(admitted + waited);
        }
        Ok(slot)
    }
}
