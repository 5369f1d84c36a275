//! Backend pools: which backends serve a model, the upstream HTTP client each pool uses, a
//! weighted power-of-two-choices pick among a pool's backends (`balance`) with a per-backend capacity (beyond it
//! requests wait in the pool's admission queue, see `crate::queue`), and a light reachability
//! probe for `/readyz`, weights, warm-up, ejection, load-aware balancing and affinity. Live
//! membership (reloads, DNS discovery) is in `fleet`.
//!
//! Here: `Pool` (one model's pool as a worker holds it) and `Generation` (all pools of one
//! configuration). A backend's own state is in `backend`, choosing among backends in
//! `balance`, the upstream client in `upstream_client` and the connections the relays drive in
//! `upstream_conn`, probes, warm-up and load scrapes in `health`, why a backend could not be
//! reached in `cause`, the longest-prefix index in `prefix`, what the engines' KV events say
//! their caches hold in `engine_cache` (kept up by `fleet`'s `kv_events_loop`).

pub(crate) mod adapters;
mod backend;
mod balance;
pub(crate) mod cause;
pub(crate) mod connector;
pub(crate) mod engine_cache;
pub(crate) mod fleet;
pub(crate) mod hash;
mod health;
pub mod prefix;
mod upstream_client;
pub(crate) mod upstream_conn;

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::HeaderValue;

use crate::config::{PoolConfig, QueueConfig, Timeouts};
use crate::queue::AdmissionQueue;
use fleetgate_protocol::models;

pub use backend::Backend;

pub(crate) use backend::{BackendState, Reachability};
pub use balance::bit;
pub(crate) use balance::{Balancer, InFlight, PrefillCost};
pub use engine_cache::prompt::PromptTokens;
pub use upstream_client::UpstreamClient;

use backend::bearer;
use upstream_client::client_for;

#[derive(Debug)]
pub struct Pool {
    pub model: Arc<str>,
    /// Position among the pools (of this generation).
    pub index: usize,
    /// Its metrics index: stable across reloads, never reused for another pool.
    pub(crate) metrics_index: usize,
    /// The next backend metrics index to hand out.
    next_backend_metrics_index: usize,
    /// The name the backends serve the model under, and the same as a JSON string literal
    /// (a request naming an alias gets it spliced in).
    pub(crate) served_name: Arc<str>,
    pub(crate) served_json: Bytes,
    /// `"model":<served_json>` as the backends write it in their answers (compact JSON, as
    /// vLLM's): an answer to a client that named the model otherwise gets the client's name
    /// back in its place.
    pub(crate) served_field: Arc<memchr::memmem::Finder<'static>>,
    pub(crate) upstream_auth: Option<HeaderValue>,
    pub(crate) timeouts: Timeouts,
    pub backends: Vec<Arc<Backend>>,
    pub balancer: Arc<Balancer>,
    pub(crate) client: UpstreamClient,
    /// Environments whose keys may use this pool (`None`: all).
    pub(crate) environments: Option<Vec<crate::key::Environment>>,
    /// (minimum estimated prompt tokens, index of the pool that takes them).
    pub(crate) long_prompt: Option<(u64, usize)>,
    pub(crate) affinity: Option<crate::config::AffinityConfig>,
    /// `by = "longest_prefix"`: which backends hold which prompt prefixes (kept across a
    /// reload while the settings stay).
    pub(crate) prefix: Option<Arc<prefix::PrefixIndex>>,
    /// `by = "kv_events"`: the model's tokenizer and chat template (kept across a reload while
    /// the settings stay).
    pub(crate) prompt_tokens: Option<Arc<PromptTokens>>,
    /// `by = "kv_events"`: requests sent to a backend holding part of their prompt (hits) and
    /// the others (misses); shared by the workers' copies, kept across a reload.
    pub(crate) kv_counts: Arc<[std::sync::atomic::AtomicU64; 2]>,
    /// Its `fallbacks` and `context_window_fallbacks`, as pool indexes (`None`: neither).
    pub(crate) fallback: Option<Arc<Fallbacks>>,
    /// Which backends serve each LoRA adapter (`adapters`), shared by the workers' copies.
    pub(crate) adapters: adapters::SharedIndex,
    config: PoolConfig,
}

/// A pool's fallbacks, resolved to the indexes of the pools they name in its generation.
#[derive(Debug)]
pub(crate) struct Fallbacks {
    /// Tried in order when the pool cannot serve a request before its first byte.
    pub(crate) on_failure: Box<[usize]>,
    /// Tried in order for a prompt too long for the pool's context.
    pub(crate) context_window: Box<[usize]>,
    /// Environments whose requests may go to them (`None`: all).
    pub(crate) environments: Option<Vec<crate::key::Environment>>,
}

