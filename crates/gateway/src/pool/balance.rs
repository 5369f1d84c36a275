//! Choosing a backend: weighted power of two choices over a pool's backends, affinity by
//! rendezvous hashing, exclusion masks for retries and the gray canary, the in-flight slot that
//! hands itself to the next waiter, and the retry budget.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::config::{EjectionConfig, PoolConfig, RetryConfig};
use crate::queue::{AdmissionQueue, Slots};

use super::backend::{Backend, Reachability, weight_of};
use super::hash::mix64;
use super::prefix::Tenants;

/// Retries allowed as a share of requests: each request deposits `ratio` of a retry, a retry
/// spends one; at most ten are saved up.
#[derive(Debug)]
pub(crate) struct RetryBudget {
    /// Thousandths of a retry.
    milli: AtomicI64,
    deposit: i64,
}

impl RetryBudget {
    const CAP: i64 = 10_000;

    fn new(ratio: f64) -> Self {
        Self {
            milli: AtomicI64::new(Self::CAP / 2),
            deposit: (ratio * 1000.0).round() as i64,
        }
    }

    pub(crate) fn deposit(&self) {
        if self.deposit > 0 && self.milli.load(Ordering::Relaxed) < Self::CAP {
            self.milli.fetch_add(self.deposit, Ordering::Relaxed);
        }
    }

    pub(crate) fn try_spend(&self) -> bool {
        self.milli
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                (m >= 1000).then_some(m - 1000)
            })
            .is_ok()
    }
}

/// What all workers' copies of a pool share: the backends (in-flight counts, reachability,
/// ejection), the admission queue in front of them and the retry budget. It picks the backend
/// for each request.
#[derive(Debug)]
pub struct Balancer {
    pub backends: Vec<Arc<Backend>>,
    /// Shared by every generation of the pool (a reload keeps the waiters).
    pub queue: Arc<AdmissionQueue<InFlight>>,
    pub(crate) retry_budget: RetryBudget,
    pub(crate) retries: RetryConfig,
    pub(crate) ejection: EjectionConfig,
    /// Backends gray keys avoid while one outside this mask can serve (0: no canary).
    pub(crate) gray_exclude: u64,
    /// Running sums of the backends' weights, for weighted sampling.
    cumulative: Vec<u32>,
}

/// Bit of backend `i` in an exclusion mask (backends past 64 are never excluded).
pub fn bit(i: usize) -> u64 {
    if i < 64 { 1 << i } else { 0 }
}

impl Balancer {
    /// Weights and labels are read from `cfg` (a backend kept by a reload takes them over only
    /// once the whole new configuration is built).
    pub(super) fn new(
        backends: Vec<Arc<Backend>>,
        queue: Arc<AdmissionQueue<InFlight>>,
        cfg: &PoolConfig,
    ) -> Self {
        let canary = cfg.gray_canary_label.as_deref().map_or(0, |label| {
            cfg.backends
                .iter()
                .enumerate()
                .filter(|(_, b)| b.labels.iter().any(|l| l == label))
                .fold(0u64, |m, (i, _)| m | bit(i))
        });
        let gray_exclude = if canary == 0 { 0 } else { !canary };
        let mut sum = 0u32;
        let cumulative = cfg
            .backends
            .iter()
            .map(|b| {
                sum = sum.saturating_add(weight_of(b));
                sum
            })
            .collect();
        Self {
            backends,
            queue,
            retry_budget: RetryBudget::new(cfg.retries.budget_ratio),
            retries: cfg.retries,
            ejection: cfg.ejection,
            gray_exclude,
            cumulative,
        }
    }

    /// A free slot, chosen by weighted power of two choices: two backends drawn with
    /// probability proportional to their weight, the one with fewer requests in flight per
    /// unit of weight wins (the first drawn on a tie, so idle traffic follows the weights). Backends that are down, ejected,
    /// draining, full or in `exclude` are skipped; when neither drawn one can take the request,
    /// the least loaded of all that can does. `None` when none can.
    pub fn try_acquire(self: &Arc<Self>) -> Option<InFlight> {
        self.try_acquire_excluding(0)
    }

