//! Token ids of the text between a tokenizer's added tokens, remembered, so that an agent's
//! later turn does not tokenize again the history it sent before.
//!
//! A Hugging Face tokenizer first cuts a text at its added tokens (`<|im_start|>`,
//! `<|im_end|>`, `<think>`, …; leftmost, longest match), then normalizes, pre-tokenizes and
//! encodes each stretch between them on its own. So a text's ids are its stretches' ids and the
//! added tokens' ids in order, and a stretch seen before (a message of the history, the system
//! prompt, the tools) has the same ids again. That holds when no added token strips the spaces
//! around it, matches only whole words, or is matched after normalization; a tokenizer with
//! such a token is encoded whole every time (`Segments::new` says `None`).
//!
//! Stretches of at least `MIN_CACHED` bytes are remembered by a 64-bit hash of their bytes and
//! their length, in two generations (the newer takes every insert and a hit found in the older;
//! when the newer holds `max_ids` ids it becomes the older and the oldest is dropped), so at
//! most `2 × max_ids` ids (4 bytes each) are held. The lock is held for a map operation, never
//! while encoding.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

use crate::pool::hash::words64;

/// Shorter stretches are encoded every time: remembering them would cost about what they do.
const MIN_CACHED: usize = 256;

/// A tokenizer's stretches between added tokens, and the ids of those seen before.
pub(crate) struct Segments {
    /// The added tokens, matched leftmost-longest as the tokenizer matches them.
    added: AhoCorasick,
    /// Each added token's id, by pattern index.
    ids: Vec<u32>,
    cache: Mutex<Generations>,
    max_ids: usize,
}

#[derive(Default)]
struct Generations {
    newer: HashMap<(u64, usize), Arc<[u32]>>,
    older: HashMap<(u64, usize), Arc<[u32]>>,
    newer_ids: usize,
}

impl Generations {
    /// Into the newer generation, which first becomes the older when it would pass `max_ids`.
    fn admit(&mut self, key: (u64, usize), ids: Arc<[u32]>, max_ids: usize) {
        if self.newer_ids + ids.len() > max_ids {
            self.older = std::mem::take(&mut self.newer);
            self.newer_ids = 0;
        }
        self.newer_ids += ids.len();
        self.newer.insert(key, ids);
    }
}

impl std::fmt::Debug for Segments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segments")
            .field("added_tokens", &self.ids.len())
            .finish_non_exhaustive()
    }
}

impl Segments {
    /// For `tokenizer`, holding up to `2 × max_ids` ids; `None` when one of its added tokens
    /// makes a stretch's ids depend on its neighbours (lstrip, rstrip, single word, or matched
    /// after normalization), or it has none.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer, max_ids: usize) -> Option<Self> {
        let decoder = tokenizer.get_added_tokens_decoder();
        if decoder.is_empty()
            || decoder
                .values()
                .any(|t| t.lstrip || t.rstrip || t.single_word || t.normalized)
        {
            return None;
        }
        let (ids, texts): (Vec<u32>, Vec<String>) =
            decoder.into_iter().map(|(id, t)| (id, t.content)).unzip();
        let added = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .ok()?;
        Some(Self {
            added,
            ids,
            cache: Mutex::default(),
            max_ids: max_ids.max(1),
        })
    }

    /// `text`'s ids: each stretch between added tokens from the cache or by `encode` (without
    /// special tokens), each added token its id.
    pub(crate) fn encode(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in self.added.find_iter(text) {
            self.stretch(&text[at..m.start()], &encode, &mut out)?;
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.stretch(&text[at..], &encode, &mut out)?;
        Ok(out)
    }

    fn stretch(
        &self,
        s: &str,
        encode: &impl Fn(&str) -> Result<Vec<u32>, String>,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        if s.is_empty() {
            return Ok(());
        }
        if s.len() < MIN_CACHED {
            out.extend(encode(s)?);
            return Ok(());
        }
        let key = (words64(s.as_bytes()), s.len());
        if let Some(ids) = self.lookup(key) {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let ids: Arc<[u32]> = encode(s)?.into();
        out.extend_from_slice(&ids);
        self.insert(key, ids);
        Ok(())
    }

    fn lookup(&self, key: (u64, usize)) -> Option<Arc<[u32]>> {
        let mut g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ids) = g.newer.get(&key) {
            return Some(ids.clone());
        }
        let ids = g.older.remove(&key)?;
        g.admit(key, ids.clone(), self.max_ids);
        Some(ids)
    }

    fn insert(&self, key: (u64, usize), ids: Arc<[u32]>) {
        let mut g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        g.admit(key, ids, self.max_ids);
    }

    /// Ids held now (both generations).
    #[cfg(test)]
    pub(crate) fn held_ids(&self) -> usize {
        let g = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        g.newer
            .values()
            .chain(g.older.values())
            .map(|v| v.len())
            .sum()
    }
}