/// Two longest-prefix settings that keep the same index (its blocks and bounds).
fn same_index(a: &crate::config::AffinityConfig, b: &crate::config::AffinityConfig) -> bool {
    a.by == b.by
        && a.block_bytes == b.block_bytes
        && a.max_blocks == b.max_blocks
        && a.max_age == b.max_age
}

impl Pool {
    /// Build a pool from its config. With `prev` (the same model's pool before a reload), its
    /// backends that are still configured unchanged are kept with their state, its admission
    /// queue (with its waiters) and its upstream client are kept, and its metrics indexes.
    fn new(
        cfg: &PoolConfig,
        index: usize,
        metrics_index: usize,
        queue: &QueueConfig,
        prev: Option<&Pool>,
    ) -> io::Result<Self> {
        let upstream_auth = match &cfg.upstream_api_key {
            Some(k) => Some(bearer(k.expose(), &cfg.model)?),
            None => None,
        };
        let mut next_backend_metrics_index = prev.map_or(0, |p| p.next_backend_metrics_index);
        let mut backends = Vec::with_capacity(cfg.backends.len());
        for b in &cfg.backends {
            let fresh = Backend::new(b, next_backend_metrics_index, cfg, upstream_auth.as_ref())?;
            let kept = prev.and_then(|p| p.backends.iter().find(|o| o.same_as(&fresh)));
            match kept {
                Some(old) => backends.push(old.clone()),
                None => {
                    next_backend_metrics_index += 1;
                    backends.push(Arc::new(fresh));
                }
            }
        }
        let served = cfg.served_model_name.as_deref().unwrap_or(&cfg.model);
        let served_json = Bytes::from(serde_json::to_vec(served).map_err(io::Error::other)?);
        let mut field = b"\"model\":".to_vec();
        field.extend_from_slice(&served_json);
        let served_field = Arc::new(memchr::memmem::Finder::new(&field).into_owned());
        let queue = match prev {
            Some(p) => p.balancer.queue.clone(),
            None => Arc::new(AdmissionQueue::new(queue.max_size, queue.max_per_key)),
        };
        let balancer = Arc::new(Balancer::new(backends.clone(), queue, cfg));
        // Kept backends keep the adapters they were seen to serve.
        let adapter_index = adapters::AdapterIndex::of(&backends);
        let client = client_for(cfg, prev)?;
        let prefix = cfg
            .affinity
            .filter(|a| a.by == crate::config::AffinityBy::LongestPrefix)
            .map(|a| {
                prev.and_then(|p| {
                    p.prefix
                        .clone()
                        .filter(|_| p.affinity.is_some_and(|o| same_index(&o, &a)))
                })
                .unwrap_or_else(|| {
                    Arc::new(prefix::PrefixIndex::new(
                        a.block_bytes,
                        a.max_blocks,
                        a.max_age,
                    ))
                })
            });
        let prompt_tokens = match (&cfg.affinity, &cfg.kv_events) {
            (Some(a), Some(k)) if a.by == crate::config::AffinityBy::KvEvents => {
                let kept = prev.and_then(|p| {
                    p.prompt_tokens.clone().filter(|_| {
                        p.config.kv_events.as_ref().is_some_and(|o| {
                            (&o.tokenizer, &o.chat_template) == (&k.tokenizer, &k.chat_template)
                        })
                    })
                });
                match (kept, &k.tokenizer) {
                    (Some(t), _) => Some(t),
                    (None, Some(dir)) => Some(Arc::new(
                        PromptTokens::load(dir, k.chat_template.as_deref()).map_err(|e| {
                            io::Error::new(
                                io::ErrorKind::InvalidInput,
                                format!("pool {}: kv_events.tokenizer: {e}", cfg.model),
                            )
                        })?,
                    )),
                    (None, None) => None,
                }
            }
            _ => None,
        };
        Ok(Self {
            model: Arc::from(cfg.model.as_str()),
            index,
            metrics_index,
            next_backend_metrics_index,
            served_name: Arc::from(served),
            served_json,
            served_field,
            upstream_auth,
            timeouts: cfg.timeouts,
            backends,
            balancer,
            client,
            environments: cfg.environments.clone(),
            long_prompt: None,
            affinity: cfg.affinity,
            prefix,
            prompt_tokens,
            kv_counts: prev.map_or_else(Default::default, |p| p.kv_counts.clone()),
            fallback: None,
            adapters: Arc::new(arc_swap::ArcSwap::from_pointee(adapter_index)),
            config: cfg.clone(),
        })
    }