    pub fn try_acquire_excluding(self: &Arc<Self>, exclude: u64) -> Option<InFlight> {
        self.try_acquire_within(exclude, 1)
    }

    /// A slot beyond the backends' capacity, up to twice it, chosen as `try_acquire` chooses:
    /// for a request the backends' own queue puts before everything the gateway holds
    /// (`[pools.priority]`'s first environment). vLLM then holds it first among its waiting
    /// requests, so it waits for the next free slot of the engine, not for one of this
    /// replica's slots, whichever replica holds the rest.
    pub(crate) fn try_acquire_overflow(self: &Arc<Self>, exclude: u64) -> Option<InFlight> {
        self.try_acquire_within(exclude, 2)
    }

    fn try_acquire_within(self: &Arc<Self>, exclude: u64, times: u32) -> Option<InFlight> {
        let n = self.backends.len();
        if n == 0 {
            return None;
        }
        let usable = |i: usize| -> Option<u32> {
            let b = &self.backends[i];
            if exclude & bit(i) != 0 || !b.eligible() {
                return None;
            }
            // In slow start a backend takes only its ramp's share of the draws.
            if b.up_since.load(Ordering::Relaxed) != 0 {
                let ramp = b.ramp();
                if ramp < 1.0 && rand::random::<f64>() >= ramp {
                    return None;
                }
            }
            b.has_room_within(times)
        };
        let better = |a, b| self.less_loaded(a, b);
        for round in 0..8 {
            let pick = if n == 1 {
                usable(0).map(|f| (0, f))
            } else if round == 0 {
                let (a, b) = self.draw_two();
                match (usable(a).map(|f| (a, f)), usable(b).map(|f| (b, f))) {
                    (Some(x), Some(y)) => Some(if better(y, x) { y } else { x }),
                    (Some(x), None) | (None, Some(x)) => Some(x),
                    (None, None) => self.scan(&usable, &better),
                }
            } else {
                self.scan(&usable, &better)
            };
            let (i, f) = pick?;
            // Another thread may have taken that slot since: then look again.
            if self.backends[i]
                .in_flight
                .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Some(InFlight {
                    balancer: self.clone(),
                    index: i,
                    counted: true,
                    prefill: 0,
                });
            }
        }
        None
    }

    /// A slot on backend `i` and no other (a request that must reach the backend holding the
    /// response it names). Counted within the backend's capacity when `counted` (`None`: full
    /// now); uncounted (a read or a cancel of a stored response) always. Whether the backend
    /// may take it is the caller's question: it must be this one.
    pub(crate) fn try_acquire_at(self: &Arc<Self>, i: usize, counted: bool) -> Option<InFlight> {
        let b = self.backends.get(i)?;
        if counted {
            loop {
                let f = b.has_room()?;
                if b.in_flight
                    .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    break;
                }
            }
        }
        Some(InFlight {
            balancer: self.clone(),
            index: i,
            counted,
            prefill: 0,
        })
    }

    /// Fewer in flight per unit of weight: n_a / w_a < n_b / w_b. Idle backends tie, and the
    /// first drawn wins a tie: idle traffic follows the weighted draw. With load-aware pools
    /// the other gateways' requests at the last scrape count too (`Backend::load`).
    fn less_loaded(&self, a: (usize, u32), b: (usize, u32)) -> bool {
        let load = |(i, f): (usize, u32)| -> u64 { self.backends[i].load(f) };
        load(a) * u64::from(self.backends[b.0].weight())
            < load(b) * u64::from(self.backends[a.0].weight())
    }

    /// A backend for a request that is not inference (tokenization), not counted in its
    /// in-flight number: it takes no capacity slot an inference request could use, never
    /// waits in the queue, and its end hands nothing on. Chosen like the others (two weighted
    /// draws, the less loaded wins) among the backends that may take requests, capacity and
    /// slow start aside; avoiding `avoid` (the gray canary) while another backend can take it.
    pub(crate) fn try_acquire_uncounted(self: &Arc<Self>, avoid: u64) -> Option<InFlight> {
        self.pick_uncounted(avoid)
            .or_else(|| (avoid != 0).then(|| self.pick_uncounted(0)).flatten())
    }

    /// `try_acquire_uncounted` without the fallback: a retry excludes the backends it tried.
    pub(crate) fn pick_uncounted(self: &Arc<Self>, exclude: u64) -> Option<InFlight> {
        let usable = |i: usize| -> Option<u32> {
            let b = &self.backends[i];
            (exclude & bit(i) == 0 && b.eligible()).then(|| b.in_flight.load(Ordering::Relaxed))
        };
        let better = |a, b| self.less_loaded(a, b);
        let pick = match self.backends.len() {
            0 => None,
            1 => usable(0).map(|f| (0, f)),
            _ => {
                let (a, b) = self.draw_two();
                match (usable(a).map(|f| (a, f)), usable(b).map(|f| (b, f))) {
                    (Some(x), Some(y)) => Some(if better(y, x) { y } else { x }),
                    (Some(x), None) | (None, Some(x)) => Some(x),
                    (None, None) => self.scan(&usable, &better),
                }
            }
        };
        pick.map(|(i, _)| InFlight {
            balancer: self.clone(),
            index: i,
            counted: false,
            prefill: 0,
        })
    }

    /// A slot on the backend preferred for `key` (rendezvous hashing over the usable
    /// backends, so every replica prefers the same one and only a removed backend's keys move),
    /// unless it is overloaded — more than twice the least loaded backend's requests and more
    /// than `slack` above them — or full: then the usual choice.
    pub(crate) fn try_acquire_affine(
        self: &Arc<Self>,
        key: u64,
        exclude: u64,
        slack: u32,
    ) -> Option<InFlight> {
        let mut best: Option<(usize, u32, u64)> = None;
        let mut min_load = u64::MAX;
        for (i, b) in self.backends.iter().enumerate() {
            if exclude & bit(i) != 0 || !b.eligible() {
                continue;
            }
            let f = b.in_flight.load(Ordering::SeqCst);
            min_load = min_load.min(b.load(f));
            let cap = b.capacity();
            if cap != 0 && f >= cap {
                continue;
            }
            let score = mix64(key ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            if best.is_none_or(|(_, _, s)| score > s) {
                best = Some((i, f, score));
            }
        }
        if let Some((i, f, _)) = best {
            let b = &self.backends[i];
            let load = b.load(f);
            let fair = min_load
                .saturating_mul(2)
                .max(min_load.saturating_add(u64::from(slack)));
            if load <= fair
                && b.in_flight
                    .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                return Some(InFlight {
                    balancer: self.clone(),
                    index: i,
                    counted: true,
                    prefill: 0,
                });
            }
        }
        self.try_acquire_excluding(exclude)
    }

    /// Longest-prefix routing, weighed as KV-event routing weighs what the engines report
    /// (`try_acquire_held`), on what this fleet of gateways sent where: backend `i` is believed
    /// to hold the prompt's first `held[i]` blocks (the deepest of `found`, shortest first, it
    /// is a tenant of), and `blocks` × `tokens_per_block` is the prompt's estimated size. So a
    /// request goes where it starts soonest: a backend holding its history, unless the
    /// prompts sent there and not yet prefilled cost more than that history saves — a prefix
    /// believed held is only being prefilled while the request that carried it waits for its
    /// first token, and new conversations arriving together are spread, not stacked behind
    /// it. `true` when it went to a backend believed to hold some of the prompt.
    pub(crate) fn try_acquire_prefix(
        self: &Arc<Self>,
        found: &[Tenants],
        blocks: usize,
        tokens_per_block: u64,
        exclude: u64,
        slack: u32,
    ) -> Option<(InFlight, bool)> {
        let held: Vec<usize> = self
            .backends
            .iter()
            .map(|b| {
                let me = u32::try_from(b.metrics_index).unwrap_or(u32::MAX);
                found
                    .iter()
                    .rposition(|tenants| tenants.contains(me))
                    .map_or(0, |deepest| deepest + 1)
            })
            .collect();
        let uncached: Vec<u64> = held
            .iter()
            .map(|h| (blocks.saturating_sub(*h) as u64).saturating_mul(tokens_per_block))
            .collect();
        let cost = PrefillCost {
            held: &held,
            uncached: &uncached,
            session: None,
        };
        self.try_acquire_held(&cost, exclude, slack)
    }

    /// KV-event routing. Among the usable backends with capacity whose load is within the
    /// bound of longest-prefix routing (at most twice the least loaded backend's, or `slack`
    /// above it):
    /// - when they differ in what they hold of the prompt, the one where the request would
    ///   start soonest: the fewest prompt tokens its engine has still to prefill before it
    ///   gets to this one (what this gateway sent it that has no first token yet,
    ///   `prefill_pending`, and what the other replicas say they did, `others_prefill`) plus
    ///   this prompt's tokens it does not hold (Dynamo's cost: blocks to prefill plus active
    ///   prefill work); then the agent session's own backend, then the
    ///   least loaded, then any (drawn at random). A request decoding costs a new one little
    ///   (one token of a step's budget), so in-flight requests count only by what they have
    ///   left to prefill;
    /// - when they all hold the same of it (nothing, or only what every engine holds, such as
    ///   a shared system prompt under cache pressure), where it goes changes nothing it
    ///   prefills: the agent session's own backend (rendezvous hashing over the usable
    ///   backends, as every replica computes it), else the usual choice (power of two
    ///   choices), so requests that arrive together are not dealt out in lockstep.
    ///
    /// When no backend is within the bound or has capacity: the usual choice. `true` when it
    /// went to a backend holding some of the prompt.
    pub(crate) fn try_acquire_held(
        self: &Arc<Self>,
        cost: &PrefillCost<'_>,
        exclude: u64,
        slack: u32,
    ) -> Option<(InFlight, bool)> {
        let home = cost.session.and_then(|key| self.home(key, exclude));
        let fair = self.fair_load(exclude, slack);
        // Backend `i`'s in-flight count and load, when it is within the bound and has room.
        let open = |i: usize| {
            let b = &self.backends[i];
            let (f, l) = load_of(b);
            let cap = b.capacity();
            (l <= fair && (cap == 0 || f < cap)).then_some((f, l))
        };
        let uncached = |i: usize| cost.uncached.get(i).copied().unwrap_or(u64::MAX);
        let mut fewest = u64::MAX;
        let mut most = 0;
        // Equal costs go to the first found, from a random backend on: not always the same
        // one, which would deal requests arriving together out in a fixed order.
        let n = self.backends.len();
        let from = if n > 1 { rand::random_range(0..n) } else { 0 };
        let best = (0..n)
            .map(|k| (from + k) % n)
            .filter(|i| self.usable(*i, exclude))
            .filter_map(|i| {
                open(i).map(|(f, l)| {
                    let prefill = uncached(i);
                    fewest = fewest.min(prefill);
                    most = most.max(prefill);
                    let b = &self.backends[i];
                    let queued = b
                        .prefill_pending
                        .load(Ordering::Relaxed)
                        .saturating_add(b.others_prefill.load(Ordering::Relaxed));
                    ((prefill.saturating_add(queued), home != Some(i), l), i, f)
                })
            })
            .min_by_key(|(cost, _, _)| *cost);
        let slot = match best {
            None => None,
            Some((_, i, f)) if fewest < most => self.claim_at(i, f),
            Some(_) => home.and_then(|h| open(h).and_then(|(f, _)| self.claim_at(h, f))),
        };
        let mut slot = slot.or_else(|| self.try_acquire_excluding(exclude))?;
        let i = slot.position();
        slot.leave_prefill(cost.uncached.get(i).copied().unwrap_or(0));
        Some((slot, cost.held.get(i).is_some_and(|h| *h > 0)))
    }

    /// The usable backend a key hashes to (rendezvous hashing: only a removed backend's keys
    /// move), full or not.
    fn home(&self, key: u64, exclude: u64) -> Option<usize> {
        (0..self.backends.len())
            .filter(|&i| self.usable(i, exclude))
            .max_by_key(|&i| mix64(key ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
    }

    /// Neither excluded nor out of rotation.
    fn usable(&self, i: usize, exclude: u64) -> bool {
        exclude & bit(i) == 0 && self.backends[i].eligible()
    }

    /// The most load a preferred backend may carry: twice the least loaded usable backend's,
    /// or `slack` above it.
    fn fair_load(&self, exclude: u64, slack: u32) -> u64 {
        let min_load = (0..self.backends.len())
            .filter(|i| self.usable(*i, exclude))
            .map(|i| load_of(&self.backends[i]).1)
            .min()
            .unwrap_or(0);
        min_load
            .saturating_mul(2)
            .max(min_load.saturating_add(u64::from(slack)))
    }

    /// A slot on backend `i`, if its in-flight count is still `f`.
    fn claim_at(self: &Arc<Self>, i: usize, f: u32) -> Option<InFlight> {
        self.backends[i]
            .in_flight
            .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| InFlight {
                balancer: self.clone(),
                index: i,
                counted: true,
                prefill: 0,
            })
    }

    fn scan(
        &self,
        usable: &impl Fn(usize) -> Option<u32>,
        better: &impl Fn((usize, u32), (usize, u32)) -> bool,
    ) -> Option<(usize, u32)> {
        let mut best: Option<(usize, u32)> = None;
        for i in 0..self.backends.len() {
            if let Some(f) = usable(i)
                && best.is_none_or(|b| better((i, f), b))
            {
                best = Some((i, f));
            }
        }
        best
    }

    /// Two distinct backends, each drawn with probability proportional to its weight (with
    /// two backends, one draw decides which comes first).
    fn draw_two(&self) -> (usize, usize) {
        let total = self.cumulative.last().copied().unwrap_or(1).max(1);
        let draw = || {
            let r = rand::random_range(0..total);
            self.cumulative.partition_point(|&c| c <= r)
        };
        let a = draw();
        if self.backends.len() == 2 {
            return (a, 1 - a);
        }
        let mut b = draw();
        if b == a {
            b = draw();
        }
        if b == a {
            b = (a + 1) % self.backends.len();
        }
        (a, b)
    }

    /// Some backend not in `exclude` may take requests now or later (not down, not draining,
    /// not ejected): where a stream cut on one backend may be continued.
    pub(crate) fn any_usable_besides(&self, exclude: u64) -> bool {
        (0..self.backends.len()).any(|i| self.usable(i, exclude))
    }

    /// Some backend may take requests now or later (not down, not draining).
    pub(crate) fn any_usable(&self) -> bool {
        self.backends.iter().any(|b| {
            b.reachability() != Reachability::Down
                && !b.draining.load(Ordering::Relaxed)
                && !b.removed.load(Ordering::Relaxed)
        })
    }

    /// The first choice for a routed request: avoiding `avoid` (the gray canary) while another
    /// backend can take it, on its affinity backend when it has one (and that one is not
    /// overloaded).
    pub(crate) fn try_acquire_routed(
        self: &Arc<Self>,
        avoid: u64,
        affinity: Option<(u64, u32)>,
    ) -> Option<InFlight> {
        let first = |exclude| match affinity {
            Some((key, slack)) => self.try_acquire_affine(key, exclude, slack),
            None => self.try_acquire_excluding(exclude),
        };
        first(avoid).or_else(|| (avoid != 0).then(|| self.try_acquire()).flatten())
    }

    /// Give free slots to waiting requests (after a slot was freed or a backend came back).
    pub(crate) fn dispatch(self: &Arc<Self>) {
        if self.queue.has_waiters() {
            self.queue.dispatch(|only| self.try_take(only));
        }
    }
}

