//! What one engine (one data-parallel rank of a backend) holds in its prefix cache, as its KV
//! events said: the gateway's own block identities (`BlockId`, chained over the blocks' token
//! ids), and the engine's hash of each, to apply a later removal.
//!
//! Bytes per block: one entry in each of two hash maps (`BlockId` → entry, 16 bytes; engine
//! hash → `BlockId`, 16 bytes), about 40 bytes with the maps' control bytes and load factor,
//! up to twice that just after a map grows. `max_blocks` bounds it: a block stored past it is
//! not indexed (counted in `unplaced`), so the index believes less than the engine holds; when
//! the index is full after a gap, the blocks from before the gap go first.
//!
//! What the index cannot know after lost events: a block evicted while events were lost stays
//! in the index (a phantom), which would make routing believe a hit the engine no longer has.
//! So after a gap every block already indexed is "before the gap": a lookup does not count
//! it, a later `BlockStored` of the same block makes it current again, and once the engine has
//! stored as many blocks as the index can hold since the gap, the blocks still from before
//! are dropped and the index is trusted again. Missed stores only make the index believe
//! less than the engine holds, which routing survives.

use std::collections::HashMap;

use fleetgate_protocol::kv_events::{BlockId, EngineHash, Event, Stored};

/// Whether the index holds everything the engine holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trust {
    /// Every event since the index started (empty) was applied.
    Complete,
    /// Events were lost, or the engine held blocks before the index started, or the index
    /// hit `max_blocks`: lookups count only blocks known since then.
    Partial,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Engine hashes naming this block (the same tokens behind the same prefix, stored under
    /// two hashes, count twice).
    refs: u32,
    /// The era it was last stored in: a lookup counts it only in the current one.
    era: u32,
}

#[derive(Debug)]
pub(crate) struct Index {
    blocks: HashMap<BlockId, Entry>,
    by_engine: HashMap<EngineHash, BlockId>,
    max_blocks: usize,
    era: u32,
    trust: Trust,
    /// Blocks stored since trust was lost.
    stored_since: u64,
    /// Blocks the engine reported that the index could not place: behind a parent it never
    /// saw, or past `max_blocks`.
    pub(crate) unplaced: u64,
    /// The block size the engine reported last.
    pub(crate) block_size: u32,
}

impl Index {
    pub(crate) fn new(max_blocks: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            by_engine: HashMap::new(),
            max_blocks,
            era: 0,
            trust: Trust::Complete,
            stored_since: 0,
            unplaced: 0,
            block_size: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn trust(&self) -> Trust {
        self.trust
    }

    /// Bytes the two maps hold, from their capacities.
    pub(crate) fn bytes(&self) -> usize {
        let per = |size: usize| size + 1;
        self.blocks.capacity() * per(size_of::<(BlockId, Entry)>())
            + self.by_engine.capacity() * per(size_of::<(EngineHash, BlockId)>())
    }

    /// Events were lost (a sequence gap, a missed history): what is indexed now may name
    /// blocks the engine has evicted since.
    pub(crate) fn lose_trust(&mut self) {
        self.trust = Trust::Partial;
        self.era = self.era.wrapping_add(1);
        self.stored_since = 0;
    }

    /// The engine restarted or cleared its cache: it holds nothing.
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.by_engine.clear();
        self.blocks.shrink_to(1024);
        self.by_engine.shrink_to(1024);
        self.era = self.era.wrapping_add(1);
        self.stored_since = 0;
        self.trust = Trust::Complete;
    }

    pub(crate) fn apply(&mut self, event: &Event) {
        match event {
            Event::Stored(s) => self.store(s),
            Event::Removed(r) => {
                // Blocks on another medium (an offloading connector's CPU tier) were never
                // indexed; their hashes are not found.
                for h in &r.hashes {
                    self.remove(*h);
                }
            }
            Event::Cleared => self.clear(),
        }
    }

