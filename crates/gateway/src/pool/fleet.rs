//! Live membership: the pools as configured now, swapped without a restart.
//!
//! A `Fleet` holds the current `Generation` of pools (the one the probes, the load scrapes and
//! the admin API use) and every worker's own copy of it. A reload (SIGHUP, the config
//! file watcher, or a DNS answer that changed) builds the next generation beside the current
//! one and swaps it in everywhere at once:
//!
//! - a backend configured unchanged in the new generation is the same object: its state,
//!   in-flight count, EWMA and ejection carry over; a new weight, capacity or labels apply at
//!   once;
//! - a backend no longer configured is *removed*: it takes no new request, while the requests
//!   and streams it is serving finish (they hold the generation they started in);
//! - a pool that stays keeps its admission queue with its waiters, its upstream clients (open
//!   keep-alive connections) and its metrics series.
//!
//! DNS discovery: a backend entry with `discover = "dns"` names a hostname (a Kubernetes
//! headless Service) that is re-resolved on an interval; each address is one backend with the
//! entry's weight, capacity, labels and key. An answer that changes the set is applied as a
//! reload; a failed lookup keeps the last known addresses.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tokio_util::sync::CancellationToken;

use crate::config::{BackendConfig, Discover, PoolConfig, QueueConfig};

use super::{Backend, Generation, Pool};

/// A worker's swappable handle on the current generation: the pools its requests use, swapped
/// by each reload.
pub(crate) type CurrentGeneration = Arc<ArcSwap<Generation>>;

/// Answers a DNS discovery lookup: the addresses of `host` (`port` for resolvers that want it).
/// Called with a new generation and the (model, backend URL) pairs that left with it.
pub(crate) type OnRelayout = Arc<dyn Fn(&Generation, &[(Arc<str>, Arc<str>)]) + Send + Sync>;

pub(crate) type Resolver = Arc<
    dyn Fn(
            String,
            u16,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<BTreeSet<IpAddr>>> + Send>,
        > + Send
        + Sync,
>;

/// What a reload changed, for the log and the caller.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReloadSummary {
    pub pools_added: Vec<String>,
    pub(crate) pools_removed: Vec<String>,
    /// `model backend` pairs.
    pub backends_added: Vec<String>,
    pub backends_removed: Vec<String>,
    /// The generation now serving (1 at start).
    pub generation: u64,
}

impl ReloadSummary {
    pub fn is_empty(&self) -> bool {
        self.pools_added.is_empty()
            && self.pools_removed.is_empty()
            && self.backends_added.is_empty()
            && self.backends_removed.is_empty()
    }
}

impl std::fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            if v.is_empty() {
                "-".to_owned()
            } else {
                v.join(", ")
            }
        };
        write!(
            f,
            "generation {}: pools added {}, removed {}; backends added {}, removed {}",
            self.generation,
            list(&self.pools_added),
            list(&self.pools_removed),
            list(&self.backends_added),
            list(&self.backends_removed)
        )
    }
}

/// Addresses found for one `discover = "dns"` entry.
#[derive(Debug, Clone)]
struct Discovered {
    pool: usize,
    entry: usize,
    addrs: BTreeSet<IpAddr>,
}

struct Inner {
    /// The pools as configured (DNS entries unexpanded).
    configured: Vec<PoolConfig>,
    discovered: Vec<Discovered>,
    generation: u64,
}

/// Reload counters (registered once; a `Fleet` without a registry counts nowhere).
struct FleetMetrics {
    reloads: IntCounterVec,
    generation: IntGauge,
    dns_failures: IntCounterVec,
}

