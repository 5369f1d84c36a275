//! Longest-prefix routing's memory (`[pools.affinity] by = "longest_prefix"`): which backends
//! were last sent each block of prompt text, so that a conversation's next turn — its whole
//! history resent, plus a new message — goes where that history's KV cache is.
//!
//! A prompt is cut into blocks of `block_bytes` and each full block is named by a hash chained
//! over every block before it (as vLLM names its KV blocks), so one name stands for a whole
//! prefix. The index maps names to the few backends that were sent that prefix most recently
//! (its tenants). A lookup walks a prompt's names from the first until one is unknown: the
//! deepest known name is the longest prefix some backend holds. Hashing is linear in the
//! prompt; every lookup and record takes a shard's lock for a few map operations and never
//! across an await.
//!
//! Memory is bounded by size and age: each shard keeps two generations of names; the newer one
//! takes every record, a lookup hit in the older one is moved up, and when the newer one is
//! full or older than half of `max_age` it becomes the older one and the oldest is dropped. So at
//! most `max_blocks` names are held, and a name not used for `max_age` is gone.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::hash::words64_from;
use crate::clock::mono_ms;

const SHARDS: usize = 16;
/// Backends remembered per prefix: the most recent first.
pub(crate) const TENANTS: usize = 4;
const EMPTY: u32 = u32::MAX;

/// The backends (by their stable metrics index) that were last sent a prefix, newest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenants([u32; TENANTS]);

impl Tenants {
    fn new(backend: u32) -> Self {
        let mut t = [EMPTY; TENANTS];
        t[0] = backend;
        Tenants(t)
    }

    /// `backend` becomes the newest tenant (it moves up if it was one).
    fn add(&mut self, backend: u32) {
        let at = self
            .0
            .iter()
            .position(|s| *s == backend)
            .unwrap_or(TENANTS - 1);
        self.0.copy_within(0..at, 1);
        self.0[0] = backend;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied().take_while(|s| *s != EMPTY)
    }

    pub(crate) fn contains(&self, backend: u32) -> bool {
        self.iter().any(|s| s == backend)
    }
}

#[derive(Debug, Default)]
struct Shard {
    newer: HashMap<u64, Tenants>,
    older: HashMap<u64, Tenants>,
    /// `mono_ms()` when `newer` was started.
    since: u64,
}

/// The prefix index of one pool.
#[derive(Debug)]
pub struct PrefixIndex {
    shards: [Mutex<Shard>; SHARDS],
    block_bytes: usize,
    /// Names one generation of one shard holds before it rotates.
    per_generation: usize,
    /// A generation rotates when it is older than this (so a name lives at most twice it).
    rotate_after_ms: u64,
    /// Requests routed to a backend holding their prefix, and the others (no prefix known,
    /// or its backends too loaded: the fallback).
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
}

