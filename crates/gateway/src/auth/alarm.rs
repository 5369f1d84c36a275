//! A precise alarm for held-back refusals: one thread sleeps until the earliest deadline and
//! wakes the requests that wait for it, so a refusal leaves at its deadline whatever the request
//! did before (looked a key up in the store, or not).
//!
//! Why not `tokio::time::sleep`: tokio's timer counts whole milliseconds from the moment its
//! event loop last went idle, so on a quiet worker the wake-up keeps the sub-millisecond phase
//! of that moment — which is when the key check ended. The measured difference between an
//! unknown key id and a wrong secret survived a 100 ms tokio sleep unchanged (docs/benchmarks.md,
//! "Brute force and timing"). Here the wake-up comes from another thread at the deadline
//! itself.
//!
//! One thread per `Alarm` (one per gateway), started on first use and stopped when the alarm
//! is dropped; entries are one per waiting refusal, bounded by `auth.max_delayed_answers`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Instant;

struct Entry {
    at: Instant,
    /// Breaks ties, so entries with the same deadline are still distinct.
    seq: u64,
    waker: Waker,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct State {
    due: BinaryHeap<Reverse<Entry>>,
    seq: u64,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent whatever panicked while holding it (pushes and pops only).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread: wake every entry that is due, sleep until the next deadline or a new
    /// earlier one.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            if state.stop {
                return;
            }
            let now = Instant::now();
            if state.due.peek().is_some_and(|Reverse(e)| e.at <= now) {
                let due = state.due.pop();
                // Woken outside the lock: whatever waking runs (or drops) cannot reach it.
                drop(state);
                if let Some(Reverse(e)) = due {
                    e.waker.wake();
                }
                state = self.lock();
                continue;
            }
            state = match state.due.peek() {
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(Reverse(e)) => {
                    let wait = e.at.saturating_duration_since(now);
                    self.changed
                        .wait_timeout(state, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

/// Wakes waiting refusals at their deadlines, from its own thread.
#[derive(Default)]
pub(super) struct Alarm {
    shared: Arc<Shared>,
    /// The thread, once started; `None` inside when it could not be started.
    thread: OnceLock<Option<JoinHandle<()>>>,
}

impl Alarm {
    /// Resolves at `at` (at once when it has passed).
    pub(super) fn at(&self, at: Instant) -> Ring<'_> {
        Ring {
            alarm: self,
            at,
            waker: None,
            fallback: None,
        }
    }

    /// Whether the thread runs (started here on first use).
    fn running(&self) -> bool {
        self.thread
            .get_or_init(|| {
                let shared = self.shared.clone();
                std::thread::Builder::new()
                    .name("fleetgate-auth-alarm".into())
                    .spawn(move || shared.run())
                    .map_err(|e| {
                        tracing::error!(
                            error = %e,
                            "cannot start the thread that times delayed refusals: \
                             refusals are delayed on the event loop's millisecond timer"
                        );
                    })
                    .ok()
            })
            .is_some()
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_one();
        if let Some(Some(thread)) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

/// The wait for one deadline.
pub(super) struct Ring<'a> {
    alarm: &'a Alarm,
    at: Instant,
    /// The waker registered with the alarm, so a repeated poll registers again only when the
    /// task's waker changed.
    waker: Option<Waker>,
    /// The runtime's timer, when the alarm thread could not be started.
    fallback: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Future for Ring<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.at {
            return Poll::Ready(());
        }
        if self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return Poll::Pending;
        }
        if !self.alarm.running() {
            // No thread: the runtime's timer (coarser, see the module comment).
            let at = self.at;
            return self
                .fallback
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())))
                .as_mut()
                .poll(cx);
        }
        let waker = cx.waker().clone();
        let shared = &self.alarm.shared;
        let earliest = {
            let mut state = shared.lock();
            state.seq += 1;
            let seq = state.seq;
            let earliest = state.due.peek().is_none_or(|Reverse(e)| self.at < e.at);
            state.due.push(Reverse(Entry {
                at: self.at,
                seq,
                waker: waker.clone(),
            }));
            earliest
        };
        if earliest {
            shared.changed.notify_one();
        }
        self.waker = Some(waker);
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn rings_at_each_deadline_in_order_and_stops_when_dropped() {
        let alarm = Alarm::default();
        let start = Instant::now();
        let late = start + Duration::from_millis(60);
        let early = start + Duration::from_millis(20);
        // Registered late first: the thread must wake up earlier for the new earliest.
        let (a, b) = tokio::join!(
            async {
                alarm.at(late).await;
                Instant::now()
            },
            async {
                tokio::task::yield_now().await;
                alarm.at(early).await;
                Instant::now()
            }
        );
        assert!(a >= late && b >= early);
        alarm.at(start).await;
        assert!(alarm.shared.lock().due.is_empty());
        drop(alarm);
    }
}