pub struct Fleet {
    current: ArcSwap<Generation>,
    /// Every worker's own copy (its own upstream clients), swapped by each reload.
    workers: Mutex<Vec<CurrentGeneration>>,
    inner: Mutex<Inner>,
    queue: QueueConfig,
    on_relayout: Mutex<Option<OnRelayout>>,
    counters: Option<FleetMetrics>,
    /// Bumped after each applied change: the load scrapes restart on the new generation.
    changed: tokio::sync::watch::Sender<u64>,
    /// Replaces the system resolver for the discovery rounds (tests; a custom service registry).
    resolver: Mutex<Option<Resolver>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

/// Why a new generation could not be built; the pools in service stay as they were.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// A discovered address does not make a valid backend URL.
    #[error("discovered backend URL `{url}` is invalid: {reason}")]
    DiscoveredUrl { url: String, reason: String },
    /// Building a pool or a worker's copy failed (an upstream key that is not a valid header
    /// value, an unreadable CA file).
    #[error("{0}")]
    Build(#[from] std::io::Error),
}

/// The backend a DNS answer gives: the entry's URL with `ip` as host.
fn with_host(entry: &BackendConfig, ip: IpAddr) -> Result<BackendConfig, ReloadError> {
    let url = &entry.url;
    let host = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let port = url.port_u16().map(|p| format!(":{p}")).unwrap_or_default();
    let text = format!(
        "{}://{host}{port}{}",
        url.scheme_str().unwrap_or("http"),
        url.path().trim_end_matches('/')
    );
    let uri = text
        .parse()
        .map_err(|e: http::uri::InvalidUri| ReloadError::DiscoveredUrl {
            url: text.clone(),
            reason: e.to_string(),
        })?;
    Ok(BackendConfig {
        url: uri,
        discover: Discover::Static,
        ..entry.clone()
    })
}

/// `configured` with each DNS entry replaced by one backend per discovered address.
fn expand(
    configured: &[PoolConfig],
    discovered: &[Discovered],
) -> Result<Vec<PoolConfig>, ReloadError> {
    let mut out = Vec::with_capacity(configured.len());
    for (i, p) in configured.iter().enumerate() {
        let mut pool = p.clone();
        pool.backends.clear();
        for (j, b) in p.backends.iter().enumerate() {
            match &b.discover {
                Discover::Static => pool.backends.push(b.clone()),
                Discover::Dns { .. } => {
                    let found = discovered.iter().find(|d| d.pool == i && d.entry == j);
                    for ip in found.into_iter().flat_map(|d| &d.addrs) {
                        let b = with_host(b, *ip)?;
                        // The same address listed statically, or by another entry: once.
                        if !pool.backends.iter().any(|o| o.url == b.url) {
                            pool.backends.push(b);
                        }
                    }
                }
            }
        }
        out.push(pool);
    }
    Ok(out)
}

/// The host and port to resolve for a DNS entry.
fn lookup_target(b: &BackendConfig) -> Option<(String, u16)> {
    let host = b.url.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = b
        .url
        .port_u16()
        .unwrap_or(if b.url.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    Some((host.to_owned(), port))
}

/// Resolve `host` with the system resolver (as the pods' own lookups would).
pub(crate) async fn resolve(host: &str, port: u16) -> std::io::Result<BTreeSet<IpAddr>> {
    let addrs = tokio::net::lookup_host((host, port)).await?;
    Ok(addrs.map(|a| a.ip()).collect())
}

impl Fleet {
    /// The fleet of `configured`, DNS entries resolved once now (an entry that does not
    /// resolve starts with no backends and is retried on its interval).
    pub(crate) async fn start(
        configured: Vec<PoolConfig>,
        queue: QueueConfig,
        registry: Option<&Registry>,
    ) -> std::io::Result<Fleet> {
        let mut discovered = Vec::new();
        for (i, p) in configured.iter().enumerate() {
            for (j, b) in p.backends.iter().enumerate() {
                if let Discover::Dns { .. } = b.discover {
                    let addrs = match lookup_target(b) {
                        Some((host, port)) => match resolve(&host, port).await {
                            Ok(a) => a,
                            Err(e) => {
                                tracing::warn!(model = %p.model, host, error = %e,
                                    "DNS discovery: no answer yet; retrying on its interval");
                                BTreeSet::new()
                            }
                        },
                        None => BTreeSet::new(),
                    };
                    discovered.push(Discovered {
                        pool: i,
                        entry: j,
                        addrs,
                    });
                }
            }
        }
        let expanded = expand(&configured, &discovered).map_err(std::io::Error::other)?;
        let pools = Generation::new(&expanded, &queue)?;
        let counters = match registry {
            Some(r) => Some(FleetMetrics::register(r).map_err(std::io::Error::other)?),
            None => None,
        };
        if let Some(c) = &counters {
            c.generation.set(1);
        }
        Ok(Fleet {
            current: ArcSwap::from_pointee(pools),
            workers: Mutex::new(Vec::new()),
            inner: Mutex::new(Inner {
                configured,
                discovered,
                generation: 1,
            }),
            queue,
            on_relayout: Mutex::new(None),
            counters,
            changed: tokio::sync::watch::Sender::new(1),
            resolver: Mutex::new(None),
        })
    }

    /// The pools now (probes, admin API, metrics).
    pub(crate) fn current(&self) -> Arc<Generation> {
        self.current.load_full()
    }

    /// A new worker's current generation (its own upstream clients), kept current by every
    /// reload.
    pub(crate) fn for_worker(&self) -> std::io::Result<CurrentGeneration> {
        let current = Arc::new(ArcSwap::from_pointee(self.current.load().fork(None)?));
        lock(&self.workers).push(current.clone());
        Ok(current)
    }

    /// Answer the following discovery rounds with `resolver` instead of the system's.
    pub fn set_resolver(&self, resolver: Resolver) {
        *lock(&self.resolver) = Some(resolver);
    }

    /// Run `f` on each new generation before it is swapped in (the request metrics resolve
    /// their handles for it there). The pool does not know who listens: it hands the
    /// generation over, so it never imports the telemetry that reads it.
    pub(crate) fn on_relayout(&self, f: OnRelayout) {
        *lock(&self.on_relayout) = Some(f);
    }

    /// Changes after each applied reload.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Apply a new `[[pools]]` configuration (already validated). DNS entries keep the
    /// addresses found so far for an entry still configured with the same URL; new entries
    /// are resolved by the next discovery round.
    pub(crate) fn reload(&self, configured: Vec<PoolConfig>) -> Result<ReloadSummary, ReloadError> {
        let mut inner = lock(&self.inner);
        let mut discovered = Vec::new();
        for (i, p) in configured.iter().enumerate() {
            for (j, b) in p.backends.iter().enumerate() {
                if let Discover::Dns { .. } = b.discover {
                    let addrs = inner
                        .discovered
                        .iter()
                        .find(|d| {
                            let old = &inner.configured[d.pool];
                            old.model == p.model && old.backends[d.entry].url == b.url
                        })
                        .map(|d| d.addrs.clone())
                        .unwrap_or_default();
                    discovered.push(Discovered {
                        pool: i,
                        entry: j,
                        addrs,
                    });
                }
            }
        }
        let result = self.apply(&mut inner, &configured, &discovered);
        if result.is_ok() {
            inner.configured = configured;
            inner.discovered = discovered;
        }
        self.count(if result.is_ok() { "ok" } else { "error" });
        result
    }

    /// A reload that never got here (its file did not parse).
    pub(crate) fn count_failed(&self) {
        self.count("error");
    }

    fn count(&self, result: &str) {
        if let Some(c) = &self.counters {
            c.reloads.with_label_values(&[result]).inc();
        }
    }

    /// Build the generation of `configured` × `discovered` and swap it in everywhere.
    /// Name the retired backends in the summary; the (model, URL) pairs whose metric series
    /// go (the same model and URL may live on as a new object when its settings changed: its
    /// series stay).
    fn removed_labels(
        next: &Generation,
        retired: &[(&Pool, &Arc<Backend>)],
        summary: &mut ReloadSummary,
    ) -> Vec<(Arc<str>, Arc<str>)> {
        let mut removed = Vec::with_capacity(retired.len());
        for (p, b) in retired {
            summary
                .backends_removed
                .push(format!("{} {}", p.model, b.base));
            if !next
                .get(&p.model)
                .is_some_and(|q| q.backends.iter().any(|n| n.base == b.base))
            {
                removed.push((p.model.clone(), b.base.clone()));
            }
        }
        removed
    }

    fn apply(
        &self,
        inner: &mut Inner,
        configured: &[PoolConfig],
        discovered: &[Discovered],
    ) -> Result<ReloadSummary, ReloadError> {
        let expanded = expand(configured, discovered)?;
        let old = self.current.load_full();
        let next = Generation::build(&expanded, &self.queue, Some(&old))?;
        // Every worker's copy first (their own clients, kept where the settings allow), so a
        // failure leaves everything as it was.
        let workers = lock(&self.workers);
        let forks = workers
            .iter()
            .map(|w| next.fork(Some(&w.load())))
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut summary = ReloadSummary::default();
        for p in next.iter() {
            let before = old.iter().find(|o| o.model == p.model);
            if before.is_none() {
                summary.pools_added.push(p.model.to_string());
            }
            for b in &p.backends {
                if before.is_none_or(|o| !o.backends.iter().any(|x| Arc::ptr_eq(x, b))) {
                    summary
                        .backends_added
                        .push(format!("{} {}", p.model, b.base));
                }
            }
        }
        for o in old.iter() {
            if !next.iter().any(|p| p.model == o.model) {
                summary.pools_removed.push(o.model.to_string());
            }
        }
        let retired = next.retired_since(&old);
        let removed_labels = Self::removed_labels(&next, &retired, &mut summary);
        if let Some(f) = &*lock(&self.on_relayout) {
            f(&next, &removed_labels);
        }
        for (worker, fork) in workers.iter().zip(forks) {
            worker.store(Arc::new(fork));
        }
        drop(workers);
        let next = Arc::new(next);
        self.current.store(next.clone());
        // Retired only once every worker has the next generation: a request that routed in
        // the old one and finds its backends retired is routed again in the new one.
        for (_, b) in &retired {
            b.retire();
        }
        inner.generation += 1;
        summary.generation = inner.generation;
        if let Some(c) = &self.counters {
            c.generation
                .set(i64::try_from(inner.generation).unwrap_or(i64::MAX));
        }
        // Waiters may fit on the new backends now.
        for p in next.iter() {
            p.balancer.dispatch();
        }
        self.changed.send_replace(inner.generation);
        Ok(summary)
    }

    /// Re-resolve every DNS entry on its interval until `stop`; apply a changed answer.
    pub(crate) async fn discovery_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut next_due: Vec<tokio::time::Instant> = Vec::new();
        loop {
            let entries: Vec<(usize, usize, String, BackendConfig)> = {
                let inner = lock(&self.inner);
                inner
                    .discovered
                    .iter()
                    .map(|d| {
                        let p = &inner.configured[d.pool];
                        (
                            d.pool,
                            d.entry,
                            p.model.clone(),
                            p.backends[d.entry].clone(),
                        )
                    })
                    .collect()
            };
            if entries.is_empty() {
                // Nothing to resolve until a reload configures an entry.
                let mut changed = self.subscribe();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = changed.changed() => continue,
                }
            }
            next_due.resize(entries.len(), tokio::time::Instant::now());
            let now = tokio::time::Instant::now();
            for (k, (pool, entry, model, b)) in entries.iter().enumerate() {
                if next_due[k] > now {
                    continue;
                }
                let Discover::Dns { interval } = b.discover else {
                    continue;
                };
                next_due[k] = now + interval;
                let Some((host, port)) = lookup_target(b) else {
                    continue;
                };
                let custom = lock(&self.resolver).clone();
                let lookup = async {
                    match custom {
                        Some(r) => r(host.clone(), port).await,
                        None => resolve(&host, port).await,
                    }
                };
                let answer = tokio::select! {
                    _ = stop.cancelled() => return,
                    a = tokio::time::timeout(interval.max(Duration::from_secs(1)), lookup) => a,
                };
                let addrs = match answer {
                    Ok(Ok(a)) => a,
                    Ok(Err(e)) => {
                        self.dns_failed(model, &host, &e.to_string());
                        continue;
                    }
                    Err(_) => {
                        self.dns_failed(model, &host, "timed out");
                        continue;
                    }
                };
                self.discovered(*pool, *entry, &b.url, addrs, model, &host);
            }
            let wait = next_due.iter().min().map_or(Duration::from_secs(5), |t| {
                t.saturating_duration_since(tokio::time::Instant::now())
            });
            let mut changed = self.subscribe();
            changed.mark_unchanged();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait.max(Duration::from_millis(50))) => {}
                // A reload may have changed the entries.
                _ = changed.changed() => {}
            }
        }
    }

    /// Probe the current generation's backends every `interval` (and at once after a
    /// change, so new backends are checked and warmed without waiting) until `stop`.
    pub(crate) async fn probe_loop(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let mut changed = self.subscribe();
        loop {
            self.current().probe_once().await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
                r = changed.changed() => if r.is_err() { return },
            }
        }
    }

    /// Scrape the load-aware pools' backends (see `Generation::load_loop`), restarted on each
    /// change, until `stop`.
    pub(crate) async fn load_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut changed = self.subscribe();
        loop {
            let pools = self.current();
            let run = async {
                pools.load_loop(stop.clone()).await;
                std::future::pending::<()>().await
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                () = run => {}
                r = changed.changed() => if r.is_err() { return },
            }
        }
    }

    fn dns_failed(&self, model: &str, host: &str, why: &str) {
        if let Some(c) = &self.counters {
            c.dns_failures.with_label_values(&[model]).inc();
        }
        tracing::warn!(
            model,
            host,
            error = why,
            "DNS discovery failed; keeping the last known backends"
        );
    }

    /// Apply one entry's answer if it differs from what it had.
    fn discovered(
        &self,
        pool: usize,
        entry: usize,
        url: &http::Uri,
        addrs: BTreeSet<IpAddr>,
        model: &str,
        host: &str,
    ) {
        if let Some(c) = &self.counters {
            // The pool's series exists (at 0) from its first answer, not from its first failure.
            c.dns_failures.with_label_values(&[model]);
        }
        let mut inner = lock(&self.inner);
        // A reload in between may have moved or removed the entry.
        let Some(k) = inner.discovered.iter().position(|d| {
            d.pool == pool
                && d.entry == entry
                && inner.configured[pool]
                    .backends
                    .get(entry)
                    .is_some_and(|b| b.url == *url)
        }) else {
            return;
        };
        if inner.discovered[k].addrs == addrs {
            return;
        }
        if addrs.is_empty() {
            // An empty answer for a Service whose pods are all gone is possible, but so is a
            // resolver hiccup: keep serving the last addresses and say so.
            self.dns_failed(model, host, "no addresses in the answer");
            return;
        }
        let mut discovered = inner.discovered.clone();
        discovered[k].addrs = addrs;
        let configured = inner.configured.clone();
        match self.apply(&mut inner, &configured, &discovered) {
            Ok(summary) => {
                inner.discovered = discovered;
                self.count("ok");
                tracing::info!(model, host, %summary, "DNS discovery: backends changed");
            }
            Err(e) => {
                self.count("error");
                tracing::error!(model, host, error = %e, "DNS discovery: could not apply the new backends");
            }
        }
    }
}

