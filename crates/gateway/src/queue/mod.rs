//! The queue stage: waiting for a backend slot. A request takes a free slot at once when one
//! has room and nobody waits before it; else it joins its pool's admission queue (prod before
//! gray before stress, keys taking turns, bounded overall and per key) and waits up to its
//! environment's maximum. Everything about waiting lives here: the queue (`admission`), a
//! request's place in it (`Waiting`), the refusals the queue gives (`QueueRefusal`) and the
//! body of a stream that waits with `: queued` comments (`body`).
//!
//! The stage is generic over `Slots`, the pool side that hands slots out, so the queue never
//! imports the pool (the pool builds on the queue, not the other way round).

mod admission;
pub(crate) mod body;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use prometheus::{IntCounter, IntCounterVec};

use crate::key::{Environment, KeyRecord};
use fleetgate_protocol::error::ErrorKind;

pub(crate) use admission::{AdmissionQueue, JoinRefused, Place, TimedOut};
pub(crate) use body::{Continued, QueuedBody};

/// The pool side of the queue: where slots come from and who to ask whether any backend can
/// ever take the request.
pub(crate) trait Slots: Send + Sync + 'static {
    type Slot: Send + 'static;
    /// The admission queue in front of these slots.
    fn queue(&self) -> &AdmissionQueue<Self::Slot>;
    /// A free slot, by the pool's balancing, among the backends `only` names (0: any), handed
    /// to a waiter that reaches the front.
    fn try_take(self: &Arc<Self>, only: u64) -> Option<Self::Slot>;
    /// Some backend may take requests now or later: waiting is not in vain.
    fn any_usable(&self) -> bool;
}

/// A slot now, or a place in the queue to wait in.
pub(crate) enum Claim<S: Slots> {
    Now(S::Slot),
    Wait(Waiting<S>),
}

/// Why the queue did not give a slot.
#[derive(Debug)]
pub(crate) enum QueueError {
    /// No backend of the pool can take requests (all down, draining or removed): waiting
    /// would be in vain. The pool names each backend's state.
    NoUsableBackend,
    /// The queue refused the request or its wait ended.
    Refused(Box<QueueRefusal>),
}

/// Which refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusalKind {
    /// `queue.max_size` requests already wait.
    Full,
    /// The key already holds `queue.max_per_key` places.
    KeyShare,
    /// The environment's maximum wait passed without a slot.
    Timeout,
}

impl RefusalKind {
    pub(crate) const ALL: [RefusalKind; 3] = [
        RefusalKind::Full,
        RefusalKind::KeyShare,
        RefusalKind::Timeout,
    ];

    /// The `limit` label of `fleetgate_rejections_total`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RefusalKind::Full => "queue_full",
            RefusalKind::KeyShare => "queue_key_share",
            RefusalKind::Timeout => "queue_timeout",
        }
    }

    pub(crate) fn error_kind(self) -> ErrorKind {
        match self {
            RefusalKind::Full => ErrorKind::QueueFull,
            // The key's own doing: a rate limit of sorts, not the fleet's capacity.
            RefusalKind::KeyShare => ErrorKind::RateLimited,
            RefusalKind::Timeout => ErrorKind::QueueTimeout,
        }
    }

    pub(crate) fn code(self) -> &'static str {
        match self {
            RefusalKind::Full => "queue_full",
            RefusalKind::KeyShare => "queue_share_exceeded",
            RefusalKind::Timeout => "queue_timeout",
        }
    }
}

/// A request the queue refused, with what the client needs to know.
#[derive(Debug, Clone)]
pub(crate) struct QueueRefusal {
    pub(crate) kind: RefusalKind,
    /// The key's public id (`-` without a key).
    pub(crate) key_id: Box<str>,
    pub(crate) environment: Environment,
    pub(crate) model: Arc<str>,
    /// Places in the queue (full, key share) or milliseconds of waiting (timeout).
    pub(crate) limit: u64,
    pub(crate) retry_after: Duration,
}

impl QueueRefusal {
    pub(crate) fn status(&self) -> StatusCode {
        self.kind.error_kind().status()
    }

    pub(crate) fn message(&self) -> String {
        let model = &self.model;
        let retry = format!(
            " Retry after {:.1} s.",
            self.retry_after.as_secs_f64().max(0.1)
        );
        match self.kind {
            RefusalKind::Full => format!(
                "Every backend of `{model}` is at capacity and the admission queue is full ({} waiting).{retry}",
                self.limit
            ),
            RefusalKind::KeyShare => format!(
                "Every backend of `{model}` is at capacity and key {} already holds its share of the admission queue ({} waiting requests).{retry}",
                self.key_id, self.limit
            ),
            RefusalKind::Timeout => format!(
                "Every backend of `{model}` stayed at capacity: the request waited the {} environment's maximum of {:.1} s in the admission queue.{retry}",
                self.environment,
                Duration::from_millis(self.limit).as_secs_f64()
            ),
        }
    }
}

/// Refusal counters, resolved once (the same series as the limits' refusals).
#[derive(Debug, Clone)]
pub(crate) struct QueueMetrics {
    refused: [IntCounter; 3],
}

impl QueueMetrics {
    pub(crate) fn new(rejections: &IntCounterVec) -> Self {
        Self {
            refused: RefusalKind::ALL.map(|k| rejections.with_label_values(&[k.as_str()])),
        }
    }

    fn count(&self, kind: RefusalKind) {
        self.refused[kind as usize].inc();
    }
}