impl Slots for Balancer {
    type Slot = InFlight;

    fn queue(&self) -> &AdmissionQueue<InFlight> {
        &self.queue
    }

    fn try_take(self: &Arc<Self>, only: u64) -> Option<InFlight> {
        match only {
            0 => self.try_acquire(),
            only => self.try_acquire_excluding(!only),
        }
    }

    fn any_usable(&self) -> bool {
        Balancer::any_usable(self)
    }
}

/// A backend's requests in flight here, and its load: those and, in a load-aware pool, the
/// other replicas' (and anyone else's) at the last scrape of its metrics.
fn load_of(b: &Backend) -> (u32, u64) {
    let f = b.in_flight.load(Ordering::SeqCst);
    (f, b.load(f))
}

/// What KV-event routing weighs for each backend (by position): the leading blocks its engine
/// holds of the prompt, the prompt tokens left to prefill there, and the agent session's hash.
#[derive(Debug)]
pub(crate) struct PrefillCost<'a> {
    pub(crate) held: &'a [usize],
    pub(crate) uncached: &'a [u64],
    pub(crate) session: Option<u64>,
}

/// Holds one in-flight slot on a backend; released on drop, whatever ends the request, and
/// handed straight to the next waiting request if there is one. An uncounted one
/// (`try_acquire_uncounted`) only names the backend.
#[derive(Debug)]
pub struct InFlight {
    balancer: Arc<Balancer>,
    index: usize,
    counted: bool,
    /// Prompt tokens this request left its backend's engine to prefill (KV-event routing),
    /// counted in the backend's `prefill_pending` until its first token or its end.
    prefill: u32,
}

