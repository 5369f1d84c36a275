//! The admission queue itself: when every backend that could serve a request is at capacity, the
//! request waits here instead of piling up inside vLLM. prod is served before gray before
//! stress; within an environment, keys take turns (round robin), and one key may hold at most
//! `queue.max_per_key` places. A waiter leaves the moment its request is dropped (deadline or
//! client disconnect).
//!
//! The queue is generic over the slot it hands out (a backend in-flight slot in the gateway)
//! so its ordering can be tested on its own. Slots are handed over directly: whoever frees a
//! slot calls `dispatch`, which gives it to the next waiter without it ever being visible to
//! a newcomer, so waiting requests are never overtaken.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::key::Environment;

/// Why a request could not join the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JoinRefused {
    /// `max_size` requests are already waiting.
    Full { max_size: usize },
    /// This key already holds `max_per_key` places.
    KeyShare { max_per_key: usize },
}

struct Waiter<T> {
    id: u64,
    tx: oneshot::Sender<T>,
    /// The slots it may take, as the bits of the backends whose slots fit (0: any), passed to
    /// `take` (a request for a LoRA adapter fits only the backends holding it).
    only: u64,
}

struct KeyLine<T> {
    key: i64,
    waiters: VecDeque<Waiter<T>>,
}

struct State<T> {
    /// By `Environment::index()`; served from the highest index (prod) down.
    classes: [VecDeque<KeyLine<T>>; 3],
    len: usize,
    next_id: u64,
}

pub struct AdmissionQueue<T> {
    state: Mutex<State<T>>,
    /// Waiters in the queue; read without the lock by whoever frees a slot.
    waiting: AtomicUsize,
    max_size: usize,
    max_per_key: usize,
    depth: std::sync::OnceLock<prometheus::IntGauge>,
}

impl<T> std::fmt::Debug for AdmissionQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionQueue")
            .field("waiting", &self.waiting())
            .field("max_size", &self.max_size)
            .finish()
    }
}

/// The serving order of the classes.
const PRIORITY: [Environment; 3] = [Environment::Prod, Environment::Gray, Environment::Stress];

impl<T> AdmissionQueue<T> {
    pub(crate) fn new(max_size: usize, max_per_key: usize) -> Self {
        Self {
            state: Mutex::new(State {
                classes: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
                len: 0,
                next_id: 0,
            }),
            waiting: AtomicUsize::new(0),
            max_size,
            max_per_key,
            depth: std::sync::OnceLock::new(),
        }
    }