    pub(crate) fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The pool's context length in tokens: its `max_model_len` setting, else the least its
    /// backends' `/v1/models` cards report (`None` before any card said one).
    pub fn context_length(&self) -> Option<u32> {
        self.config
            .fallback
            .max_model_len
            .or_else(|| self.reported_context_length())
    }

    /// The least context length the backends' `/v1/models` cards report.
    pub(crate) fn reported_context_length(&self) -> Option<u32> {
        self.backends.iter().filter_map(|b| b.max_model_len()).min()
    }
}

/// `cfg`'s fallbacks as indexes in `cfgs`, each pool once (a model and its alias are one
/// pool; the config names only pools, each other than `cfg`'s own).
fn fallbacks(cfg: &PoolConfig, cfgs: &[PoolConfig]) -> Option<Arc<Fallbacks>> {
    let f = &cfg.fallback;
    if f.is_empty() {
        return None;
    }
    let resolve = |names: &[String]| -> Box<[usize]> {
        let mut out: Vec<usize> = Vec::with_capacity(names.len());
        for name in names {
            let found = cfgs
                .iter()
                .position(|c| c.model == *name || c.aliases.contains(name));
            if let Some(i) = found
                && !out.contains(&i)
                && cfgs[i].model != cfg.model
            {
                out.push(i);
            }
        }
        out.into()
    };
    Some(Arc::new(Fallbacks {
        on_failure: resolve(&f.on_failure),
        context_window: resolve(&f.context_window),
        environments: f.environments.clone(),
    }))
}

/// The model names clients may send to these pools: each pool's model and its aliases. The one
/// list behind `/v1/models` and the `model_not_found` message, so both always agree.
fn model_ids<'a>(pools: impl Iterator<Item = &'a Pool>) -> impl Iterator<Item = &'a str> {
    pools
        .flat_map(|p| std::iter::once(&*p.model).chain(p.config.aliases.iter().map(String::as_str)))
}

/// A `/v1/models` body (OpenAI list shape) naming these pools' models: each with what its
/// backends say about it (vLLM's card: `max_model_len`, `root`, `created`, … from the probes'
/// `GET /v1/models`, a healthy backend's first) under the name clients use, or a plain entry
/// before any backend has answered.
fn models_list_body<'a>(
    pools: impl Iterator<Item = &'a Pool>,
    key: Option<&crate::key::KeyRecord>,
) -> Bytes {
    let mut cards = Vec::new();
    for p in pools {
        if key.is_none_or(|k| usable_by(k, p)) {
            let card = p
                .backends
                .iter()
                .filter(|b| b.reachability() == Reachability::Up)
                .chain(p.backends.iter())
                .find_map(|b| b.model_card());
            for id in model_ids(std::iter::once(p)) {
                cards.push(models::card(id, card.as_deref()));
            }
        }
        // Its LoRA adapters the key may use (its allow-list names adapters as it names
        // models), with the pool's model as their `parent`.
        if key.is_none_or(|k| environment_may_use(k, p)) {
            cards.extend(p.adapter_cards(|name| key.is_none_or(|k| k.allows_model(name))));
        }
    }
    models::list_body(cards)
}

