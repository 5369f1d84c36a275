//! LoRA adapters: which adapters each backend serves, as its `GET /v1/models` lists them
//! (vLLM's cards with a `parent`, read by the health probes when a backend is new or back from
//! down and every `health.models_interval_ms`), and, per pool, which backends hold each
//! adapter. A request naming an adapter goes only to those backends (`route`).

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde_json::Value;

use super::{Backend, Pool};

/// The adapters one backend serves: each name with its card (for the gateway's `/v1/models`).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Served(Vec<(Arc<str>, Value)>);

impl Served {
    pub(crate) fn from_list(body: &[u8]) -> Self {
        Served(
            fleetgate_protocol::models::adapter_cards(body)
                .into_iter()
                .map(|(name, card)| (Arc::from(name), card))
                .collect(),
        )
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.0.iter().map(|(n, _)| n)
    }

    fn card(&self, name: &str) -> Option<&Value> {
        self.0.iter().find(|(n, _)| **n == *name).map(|(_, c)| c)
    }
}

/// A pool's adapters: each name with the bits of the backends (by position) serving it. Shared
/// by the workers' copies of the pool, replaced whole when a backend's list changes.
#[derive(Debug, Default)]
pub(crate) struct AdapterIndex {
    holders: HashMap<Arc<str>, u64>,
}

impl AdapterIndex {
    /// The index of these backends' adapters (positions past 63 are not routed to: the
    /// balancer's masks have 64 bits).
    pub(crate) fn of(backends: &[Arc<Backend>]) -> Self {
        let mut holders: HashMap<Arc<str>, u64> = HashMap::new();
        for (i, b) in backends.iter().enumerate().take(64) {
            for name in b.adapters().names() {
                *holders.entry(name.clone()).or_default() |= super::bit(i);
            }
        }
        AdapterIndex { holders }
    }

    /// The backends serving `name` (their bits), if any does.
    pub(crate) fn holders(&self, name: &str) -> Option<u64> {
        self.holders.get(name).copied().filter(|h| *h != 0)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.holders.keys()
    }
}

/// The shared cell of a pool's index.
pub(crate) type SharedIndex = Arc<ArcSwap<AdapterIndex>>;

impl Pool {
    /// The backends of this pool serving the adapter `name` (their bits), if any does.
    pub(crate) fn adapter_holders(&self, name: &str) -> Option<u64> {
        let index = self.adapters.load();
        if index.is_empty() {
            return None;
        }
        index.holders(name)
    }

    /// How many backends of this pool serve the adapter `name`.
    pub fn adapter_backends(&self, name: &str) -> u32 {
        self.adapter_holders(name).map_or(0, u64::count_ones)
    }

    /// A backend's list was read: its adapters are kept, and the pool's index rebuilt when they
    /// changed.
    pub(crate) fn learn_adapters(&self, backend: &Backend, served: Served) {
        if **backend.adapters() == served {
            return;
        }
        let names: Vec<&str> = served.names().map(|n| &**n).collect();
        tracing::info!(model = &*self.model, backend = %backend.base, adapters = ?names, "backend's LoRA adapters");
        backend.set_adapters(served);
        self.adapters
            .store(Arc::new(AdapterIndex::of(&self.backends)));
    }

    /// The `/v1/models` cards of the pool's adapters that `allowed` lets through, each a
    /// backend's card with the pool's model as its `parent` (the name clients use), sorted by
    /// name.
    pub(crate) fn adapter_cards(&self, allowed: impl Fn(&str) -> bool) -> Vec<Value> {
        let index = self.adapters.load();
        let mut names: Vec<&Arc<str>> = index.names().filter(|n| allowed(n)).collect();
        names.sort();
        names
            .into_iter()
            .filter_map(|name| {
                let card = self.backends.iter().find_map(|b| {
                    let served = b.adapters();
                    served.card(name).cloned()
                })?;
                let mut card = fleetgate_protocol::models::card(name, Some(&card));
                card["parent"] = Value::from(&*self.model);
                Some(card)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QueueConfig;
    use crate::pool::{Generation, pool_cfg};

    fn list(names: &[&str]) -> Served {
        let data: Vec<Value> = names
            .iter()
            .map(|n| serde_json::json!({"id": n, "root": format!("/a/{n}"), "parent": "m"}))
            .collect();
        Served::from_list(&serde_json::to_vec(&serde_json::json!({"data": data})).unwrap())
    }

    #[test]
    fn an_adapter_is_held_by_the_backends_that_list_it() {
        let pools = Generation::new(&[pool_cfg(3)], &QueueConfig::default()).unwrap();
        let pool = pools.get("m").unwrap();
        assert_eq!(pool.adapter_holders("sql"), None);
        pool.learn_adapters(&pool.backends[0], list(&["sql", "chat"]));
        pool.learn_adapters(&pool.backends[2], list(&["sql"]));
        assert_eq!(pool.adapter_holders("sql"), Some(0b101));
        assert_eq!(pool.adapter_holders("chat"), Some(0b001));
        assert_eq!(pool.adapter_holders("m"), None);
        // Unloaded from the first: only the third holds it.
        pool.learn_adapters(&pool.backends[0], list(&["chat"]));
        assert_eq!(pool.adapter_holders("sql"), Some(0b100));
        let cards = pool.adapter_cards(|n| n != "chat");
        assert_eq!(cards.len(), 1);
        assert_eq!(cards[0]["id"], "sql");
        assert_eq!(cards[0]["parent"], "m");
        assert_eq!(cards[0]["root"], "/a/sql");
    }
}
