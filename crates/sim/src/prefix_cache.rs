//! The simulated prefix cache: KV blocks of a prompt's tokens, hashed in a chain as vLLM's
//! automatic prefix caching does, kept in LRU order within a token budget, so a repeated
//! prefix skips its prefill.
//!
//! As vLLM, a prompt's blocks are looked up when its request starts and enter the cache (and
//! the KV events) when its prefill has computed them, so two identical prompts prefilling at
//! once both miss (with zero delays, where no scheduler runs, they enter at once).
//! Simplifications against vLLM: a prompt's blocks enter together when its whole prefill is
//! done (vLLM caches each chunk as it is computed), and blocks of running sequences are
//! evictable like any other.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::kv_events::event_token;
use super::lora::LoraAdapter;
use super::tokens::{fnv1a, mix64, pieces, token_id};

/// A prompt's full KV blocks: their hashes, and (when the cache's changes are published) the
/// token ids of those blocks as events carry them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PromptBlocks {
    pub(crate) hashes: Vec<u64>,
    pub(crate) tokens: Vec<u32>,
}

/// The hash of every full block of `ids`, each covering the previous block's hash and its own
/// token ids, so a block matches only behind the same whole prefix. A tail shorter than a
/// block is never cached. `keep_tokens`: also the blocks' token ids.
pub(crate) fn blocks(
    ids: impl Iterator<Item = u64>,
    block_size: u32,
    keep_tokens: bool,
) -> PromptBlocks {
    let block = usize::try_from(block_size.max(1)).unwrap_or(usize::MAX);
    let mut out = PromptBlocks::default();
    let mut pending = Vec::new();
    let mut prev = 0u64;
    let mut in_block = 0usize;
    let mut h = 0u64;
    for id in ids {
        if in_block == 0 {
            h = mix64(prev);
        }
        h = fnv1a(h, &id.to_le_bytes());
        if keep_tokens {
            pending.push(event_token(id));
        }
        in_block += 1;
        if in_block == block {
            prev = h;
            out.hashes.push(h);
            out.tokens.append(&mut pending);
            in_block = 0;
        }
    }
    out
}

/// `blocks` of a text prompt as the sim's tokenizer cuts it.
pub(crate) fn text_blocks(text: &str, block_size: u32, keep_tokens: bool) -> PromptBlocks {
    blocks(pieces(text).map(token_id), block_size, keep_tokens)
}

