//! A token bucket that can give back: token budgets reserve an estimate at the check and
//! settle against the backend's real usage when the response ends. (A GCRA, used for request
//! rates, cannot refund, so token budgets keep their own bucket.)

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Capacity `per_minute` tokens, refilled continuously at `per_minute / 60` per second. The
/// level may go below zero when a request used more than it reserved: later requests wait for
/// the debt to be refilled.
#[derive(Debug)]
pub(crate) struct TokenBucket {
    per_minute: u64,
    state: Mutex<Level>,
}

#[derive(Debug, Clone, Copy)]
struct Level {
    tokens: f64,
    at: Instant,
}

/// The bucket after a successful reservation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Snapshot {
    pub(crate) remaining: u64,
    /// Until the bucket is full again.
    pub(crate) reset: Duration,
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Shortfall {
    /// Enough tokens will be there after this wait.
    Wait(Duration),
    /// The request needs more than the whole budget: it can never pass.
    TooLarge,
}

impl TokenBucket {
    pub(crate) fn new(per_minute: u64) -> Self {
        Self {
            per_minute,
            state: Mutex::new(Level {
                tokens: per_minute as f64,
                at: Instant::now(),
            }),
        }
    }

    pub(crate) fn per_minute(&self) -> u64 {
        self.per_minute
    }

    fn rate_per_sec(&self) -> f64 {
        self.per_minute as f64 / 60.0
    }

    fn refill(&self, l: &mut Level, now: Instant) {
        let dt = now.saturating_duration_since(l.at).as_secs_f64();
        l.tokens = (l.tokens + dt * self.rate_per_sec()).min(self.per_minute as f64);
        l.at = now;
    }

    fn snapshot(&self, l: &Level) -> Snapshot {
        let missing = self.per_minute as f64 - l.tokens;
        Snapshot {
            remaining: l.tokens.max(0.0) as u64,
            reset: Duration::from_secs_f64((missing / self.rate_per_sec()).max(0.0)),
        }
    }

    /// Take `n` tokens if the bucket holds them.
    pub(crate) fn reserve(&self, n: u64) -> Result<Snapshot, Shortfall> {
        if n > self.per_minute {
            return Err(Shortfall::TooLarge);
        }
        let now = Instant::now();
        let mut l = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut l, now);
        let need = n as f64;
        if l.tokens >= need {
            l.tokens -= need;
            Ok(self.snapshot(&l))
        } else {
            let wait = (need - l.tokens) / self.rate_per_sec();
            Err(Shortfall::Wait(Duration::from_secs_f64(wait)))
        }
    }

    /// Settle a reservation: `delta` > 0 gives tokens back (the request used less than it
    /// reserved), < 0 takes more (it used more).
    pub(crate) fn settle(&self, delta: i64) {
        if delta == 0 {
            return;
        }
        let now = Instant::now();
        let mut l = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut l, now);
        l.tokens = (l.tokens + delta as f64).min(self.per_minute as f64);
    }

    /// How long the bucket needs to be full again at its refill rate (its debt included).
    pub(crate) fn until_full(&self) -> Duration {
        let now = Instant::now();
        let mut l = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut l, now);
        let missing = self.per_minute as f64 - l.tokens;
        Duration::from_secs_f64((missing / self.rate_per_sec()).max(0.0))
    }

    /// Set the level to what leaves the bucket `until_full` from full (a debt when that is
    /// more than a minute): another store's view of the key, in this bucket's own measure.
    pub(crate) fn set_until_full(&self, until_full: Duration) {
        let now = Instant::now();
        let mut l = self.state.lock().unwrap_or_else(|p| p.into_inner());
        l.tokens = self.per_minute as f64 - until_full.as_secs_f64() * self.rate_per_sec();
        l.at = now;
    }

    /// The bucket as it is now (for response headers when no tokens are reserved).
    pub(crate) fn peek(&self) -> Snapshot {
        let now = Instant::now();
        let mut l = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut l, now);
        self.snapshot(&l)
    }

    /// Full and untouched for the refill period: nothing would change if it were dropped.
    #[cfg(test)]
    pub(crate) fn is_full(&self) -> bool {
        self.peek().remaining >= self.per_minute
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn reserve_refill_and_settle() {
        let b = TokenBucket::new(600); // 10 tokens per second
        let s = b.reserve(500).unwrap();
        assert_eq!(s.remaining, 100);
        assert_eq!(s.reset, Duration::from_secs(50));
        match b.reserve(200) {
            Err(Shortfall::Wait(w)) => assert_eq!(w, Duration::from_secs(10)),
            other => panic!("{other:?}"),
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(b.reserve(200).unwrap().remaining, 0);
        // The request used 50 of its 200: 150 come back.
        b.settle(150);
        assert_eq!(b.peek().remaining, 150);
        // Another used 300 more than it reserved: the bucket goes into debt.
        b.settle(-300);
        assert_eq!(b.peek().remaining, 0);
        match b.reserve(10) {
            Err(Shortfall::Wait(w)) => assert_eq!(w, Duration::from_secs(16)),
            other => panic!("{other:?}"),
        }
        assert_eq!(b.reserve(601), Err(Shortfall::TooLarge));
        tokio::time::advance(Duration::from_secs(120)).await;
        assert!(b.is_full());
        // Refunds never overfill.
        b.settle(1000);
        assert_eq!(b.peek().remaining, 600);
    }
}
