//! What an engine that publishes no KV events (`kv_events = false` on a backend) can still
//! hold: the blocks of the prompts this gateway sent it, least recently sent evicted first,
//! never more than the engine's own KV cache holds.
//!
//! The capacity is the engine's: `vllm:cache_config_info`'s `num_gpu_blocks` and `block_size`,
//! read from its `/metrics`. A block the gateway sent more than `num_gpu_blocks` distinct
//! blocks ago is one that cache must have evicted, so it is not believed; until the capacity
//! is known nothing is believed (routing by load alone). vLLM evicts the least recently used
//! free block, and frees a finished request's blocks last block first, so a prompt is stored
//! here tail first: its leading blocks are the last to go, as in the engine.
//!
//! What it cannot see, and what that costs: requests other replicas and other clients send
//! (their blocks evict some of these sooner than the estimate says), blocks in use by running
//! requests (which vLLM does not evict), and an engine restart (its cache emptied). The first
//! and the last make it believe more than the engine holds: routing then sends a request
//! where its prefix was, at worst as no affinity would. With events (the default), none of
//! this applies.
//!
//! Bytes per block: one entry of a linked hash map (`BlockId` and two links, about 40 bytes
//! with the map's control bytes); at most `num_gpu_blocks` (capped at the pool's
//! `kv_events.max_blocks`) entries.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use fleetgate_protocol::kv_events::BlockId;
use hashlink::LruCache;

#[derive(Debug)]
pub(crate) struct Estimate {
    blocks: Mutex<LruCache<BlockId, ()>>,
    /// The engine's KV blocks (0: not known yet).
    capacity: AtomicU64,
    block_size: AtomicU32,
    max_blocks: usize,
    /// `mono_ms()` of the last read of the engine's cache configuration (0: never).
    pub(crate) learned_ms: AtomicU64,
}

impl Estimate {
    pub(crate) fn new(max_blocks: usize) -> Self {
        Self {
            blocks: Mutex::new(LruCache::new(0)),
            capacity: AtomicU64::new(0),
            block_size: AtomicU32::new(0),
            max_blocks,
            learned_ms: AtomicU64::new(0),
        }
    }

    /// The engine's cache, as its `/metrics` says: `num_gpu_blocks` blocks of `block_size`
    /// tokens. A new block size makes every block named so far another one: they are dropped.
    pub(crate) fn learn(&self, num_gpu_blocks: u64, block_size: u32) {
        let cap = usize::try_from(num_gpu_blocks)
            .unwrap_or(usize::MAX)
            .min(self.max_blocks);
        if let Ok(mut blocks) = self.blocks.lock() {
            if self.block_size.swap(block_size, Ordering::Relaxed) != block_size {
                blocks.clear();
            }
            blocks.set_capacity(cap);
        }
        self.capacity.store(cap as u64, Ordering::Relaxed);
        self.learned_ms
            .store(crate::clock::mono_ms().max(1), Ordering::Relaxed);
    }

    pub(crate) fn block_size(&self) -> Option<u32> {
        Some(self.block_size.load(Ordering::Relaxed)).filter(|b| *b > 0)
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Blocks believed held now.
    pub(crate) fn len(&self) -> usize {
        self.blocks.lock().map_or(0, |b| b.len())
    }

    /// Leading blocks of `prompt` believed held.
    pub(crate) fn held(&self, prompt: &[BlockId]) -> usize {
        self.blocks.lock().map_or(0, |b| {
            prompt.iter().take_while(|id| b.contains_key(*id)).count()
        })
    }

    /// The engine was sent `prompt`: it holds its blocks now, most recently used, the
    /// leading ones last to be evicted.
    pub(crate) fn sent(&self, prompt: &[BlockId]) {
        if self.capacity() == 0 {
            return;
        }
        if let Ok(mut blocks) = self.blocks.lock() {
            for id in prompt.iter().rev() {
                blocks.insert(*id, ());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(range: std::ops::Range<u64>) -> Vec<BlockId> {
        range.map(BlockId).collect()
    }

    #[test]
    fn nothing_is_believed_until_the_engines_capacity_is_known() {
        let e = Estimate::new(1 << 20);
        e.sent(&ids(0..8));
        assert_eq!(e.held(&ids(0..8)), 0);
        e.learn(100, 16);
        assert_eq!(e.block_size(), Some(16));
        e.sent(&ids(0..8));
        assert_eq!(e.held(&ids(0..8)), 8);
        assert_eq!(e.held(&ids(0..4)), 4, "a shorter prompt");
        assert_eq!(
            e.held(&[BlockId(0), BlockId(99)]),
            1,
            "a prompt that goes on otherwise"
        );
    }

    /// A cache of 10 blocks cannot hold what was sent 10 blocks ago; of a prompt that did not
    /// fit, the leading blocks stay (vLLM frees a finished request's blocks tail first).
    #[test]
    fn blocks_a_cache_of_that_size_must_have_evicted_are_not_believed() {
        let e = Estimate::new(1 << 20);
        e.learn(10, 16);
        e.sent(&ids(0..6));
        e.sent(&ids(100..106));
        assert_eq!(e.held(&ids(100..106)), 6);
        assert_eq!(
            e.held(&ids(0..6)),
            4,
            "the first prompt's last two blocks went first"
        );
        assert_eq!(e.len(), 10);
        // Sending the first one again makes it the most recent.
        e.sent(&ids(0..6));
        assert_eq!(e.held(&ids(0..6)), 6);
        assert_eq!(e.held(&ids(100..106)), 4);
        // A prompt larger than the cache keeps its leading blocks.
        e.sent(&ids(200..230));
        assert_eq!(e.held(&ids(200..230)), 10);
        assert_eq!(e.held(&ids(0..6)), 0);
        // A smaller cache (a restarted engine with less memory) drops the oldest; a new block
        // size drops everything.
        e.learn(4, 16);
        assert_eq!(e.held(&ids(200..230)), 4);
        e.learn(4, 32);
        assert_eq!(e.held(&ids(200..230)), 0);
    }

    #[test]
    fn the_pools_bound_caps_the_engines_capacity() {
        let e = Estimate::new(1024);
        e.learn(1 << 40, 16);
        assert_eq!(e.capacity(), 1024);
        e.sent(&ids(0..5000));
        assert_eq!(e.len(), 1024);
    }
}
