//! Queue ordering, fairness, bounds, deadlines and cancellation, with paused time.

use std::time::Duration;

use super::*;

/// A source of numbered slots, `free` of them available.
struct Source {
    free: usize,
    next: u32,
}

impl Source {
    fn take(&mut self) -> Option<u32> {
        if self.free == 0 {
            return None;
        }
        self.free -= 1;
        self.next += 1;
        Some(self.next)
    }
}

fn none(_: u64) -> Option<u32> {
    None
}

#[tokio::test(start_paused = true)]
async fn prod_before_gray_before_stress() {
    let q = AdmissionQueue::<u32>::new(100, 100);
    let mut stress = q.join(1, Environment::Stress, 0, none).unwrap();
    let mut gray = q.join(2, Environment::Gray, 0, none).unwrap();
    let mut prod = q.join(3, Environment::Prod, 0, none).unwrap();
    assert_eq!(q.waiting(), 3);
    let mut src = Source { free: 1, next: 0 };
    q.dispatch(|_| src.take());
    assert_eq!(prod.try_now(), Some(1));
    assert_eq!((gray.try_now(), stress.try_now()), (None, None));
    src.free = 1;
    q.dispatch(|_| src.take());
    assert_eq!(gray.try_now(), Some(2));
    src.free = 5;
    q.dispatch(|_| src.take());
    assert_eq!(stress.try_now(), Some(3));
    // Slots left over when nobody waits stay with the source.
    assert_eq!(src.free, 4);
    assert_eq!(q.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn keys_take_turns_within_a_class() {
    let q = AdmissionQueue::<u32>::new(100, 100);
    let mut tickets = Vec::new();
    for _ in 0..5 {
        tickets.push((1, q.join(1, Environment::Stress, 0, none).unwrap()));
    }
    for _ in 0..2 {
        tickets.push((2, q.join(2, Environment::Stress, 0, none).unwrap()));
    }
    tickets.push((3, q.join(3, Environment::Stress, 0, none).unwrap()));
    let mut order = Vec::new();
    for n in 1..=8 {
        let mut src = Source {
            free: 1,
            next: n - 1,
        };
        q.dispatch(|_| src.take());
        for (k, t) in &mut tickets {
            if t.try_now().is_some() {
                order.push(*k);
            }
        }
    }
    // The flooding key 1 gets every third slot, not the first five.
    assert_eq!(order, [1, 2, 3, 1, 2, 1, 1, 1]);
}

#[tokio::test(start_paused = true)]
async fn bounded_overall_and_per_key() {
    let q = AdmissionQueue::<u32>::new(4, 2);
    let _a = q.join(1, Environment::Stress, 0, none).unwrap();
    let _b = q.join(1, Environment::Stress, 0, none).unwrap();
    assert_eq!(
        q.join(1, Environment::Stress, 0, none).err(),
        Some(JoinRefused::KeyShare { max_per_key: 2 })
    );
    let _c = q.join(2, Environment::Prod, 0, none).unwrap();
    let _d = q.join(3, Environment::Gray, 0, none).unwrap();
    assert_eq!(
        q.join(4, Environment::Prod, 0, none).err(),
        Some(JoinRefused::Full { max_size: 4 })
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_free_at_join_is_taken_at_once() {
    let q = AdmissionQueue::<u32>::new(4, 2);
    let mut src = Source { free: 1, next: 0 };
    let t = q.join(1, Environment::Stress, 0, |_| src.take()).unwrap();
    assert_eq!(q.waiting(), 0);
    assert_eq!(t.wait(Duration::ZERO).await, Ok(1));
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_the_wait_and_frees_the_place() {
    let q = AdmissionQueue::<u32>::new(4, 4);
    let t = q.join(1, Environment::Stress, 0, none).unwrap();
    let started = tokio::time::Instant::now();
    assert_eq!(t.wait(Duration::from_secs(5)).await, Err(TimedOut));
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(q.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_leaves_at_once_and_the_next_one_is_served() {
    let q = std::sync::Arc::new(AdmissionQueue::<u32>::new(4, 4));
    let q2 = q.clone();
    let waiting = tokio::spawn(async move {
        let t = q2.join(1, Environment::Prod, 0, none).unwrap();
        t.wait(Duration::from_secs(30)).await
    });
    tokio::task::yield_now().await;
    let mut next = q.join(2, Environment::Stress, 0, none).unwrap();
    assert_eq!(q.waiting(), 2);
    // The client disconnects while its request waits (its future, holding the ticket, is
    // dropped).
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(q.waiting(), 1);
    let mut src = Source { free: 1, next: 0 };
    q.dispatch(|_| src.take());
    assert_eq!(next.try_now(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn waiters_are_woken_by_dispatch() {
    let q = std::sync::Arc::new(AdmissionQueue::<u32>::new(4, 4));
    let q2 = q.clone();
    let waiter = tokio::spawn(async move {
        let t = q2.join(1, Environment::Gray, 0, none).unwrap();
        t.wait(Duration::from_secs(30)).await
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(q.waiting(), 1);
    let mut src = Source { free: 1, next: 41 };
    q.dispatch(|_| src.take());
    assert_eq!(waiter.await.unwrap(), Ok(42));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_fits_only_some_slots_is_passed_over_until_one_of_them_is_free() {
    let q = AdmissionQueue::<u32>::new(10, 10);
    // Slots are numbered by backend: 1 and 2. Backend 1 is busy; 2 is free.
    let free = std::cell::RefCell::new(vec![2u32]);
    let take = |only: u64| {
        let mut f = free.borrow_mut();
        let at = f.iter().position(|b| only == 0 || only & (1 << b) != 0)?;
        Some(f.remove(at))
    };
    // A prod request that fits only backend 1 waits before a stress request that fits any.
    let mut adapter = q.join(1, Environment::Prod, 1 << 1, none).unwrap();
    let mut any = q.join(2, Environment::Stress, 0, none).unwrap();
    q.dispatch(take);
    assert_eq!(adapter.try_now(), None, "backend 2 does not fit it");
    assert_eq!(
        any.try_now(),
        Some(2),
        "the waiter after it takes backend 2"
    );
    assert_eq!(q.waiting(), 1);
    // Backend 1 frees: the adapter's request gets it.
    free.borrow_mut().push(1);
    q.dispatch(take);
    assert_eq!(adapter.try_now(), Some(1));
    assert_eq!(q.waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn waiters_that_fit_any_slot_keep_their_order_and_turns() {
    let q = AdmissionQueue::<u32>::new(10, 10);
    let mut a1 = q.join(1, Environment::Stress, 0, none).unwrap();
    let mut a2 = q.join(1, Environment::Stress, 0, none).unwrap();
    let mut b1 = q.join(2, Environment::Stress, 0, none).unwrap();
    let mut src = Source { free: 2, next: 0 };
    q.dispatch(|_| src.take());
    // Keys take turns: key 1's first, then key 2's, then key 1's second.
    assert_eq!(a1.try_now(), Some(1));
    assert_eq!(b1.try_now(), Some(2));
    assert_eq!(a2.try_now(), None);
}