impl FleetMetrics {
    fn register(r: &Registry) -> Result<Self, prometheus::Error> {
        let reloads = IntCounterVec::new(
            Opts::new(
                "fleetgate_config_reloads_total",
                "Pool configuration changes applied without a restart (reload, file watcher, DNS), by result",
            ),
            &["result"],
        )?;
        r.register(Box::new(reloads.clone()))?;
        for l in ["ok", "error"] {
            reloads.with_label_values(&[l]);
        }
        let generation = IntGauge::new(
            "fleetgate_config_generation",
            "The pool configuration generation serving now (1 at start, +1 per applied change)",
        )?;
        r.register(Box::new(generation.clone()))?;
        let dns_failures = IntCounterVec::new(
            Opts::new(
                "fleetgate_dns_discovery_failures_total",
                "DNS discovery lookups that failed or came back empty (the last addresses stay in use)",
            ),
            &["model"],
        )?;
        r.register(Box::new(dns_failures.clone()))?;
        Ok(Self {
            reloads,
            generation,
            dns_failures,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(url: &str, interval_ms: u64) -> BackendConfig {
        let mut b = BackendConfig::new(url.parse().unwrap());
        b.discover = Discover::Dns {
            interval: Duration::from_millis(interval_ms),
        };
        b.weight = 3;
        b.labels = vec!["stable".into()];
        b
    }

    #[test]
    fn expands_each_address_into_a_backend_with_the_entry_settings() {
        let mut pool = PoolConfig::new("m", vec!["http://10.0.0.9:8000".parse().unwrap()]);
        pool.backends
            .push(entry("http://vllm.ns.svc.cluster.local:8000", 5000));
        let found = Discovered {
            pool: 0,
            entry: 1,
            addrs: ["10.0.0.7", "10.0.0.9", "fd00::5"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect(),
        };
        let out = expand(&[pool], &[found]).unwrap();
        let urls: Vec<String> = out[0].backends.iter().map(|b| b.url.to_string()).collect();
        // The static backend first; 10.0.0.9 listed once.
        assert_eq!(
            urls,
            [
                "http://10.0.0.9:8000/",
                "http://10.0.0.7:8000/",
                "http://[fd00::5]:8000/"
            ]
        );
        assert_eq!(out[0].backends[1].weight, 3);
        assert_eq!(out[0].backends[1].labels, ["stable"]);
        assert!(matches!(out[0].backends[1].discover, Discover::Static));
    }

    #[test]
    fn an_entry_without_answers_gives_no_backends() {
        let mut pool = PoolConfig::new("m", vec![]);
        pool.backends.push(entry("http://vllm:8000", 5000));
        let out = expand(&[pool], &[]).unwrap();
        assert!(out[0].backends.is_empty());
    }

    #[tokio::test]
    async fn localhost_resolves() {
        let a = resolve("localhost", 80).await.unwrap();
        assert!(a.iter().any(|ip| ip.is_loopback()), "{a:?}");
    }
}