/// Who asks: the key (its turn and share in the queue, its environment's priority) and the
/// model (named in refusals).
pub(crate) struct Asker<'a> {
    pub(crate) key: Option<&'a KeyRecord>,
    pub(crate) model: &'a Arc<str>,
    pub(crate) metrics: Option<&'a QueueMetrics>,
    /// The backends' own queue puts this request before every other environment's
    /// (`[pools.priority]`): it takes a slot now while none of its own environment waits,
    /// passing the other environments' waiters (its `first` may then pass the capacity too).
    pub(crate) goes_first: bool,
}

impl Asker<'_> {
    pub(crate) fn refuse(
        &self,
        kind: RefusalKind,
        limit: u64,
        retry_after: Duration,
    ) -> QueueError {
        if let Some(m) = self.metrics {
            m.count(kind);
        }
        let (key_id, environment) = match self.key {
            Some(k) => (k.public_id.clone(), k.environment),
            None => (Box::from("-"), Environment::Stress),
        };
        QueueError::Refused(Box::new(QueueRefusal {
            kind,
            key_id,
            environment,
            model: self.model.clone(),
            limit,
            retry_after,
        }))
    }
}

/// A slot at once (`first`: the pool's choice under the route's constraints) while nobody
/// waits before this request, else a place in the queue. A full queue, or a key holding its
/// share of it, is refused at once. Nobody waits before a request that `goes_first` unless
/// its own environment does.
pub(crate) fn claim<S: Slots>(
    slots: &Arc<S>,
    first: impl FnOnce() -> Option<S::Slot>,
    asker: &Asker<'_>,
) -> Result<Claim<S>, QueueError> {
    claim_only(slots, first, asker, 0)
}

/// `claim` for a request that fits only the backends `only` names (their bits; 0: any): it
/// waits for a slot on one of them.
pub(crate) fn claim_only<S: Slots>(
    slots: &Arc<S>,
    first: impl FnOnce() -> Option<S::Slot>,
    asker: &Asker<'_>,
    only: u64,
) -> Result<Claim<S>, QueueError> {
    let queue = slots.queue();
    let (key_id, env) = match asker.key {
        Some(k) => (k.id, k.environment),
        None => (-1, Environment::Stress),
    };
    let nobody_before = !queue.has_waiters() || asker.goes_first && !queue.has_waiters_in(env);
    if nobody_before && let Some(slot) = first() {
        return Ok(Claim::Now(slot));
    }
    if !slots.any_usable() {
        return Err(QueueError::NoUsableBackend);
    }
    let mut ticket = match queue.join(key_id, env, only, |only| slots.try_take(only)) {
        Ok(t) => t,
        Err(JoinRefused::Full { max_size }) => {
            return Err(asker.refuse(RefusalKind::Full, max_size as u64, Duration::from_secs(1)));
        }
        Err(JoinRefused::KeyShare { max_per_key }) => {
            let limit = max_per_key as u64;
            return Err(asker.refuse(RefusalKind::KeyShare, limit, Duration::from_secs(1)));
        }
    };
    // A slot freed while joining was handed over at once.
    if let Some(slot) = ticket.try_now() {
        return Ok(Claim::Now(slot));
    }
    Ok(Claim::Wait(Waiting {
        place: ticket.detach(),
        slots: slots.clone(),
    }))
}

/// Wait in the queue up to `max_wait`. A wait that ends while no backend can take requests
/// says so rather than blaming capacity.
pub(crate) async fn wait<S: Slots>(
    waiting: Waiting<S>,
    max_wait: Duration,
    asker: &Asker<'_>,
) -> Result<S::Slot, QueueError> {
    let slots = waiting.slots.clone();
    match waiting.wait(max_wait).await {
        Ok(slot) => Ok(slot),
        Err(TimedOut) if !slots.any_usable() => Err(QueueError::NoUsableBackend),
        Err(TimedOut) => {
            let limit = u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX);
            Err(asker.refuse(RefusalKind::Timeout, limit, Duration::from_secs(2)))
        }
    }
}

/// A request's place in a pool's admission queue, owning its pool (so it can outlive the
/// request handler: a streaming request that waits while `: queued` comments go out). Dropping
/// it leaves the queue.
pub(crate) struct Waiting<S: Slots> {
    slots: Arc<S>,
    place: Option<Place<S::Slot>>,
}

impl<S: Slots> std::fmt::Debug for Waiting<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting")
    }
}

/// How often a waiting request looks for a free slot itself. Freed slots are handed over at
/// once; this catches what frees capacity without freeing a slot (an ejection running out, a
/// backend's warm-up or slow start ending), so a queue whose backends were all ejected and idle
/// moves on when the first ejection ends instead of waiting out its deadline for nothing.
const RECHECK: Duration = Duration::from_millis(100);

impl<S: Slots> Waiting<S> {
    async fn wait(mut self, max_wait: Duration) -> Result<S::Slot, TimedOut> {
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Some(place) = self.place.as_mut() else {
                return Err(TimedOut);
            };
            match place.recv(left.min(RECHECK)).await {
                Ok(slot) => return Ok(slot),
                Err(TimedOut) if left <= RECHECK => return Err(TimedOut),
                Err(TimedOut) => {
                    // Hand out whatever can be taken now, in the queue's order.
                    let queue = self.slots.queue();
                    if queue.has_waiters() {
                        queue.dispatch(|only| self.slots.try_take(only));
                    }
                    if let Some(slot) = place.try_now() {
                        return Ok(slot);
                    }
                }
            }
        }
    }
}

impl<S: Slots> Drop for Waiting<S> {
    fn drop(&mut self) {
        if let Some(p) = &self.place {
            self.slots.queue().leave(p);
        }
    }
}
