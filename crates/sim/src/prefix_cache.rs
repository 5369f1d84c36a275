//! The simulated prefix cache: KV blocks of a prompt's tokens, hashed in a chain as vLLM's
//! automatic prefix caching does, kept in LRU order within a token budget, so a repeated
//! prefix skips its prefill.
//!
//! Simplifications against vLLM, chosen so that hit counts stay predictable for tests: a
//! prompt's blocks enter the cache when its request starts (vLLM caches them as prefill
//! computes them, so two identical prompts sent at the same instant both miss there), and
//! blocks of running sequences are evictable like any other.

use std::collections::{BTreeMap, HashMap};

use super::tokens::{fnv1a, mix64, pieces, token_id};

/// The hash of every full block of `ids`, each covering the previous block's hash and its own
/// token ids, so a block matches only behind the same whole prefix. A tail shorter than a
/// block is never cached.
pub(crate) fn block_hashes(ids: impl Iterator<Item = u64>, block_size: u32) -> Vec<u64> {
    let block = usize::try_from(block_size.max(1)).unwrap_or(usize::MAX);
    let mut out = Vec::new();
    let mut prev = 0u64;
    let mut in_block = 0usize;
    let mut h = 0u64;
    for id in ids {
        if in_block == 0 {
            h = mix64(prev);
        }
        h = fnv1a(h, &id.to_le_bytes());
        in_block += 1;
        if in_block == block {
            prev = h;
            out.push(h);
            in_block = 0;
        }
    }
    out
}

/// `block_hashes` of a text prompt as the sim's tokenizer cuts it.
pub(crate) fn text_block_hashes(text: &str, block_size: u32) -> Vec<u64> {
    block_hashes(pieces(text).map(token_id), block_size)
}

/// Blocks by hash, least recently used first out.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    block_size: u32,
    capacity_blocks: usize,
    /// Block hash → the tick it was last used at.
    blocks: HashMap<u64, u64>,
    /// Tick → block hash; the first entry is the next to evict.
    lru: BTreeMap<u64, u64>,
    tick: u64,
}

impl PrefixCache {
    /// `None` when the budget holds no block: the cache is off.
    pub(crate) fn new(block_size: u32, capacity_tokens: u64) -> Option<Self> {
        let block_size = block_size.max(1);
        let capacity_blocks =
            usize::try_from(capacity_tokens / u64::from(block_size)).unwrap_or(usize::MAX);
        (capacity_blocks > 0).then(|| Self {
            block_size,
            capacity_blocks,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        })
    }

    /// Looks a prompt of `prompt_tokens` tokens up by its block hashes and stores its blocks;
    /// returns the tokens found (a multiple of the block size). As vLLM, at least the last
    /// prompt token is always computed, so a prompt that is all cached still pays one block.
    pub(crate) fn admit(&mut self, hashes: &[u64], prompt_tokens: u32) -> u32 {
        let bs = self.block_size;
        let usable = usize::try_from(prompt_tokens.saturating_sub(1) / bs).unwrap_or(usize::MAX);
        let hit_blocks = hashes
            .iter()
            .take(usable)
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        // Ticks run backwards along the chain, so eviction takes a prompt's tail blocks before
        // its head: the prefix others share stays longest.
        self.tick += hashes.len() as u64 + 1;
        for (i, h) in hashes.iter().enumerate() {
            let t = self.tick - i as u64;
            if let Some(old) = self.blocks.insert(*h, t) {
                self.lru.remove(&old);
            }
            self.lru.insert(t, *h);
        }
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
        }
        u32::try_from(hit_blocks)
            .unwrap_or(u32::MAX)
            .saturating_mul(bs)
    }

    /// Blocks held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<u64> {
        (0..n).collect()
    }

    #[test]
    fn only_full_blocks_hash_and_a_block_depends_on_its_prefix() {
        let a = block_hashes(ids(40).into_iter(), 16);
        assert_eq!(a.len(), 2);
        let mut other = ids(40);
        other[0] = 99;
        let b = block_hashes(other.into_iter(), 16);
        assert_ne!(
            a[1], b[1],
            "same tokens behind another prefix are another block"
        );
    }

    #[test]
    fn repeat_hits_all_but_the_last_token_block() {
        let mut c = PrefixCache::new(16, 1_000).unwrap();
        let h = block_hashes(ids(64).into_iter(), 16);
        assert_eq!(c.admit(&h, 64), 0);
        // 64 tokens: the last one is always computed, so three blocks of four hit.
        assert_eq!(c.admit(&h, 64), 48);
        let longer = block_hashes(ids(100).into_iter(), 16);
        assert_eq!(c.admit(&longer, 100), 64);
    }

    #[test]
    fn evicts_least_recently_used_tail_first() {
        let mut c = PrefixCache::new(16, 64).unwrap();
        let a = block_hashes(ids(64).into_iter(), 16);
        c.admit(&a, 65);
        let b = block_hashes((1000..1032).collect::<Vec<_>>().into_iter(), 16);
        c.admit(&b, 33);
        assert_eq!(c.len(), 4);
        // a's two tail blocks went; its head still hits.
        assert_eq!(c.admit(&a, 65), 32);
    }

    #[test]
    fn zero_budget_is_off() {
        assert!(PrefixCache::new(16, 0).is_none());
        assert!(PrefixCache::new(16, 15).is_none());
    }
}