    /// Show the queue's length in this gauge from now on.
    pub(crate) fn set_depth_gauge(&self, g: prometheus::IntGauge) {
        let _ = self.depth.set(g);
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn has_waiters(&self) -> bool {
        self.waiting() > 0
    }

    /// Requests of `class` wait (a newcomer of that class must not pass them).
    pub(crate) fn has_waiters_in(&self, class: Environment) -> bool {
        self.has_waiters() && !self.lock().classes[class.index()].is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Join the queue, then hand out whatever `take` can give right away (a slot freed since
    /// the caller last looked is not missed: `waiting` is raised before `take` runs, and a
    /// releaser lowers its count before it reads `waiting`).
    pub(crate) fn join(
        &self,
        key: i64,
        class: Environment,
        only: u64,
        take: impl FnMut(u64) -> Option<T>,
    ) -> Result<Ticket<'_, T>, JoinRefused> {
        let leftover;
        let ticket;
        {
            let mut s = self.lock();
            if s.len >= self.max_size {
                return Err(JoinRefused::Full {
                    max_size: self.max_size,
                });
            }
            let lines = &mut s.classes[class.index()];
            let line_at = lines.iter().position(|l| l.key == key);
            if let Some(i) = line_at
                && lines[i].waiters.len() >= self.max_per_key
            {
                return Err(JoinRefused::KeyShare {
                    max_per_key: self.max_per_key,
                });
            }
            let (tx, rx) = oneshot::channel();
            let id = s.next_id;
            s.next_id += 1;
            let lines = &mut s.classes[class.index()];
            match line_at {
                Some(i) => lines[i].waiters.push_back(Waiter { id, tx, only }),
                None => lines.push_back(KeyLine {
                    key,
                    waiters: VecDeque::from([Waiter { id, tx, only }]),
                }),
            }
            s.len += 1;
            self.waiting.fetch_add(1, Ordering::SeqCst);
            leftover = self.dispatch_locked(&mut s, take);
            self.show_depth(&s);
            ticket = Ticket {
                queue: self,
                place: Some(Place { rx, id, key, class }),
            };
        }
        drop(leftover);
        Ok(ticket)
    }

    /// Hand slots from `take` to waiters in priority order until either runs out. Call after
    /// freeing a slot when `has_waiters()`. `take(only)` gives a slot among the backends `only`
    /// names (0: any).
    pub(crate) fn dispatch(&self, take: impl FnMut(u64) -> Option<T>) {
        let leftover = {
            let mut s = self.lock();
            let l = self.dispatch_locked(&mut s, take);
            self.show_depth(&s);
            l
        };
        // Dropped outside the lock: dropping a slot may dispatch again.
        drop(leftover);
    }

    /// Each waiter in order gets a slot it fits. A waiter that fits only some backends and
    /// finds none of theirs free is passed over (its place kept) by the waiters after it, which
    /// may fit another backend; one that fits any slot and finds none ends the round.
    fn dispatch_locked(
        &self,
        s: &mut State<T>,
        mut take: impl FnMut(u64) -> Option<T>,
    ) -> Option<T> {
        // The masks no slot was free for in this round (a few: adapters are few).
        let mut spent = [0u64; 8];
        let mut n_spent = 0;
        while s.len > 0 {
            let Some(at) = next_fitting(s, &spent[..n_spent]) else {
                break;
            };
            let only = waiter_at(s, at).only;
            let Some(slot) = take(only) else {
                if only == 0 || n_spent == spent.len() {
                    break;
                }
                spent[n_spent] = only;
                n_spent += 1;
                continue;
            };
            let w = remove_at(s, at);
            s.len -= 1;
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            if let Err(slot) = w.tx.send(slot) {
                // The waiter is gone (its ticket is being dropped): the slot is freed outside
                // the lock, which hands it to the next waiter that fits it.
                return Some(slot);
            }
        }
        None
    }

    /// Leave the queue (a place detached from its ticket is left this way by its owner).
    pub(crate) fn leave(&self, place: &Place<T>) {
        self.leave_by(place.key, place.class, place.id);
    }

    fn leave_by(&self, key: i64, class: Environment, id: u64) {
        let mut s = self.lock();
        let lines = &mut s.classes[class.index()];
        let Some(i) = lines.iter().position(|l| l.key == key) else {
            return;
        };
        let Some(j) = lines[i].waiters.iter().position(|w| w.id == id) else {
            return;
        };
        lines[i].waiters.remove(j);
        if lines[i].waiters.is_empty() {
            lines.remove(i);
        }
        s.len -= 1;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.show_depth(&s);
    }

    fn show_depth(&self, s: &State<T>) {
        if let Some(g) = self.depth.get() {
            g.set(i64::try_from(s.len).unwrap_or(i64::MAX));
        }
    }
}

/// Where a waiter is: its class, its key's line in the class, its place in the line.
#[derive(Clone, Copy)]
struct At {
    class: usize,
    line: usize,
    waiter: usize,
}

/// The next waiter whose mask is not `spent`: highest class first; within it the keys in ring
/// order from the front, each key's waiters in order.
fn next_fitting<T>(s: &State<T>, spent: &[u64]) -> Option<At> {
    for env in PRIORITY {
        let class = env.index();
        for (line, l) in s.classes[class].iter().enumerate() {
            if let Some(waiter) = l.waiters.iter().position(|w| !spent.contains(&w.only)) {
                return Some(At {
                    class,
                    line,
                    waiter,
                });
            }
        }
    }
    None
}

fn waiter_at<T>(s: &State<T>, at: At) -> &Waiter<T> {
    &s.classes[at.class][at.line].waiters[at.waiter]
}

/// Take the waiter `at` out. The key at the front of the ring that is served moves to the back
/// if it still has waiters (keys take turns); a key further back keeps its place.
fn remove_at<T>(s: &mut State<T>, at: At) -> Waiter<T> {
    let lines = &mut s.classes[at.class];
    let Some(w) = lines[at.line].waiters.remove(at.waiter) else {
        unreachable!("`at` was found in this state, under the same lock");
    };
    if lines[at.line].waiters.is_empty() {
        lines.remove(at.line);
    } else if at.line == 0
        && let Some(front) = lines.pop_front()
    {
        lines.push_back(front);
    }
    w
}

/// A place in the queue. Dropping it leaves the queue at once.
pub(crate) struct Ticket<'a, T> {
    queue: &'a AdmissionQueue<T>,
    place: Option<Place<T>>,
}

/// A place without the borrow of its queue: whoever holds it must call
/// `AdmissionQueue::leave` when dropping it (see `queue::Waiting`).
pub(crate) struct Place<T> {
    rx: oneshot::Receiver<T>,
    id: u64,
    key: i64,
    class: Environment,
}

/// The wait ended without a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimedOut;

impl<T> Place<T> {
    /// Wait for a slot, at most `max_wait`.
    pub(crate) async fn recv(&mut self, max_wait: Duration) -> Result<T, TimedOut> {
        match tokio::time::timeout(max_wait, &mut self.rx).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => Err(TimedOut),
        }
    }

    /// The slot if it was handed over already (no waiting).
    pub(crate) fn try_now(&mut self) -> Option<T> {
        self.rx.try_recv().ok()
    }
}

impl<T> Ticket<'_, T> {
    /// Wait for a slot, at most `max_wait`.
    #[cfg(test)]
    pub(crate) async fn wait(mut self, max_wait: Duration) -> Result<T, TimedOut> {
        match self.place.as_mut() {
            Some(p) => p.recv(max_wait).await,
            None => Err(TimedOut),
        }
    }

    /// The slot if it was handed over already (no waiting).
    pub(crate) fn try_now(&mut self) -> Option<T> {
        self.place.as_mut().and_then(Place::try_now)
    }

    /// The place, for an owner that outlives this borrow; it must leave the queue itself.
    pub(crate) fn detach(mut self) -> Option<Place<T>> {
        self.place.take()
    }
}

impl<T> Drop for Ticket<'_, T> {
    fn drop(&mut self) {
        // Leave first; a slot that raced into the place is dropped with it afterwards
        // (outside the lock), which passes it on.
        if let Some(p) = &self.place {
            self.queue.leave(p);
        }
    }
}

#[cfg(test)]
mod tests;