impl InFlight {
    pub fn backend(&self) -> &Arc<Backend> {
        &self.balancer.backends[self.index]
    }

    /// The balancer of the pool generation the slot was taken from.
    pub(crate) fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// The backend's position in the pool generation the slot was taken from (the bit a retry
    /// excludes).
    pub(crate) fn position(&self) -> usize {
        self.index
    }

    /// Counted in the backend's in-flight number (an inference request's slot).
    pub(crate) fn is_counted(&self) -> bool {
        self.counted
    }

    /// Move the slot into a new holder: this one no longer counts (its drop releases
    /// nothing), the returned one holds the slot until it drops.
    pub(crate) fn hand_over(&mut self) -> InFlight {
        InFlight {
            balancer: self.balancer.clone(),
            index: self.index,
            counted: std::mem::replace(&mut self.counted, false),
            prefill: std::mem::take(&mut self.prefill),
        }
    }

    /// The request leaves its backend's engine `tokens` of prompt to prefill before its
    /// first token.
    fn leave_prefill(&mut self, tokens: u64) {
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        self.backend()
            .prefill_pending
            .fetch_add(u64::from(tokens), Ordering::Relaxed);
        self.prefill = tokens;
    }

    /// The engine has prefilled the prompt (its first token, or the answer's head when it
    /// is not streamed): it no longer stands before the backend's next requests.
    pub(crate) fn prefilled(&mut self) {
        let tokens = std::mem::take(&mut self.prefill);
        if tokens > 0 {
            self.backend()
                .prefill_pending
                .fetch_sub(u64::from(tokens), Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.prefilled();
        if !self.counted {
            return;
        }
        self.balancer.backends[self.index]
            .in_flight
            .fetch_sub(1, Ordering::SeqCst);
        self.balancer.dispatch();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QueueConfig;
    use crate::pool::hash::fnv1a;
    use crate::pool::{Generation, pool_cfg};

    #[test]
    fn affinity_prefers_one_backend_until_it_is_overloaded() {
        let pools = Generation::new(&[pool_cfg(3)], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let key = fnv1a(b"\"alice\"");
        let first = balancer.try_acquire_affine(key, 0, 2).unwrap();
        let preferred = first.position();
        let second = balancer.try_acquire_affine(key, 0, 2).unwrap();
        assert_eq!(second.position(), preferred, "same key, same backend");
        // Two in flight there, none elsewhere: 2 ≤ max(2 × 0, 0 + 2) still; a third is too many.
        let third = balancer.try_acquire_affine(key, 0, 2).unwrap();
        assert_eq!(third.position(), preferred);
        let fourth = balancer.try_acquire_affine(key, 0, 2).unwrap();
        assert_ne!(
            fourth.position(),
            preferred,
            "an overloaded preference is skipped"
        );
        // Other keys spread over the backends.
        drop((first, second, third, fourth));
        let mut used = std::collections::HashSet::new();
        for u in 0..64u32 {
            let s = balancer
                .try_acquire_affine(fnv1a(&u.to_le_bytes()), 0, 2)
                .unwrap();
            used.insert(s.position());
        }
        assert_eq!(used.len(), 3);
    }

    /// A load-aware backend's load is the other gateways' requests at the last scrape plus
    /// this gateway's own now: its own choices count at once, not at the next scrape.
    #[test]
    fn a_replica_counts_its_own_requests_at_once_and_the_others_at_the_scrape() {
        let pools = Generation::new(&[pool_cfg(2)], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let b = &balancer.backends[0];
        assert_eq!(b.load(3), 3, "never scraped: its own requests");
        // The engine ran 6 when 2 of them were ours: 4 are the others'.
        b.set_remote_load(6, 2);
        assert_eq!(b.load(2), 6);
        assert_eq!(b.load(5), 9, "3 sent since the scrape count now");
        assert_eq!(
            b.load(0),
            4,
            "ours ended: the others' stay until the next scrape"
        );
        // Sent but not yet seen by the engine: nobody else's.
        b.set_remote_load(1, 4);
        assert_eq!(b.load(4), 4);
        // With the others' load on backend 0, the least loaded is backend 1 until it holds as
        // many: 4 others' on 0, so 1 takes the next four.
        b.set_remote_load(4, 0);
        let slots: Vec<_> = (0..4)
            .map(|_| balancer.try_acquire_excluding(0).unwrap())
            .collect();
        assert!(
            slots.iter().all(|s| s.position() == 1),
            "{:?}",
            slots.iter().map(|s| s.position()).collect::<Vec<_>>()
        );
    }

    /// KV-event routing weighs what is left to prefill here against the prefill each backend
    /// still owes the requests sent before: the engine holding the prompt wins until the
    /// prompts queued on it cost more than the prefill it saves; a request that has its first
    /// token no longer counts; among equals the session's backend, then the least loaded.
    #[test]
    fn kv_routing_goes_where_the_request_starts_soonest() {
        let pools = Generation::new(&[pool_cfg(3)], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let held = [0, 60, 0];
        let uncached = [1000, 400, 1000];
        let cost = |session| PrefillCost {
            held: &held,
            uncached: &uncached,
            session,
        };
        // Backend 1 holds most of the prompt: 400 + 400 × the prompts it has not prefilled yet,
        // against 1000.
        let mut at_one = Vec::new();
        for queued in 0..2 {
            let (slot, hit) = balancer.try_acquire_held(&cost(None), 0, 64).unwrap();
            assert_eq!((slot.position(), hit), (1, true), "{queued} queued");
            at_one.push(slot);
        }
        // Two prompts queued there (400 + 800 > 1000): an idle backend is sooner.
        let (slot, hit) = balancer.try_acquire_held(&cost(None), 0, 64).unwrap();
        assert!(slot.position() != 1 && !hit);
        drop(slot);
        // Once they have their first tokens they are only decoding: backend 1 again, though it
        // has the most requests in flight.
        for s in &mut at_one {
            s.prefilled();
        }
        let (slot, _) = balancer.try_acquire_held(&cost(None), 0, 64).unwrap();
        assert_eq!(
            slot.position(),
            1,
            "decoding requests cost a new one no prefill"
        );
        at_one.push(slot);
        // A request that ends before its first token takes its prompt off the queue too.
        drop(at_one.pop());
        let (slot, _) = balancer.try_acquire_held(&cost(None), 0, 64).unwrap();
        assert_eq!(slot.position(), 1);
        at_one.push(slot);
        // Backends 0 and 2 tie: the session's own backend takes it, whichever it is.
        let home = |key: u64| balancer.home(key, 0).unwrap();
        let key = (0..64u64).find(|k| home(*k) != 1).unwrap();
        let (slot, _) = balancer
            .try_acquire_held(
                &PrefillCost {
                    held: &[0, 0, 0],
                    uncached: &[1000, 1000, 1000],
                    session: Some(key),
                },
                0,
                64,
            )
            .unwrap();
        assert_eq!(slot.position(), home(key));
        drop(slot);
        // The load bound stands: with slack 1, backend 1 (3 in flight) is past 2 × 0 and 0 + 1.
        let (slot, _) = balancer.try_acquire_held(&cost(None), 0, 1).unwrap();
        assert_ne!(
            slot.position(),
            1,
            "three in flight is past the bound of slack 1"
        );
    }

    /// Where every engine holds the same of the prompt, the choice is the usual one: idle
    /// backends are drawn at random (a fixed order would deal requests that arrive together
    /// out in lockstep), and what is queued to prefill is still counted.
    #[test]
    fn kv_routing_without_a_difference_is_the_usual_choice() {
        let pools = Generation::new(&[pool_cfg(3)], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let cost = PrefillCost {
            held: &[2, 2, 2],
            uncached: &[700, 700, 700],
            session: None,
        };
        let mut used = [0u32; 3];
        for _ in 0..60 {
            let (slot, hit) = balancer.try_acquire_held(&cost, 0, 64).unwrap();
            assert!(hit, "every backend holds some of it");
            used[slot.position()] += 1;
        }
        assert!(used.iter().all(|n| *n > 0), "idle backends drawn: {used:?}");
        let (slot, _) = balancer.try_acquire_held(&cost, 0, 64).unwrap();
        let b = slot.backend().clone();
        assert_eq!(b.prefill_pending.load(Ordering::Relaxed), 700);
        drop(slot);
        assert_eq!(b.prefill_pending.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn overflow_takes_up_to_twice_the_capacity() {
        let mut cfg = pool_cfg(1);
        cfg.max_in_flight_per_backend = 2;
        let pools = Generation::new(&[cfg], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let held: Vec<InFlight> = (0..2).map(|_| balancer.try_acquire().unwrap()).collect();
        assert!(balancer.try_acquire().is_none(), "full at its capacity");
        let over: Vec<InFlight> = (0..2)
            .map(|_| balancer.try_acquire_overflow(0).unwrap())
            .collect();
        assert!(
            balancer.try_acquire_overflow(0).is_none(),
            "twice the capacity at most"
        );
        drop(held);
        assert!(
            balancer.try_acquire().is_none(),
            "a slot freed while the overflow holds the capacity is not one within it"
        );
        drop(over);
        assert!(balancer.try_acquire().is_some());
    }

    #[test]
    fn weighted_draws_follow_the_weights() {
        let mut cfg = pool_cfg(3);
        for (b, w) in cfg.backends.iter_mut().zip([1, 2, 7]) {
            b.weight = w;
        }
        let pools = Generation::new(&[cfg], &QueueConfig::default()).unwrap();
        let balancer = &pools.get("m").unwrap().balancer;
        let mut firsts = [0u32; 3];
        for _ in 0..10_000 {
            let (a, b) = balancer.draw_two();
            assert_ne!(a, b);
            firsts[a] += 1;
        }
        // Expected 1000 / 2000 / 7000.
        assert!((800..1200).contains(&firsts[0]), "{firsts:?}");
        assert!((1750..2250).contains(&firsts[1]), "{firsts:?}");
        assert!((6700..7300).contains(&firsts[2]), "{firsts:?}");
    }
}
