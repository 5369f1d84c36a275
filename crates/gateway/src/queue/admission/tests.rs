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

fn none() -> Option<u32> {
    None
}

#[tokio::test(start_paused = true)]
async fn prod_before_gray_before_stress() {
    let q = AdmissionQueue::<u32>::new(100, 100);
    let mut stress = q.join(1, Environment::Stress, none).unwrap();
    let mut gray = q.join(2, Environment::Gray, none).unwrap();
    let mut prod = q.join(3, Environment::Prod, none).unwrap();
    assert_eq!(q.waiting(), 3);
    let mut src = Source { free: 1, next: 0 };
    q.dispatch(|| src.take());
    assert_eq!(prod.try_now(), Some(1));
    assert_eq!((gray.try_now(), stress.try_now()), (None, None));
    src.free = 1;
    q.dispatch(|| src.take());
    assert_eq!(gray.try_now(), Some(2));
    src.free = 5;
    q.dispatch(|| src.take());
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
        tickets.push((1, q.join(1, Environment::Stress, none).unwrap()));
    }
    for _ in 0..2 {
        tickets.push((2, q.join(2, Environment::Stress, none).unwrap()));
    }
    tickets.push((3, q.join(3, Environment::Stress, none).unwrap()));
    let mut order = Vec::new();
    for n in 1..=8 {
        let mut src = Source {
            free: 1,
            next: n - 1,
        };
        q.dispatch(|| src.take());
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
    let _a = q.join(1, Environment::Stress, none).unwrap();
    let _b = q.join(1, Environment::Stress, none).unwrap();
    assert_eq!(
        q.join(1, Environment::Stress, none).err(),
        Some(JoinRefused::KeyShare { max_per_key: 2 })
    );
    let _c = q.join(2, Environment::Prod, none).unwrap();
    let _d = q.join(3, Environment::Gray, none).unwrap();
    assert_eq!(
        q.join(4, Environment::Prod, none).err(),
        Some(JoinRefused::Full { max_size: 4 })
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_free_at_join_is_taken_at_once() {
    let q = AdmissionQueue::<u32>::new(4, 2);
    let mut src = Source { free: 1, next: 0 };
    let t = q.join(1, Environment::Stress, || src.take()).unwrap();
    assert_eq!(q.waiting(), 0);
    assert_eq!(t.wait(Duration::ZERO).await, Ok(1));
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_the_wait_and_frees_the_place() {
    let q = AdmissionQueue::<u32>::new(4, 4);
    let t = q.join(1, Environment::Stress, none).unwrap();
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
        let t = q2.join(1, Environment::Prod, none).unwrap();
        t.wait(Duration::from_secs(30)).await
    });
    tokio::task::yield_now().await;
    let mut next = q.join(2, Environment::Stress, none).unwrap();
    assert_eq!(q.waiting(), 2);
    // The client disconnects while its request waits (its future, holding the ticket, is
    // dropped).
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(q.waiting(), 1);
    let mut src = Source { free: 1, next: 0 };
    q.dispatch(|| src.take());
    assert_eq!(next.try_now(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn waiters_are_woken_by_dispatch() {
    let q = std::sync::Arc::new(AdmissionQueue::<u32>::new(4, 4));
    let q2 = q.clone();
    let waiter = tokio::spawn(async move {
        let t = q2.join(1, Environment::Gray, none).unwrap();
        t.wait(Duration::from_secs(30)).await
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(q.waiting(), 1);
    let mut src = Source { free: 1, next: 41 };
    q.dispatch(|| src.take());
    assert_eq!(waiter.await.unwrap(), Ok(42));
}
