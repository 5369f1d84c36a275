//! Which subscribers run: one per backend and rank of every pool with `[pools.kv_events]`,
//! started and stopped as reloads and DNS discovery change the backends.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{EngineCache, run_rank};
use crate::config::KvEventsConfig;
use crate::pool::fleet::Fleet;

/// A backend's subscription, by pool model, backend base URL, its publisher port (0: no
/// events, an estimate) and what the pool configures.
type Key = (Arc<str>, Arc<str>, u16, KvEventsConfig);

impl Fleet {
    /// Keeps a subscriber running for every backend of the pools that subscribe to their
    /// engines' KV events, until `stop`; each backend's `engine_cache` is its subscribers'
    /// index (kept across reloads while the backend and its pool's settings stay).
    pub(crate) async fn kv_events_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut changed = self.subscribe();
        let tasks = TaskTracker::new();
        let mut running: HashMap<Key, (Arc<EngineCache>, CancellationToken)> = HashMap::new();
        loop {
            let pools = self.current();
            let mut wanted: HashMap<Key, Arc<EngineCache>> = HashMap::new();
            for p in pools.iter() {
                let Some(cfg) = &p.config().kv_events else {
                    continue;
                };
                for b in &p.backends {
                    // The configuration ensures a port for every backend with events.
                    let port = if b.kv_events {
                        b.kv_events_port.or(cfg.port).unwrap_or(0)
                    } else {
                        0
                    };
                    let key = (p.model.clone(), b.base.clone(), port, cfg.clone());
                    let cache = match running.get(&key) {
                        Some((cache, _)) => cache.clone(),
                        None if port == 0 => {
                            let cache = Arc::new(EngineCache::estimated(cfg));
                            let token = stop.child_token();
                            tasks.spawn(super::cache_config::watch(
                                cache.clone(),
                                p.client.clone(),
                                b.clone(),
                                p.config().health.timeout,
                                token.clone(),
                            ));
                            running.insert(key.clone(), (cache.clone(), token));
                            cache
                        }
                        None => {
                            let host = b
                                .base
                                .parse::<http::Uri>()
                                .ok()
                                .and_then(|u| u.host().map(str::to_owned))
                                .unwrap_or_default();
                            let cache = Arc::new(EngineCache::new(&host, port, cfg));
                            let token = stop.child_token();
                            for rank in cache.ranks.iter() {
                                tasks.spawn(run_rank(
                                    rank.clone(),
                                    Arc::from(cfg.topic.as_str()),
                                    p.model.clone(),
                                    b.base.clone(),
                                    token.clone(),
                                ));
                            }
                            running.insert(key.clone(), (cache.clone(), token));
                            cache
                        }
                    };
                    b.engine_cache.store(Some(cache.clone()));
                    wanted.insert(key, cache);
                }
            }
            running.retain(|key, (_, token)| {
                let keep = wanted.contains_key(key);
                if !keep {
                    token.cancel();
                }
                keep
            });
            tokio::select! {
                _ = stop.cancelled() => break,
                r = changed.changed() => if r.is_err() { break },
            }
        }
        tasks.close();
        tasks.wait().await;
    }
}
