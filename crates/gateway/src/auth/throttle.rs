//! The brute-force brake: how many failed authentications a client address may make before it
//! is refused without its key being checked, and the bound on answers held back by a delay.
//!
//! Each address (an IPv6 client by its /64, the smallest block one subscriber gets) has one
//! number: the GCRA "theoretical arrival time" of its failures. `failures_per_minute` failures
//! may come at once; after that one more every `60 s / failures_per_minute`. Only failures
//! write; a request is refused unchecked while its address is past its allowance (a read), so
//! guessing gains nothing from speed, and a correct key from a throttled address waits too.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// Addresses tracked at most (about 64 bytes each). Past it, a new address's failures are not
/// tracked (they are still delayed), so a spray of addresses cannot grow memory without bound.
pub(super) const TRACKED_ADDRESSES_CAP: usize = 100_000;

/// How often a full map may be swept for recovered addresses outside the periodic prune.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What the failure allowance is counted against: an IPv4 address, or an IPv6 /64.
fn source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let prefix = u128::from(v6) & !u128::from(u64::MAX);
                IpAddr::V6(prefix.into())
            }
        },
    }
}

/// Whether `every` has passed since `last` (0: never), claiming the moment if so: one caller
/// of many wins.
fn once_per(last: &AtomicU64, now_ns: u64, every: Duration) -> bool {
    let seen = last.load(Ordering::Relaxed);
    let every = u64::try_from(every.as_nanos()).unwrap_or(u64::MAX);
    (seen == 0 || now_ns.saturating_sub(seen) >= every)
        && last
            .compare_exchange(seen, now_ns.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Failures per address, GCRA: at most `burst` at once, then one per `interval`.
pub(super) struct FailureThrottle {
    /// Theoretical arrival time of the next failure, in ns since `epoch`.
    by_source: DashMap<IpAddr, u64>,
    epoch: Instant,
    interval_ns: u64,
    /// How far ahead of now the arrival time may run before the address is throttled:
    /// `(burst - 1) * interval`.
    tolerance_ns: u64,
    cap: usize,
    /// `ns since epoch` of the last sweep of a full map, and of the last "full" warning.
    last_sweep: AtomicU64,
    last_warning: AtomicU64,
}

impl FailureThrottle {
    /// `per_minute` failures allowed at once and per minute (at least 1).
    pub(super) fn new(per_minute: u32, cap: usize) -> Self {
        let per_minute = u64::from(per_minute.max(1));
        let interval_ns = 60_000_000_000 / per_minute;
        Self {
            by_source: DashMap::new(),
            epoch: Instant::now(),
            interval_ns,
            tolerance_ns: interval_ns * (per_minute - 1),
            cap,
            last_sweep: AtomicU64::new(0),
            last_warning: AtomicU64::new(0),
        }
    }

    fn ns(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// `Some(wait)` when `peer` is past its allowance at `now`: how long until one more attempt
    /// is let through. A read only; an address that never failed is not in the map.
    pub(super) fn throttled(&self, peer: IpAddr, now: Instant) -> Option<Duration> {
        let tat = *self.by_source.get(&source(peer))?;
        let ahead = tat.saturating_sub(self.ns(now));
        (ahead > self.tolerance_ns).then(|| Duration::from_nanos(ahead - self.tolerance_ns))
    }

    /// Count one failure of `peer` at `now`.
    pub(super) fn record(&self, peer: IpAddr, now: Instant) {
        let now_ns = self.ns(now);
        let key = source(peer);
        if let Some(mut tat) = self.by_source.get_mut(&key) {
            *tat = (*tat).max(now_ns).saturating_add(self.interval_ns);
            return;
        }
        if self.by_source.len() >= self.cap && !self.sweep_full(now_ns) {
            return;
        }
        self.by_source
            .entry(key)
            .and_modify(|tat| *tat = (*tat).max(now_ns).saturating_add(self.interval_ns))
            .or_insert(now_ns.saturating_add(self.interval_ns));
    }

    /// The map is full: drop recovered addresses (at most once per `SWEEP_EVERY`). Whether
    /// there is room now.
    fn sweep_full(&self, now_ns: u64) -> bool {
        if once_per(&self.last_sweep, now_ns, SWEEP_EVERY) {
            self.by_source.retain(|_, tat| *tat > now_ns);
        }
        if self.by_source.len() < self.cap {
            return true;
        }
        if once_per(&self.last_warning, now_ns, Duration::from_secs(60)) {
            tracing::warn!(
                tracked = self.cap,
                "authentication failures come from more addresses than the gateway tracks: \
                 failures of new addresses are delayed but not counted until some recover"
            );
        }
        false
    }

    /// Forget addresses whose allowance has fully recovered (the same as never seen).
    pub(super) fn prune(&self, now: Instant) {
        let now_ns = self.ns(now);
        self.by_source.retain(|_, tat| *tat > now_ns);
        self.by_source.shrink_to_fit();
    }

    /// Addresses tracked now.
    pub(super) fn tracked(&self) -> usize {
        self.by_source.len()
    }
}

/// Answers held back by a delay right now, bounded: a held answer is a timer in its request's
/// own future (no thread, no task), but it keeps the request's state alive, so past the bound
/// answers go out at once rather than pile up. Refusals of throttled addresses may fill only
/// half: their timing reveals nothing (no key was checked), and a flood of them from one
/// address must not use up the slots that keep key checks' timing hidden.
pub(super) struct DelayedAnswers {
    waiting: AtomicUsize,
    cap: usize,
}

/// One held answer; the count drops with it (also when the client goes away mid-delay).
pub(super) struct DelaySlot<'a>(&'a AtomicUsize);

impl Drop for DelaySlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DelayedAnswers {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            cap,
        }
    }

    /// A slot to wait in, or `None` when the bound is reached: all of it for a checked key,
    /// half of it for a `throttled` address.
    pub(super) fn try_hold(&self, throttled: bool) -> Option<DelaySlot<'_>> {
        let bound = if throttled {
            self.cap.div_ceil(2)
        } else {
            self.cap
        };
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < bound).then_some(n + 1)
            })
            .ok()
            .map(|_| DelaySlot(&self.waiting))
    }

    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const A: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    const B: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2));

    #[test]
    fn the_allowance_then_one_per_interval() {
        let t = FailureThrottle::new(3, 100);
        let now = Instant::now();
        for _ in 0..3 {
            assert_eq!(t.throttled(A, now), None);
            t.record(A, now);
        }
        // 60 s / 3 = 20 s per failure: the fourth attempt waits for one interval.
        assert_eq!(t.throttled(A, now), Some(Duration::from_secs(20)));
        assert_eq!(
            t.throttled(B, now),
            None,
            "other addresses are not affected"
        );
        let later = now + Duration::from_secs(20);
        assert_eq!(t.throttled(A, later), None, "one attempt after an interval");
        t.record(A, later);
        assert_eq!(t.throttled(A, later), Some(Duration::from_secs(20)));
        // Fully recovered after three intervals of quiet: pruned like an unseen address.
        t.prune(later + Duration::from_secs(59));
        assert_eq!(t.tracked(), 1);
        t.prune(later + Duration::from_secs(60));
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let t = FailureThrottle::new(1, 100);
        let now = Instant::now();
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2:ffff:ffff:ffff:ffff".parse().unwrap();
        let next_64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        t.record(one, now);
        assert!(t.throttled(same_64, now).is_some());
        assert!(t.throttled(next_64, now).is_none());
        t.record(A, now);
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert!(t.throttled(mapped, now).is_some());
        assert_eq!(
            source(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            "::".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn a_full_map_keeps_its_bound_and_makes_room_from_recovered_addresses() {
        let t = FailureThrottle::new(60, 2);
        let now = Instant::now();
        t.record(A, now);
        t.record(B, now);
        let c = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 3));
        t.record(c, now);
        assert_eq!(t.tracked(), 2, "bounded");
        assert_eq!(t.throttled(c, now), None, "untracked");
        // A and B recover after one interval (1 s); the next new address finds room.
        let later = now + Duration::from_secs(2);
        t.record(c, later);
        assert_eq!(t.tracked(), 1);
        assert_eq!(t.throttled(c, later), None, "one failure of 60");
    }

    #[test]
    fn delayed_answers_are_bounded_and_released_on_drop() {
        let d = DelayedAnswers::new(4);
        let a = d.try_hold(true).unwrap();
        let b = d.try_hold(true).unwrap();
        assert!(d.try_hold(true).is_none(), "throttled: half the slots");
        let c = d.try_hold(false).unwrap();
        let e = d.try_hold(false).unwrap();
        assert!(d.try_hold(false).is_none());
        assert_eq!(d.waiting(), 4);
        drop(a);
        assert!(d.try_hold(true).is_none(), "still three waiting");
        let f = d.try_hold(false);
        assert!(f.is_some());
        drop((b, c, e, f));
        assert_eq!(d.waiting(), 0);
    }
}