/// "`a`, `b`": the names for a message.
fn model_list<'a>(pools: impl Iterator<Item = &'a Pool>) -> String {
    let list = model_ids(pools)
        .map(|id| format!("`{id}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if list.is_empty() {
        "none for this key".to_owned()
    } else {
        list
    }
}

/// The key may use the pool: its model rights, and the pool's environments. (Routing refuses
/// a request by the same two rules, each with its own message.)
fn usable_by(key: &crate::key::KeyRecord, p: &Pool) -> bool {
    key.allows_model(&p.model) && environment_may_use(key, p)
}

fn environment_may_use(key: &crate::key::KeyRecord, p: &Pool) -> bool {
    p.environments
        .as_ref()
        .is_none_or(|e| e.contains(&key.environment))
}

/// All pools of one configuration generation, by the model name clients send. A reload
/// builds the next generation beside this one (see `fleet`).
#[derive(Debug)]
pub struct Generation {
    pools: Vec<Pool>,
    /// The next pool metrics index to hand out.
    next_metrics_index: usize,
    by_model: HashMap<Arc<str>, usize>,
    /// "`a`, `b`": every model name (aliases too), for the model-not-found message of a
    /// key that may use them all.
    model_list: String,
    /// The largest part of a request head any backend decides (`Backend::head_bytes`): the
    /// head limit is checked before routing, against every backend it could go to.
    pub(crate) max_backend_head: usize,
}

impl Generation {
    pub fn new(cfgs: &[PoolConfig], queue: &QueueConfig) -> io::Result<Self> {
        Self::build(cfgs, queue, None)
    }

    /// The pools of `cfgs`, continuing `prev` when given (a reload): a pool whose model was
    /// served before keeps its queue, client, metrics index and the backends still configured
    /// unchanged (with their state and in-flight counts). Backends of `prev` not kept are
    /// not touched here: see `retired_since`.
    pub(crate) fn build(
        cfgs: &[PoolConfig],
        queue: &QueueConfig,
        prev: Option<&Generation>,
    ) -> io::Result<Self> {
        let mut next_metrics_index = prev.map_or(0, |p| p.next_metrics_index);
        let mut pools = Vec::with_capacity(cfgs.len());
        for (i, c) in cfgs.iter().enumerate() {
            let old = prev.and_then(|p| p.iter().find(|o| *o.model == *c.model));
            let metrics_index = match old {
                Some(o) => o.metrics_index,
                None => {
                    next_metrics_index += 1;
                    next_metrics_index - 1
                }
            };
            pools.push(Pool::new(c, i, metrics_index, queue, old)?);
        }
        for i in 0..pools.len() {
            if let Some(lp) = &cfgs[i].long_prompt {
                let target = cfgs
                    .iter()
                    .position(|c| c.model == lp.pool)
                    .ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!(
                                "pool `{}`: long_prompt.pool `{}` is not a pool",
                                cfgs[i].model, lp.pool
                            ),
                        )
                    })?;
                pools[i].long_prompt = Some((lp.min_prompt_tokens, target));
            }
            pools[i].fallback = fallbacks(&cfgs[i], cfgs);
        }
        let by_model = pools
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                std::iter::once(p.model.clone())
                    .chain(p.config.aliases.iter().map(|a| Arc::from(a.as_str())))
                    .map(move |name| (name, i))
            })
            .collect();
        let model_list = model_list(pools.iter());
        let max_backend_head = pools
            .iter()
            .flat_map(|p| p.backends.iter().map(|b| b.head_bytes))
            .max()
            .unwrap_or(0);
        // Everything is built: kept backends take their new weights, capacities and labels.
        for p in &pools {
            for (b, c) in p.backends.iter().zip(&p.config.backends) {
                b.configure(c, &p.config);
            }
        }
        Ok(Self {
            pools,
            next_metrics_index,
            by_model,
            model_list,
            max_backend_head,
        })
    }

    /// The `/v1/models` body for a caller who may use every pool (built per call: the cards
    /// change with the probes, and the route is not on any request's path).
    pub(crate) fn models_body(&self) -> Bytes {
        models_list_body(self.pools.iter(), None)
    }

    /// The `/v1/models` body for one key: only the models and adapters it may use.
    pub(crate) fn models_for(&self, key: &crate::key::KeyRecord) -> Bytes {
        models_list_body(self.pools.iter(), Some(key))
    }

    /// The models a `model_not_found` offers: exactly the ones `/v1/models` shows the key
    /// (all of them without a key).
    pub(crate) fn model_list_for(&self, key: Option<&crate::key::KeyRecord>) -> String {
        match key {
            Some(k) if !self.pools.iter().all(|p| usable_by(k, p)) => {
                model_list(self.pools.iter().filter(|p| usable_by(k, p)))
            }
            _ => self.model_list.clone(),
        }
    }

    /// The same pools and backends (shared in-flight counts and reachability) with upstream
    /// clients of their own: each worker thread uses its own, so an upstream connection's task
    /// always runs on the thread that relays its body. With `prev` (the worker's pools before a
    /// reload), a pool's client is kept while its TLS and connect settings are unchanged, so
    /// open keep-alive connections stay in use.
    pub(crate) fn fork(&self, prev: Option<&Generation>) -> io::Result<Self> {
        let pools = self
            .pools
            .iter()
            .map(|p| {
                let client = client_for(&p.config, prev.and_then(|v| v.get_exact(&p.model)))?;
                Ok(Pool {
                    model: p.model.clone(),
                    index: p.index,
                    metrics_index: p.metrics_index,
                    next_backend_metrics_index: p.next_backend_metrics_index,
                    served_name: p.served_name.clone(),
                    served_json: p.served_json.clone(),
                    served_field: p.served_field.clone(),
                    upstream_auth: p.upstream_auth.clone(),
                    timeouts: p.timeouts,
                    backends: p.backends.clone(),
                    balancer: p.balancer.clone(),
                    client,
                    environments: p.environments.clone(),
                    long_prompt: p.long_prompt,
                    affinity: p.affinity,
                    prefix: p.prefix.clone(),
                    prompt_tokens: p.prompt_tokens.clone(),
                    kv_counts: p.kv_counts.clone(),
                    fallback: p.fallback.clone(),
                    adapters: p.adapters.clone(),
                    config: p.config.clone(),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            pools,
            next_metrics_index: self.next_metrics_index,
            by_model: self.by_model.clone(),
            model_list: self.model_list.clone(),
            max_backend_head: self.max_backend_head,
        })
    }

    /// Backends of `prev` that these pools no longer hold.
    pub(crate) fn retired_since<'a>(
        &self,
        prev: &'a Generation,
    ) -> Vec<(&'a Pool, &'a Arc<Backend>)> {
        prev.iter()
            .flat_map(|p| p.backends.iter().map(move |b| (p, b)))
            .filter(|(_, b)| {
                !self
                    .iter()
                    .flat_map(|q| &q.backends)
                    .any(|n| Arc::ptr_eq(n, b))
            })
            .collect()
    }

    /// The pool named `model` itself (not an alias).
    fn get_exact(&self, model: &str) -> Option<&Pool> {
        self.pools.iter().find(|p| *p.model == *model)
    }

    /// Every backend with its state, as `GET /admin/ready` and `GET /admin/backends` show them.
    pub fn backends_json(&self) -> Vec<serde_json::Value> {
        self.pools
            .iter()
            .flat_map(|p| {
                p.backends.iter().map(move |b| {
                    serde_json::json!({
                        "model": &*p.model,
                        "backend": &*b.base,
                        "name": &*b.name,
                        "state": b.state().as_str(),
                        "in_flight": b.in_flight.load(Ordering::Relaxed),
                        "capacity": b.capacity(),
                        "weight": b.weight(),
                        "labels": &*b.labels(),
                        "ewma_ttft_ms": b.ewma_ttft().map(|d| d.as_secs_f64() * 1e3),
                        "remote_load": p.config.load_aware.as_ref().map(|_| b.remote_load.load(Ordering::Relaxed)),
                        "kv_cache_usage": p.config.load_aware.as_ref().map(|_| b.kv_usage()),
                        "last_error": b.last_error().map(|e| e.message.clone()),
                        "last_error_at": b.last_error().map(|e| crate::clock::format_wall_ms(e.at_ms)),
                        "kv_events": b.engine_cache.load().as_ref().map(|c| c.json()),
                        "prefill_pending_tokens": p.affinity.as_ref().map(|_| b.prefill_pending.load(Ordering::Relaxed)),
                        "others_prefill_pending_tokens": p.prefix.as_ref().map(|_| b.others_prefill.load(Ordering::Relaxed)),
                        "lora_adapters": b.adapters().names().map(|n| &**n).collect::<Vec<&str>>(),
                    })
                })
            })
            .collect()
    }

    /// Find a backend by model (or alias) and base URL (a trailing `/` or `/v1` ignored).
    pub fn find_backend(&self, model: &str, url: &str) -> Option<&Arc<Backend>> {
        let url = url.trim_end_matches('/');
        let url = url.strip_suffix("/v1").unwrap_or(url);
        self.get(model)?.backends.iter().find(|b| &*b.base == url)
    }

    /// The pool at `index` (a `Pool::index`).
    pub fn at(&self, index: usize) -> Option<&Pool> {
        self.pools.get(index)
    }

    pub fn get(&self, model: &str) -> Option<&Pool> {
        self.by_model.get(model).map(|&i| &self.pools[i])
    }

    /// The pool whose backends serve the LoRA adapter `name`, and which of them do (their
    /// bits): the first pool in the configuration's order where any does.
    pub(crate) fn adapter(&self, name: &str) -> Option<(&Pool, u64)> {
        self.pools
            .iter()
            .find_map(|p| p.adapter_holders(name).map(|h| (p, h)))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter()
    }

    /// At least one backend answered its last probe (or served a request).
    pub(crate) fn any_reachable(&self) -> bool {
        self.pools
            .iter()
            .flat_map(|p| &p.backends)
            .any(|b| b.reachability() == Reachability::Up)
    }
}

/// A pool config of `n` backends on unused local ports, for the unit tests.
#[cfg(test)]
fn pool_cfg(n: usize) -> PoolConfig {
    PoolConfig::new(
        "m",
        (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 10 + i).parse().unwrap())
            .collect(),
    )
}
