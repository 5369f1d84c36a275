//! What each engine's prefix cache holds, from the engines' own KV events (`[pools.kv_events]`):
//! one subscriber per backend and data-parallel rank reads vLLM's ZeroMQ publisher, applies
//! each batch to that rank's `Index`, and says how far the index can be trusted.
//!
//! - A sequence gap (batches the PUB socket dropped, a reconnect that missed some) is filled
//!   from the engine's replay endpoint when the pool names one; what the replay no longer
//!   holds makes the index `Partial` (see `index`).
//! - A sequence lower than the last one is a new publisher (the engine restarted, so its cache
//!   is empty): the index is cleared, and the history from sequence 0 is asked of the replay.
//! - A payload that does not decode is counted and skipped, and counts as a lost batch.
//! - A subscriber that cannot connect keeps retrying (100 ms doubling to 5 s); meanwhile the
//!   rank is `down` and its index is left as it was, untrusted from the first batch after.
//!
//! Every replica subscribes itself, so all of them read the same truth without sharing it.
//!
//! A backend whose engine publishes no events (`kv_events = false`) has an `Estimate`
//! instead: what this gateway sent it, within the capacity its `/metrics` reports.

mod cache_config;
mod estimate;
pub(crate) mod index;
pub(crate) mod prompt;
mod segments;
mod subscriber;
mod subscriptions;
pub(crate) mod zmtp;

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::config::KvEventsConfig;
use fleetgate_protocol::kv_events::BlockId;
use index::{Index, Trust};

use subscriber::run_rank;

/// A rank's link to its publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    /// Not connected yet since start.
    Connecting = 0,
    Up = 1,
    /// The connection failed or ended; retrying.
    Down = 2,
}

/// One data-parallel rank of a backend: its index and its subscriber's counters.
#[derive(Debug)]
pub(crate) struct Rank {
    pub(crate) rank: u32,
    /// Where its publisher and replay endpoint are (`host:port`).
    pub(crate) endpoint: String,
    pub(crate) replay: Option<String>,
    pub(crate) index: RwLock<Index>,
    link: AtomicU8,
    /// Batches applied live, applied from the replay, lost (neither), and payloads that did
    /// not decode.
    pub(crate) applied: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) bad: AtomicU64,
    /// Times the publisher's sequence went back (a restarted engine).
    pub(crate) restarts: AtomicU64,
    /// `mono_ms()` of the last batch applied (0: none yet).
    pub(crate) last_batch_ms: AtomicU64,
    /// Why the rank is down or partial, for `/admin/ready`.
    pub(crate) detail: arc_swap::ArcSwapOption<String>,
}

impl Rank {
    pub(crate) fn link(&self) -> Link {
        match self.link.load(Ordering::Relaxed) {
            1 => Link::Up,
            2 => Link::Down,
            _ => Link::Connecting,
        }
    }

    pub(crate) fn set_link(&self, link: Link) {
        self.link.store(link as u8, Ordering::Relaxed);
    }

    /// `live` (connected, index complete), `partial` (connected, index incomplete: see
    /// `index`), `down` or `connecting`.
    pub(crate) fn state(&self) -> &'static str {
        match self.link() {
            Link::Connecting => "connecting",
            Link::Down => "down",
            Link::Up => match self.index.read().map(|i| i.trust()) {
                Ok(Trust::Complete) => "live",
                _ => "partial",
            },
        }
    }

    fn json(&self) -> serde_json::Value {
        let (blocks, bytes, unplaced, block_size) = self
            .index
            .read()
            .map(|i| (i.len(), i.bytes(), i.unplaced, i.block_size))
            .unwrap_or_default();
        let last = self.last_batch_ms.load(Ordering::Relaxed);
        serde_json::json!({
            "rank": self.rank,
            "endpoint": format!("tcp://{}", self.endpoint),
            "replay_endpoint": self.replay.as_ref().map(|r| format!("tcp://{r}")),
            "state": self.state(),
            "detail": self.detail.load().as_deref().map(String::as_str),
            "blocks": blocks,
            "index_bytes": bytes,
            "block_size": (block_size > 0).then_some(block_size),
            "batches": self.applied.load(Ordering::Relaxed),
            "replayed": self.replayed.load(Ordering::Relaxed),
            "lost": self.lost.load(Ordering::Relaxed),
            "bad_payloads": self.bad.load(Ordering::Relaxed),
            "unplaced_blocks": unplaced,
            "restarts": self.restarts.load(Ordering::Relaxed),
            "last_batch_seconds_ago": (last > 0)
                .then(|| crate::clock::mono_ms().saturating_sub(last) as f64 / 1e3),
        })
    }
}

