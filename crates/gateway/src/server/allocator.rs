//! What a runtime thread gives back when it runs out of work.
//!
//! jemalloc keeps a cache per thread of what the thread freed, for its next allocations, and
//! trims it only as the thread allocates again. A worker that relayed a burst of streams and
//! then went quiet would hold what the burst freed into it (about 3 MB over the threads after
//! 5 000 streams, docs/benchmarks.md "What stays") for as long as it stays quiet. The binary
//! hands its allocator's release to [`set_release`]; every runtime thread of the gateway calls
//! [`parked`] as it parks, and the release runs there at most once per [`INTERVAL`] per thread.
//! A busy worker releases at most once a second, however often it parks; one whose work has
//! ended releases what that work freed at its next park, and the wake-ups of an idle worker
//! (its pool's sweep, each second) then find its cache empty.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Shortest time between two releases on one thread.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

static RELEASE: OnceLock<fn()> = OnceLock::new();

thread_local! {
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Sets what a parking thread releases (once per process; later calls are ignored).
pub fn set_release(release: fn()) {
    let _ = RELEASE.set(release);
}

/// A runtime's `on_thread_park` hook: runs the release when this thread last ran it at least
/// [`INTERVAL`] ago. Without a release set (a build without jemalloc, the tests' servers) it
/// returns at once.
pub fn parked() {
    let Some(release) = RELEASE.get() else {
        return;
    };
    let now = Instant::now();
    let due = LAST.with(|last| {
        let due = last.get().is_none_or(|t| now.duration_since(t) >= INTERVAL);
        if due {
            last.set(Some(now));
        }
        due
    });
    if due {
        release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static RELEASED: Cell<u32> = const { Cell::new(0) };
    }

    fn count_release() {
        RELEASED.with(|n| n.set(n.get() + 1));
    }

    #[test]
    fn a_thread_releases_on_its_first_park_then_once_per_interval() {
        set_release(count_release);
        // A thread of its own: its last release and its count start empty.
        std::thread::spawn(|| {
            let released = || RELEASED.with(Cell::get);
            parked();
            assert_eq!(released(), 1, "the first park releases");
            parked();
            parked();
            assert_eq!(released(), 1, "parks within the interval do not");
            LAST.with(|last| last.set(Some(Instant::now() - INTERVAL)));
            parked();
            assert_eq!(released(), 2, "a park an interval later does");
        })
        .join()
        .unwrap();
    }
}