/// A change of the cache, as `--kv-events-config` publishes it.
pub(crate) use crate::kv_events::Change;

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
    /// What changed since the last `take_changes`, when the changes are published.
    changes: Option<Vec<Change>>,
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
            changes: None,
        })
    }

    /// Record what changes from now on (`take_changes`).
    pub(crate) fn record_changes(&mut self) {
        self.changes = Some(Vec::new());
    }

    /// The changes since the last call, in order.
    pub(crate) fn take_changes(&mut self) -> Vec<Change> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Looks a prompt of `prompt_tokens` tokens up by its block hashes and stores its blocks;
    /// returns the tokens found (a multiple of the block size). As vLLM, at least the last
    /// prompt token is always computed, so a prompt that is all cached still pays one block.
    #[cfg(test)]
    pub(crate) fn admit(&mut self, prompt: &PromptBlocks, prompt_tokens: u32) -> u32 {
        let hit = self.lookup(prompt, prompt_tokens);
        self.store(prompt, None);
        hit
    }

    /// The leading prompt tokens of `prompt` the cache holds (a multiple of the block size, at
    /// most the last whole block before the prompt's last token); they become the most recently
    /// used.
    pub(crate) fn lookup(&mut self, prompt: &PromptBlocks, prompt_tokens: u32) -> u32 {
        let bs = self.block_size;
        let usable = usize::try_from(prompt_tokens.saturating_sub(1) / bs).unwrap_or(usize::MAX);
        let hit_blocks = prompt
            .hashes
            .iter()
            .take(usable)
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        self.touch(&prompt.hashes[..hit_blocks]);
        u32::try_from(hit_blocks)
            .unwrap_or(u32::MAX)
            .saturating_mul(bs)
    }

    /// `hashes` become the most recently used, the chain's head last (evicted last).
    fn touch(&mut self, hashes: &[u64]) {
        self.tick += hashes.len() as u64 + 1;
        for (i, h) in hashes.iter().enumerate() {
            let t = self.tick - i as u64;
            if let Some(old) = self.blocks.insert(*h, t) {
                self.lru.remove(&old);
            }
            self.lru.insert(t, *h);
        }
    }

    /// The prompt's blocks, computed, enter the cache (the new ones as one `BlockStored`
    /// behind the block before the first, naming the request's LoRA adapter), least recently
    /// used ones evicted past the budget.
    pub(crate) fn store(&mut self, prompt: &PromptBlocks, adapter: Option<&Arc<LoraAdapter>>) {
        let hashes = &prompt.hashes[..];
        let bs = self.block_size;
        // Ticks run backwards along the chain, so eviction takes a prompt's tail blocks before
        // its head: the prefix others share stays longest.
        self.tick += hashes.len() as u64 + 1;
        // Blocks new to the cache, as one `BlockStored` behind the block before the first.
        let mut new_from = None;
        for (i, h) in hashes.iter().enumerate() {
            let t = self.tick - i as u64;
            match self.blocks.insert(*h, t) {
                Some(old) => {
                    self.lru.remove(&old);
                }
                None => {
                    new_from.get_or_insert(i);
                }
            }
            self.lru.insert(t, *h);
        }
        let bs_len = bs as usize;
        if let (Some(changes), Some(from)) = (self.changes.as_mut(), new_from)
            && prompt.tokens.len() == hashes.len() * bs_len
        {
            changes.push(Change::Stored {
                hashes: hashes[from..].to_vec(),
                parent: from.checked_sub(1).map(|p| hashes[p]),
                tokens: prompt.tokens[from * bs_len..].to_vec(),
                adapter: adapter.cloned(),
            });
        }
        let mut evicted = Vec::new();
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
            evicted.push(h);
        }
        if let Some(changes) = self.changes.as_mut()
            && !evicted.is_empty()
        {
            changes.push(Change::Removed(evicted));
        }
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

    fn block_hashes(ids: impl Iterator<Item = u64>, block_size: u32) -> PromptBlocks {
        blocks(ids, block_size, true)
    }

    #[test]
    fn only_full_blocks_hash_and_a_block_depends_on_its_prefix() {
        let a = block_hashes(ids(40).into_iter(), 16);
        assert_eq!(a.hashes.len(), 2);
        let mut other = ids(40);
        other[0] = 99;
        let b = block_hashes(other.into_iter(), 16);
        assert_ne!(
            a.hashes[1], b.hashes[1],
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

    #[test]
    fn changes_name_the_new_blocks_behind_their_parent_and_the_evicted_ones() {
        let mut c = PrefixCache::new(4, 12).unwrap();
        c.record_changes();
        let a = block_hashes(ids(8).into_iter(), 4);
        c.admit(&a, 9);
        let longer = block_hashes(ids(12).into_iter(), 4);
        c.admit(&longer, 13);
        let changes = c.take_changes();
        let [
            Change::Stored {
                hashes: h1,
                parent: None,
                tokens: t1,
                adapter: None,
            },
            Change::Stored {
                hashes: h2,
                parent: Some(p2),
                tokens: t2,
                adapter: None,
            },
        ] = &changes[..]
        else {
            panic!("{changes:?}")
        };
        assert_eq!((h1, t1), (&a.hashes, &(0..8).collect::<Vec<u32>>()));
        assert_eq!(
            (h2, *p2, t2),
            (
                &longer.hashes[2..].to_vec(),
                a.hashes[1],
                &vec![8, 9, 10, 11]
            )
        );
        let other = block_hashes((100..108).collect::<Vec<_>>().into_iter(), 4);
        c.admit(&other, 9);
        let changes = c.take_changes();
        assert!(
            matches!(&changes[..], [Change::Stored { .. }, Change::Removed(gone)] if gone == &vec![longer.hashes[2], longer.hashes[1]]),
            "the tail goes first: {changes:?}"
        );
    }
}