/// One backend's engines: their events' ranks, or (no events) the estimate.
#[derive(Debug)]
pub(crate) struct EngineCache {
    pub(crate) ranks: Box<[Arc<Rank>]>,
    pub(crate) estimate: Option<Estimate>,
}

pub(crate) use estimate::Estimate;

impl EngineCache {
    /// Leading blocks of `prompt` the backend's best engine holds: 0 from an engine whose
    /// events do not arrive (its index is left as it was, and no longer trusted).
    pub(crate) fn held(&self, prompt: &[BlockId]) -> usize {
        if let Some(e) = &self.estimate {
            return e.held(prompt);
        }
        self.ranks
            .iter()
            .filter(|r| r.link() == Link::Up)
            .filter_map(|r| r.index.read().ok().map(|i| i.held_prefix(prompt)))
            .max()
            .unwrap_or(0)
    }

    /// The engines' block size, once an event (or, estimated, their `/metrics`) said it.
    pub(crate) fn block_size(&self) -> Option<u32> {
        if let Some(e) = &self.estimate {
            return e.block_size();
        }
        self.ranks
            .iter()
            .filter_map(|r| r.index.read().ok().map(|i| i.block_size))
            .find(|&b| b > 0)
    }

    /// The backend was sent `prompt`: an estimate now believes it (events say it themselves).
    pub(crate) fn sent(&self, prompt: &[BlockId]) {
        if let Some(e) = &self.estimate {
            e.sent(prompt);
        }
    }

    /// A backend whose engine publishes no events.
    pub(crate) fn estimated(cfg: &KvEventsConfig) -> Self {
        Self {
            ranks: Box::new([]),
            estimate: Some(Estimate::new(cfg.max_blocks)),
        }
    }

    /// The ranks of the backend at `host` (as a URL writes it, IPv6 in brackets), publishing
    /// from `port` (the pool's, or the backend's own) on.
    pub(crate) fn new(host: &str, port: u16, cfg: &KvEventsConfig) -> Self {
        let ranks = (0..cfg.data_parallel_size)
            .map(|r| {
                let replay_offset = cfg
                    .replay_port
                    .zip(cfg.port)
                    .map(|(r, p)| i32::from(r) - i32::from(p));
                let port = u32::from(port) + r;
                Arc::new(Rank {
                    rank: r,
                    endpoint: format!("{host}:{port}"),
                    // The replay endpoint keeps its distance from the publisher's port.
                    replay: replay_offset
                        .map(|off| format!("{host}:{}", i64::from(port) + i64::from(off))),
                    index: RwLock::new(Index::new(cfg.max_blocks)),
                    link: AtomicU8::new(Link::Connecting as u8),
                    applied: AtomicU64::new(0),
                    replayed: AtomicU64::new(0),
                    lost: AtomicU64::new(0),
                    bad: AtomicU64::new(0),
                    restarts: AtomicU64::new(0),
                    last_batch_ms: AtomicU64::new(0),
                    detail: arc_swap::ArcSwapOption::empty(),
                })
            })
            .collect();
        Self {
            ranks,
            estimate: None,
        }
    }

    /// `/admin/ready`'s view: the backend's state (the worst of its ranks') and each rank's.
    pub(crate) fn json(&self) -> serde_json::Value {
        if let Some(e) = &self.estimate {
            let learned = e.learned_ms.load(Ordering::Relaxed);
            return serde_json::json!({
                "state": "estimated",
                "routing": if learned == 0 {
                    "no events, and the engine's cache size is not known yet (vllm:cache_config_info on its /metrics): routed by load alone"
                } else {
                    "no events: the prompts sent to it, within the engine's cache size"
                },
                "blocks": e.len(),
                "num_gpu_blocks": (learned > 0).then(|| e.capacity()),
                "block_size": e.block_size(),
                "cache_config_seconds_ago": (learned > 0)
                    .then(|| crate::clock::mono_ms().saturating_sub(learned) as f64 / 1e3),
            });
        }
        let states: Vec<&str> = self.ranks.iter().map(|r| r.state()).collect();
        let state = ["down", "connecting", "partial", "live"]
            .into_iter()
            .find(|s| states.contains(s))
            .unwrap_or("live");
        serde_json::json!({
            "state": state,
            "routing": match state {
                "live" => "the index is complete",
                "partial" => "events were lost or the history is incomplete: only blocks seen since count",
                _ => "no events: the index is left as it was and no longer trusted",
            },
            "ranks": self.ranks.iter().map(|r| r.json()).collect::<Vec<_>>(),
        })
    }
}