impl PrefixIndex {
    pub fn new(block_bytes: usize, max_blocks: usize, max_age: Duration) -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::default()),
            block_bytes: block_bytes.max(1),
            per_generation: (max_blocks / SHARDS / 2).max(1),
            rotate_after_ms: u64::try_from(max_age.as_millis() / 2)
                .unwrap_or(u64::MAX)
                .max(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The bytes of text one name stands for.
    pub(crate) fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The chained names of `text`'s full blocks, first block first (a text shorter than one
    /// block has none).
    pub fn names(&self, text: &[u8]) -> Vec<u64> {
        let mut out = Vec::with_capacity(text.len() / self.block_bytes);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for block in text.chunks_exact(self.block_bytes) {
            // Chained, so a name depends on every byte before it as much as on its own.
            h = words64_from(h, block);
            out.push(h);
        }
        out
    }

    fn shard(&self, name: u64) -> &Mutex<Shard> {
        &self.shards[(name >> 60) as usize % SHARDS]
    }

    /// The tenants of each known prefix of `names`, shortest first, up to the first unknown
    /// one.
    pub fn lookup(&self, names: &[u64]) -> Vec<Tenants> {
        let mut out = Vec::new();
        for name in names {
            let mut s = lock(self.shard(*name));
            let found = match s.newer.get(name) {
                Some(t) => Some(*t),
                None => s.older.remove(name).inspect(|t| {
                    s.newer.insert(*name, *t);
                }),
            };
            match found {
                Some(t) => out.push(t),
                None => break,
            }
        }
        out
    }

    /// The backend with metrics index `backend` was sent the prompt of `names`: it holds each
    /// of its prefixes now. Returns how many of the leading names it was known to hold before.
    pub fn record(&self, names: &[u64], backend: u32) -> usize {
        let now = mono_ms();
        let mut held = 0;
        let mut holding = true;
        for name in names {
            let mut s = lock(self.shard(*name));
            if s.newer.len() >= self.per_generation
                || now.saturating_sub(s.since) >= self.rotate_after_ms
            {
                let newer = std::mem::take(&mut s.newer);
                s.older = newer;
                s.since = now;
            }
            let from_older = s.older.remove(name);
            let mut known = true;
            let t = s.newer.entry(*name).or_insert_with(|| {
                known = from_older.is_some();
                from_older.unwrap_or(Tenants::new(backend))
            });
            holding = holding && known && t.contains(backend);
            held += usize::from(holding);
            t.add(backend);
        }
        held
    }

    /// Names held now (both generations): the index's size, for the metrics.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.newer.len() + s.older.len()
            })
            .sum()
    }

    /// Count a routing outcome.
    pub(crate) fn count(&self, hit: bool) {
        let c = if hit { &self.hits } else { &self.misses };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

fn lock(m: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::hash::mix64;

    fn index(max_blocks: usize) -> PrefixIndex {
        PrefixIndex::new(8, max_blocks, Duration::from_secs(600))
    }

    #[test]
    fn a_name_stands_for_its_whole_prefix() {
        let ix = index(1000);
        let a = ix.names(b"system: be brief. user: hello there, friend");
        let b = ix.names(b"system: be brief. user: goodbye now, friend");
        assert_eq!(a.len(), 5);
        // The same first 24 bytes, then they differ: so does every later name.
        assert_eq!(a[..3], b[..3]);
        assert!(a[3..].iter().zip(&b[3..]).all(|(x, y)| x != y));
        assert!(ix.names(b"short").is_empty());
    }

    #[test]
    fn the_longest_known_prefix_and_its_newest_tenants() {
        let ix = index(1000);
        let turn1 = ix.names(b"system prompt shared by all; user: first question");
        let turn2 = ix.names(
            b"system prompt shared by all; user: first question; assistant: answer; user: next",
        );
        assert!(ix.lookup(&turn2).is_empty());
        // What the backend was known to hold before each record: the routing's belief.
        let other = index(1000);
        assert_eq!(other.record(&turn1, 7), 0, "nothing was held before");
        assert_eq!(other.record(&turn1, 7), turn1.len(), "all of it is now");
        assert_eq!(other.record(&turn1, 8), 0, "by backend 7, not by 8");
        assert_eq!(
            other.record(&turn2, 7),
            turn1.len(),
            "turn 2's first blocks"
        );
        ix.record(&turn1, 7);
        let found = ix.lookup(&turn2);
        assert_eq!(found.len(), turn1.len(), "turn 1's whole prompt is known");
        assert_eq!(found.last().unwrap().iter().collect::<Vec<_>>(), [7]);
        // Another conversation on another backend shares only the system prompt.
        let other = ix.names(b"system prompt shared by all; user: something else entirely");
        ix.record(&other, 9);
        let found = ix.lookup(&turn2);
        assert_eq!(found.len(), turn1.len());
        assert!(found[0].contains(9) && found[0].contains(7), "shared block");
        assert_eq!(
            found.last().unwrap().iter().collect::<Vec<_>>(),
            [7],
            "the conversation's own blocks stay on its backend"
        );
        // Tenants are kept newest first, at most TENANTS of them.
        for backend in 10..20 {
            ix.record(&other[..1], backend);
        }
        let t = ix.lookup(&other[..1])[0];
        assert_eq!(t.iter().collect::<Vec<_>>(), [19, 18, 17, 16]);
    }

    #[test]
    fn memory_is_bounded_by_size() {
        // 16 shards × 2 generations × 1 name each at most.
        let ix = index(32);
        for i in 0..10_000u64 {
            ix.record(&[mix64(i)], 1);
        }
        assert!(ix.len() <= 32, "{} names held", ix.len());
        // The most recent are still known.
        assert_eq!(ix.lookup(&[mix64(9_999)]).len(), 1);
    }

    #[test]
    fn memory_is_bounded_by_age() {
        let ix = PrefixIndex::new(8, 1_000_000, Duration::from_millis(2));
        let old = ix.names(b"0123456789abcdef");
        ix.record(&old, 1);
        std::thread::sleep(Duration::from_millis(5));
        // Two rounds of records later (each rotates every shard it touches), the old names are gone.
        for i in 0..512u64 {
            ix.record(&[mix64(i)], 2);
        }
        std::thread::sleep(Duration::from_millis(5));
        for i in 512..1024u64 {
            ix.record(&[mix64(i)], 2);
        }
        assert!(ix.lookup(&old).is_empty());
    }
}