    fn store(&mut self, s: &Stored) {
        if s.medium.as_deref().is_some_and(|m| m != "GPU") {
            return;
        }
        self.block_size = s.block_size;
        let mut parent = match s.parent {
            None => None,
            Some(p) => match self.by_engine.get(&p) {
                Some(id) => Some(*id),
                None => {
                    self.unplaced += s.hashes.len() as u64;
                    return;
                }
            },
        };
        let bs = s.block_size as usize;
        for (i, (hash, tokens)) in s
            .hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let extra = s.extra_keys.get(i).copied().flatten();
            let id = BlockId::chain(parent, tokens, s.lora_name.as_deref(), extra);
            parent = Some(id);
            self.stored_since += 1;
            if self.by_engine.get(hash) == Some(&id) {
                if let Some(e) = self.blocks.get_mut(&id) {
                    e.era = self.era;
                }
                continue;
            }
            if self.blocks.len() >= self.max_blocks && !self.blocks.contains_key(&id) {
                // Blocks from before a gap are the first to go: they no longer count anyway.
                self.drop_stale();
            }
            if self.blocks.len() >= self.max_blocks && !self.blocks.contains_key(&id) {
                // Not indexed: the index believes less than the engine holds, which is safe.
                self.unplaced += 1;
                continue;
            }
            // A hash reused for another block: the old one is gone.
            self.remove(*hash);
            self.by_engine.insert(*hash, id);
            let era = self.era;
            self.blocks
                .entry(id)
                .and_modify(|e| {
                    e.refs += 1;
                    e.era = era;
                })
                .or_insert(Entry { refs: 1, era });
        }
        if self.trust == Trust::Partial && self.stored_since >= self.max_blocks as u64 {
            self.restore_trust();
        }
    }

    fn remove(&mut self, hash: EngineHash) {
        let Some(id) = self.by_engine.remove(&hash) else {
            return;
        };
        if let Some(e) = self.blocks.get_mut(&id) {
            e.refs -= 1;
            if e.refs == 0 {
                self.blocks.remove(&id);
            }
        }
    }

    /// The engine has stored a whole index's worth since trust was lost: whatever is still
    /// from before has been evicted or stored again, or is dropped now.
    fn restore_trust(&mut self) {
        self.drop_stale();
        self.trust = Trust::Complete;
    }

    /// Drops the blocks last stored before the current era (nothing when trusted).
    fn drop_stale(&mut self) {
        if self.trust == Trust::Complete {
            return;
        }
        let era = self.era;
        self.blocks.retain(|_, e| e.era == era);
        let blocks = &self.blocks;
        self.by_engine.retain(|_, id| blocks.contains_key(id));
    }

    /// Leading blocks of `prompt` the engine holds (as far as the index can tell).
    pub(crate) fn held_prefix(&self, prompt: &[BlockId]) -> usize {
        let era = self.era;
        let complete = self.trust == Trust::Complete;
        prompt
            .iter()
            .take_while(|id| {
                self.blocks
                    .get(id)
                    .is_some_and(|e| complete || e.era == era)
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetgate_protocol::kv_events::Removed;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> Event {
        Event::Stored(Stored {
            hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
            parent: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: bs,
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: vec![None; hashes.len()],
        })
    }

    fn removed(hashes: &[u64]) -> Event {
        Event::Removed(Removed {
            hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
            medium: None,
        })
    }

    fn prompt(tokens: &[u32]) -> Vec<BlockId> {
        BlockId::of_prompt(tokens, 4, None).collect()
    }

    #[test]
    fn blocks_stored_in_pieces_match_the_prompts_own_chain() {
        let mut ix = Index::new(100);
        let t: Vec<u32> = (0..12).collect();
        ix.apply(&stored(&[1], None, &t[..4], 4));
        ix.apply(&stored(&[2, 3], Some(1), &t[4..], 4));
        assert_eq!(ix.held_prefix(&prompt(&t)), 3);
        let mut other = t.clone();
        other[5] = 99;
        assert_eq!(
            ix.held_prefix(&prompt(&other)),
            1,
            "the second block differs"
        );
        ix.apply(&removed(&[2]));
        assert_eq!(
            ix.held_prefix(&prompt(&t)),
            1,
            "a prefix stops at the first miss"
        );
        ix.apply(&Event::Cleared);
        assert_eq!((ix.held_prefix(&prompt(&t)), ix.len()), (0, 0));
    }

    #[test]
    fn a_block_behind_an_unknown_parent_is_not_placed() {
        let mut ix = Index::new(100);
        ix.apply(&stored(&[2], Some(1), &[4, 5, 6, 7], 4));
        assert_eq!((ix.len(), ix.unplaced), (0, 1));
        ix.apply(&removed(&[2, 77]));
    }

    #[test]
    fn after_a_gap_only_blocks_stored_since_count_until_the_cache_turned_over() {
        let mut ix = Index::new(4);
        let t: Vec<u32> = (0..8).collect();
        ix.apply(&stored(&[1, 2], None, &t, 4));
        ix.lose_trust();
        assert_eq!(
            ix.held_prefix(&prompt(&t)),
            0,
            "maybe evicted while events were lost"
        );
        ix.apply(&stored(&[1], None, &t[..4], 4));
        assert_eq!(ix.held_prefix(&prompt(&t)), 1, "stored again since the gap");
        // Three more blocks stored: four since the gap, a whole index's worth.
        let u: Vec<u32> = (100..112).collect();
        ix.apply(&stored(&[10, 11, 12], None, &u, 4));
        assert_eq!(ix.trust(), Trust::Complete);
        assert_eq!(ix.len(), 4, "the block from before the gap was dropped");
        assert_eq!(ix.held_prefix(&prompt(&t)), 1);
    }

    #[test]
    fn max_blocks_bounds_the_index_and_stale_blocks_go_first() {
        let mut ix = Index::new(3);
        let t: Vec<u32> = (0..20).collect();
        ix.apply(&stored(&[1, 2, 3, 4, 5], None, &t, 4));
        assert_eq!((ix.len(), ix.unplaced, ix.trust()), (3, 2, Trust::Complete));
        assert_eq!(ix.held_prefix(&prompt(&t)), 3, "what is indexed is true");
        assert!(ix.bytes() > 0);
        ix.lose_trust();
        let u: Vec<u32> = (100..104).collect();
        ix.apply(&stored(&[9], None, &u, 4));
        assert_eq!(
            (ix.len(), ix.held_prefix(&prompt(&u))),
            (1, 1),
            "the full index dropped the blocks from before the gap"
        );
    }
}
