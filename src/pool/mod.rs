//! Backend pools: which backends serve a model, the upstream HTTP client each pool uses, the
//! least-in-flight choice among a pool's backends with a per-backend capacity (beyond it
//! requests wait in the pool's admission queue, see `crate::queue`), and a light reachability
//! probe for `/readyz`, weights, warm-up, ejection, load-aware balancing and affinity. Live
//! membership (reloads, DNS discovery) is in `fleet`.

pub mod fleet;

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU32, AtomicU64, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio_util::sync::CancellationToken;

use crate::clock::mono_ms;
use crate::config::{
    BackendConfig, EjectionConfig, PoolConfig, QueueConfig, RetryConfig, Timeouts,
};
use crate::queue::{AdmissionQueue, Slots};

pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Reachability as last observed (probe or real traffic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reachability {
    Unknown = 0,
    Up = 1,
    Down = 2,
}

#[derive(Debug)]
pub struct Backend {
    /// Base URL as configured (log and error text; never a label from a client).
    pub base: Arc<str>,
    /// Its metrics slot in the pool: stable across reloads (a request recorded after a reload
    /// still lands on its backend's series), never reused for another backend.
    pub slot: usize,
    pub chat_uri: Uri,
    pub completions_uri: Uri,
    pub health_uri: Uri,
    pub metrics_uri: Uri,
    pub in_flight: AtomicU32,
    /// Requests running + waiting on the backend by its own `/metrics` (all gateways' and
    /// anyone else's), when the pool is load-aware; 0 otherwise or when unread.
    pub remote_load: AtomicU32,
    /// Its KV-cache usage in thousandths, from the same scrape.
    kv_usage_permille: AtomicU32,
    /// Share of new requests relative to the pool's other backends (a reload may change it).
    weight: AtomicU32,
    /// Requests served at once (0: no cap; a reload may change it).
    capacity: AtomicU32,
    labels: ArcSwap<Vec<String>>,
    /// No longer configured (a reload or DNS removed it): takes no new requests; the ones in
    /// flight finish.
    removed: AtomicBool,
    /// `Authorization` sent to this backend (its own key, else the pool's).
    pub upstream_auth: Option<HeaderValue>,
    reachability: AtomicU8,
    /// Consecutive connect errors / 5xx answers.
    failures: AtomicU32,
    /// Ejections in a row (the backoff exponent); reset by a success.
    ejections: AtomicU32,
    /// `mono_ms()` until which the backend gets no new requests (0: not ejected).
    ejected_until: AtomicU64,
    draining: AtomicBool,
    /// Consecutive good and failed health probes.
    probes_ok: AtomicU32,
    probes_bad: AtomicU32,
    /// Must pass warm-up requests before it takes traffic (new, or back from down).
    warming: AtomicBool,
    warmup_required: bool,
    /// `mono_ms()` when it last became healthy, while its slow start lasts (0: full share).
    up_since: AtomicU64,
    slow_start_ms: u64,
    /// Exponentially weighted mean upstream TTFT in µs (f64 bits; 0: none yet).
    ewma_ttft_us: AtomicU64,
    last_error: ArcSwapOption<String>,
}

/// A backend's state as the admin API and `/readyz` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendState {
    Healthy,
    Unknown,
    Down,
    Warming,
    Ejected,
    Draining,
    Removed,
}

impl BackendState {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Healthy => "healthy",
            BackendState::Unknown => "unknown",
            BackendState::Down => "down",
            BackendState::Warming => "warming",
            BackendState::Ejected => "ejected",
            BackendState::Draining => "draining",
            BackendState::Removed => "removed",
        }
    }
}

impl Backend {
    fn new(
        cfg: &BackendConfig,
        slot: usize,
        pool: &PoolConfig,
        pool_auth: Option<&HeaderValue>,
    ) -> io::Result<Self> {
        let model = pool.model.as_str();
        let warmup_required = pool.warmup.requests > 0;
        let text = cfg.url.to_string();
        let trimmed = text.trim_end_matches('/');
        let join = |p: &str| -> io::Result<Uri> {
            format!("{trimmed}{p}")
                .parse()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e}")))
        };
        let upstream_auth = match &cfg.upstream_api_key {
            Some(k) => Some(bearer(k.expose(), model)?),
            None => pool_auth.cloned(),
        };
        Ok(Self {
            base: Arc::from(trimmed),
            slot,
            chat_uri: join("/v1/chat/completions")?,
            completions_uri: join("/v1/completions")?,
            health_uri: join(&pool.health.path)?,
            metrics_uri: join(
                pool.load_aware
                    .as_ref()
                    .map_or("/metrics", |l| l.metrics_path.as_str()),
            )?,
            in_flight: AtomicU32::new(0),
            remote_load: AtomicU32::new(0),
            kv_usage_permille: AtomicU32::new(0),
            weight: AtomicU32::new(weight_of(cfg)),
            capacity: AtomicU32::new(capacity_of(cfg, pool)),
            labels: ArcSwap::from_pointee(cfg.labels.clone()),
            removed: AtomicBool::new(false),
            upstream_auth,
            reachability: AtomicU8::new(Reachability::Unknown as u8),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            probes_ok: AtomicU32::new(0),
            probes_bad: AtomicU32::new(0),
            warming: AtomicBool::new(warmup_required),
            warmup_required,
            up_since: AtomicU64::new(0),
            slow_start_ms: u64::try_from(pool.warmup.slow_start.as_millis()).unwrap_or(u64::MAX),
            ewma_ttft_us: AtomicU64::new(0),
            last_error: ArcSwapOption::empty(),
        })
    }

    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    pub fn labels(&self) -> Arc<Vec<String>> {
        self.labels.load_full()
    }

    /// The same backend as `fresh` (built from a reloaded config): same address, credentials,
    /// probe and warm-up settings. Such a backend is kept across a reload, with its state and
    /// in-flight count; only its weight, capacity and labels are taken from `fresh`.
    fn same_as(&self, fresh: &Backend) -> bool {
        self.base == fresh.base
            && self.upstream_auth == fresh.upstream_auth
            && self.health_uri == fresh.health_uri
            && self.metrics_uri == fresh.metrics_uri
            && self.warmup_required == fresh.warmup_required
            && self.slow_start_ms == fresh.slow_start_ms
    }

    /// Take the weight, capacity and labels of `cfg` (a reload), and count as configured.
    fn configure(&self, cfg: &BackendConfig, pool: &PoolConfig) {
        self.weight.store(weight_of(cfg), Ordering::Relaxed);
        self.capacity
            .store(capacity_of(cfg, pool), Ordering::Relaxed);
        if **self.labels.load() != cfg.labels {
            self.labels.store(Arc::new(cfg.labels.clone()));
        }
        self.removed.store(false, Ordering::Relaxed);
    }

    /// Removed from the configuration: no new requests.
    pub fn retire(&self) {
        self.removed.store(true, Ordering::Relaxed);
    }

    pub fn reachability(&self) -> Reachability {
        match self.reachability.load(Ordering::Relaxed) {
            1 => Reachability::Up,
            2 => Reachability::Down,
            _ => Reachability::Unknown,
        }
    }

    pub fn mark(&self, r: Reachability) {
        let was = self.reachability.swap(r as u8, Ordering::Relaxed);
        if r == Reachability::Down && self.warmup_required {
            // Back from down means warm-up again.
            self.warming.store(true, Ordering::Relaxed);
        }
        if r == Reachability::Up && was != Reachability::Up as u8 && self.slow_start_ms > 0 {
            self.up_since.store(mono_ms(), Ordering::Relaxed);
        }
    }

    /// The share of draws a backend in slow start accepts (1: full).
    fn ramp(&self) -> f64 {
        let since = self.up_since.load(Ordering::Relaxed);
        if since == 0 {
            return 1.0;
        }
        let elapsed = mono_ms().saturating_sub(since);
        if elapsed >= self.slow_start_ms {
            self.up_since.store(0, Ordering::Relaxed);
            return 1.0;
        }
        (elapsed as f64 / self.slow_start_ms as f64).max(0.05)
    }

    /// May take new requests now: not down, not ejected, not draining. (The clock is read
    /// only for a backend that was ejected.)
    pub fn eligible(&self) -> bool {
        if self.reachability() == Reachability::Down
            || self.draining.load(Ordering::Relaxed)
            || self.warming.load(Ordering::Relaxed)
            || self.removed.load(Ordering::Relaxed)
        {
            return false;
        }
        let until = self.ejected_until.load(Ordering::Relaxed);
        if until == 0 {
            return true;
        }
        if until > mono_ms() {
            return false;
        }
        // The ejection is over: forget it, so the clock is not read again.
        let _ = self
            .ejected_until
            .compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed);
        true
    }

    pub fn state(&self) -> BackendState {
        if self.removed.load(Ordering::Relaxed) {
            BackendState::Removed
        } else if self.draining.load(Ordering::Relaxed) {
            BackendState::Draining
        } else if self.warming.load(Ordering::Relaxed) {
            BackendState::Warming
        } else if self.ejected_until.load(Ordering::Relaxed) > mono_ms() {
            BackendState::Ejected
        } else {
            match self.reachability() {
                Reachability::Up => BackendState::Healthy,
                Reachability::Down => BackendState::Down,
                Reachability::Unknown => BackendState::Unknown,
            }
        }
    }

    /// Stop (or resume) giving this backend new requests; requests in flight finish.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::Relaxed);
    }

    /// A request got a good answer: the failure streak and the backoff start over.
    pub fn record_success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        if self.ejections.load(Ordering::Relaxed) != 0
            && self.ejected_until.load(Ordering::Relaxed) <= mono_ms()
        {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// A connect error or a 5xx answer. After `consecutive_failures` in a row the backend is
    /// ejected for base × 2^(ejections − 1) (± 20 % jitter, at most `max`). Returns whether
    /// this failure ejected it.
    pub fn record_failure(&self, cfg: &EjectionConfig, why: &str) -> bool {
        self.last_error.store(Some(Arc::new(why.to_owned())));
        if cfg.consecutive_failures == 0 {
            return false;
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < cfg.consecutive_failures {
            return false;
        }
        self.failures.store(0, Ordering::Relaxed);
        let k = self.ejections.fetch_add(1, Ordering::Relaxed).min(16);
        let backoff = cfg.base.saturating_mul(1 << k).min(cfg.max);
        let jitter = rand::random_range(0.8..1.2);
        let ms = (backoff.as_secs_f64() * 1e3 * jitter) as u64;
        self.ejected_until
            .store(mono_ms() + ms.max(1), Ordering::Relaxed);
        tracing::warn!(backend = %self.base, failures = n, ejected_ms = ms, error = %why,
            "backend ejected after consecutive failures");
        true
    }

    /// Fold one upstream TTFT into the mean (α = 0.2).
    pub fn observe_ttft(&self, d: std::time::Duration) {
        let x = d.as_secs_f64() * 1e6;
        let old = f64::from_bits(self.ewma_ttft_us.load(Ordering::Relaxed));
        let new = if old == 0.0 { x } else { old + 0.2 * (x - old) };
        self.ewma_ttft_us.store(new.to_bits(), Ordering::Relaxed);
    }

    /// The mean upstream TTFT (None before the first).
    pub fn ewma_ttft(&self) -> Option<std::time::Duration> {
        let v = f64::from_bits(self.ewma_ttft_us.load(Ordering::Relaxed));
        (v > 0.0).then(|| std::time::Duration::from_secs_f64(v / 1e6))
    }

    pub fn last_error(&self) -> Option<Arc<String>> {
        self.last_error.load_full()
    }

    pub fn set_last_error(&self, why: &str) {
        self.last_error.store(Some(Arc::new(why.to_owned())));
    }

    /// KV-cache usage (0..1) from the last scrape, if the pool is load-aware.
    pub fn kv_usage(&self) -> f64 {
        f64::from(self.kv_usage_permille.load(Ordering::Relaxed)) / 1000.0
    }

    fn has_room(&self) -> Option<u32> {
        let n = self.in_flight.load(Ordering::SeqCst);
        let cap = self.capacity();
        (cap == 0 || n < cap).then_some(n)
    }
}

/// A backend's share of new requests (≥ 1).
fn weight_of(cfg: &BackendConfig) -> u32 {
    cfg.weight.max(1)
}

/// A backend's own capacity, else its pool's (0: no cap).
fn capacity_of(cfg: &BackendConfig, pool: &PoolConfig) -> u32 {
    cfg.capacity.unwrap_or(pool.max_in_flight_per_backend)
}

fn bearer(key: &str, model: &str) -> io::Result<HeaderValue> {
    let mut v = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("pool `{model}`: upstream_api_key holds characters not allowed in a header"),
        )
    })?;
    v.set_sensitive(true);
    Ok(v)
}

/// Retries allowed as a share of requests: each request deposits `ratio` of a retry, a retry
/// spends one; at most ten are saved up.
#[derive(Debug)]
pub struct RetryBudget {
    /// Thousandths of a retry.
    milli: AtomicI64,
    deposit: i64,
}

impl RetryBudget {
    const CAP: i64 = 10_000;

    fn new(ratio: f64) -> Self {
        Self {
            milli: AtomicI64::new(Self::CAP / 2),
            deposit: (ratio * 1000.0).round() as i64,
        }
    }

    pub fn deposit(&self) {
        if self.deposit > 0 && self.milli.load(Ordering::Relaxed) < Self::CAP {
            self.milli.fetch_add(self.deposit, Ordering::Relaxed);
        }
    }

    pub fn try_spend(&self) -> bool {
        self.milli
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                (m >= 1000).then_some(m - 1000)
            })
            .is_ok()
    }
}

/// What all workers' copies of a pool share: the backends (in-flight counts, reachability,
/// ejection), the admission queue in front of them and the retry budget.
#[derive(Debug)]
pub struct PoolShared {
    pub backends: Vec<Arc<Backend>>,
    /// Shared by every generation of the pool (a reload keeps the waiters).
    pub queue: Arc<AdmissionQueue<InFlight>>,
    pub retry_budget: RetryBudget,
    pub retries: RetryConfig,
    pub ejection: EjectionConfig,
    /// Backends gray keys avoid while one outside this mask can serve (0: no pinning).
    pub gray_exclude: u64,
    /// Running sums of the backends' weights, for weighted sampling.
    cumulative: Vec<u32>,
}

/// splitmix64's finaliser: a well-mixed 64-bit hash of `x`.
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a over `bytes`: the same value in every replica (affinity keys).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Bit of backend `i` in an exclusion mask (backends past 64 are never excluded).
pub fn bit(i: usize) -> u64 {
    if i < 64 { 1 << i } else { 0 }
}

impl PoolShared {
    /// Weights and labels are read from `cfg` (a backend kept by a reload takes them over only
    /// once the whole new configuration is built).
    fn new(
        backends: Vec<Arc<Backend>>,
        queue: Arc<AdmissionQueue<InFlight>>,
        cfg: &PoolConfig,
    ) -> Self {
        let pinned = cfg.gray_pin_label.as_deref().map_or(0, |label| {
            cfg.backends
                .iter()
                .enumerate()
                .filter(|(_, b)| b.labels.iter().any(|l| l == label))
                .fold(0u64, |m, (i, _)| m | bit(i))
        });
        let gray_exclude = if pinned == 0 { 0 } else { !pinned };
        let mut sum = 0u32;
        let cumulative = cfg
            .backends
            .iter()
            .map(|b| {
                sum = sum.saturating_add(weight_of(b));
                sum
            })
            .collect();
        Self {
            backends,
            queue,
            retry_budget: RetryBudget::new(cfg.retries.budget_ratio),
            retries: cfg.retries,
            ejection: cfg.ejection,
            gray_exclude,
            cumulative,
        }
    }

    /// A free slot, chosen by weighted power of two choices: two backends drawn with
    /// probability proportional to their weight, the one with fewer requests in flight per
    /// unit of weight wins (the first drawn on a tie, so idle traffic follows the weights). Backends that are down, ejected,
    /// draining, full or in `exclude` are skipped; when neither drawn one can take the request,
    /// the least loaded of all that can does. `None` when none can.
    pub fn try_acquire(self: &Arc<Self>) -> Option<InFlight> {
        self.try_acquire_excluding(0)
    }

    pub fn try_acquire_excluding(self: &Arc<Self>, exclude: u64) -> Option<InFlight> {
        let n = self.backends.len();
        if n == 0 {
            return None;
        }
        let usable = |i: usize| -> Option<u32> {
            let b = &self.backends[i];
            if exclude & bit(i) != 0 || !b.eligible() {
                return None;
            }
            // In slow start a backend takes only its ramp's share of the draws.
            if b.up_since.load(Ordering::Relaxed) != 0 {
                let ramp = b.ramp();
                if ramp < 1.0 && rand::random::<f64>() >= ramp {
                    return None;
                }
            }
            b.has_room()
        };
        // Fewer in flight per unit of weight: n_a / w_a < n_b / w_b. Idle backends tie, and
        // the first drawn wins a tie: idle traffic follows the weighted draw.
        // With load-aware pools the backend's own count (all gateways') counts when larger.
        let load = |(i, f): (usize, u32)| -> u64 {
            u64::from(f.max(self.backends[i].remote_load.load(Ordering::Relaxed)))
        };
        let better = |a: (usize, u32), b: (usize, u32)| -> bool {
            load(a) * u64::from(self.backends[b.0].weight())
                < load(b) * u64::from(self.backends[a.0].weight())
        };
        for round in 0..8 {
            let pick = if n == 1 {
                usable(0).map(|f| (0, f))
            } else if round == 0 {
                let (a, b) = self.draw_two();
                match (usable(a).map(|f| (a, f)), usable(b).map(|f| (b, f))) {
                    (Some(x), Some(y)) => Some(if better(y, x) { y } else { x }),
                    (Some(x), None) | (None, Some(x)) => Some(x),
                    (None, None) => self.scan(&usable, &better),
                }
            } else {
                self.scan(&usable, &better)
            };
            let (i, f) = pick?;
            // Another thread may have taken that slot since: then look again.
            if self.backends[i]
                .in_flight
                .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Some(InFlight {
                    pool: self.clone(),
                    index: i,
                });
            }
        }
        None
    }

    /// A slot on the backend preferred for `key` (rendezvous hashing over the usable
    /// backends, so every replica prefers the same one and only a removed backend's keys move),
    /// unless it is overloaded — more than twice the least loaded backend's requests and more
    /// than `slack` above them — or full: then the usual choice.
    pub fn try_acquire_affine(
        self: &Arc<Self>,
        key: u64,
        exclude: u64,
        slack: u32,
    ) -> Option<InFlight> {
        let mut best: Option<(usize, u32, u64)> = None;
        let mut min_load = u64::MAX;
        for (i, b) in self.backends.iter().enumerate() {
            if exclude & bit(i) != 0 || !b.eligible() {
                continue;
            }
            let f = b.in_flight.load(Ordering::SeqCst);
            let load = u64::from(f.max(b.remote_load.load(Ordering::Relaxed)));
            min_load = min_load.min(load);
            let cap = b.capacity();
            if cap != 0 && f >= cap {
                continue;
            }
            let score = mix64(key ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            if best.is_none_or(|(_, _, s)| score > s) {
                best = Some((i, f, score));
            }
        }
        if let Some((i, f, _)) = best {
            let b = &self.backends[i];
            let load = u64::from(f.max(b.remote_load.load(Ordering::Relaxed)));
            let fair = min_load
                .saturating_mul(2)
                .max(min_load.saturating_add(u64::from(slack)));
            if load <= fair
                && b.in_flight
                    .compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                return Some(InFlight {
                    pool: self.clone(),
                    index: i,
                });
            }
        }
        self.try_acquire_excluding(exclude)
    }

    fn scan(
        &self,
        usable: &impl Fn(usize) -> Option<u32>,
        better: &impl Fn((usize, u32), (usize, u32)) -> bool,
    ) -> Option<(usize, u32)> {
        let mut best: Option<(usize, u32)> = None;
        for i in 0..self.backends.len() {
            if let Some(f) = usable(i)
                && best.is_none_or(|b| better((i, f), b))
            {
                best = Some((i, f));
            }
        }
        best
    }

    /// Two distinct backends, each drawn with probability proportional to its weight (with
    /// two backends, one draw decides which comes first).
    fn draw_two(&self) -> (usize, usize) {
        let total = self.cumulative.last().copied().unwrap_or(1).max(1);
        let draw = || {
            let r = rand::random_range(0..total);
            self.cumulative.partition_point(|&c| c <= r)
        };
        let a = draw();
        if self.backends.len() == 2 {
            return (a, 1 - a);
        }
        let mut b = draw();
        if b == a {
            b = draw();
        }
        if b == a {
            b = (a + 1) % self.backends.len();
        }
        (a, b)
    }

    /// Some backend may take requests now or later (not down, not draining).
    pub fn any_usable(&self) -> bool {
        self.backends.iter().any(|b| {
            b.reachability() != Reachability::Down
                && !b.draining.load(Ordering::Relaxed)
                && !b.removed.load(Ordering::Relaxed)
        })
    }

    /// The first choice for a routed request: avoiding `avoid` (gray pinning) while another
    /// backend can take it, on its affinity backend when it has one (and that one is not
    /// overloaded).
    pub fn try_acquire_routed(
        self: &Arc<Self>,
        avoid: u64,
        affinity: Option<(u64, u32)>,
    ) -> Option<InFlight> {
        let first = |exclude| match affinity {
            Some((key, slack)) => self.try_acquire_affine(key, exclude, slack),
            None => self.try_acquire_excluding(exclude),
        };
        first(avoid).or_else(|| (avoid != 0).then(|| self.try_acquire()).flatten())
    }

    /// Give free slots to waiting requests (after a slot was freed or a backend came back).
    pub fn dispatch(self: &Arc<Self>) {
        if self.queue.has_waiters() {
            self.queue.dispatch(|| self.try_acquire());
        }
    }
}

impl Slots for PoolShared {
    type Slot = InFlight;

    fn queue(&self) -> &AdmissionQueue<InFlight> {
        &self.queue
    }

    fn try_take(self: &Arc<Self>) -> Option<InFlight> {
        self.try_acquire()
    }

    fn any_usable(&self) -> bool {
        PoolShared::any_usable(self)
    }
}

/// Holds one in-flight slot on a backend; released on drop, whatever ends the request, and
/// handed straight to the next waiting request if there is one.
#[derive(Debug)]
pub struct InFlight {
    pool: Arc<PoolShared>,
    index: usize,
}

impl InFlight {
    pub fn backend(&self) -> &Arc<Backend> {
        &self.pool.backends[self.index]
    }

    /// The pool generation the slot was taken from.
    pub fn shared(&self) -> &Arc<PoolShared> {
        &self.pool
    }

    /// The backend's position in the pool generation the slot was taken from (the bit a retry
    /// excludes).
    pub fn position(&self) -> usize {
        self.index
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.backends[self.index]
            .in_flight
            .fetch_sub(1, Ordering::SeqCst);
        self.pool.dispatch();
    }
}

#[derive(Debug)]
pub struct Pool {
    pub model: Arc<str>,
    /// Position among the pools (of this generation).
    pub index: usize,
    /// Its metrics slot: stable across reloads, never reused for another pool.
    pub slot: usize,
    /// The next backend metrics slot to hand out.
    next_backend_slot: usize,
    /// The name the backends serve the model under, and the same as a JSON string literal
    /// (a request naming an alias gets it spliced in).
    pub served_name: Arc<str>,
    pub served_json: Bytes,
    pub upstream_auth: Option<HeaderValue>,
    pub timeouts: Timeouts,
    pub backends: Vec<Arc<Backend>>,
    pub shared: Arc<PoolShared>,
    pub client: UpstreamClient,
    /// Environments whose keys may use this pool (`None`: all).
    pub environments: Option<Vec<crate::key::Environment>>,
    /// (minimum estimated prompt tokens, index of the pool that takes them).
    pub long_prompt: Option<(u64, usize)>,
    pub affinity: Option<crate::config::AffinityConfig>,
    config: PoolConfig,
}

impl Pool {
    /// Build a pool from its config. With `prev` (the same model's pool before a reload), its
    /// backends that are still configured unchanged are kept with their state, its admission
    /// queue (with its waiters) and its upstream client are kept, and its metrics slots.
    fn new(
        cfg: &PoolConfig,
        index: usize,
        slot: usize,
        queue: &QueueConfig,
        prev: Option<&Pool>,
    ) -> io::Result<Self> {
        let upstream_auth = match &cfg.upstream_api_key {
            Some(k) => Some(bearer(k.expose(), &cfg.model)?),
            None => None,
        };
        let mut next_backend_slot = prev.map_or(0, |p| p.next_backend_slot);
        let mut backends = Vec::with_capacity(cfg.backends.len());
        for b in &cfg.backends {
            let fresh = Backend::new(b, next_backend_slot, cfg, upstream_auth.as_ref())?;
            let kept = prev.and_then(|p| p.backends.iter().find(|o| o.same_as(&fresh)));
            match kept {
                Some(old) => backends.push(old.clone()),
                None => {
                    next_backend_slot += 1;
                    backends.push(Arc::new(fresh));
                }
            }
        }
        let served = cfg.served_model_name.as_deref().unwrap_or(&cfg.model);
        let served_json = Bytes::from(serde_json::to_vec(served).map_err(io::Error::other)?);
        let queue = match prev {
            Some(p) => p.shared.queue.clone(),
            None => Arc::new(AdmissionQueue::new(queue.max_size, queue.max_per_key)),
        };
        let shared = Arc::new(PoolShared::new(backends.clone(), queue, cfg));
        let client = client_for(cfg, prev)?;
        Ok(Self {
            model: Arc::from(cfg.model.as_str()),
            index,
            slot,
            next_backend_slot,
            served_name: Arc::from(served),
            served_json,
            upstream_auth,
            timeouts: cfg.timeouts,
            backends,
            shared,
            client,
            environments: cfg.environments.clone(),
            long_prompt: None,
            affinity: cfg.affinity,
            config: cfg.clone(),
        })
    }

    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// A slot on the least loaded backend with room, without queueing. `None` when every
    /// backend is down or full.
    pub fn acquire(&self) -> Option<InFlight> {
        self.shared.try_acquire()
    }
}

/// `prev`'s client (its open keep-alive connections) while the settings a client is built
/// from — extra CA, connect timeout — are unchanged; else a new one.
fn client_for(cfg: &PoolConfig, prev: Option<&Pool>) -> io::Result<UpstreamClient> {
    match prev {
        Some(p)
            if p.config.ca_file == cfg.ca_file
                && p.config.timeouts.connect == cfg.timeouts.connect =>
        {
            Ok(p.client.clone())
        }
        _ => build_client(cfg),
    }
}

fn build_client(cfg: &PoolConfig) -> io::Result<UpstreamClient> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &cfg.ca_file {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?;
        for cert in certs {
            let cert = cert.map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?;
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(io::Error::other)?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(cfg.timeouts.connect));
    http.set_keepalive(Some(Duration::from_secs(30)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(https))
}

/// A `/v1/models` body (OpenAI list shape) naming these pools' models.
fn models_list_body<'a>(pools: impl Iterator<Item = &'a Pool>) -> Bytes {
    let data: Vec<serde_json::Value> = pools
        .flat_map(|p| {
            std::iter::once(&*p.model)
                .chain(p.config.aliases.iter().map(String::as_str))
                .map(|id| {
                    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "fleetgate"})
                })
        })
        .collect();
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
            .unwrap_or_default(),
    )
}

/// All pools, by the model name clients send.
#[derive(Debug)]
pub struct Pools {
    pools: Vec<Pool>,
    /// The next pool metrics slot to hand out.
    next_slot: usize,
    by_model: HashMap<Arc<str>, usize>,
    /// "`a`, `b`" — for the model-not-found message.
    pub model_list: String,
    /// The `/v1/models` body, built once.
    pub models_body: Bytes,
}

impl Pools {
    pub fn new(cfgs: &[PoolConfig], queue: &QueueConfig) -> io::Result<Self> {
        Self::build(cfgs, queue, None)
    }

    /// The pools of `cfgs`, continuing `prev` when given (a reload): a pool whose model was
    /// served before keeps its queue, client, metrics slot and the backends still configured
    /// unchanged (with their state and in-flight counts). Backends of `prev` not kept are
    /// not touched here: see `retired_since`.
    pub fn build(
        cfgs: &[PoolConfig],
        queue: &QueueConfig,
        prev: Option<&Pools>,
    ) -> io::Result<Self> {
        let mut next_slot = prev.map_or(0, |p| p.next_slot);
        let mut pools = Vec::with_capacity(cfgs.len());
        for (i, c) in cfgs.iter().enumerate() {
            let old = prev.and_then(|p| p.iter().find(|o| *o.model == *c.model));
            let slot = match old {
                Some(o) => o.slot,
                None => {
                    next_slot += 1;
                    next_slot - 1
                }
            };
            pools.push(Pool::new(c, i, slot, queue, old)?);
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
        let model_list = pools
            .iter()
            .map(|p| format!("`{}`", p.model))
            .collect::<Vec<_>>()
            .join(", ");
        let models_body = models_list_body(pools.iter());
        // Everything is built: kept backends take their new weights, capacities and labels.
        for p in &pools {
            for (b, c) in p.backends.iter().zip(&p.config.backends) {
                b.configure(c, &p.config);
            }
        }
        Ok(Self {
            pools,
            next_slot,
            by_model,
            model_list,
            models_body,
        })
    }

    /// The `/v1/models` body for one key: only the models it may use.
    pub fn models_for(&self, key: &crate::key::KeyRecord) -> Bytes {
        let usable = |p: &Pool| {
            key.allows_model(&p.model)
                && p.environments
                    .as_ref()
                    .is_none_or(|e| e.contains(&key.environment))
        };
        if self.pools.iter().all(usable) {
            return self.models_body.clone();
        }
        models_list_body(self.pools.iter().filter(|p| usable(p)))
    }

    /// The same pools and backends (shared in-flight counts and reachability) with upstream
    /// clients of their own: each worker thread uses its own, so an upstream connection's task
    /// always runs on the thread that relays its body. With `prev` (the worker's pools before a
    /// reload), a pool's client is kept while its TLS and connect settings are unchanged, so
    /// open keep-alive connections stay in use.
    pub fn fork(&self, prev: Option<&Pools>) -> io::Result<Self> {
        let pools = self
            .pools
            .iter()
            .map(|p| {
                let client = client_for(&p.config, prev.and_then(|v| v.get_exact(&p.model)))?;
                Ok(Pool {
                    model: p.model.clone(),
                    index: p.index,
                    slot: p.slot,
                    next_backend_slot: p.next_backend_slot,
                    served_name: p.served_name.clone(),
                    served_json: p.served_json.clone(),
                    upstream_auth: p.upstream_auth.clone(),
                    timeouts: p.timeouts,
                    backends: p.backends.clone(),
                    shared: p.shared.clone(),
                    client,
                    environments: p.environments.clone(),
                    long_prompt: p.long_prompt,
                    affinity: p.affinity,
                    config: p.config.clone(),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            pools,
            next_slot: self.next_slot,
            by_model: self.by_model.clone(),
            model_list: self.model_list.clone(),
            models_body: self.models_body.clone(),
        })
    }

    /// Backends of `prev` that these pools no longer hold.
    pub fn retired_since<'a>(&self, prev: &'a Pools) -> Vec<(&'a Pool, &'a Arc<Backend>)> {
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

    /// Every backend with its state, as `/readyz` and `GET /admin/backends` show them.
    pub fn backends_json(&self) -> Vec<serde_json::Value> {
        self.pools
            .iter()
            .flat_map(|p| {
                p.backends.iter().map(move |b| {
                    serde_json::json!({
                        "model": &*p.model,
                        "backend": &*b.base,
                        "state": b.state().as_str(),
                        "in_flight": b.in_flight.load(Ordering::Relaxed),
                        "capacity": b.capacity(),
                        "weight": b.weight(),
                        "labels": &*b.labels(),
                        "ewma_ttft_ms": b.ewma_ttft().map(|d| d.as_secs_f64() * 1e3),
                        "remote_load": p.config.load_aware.as_ref().map(|_| b.remote_load.load(Ordering::Relaxed)),
                        "kv_cache_usage": p.config.load_aware.as_ref().map(|_| b.kv_usage()),
                        "last_error": b.last_error().as_deref().cloned(),
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

    pub fn iter(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter()
    }

    /// At least one backend answered its last probe (or served a request).
    pub fn any_reachable(&self) -> bool {
        self.pools
            .iter()
            .flat_map(|p| &p.backends)
            .any(|b| b.reachability() == Reachability::Up)
    }

    /// Scrape every load-aware pool's backends' `/metrics` on the pool's interval until
    /// `stop`.
    pub async fn load_loop(&self, stop: CancellationToken) {
        let mut loops = Vec::new();
        for pool in &self.pools {
            let Some(la) = pool.config.load_aware.clone() else {
                continue;
            };
            let stop = stop.clone();
            loops.push(async move {
                loop {
                    futures_util::future::join_all(pool.backends.iter().map(|b| scrape(pool, b)))
                        .await;
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(la.interval) => {}
                    }
                }
            });
        }
        futures_util::future::join_all(loops).await;
    }

    pub async fn probe_once(&self) {
        let probes = self
            .pools
            .iter()
            .flat_map(|pool| pool.backends.iter().map(move |b| probe(pool, b)));
        futures_util::future::join_all(probes).await;
    }
}

/// One health probe: `GET <base><health.path>`. `unhealthy_threshold` failures in a row take
/// the backend down; `healthy_threshold` successes in a row bring it back — through warm-up
/// when the pool has one.
async fn probe(pool: &Pool, backend: &Backend) {
    let mut req = Request::get(backend.health_uri.clone());
    if let Some(auth) = &backend.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let Ok(req) = req.body(Full::new(Bytes::new())) else {
        return;
    };
    let health = &pool.config.health;
    let result = tokio::time::timeout(health.timeout, async {
        let resp = pool.client.request(req).await?;
        let ok = resp.status().is_success();
        // Drain so the connection goes back to the pool.
        let _ = resp.into_body().collect().await;
        Ok::<bool, hyper_util::client::legacy::Error>(ok)
    })
    .await;
    let ok = matches!(result, Ok(Ok(true)));
    let state = backend.reachability();
    if !ok {
        backend.probes_ok.store(0, Ordering::Relaxed);
        let bad = backend.probes_bad.fetch_add(1, Ordering::Relaxed) + 1;
        let why = match &result {
            Ok(Ok(_)) => format!("{} answered an error", health.path),
            Ok(Err(e)) => format!("{} failed: {e}", health.path),
            Err(_) => format!(
                "{} did not answer within {} ms",
                health.path,
                health.timeout.as_millis()
            ),
        };
        backend.set_last_error(&why);
        if bad >= health.unhealthy_threshold && state != Reachability::Down {
            tracing::warn!(backend = %backend.base, error = %why, "backend failed its health probe");
            backend.mark(Reachability::Down);
        }
        return;
    }
    backend.probes_bad.store(0, Ordering::Relaxed);
    let good = backend.probes_ok.fetch_add(1, Ordering::Relaxed) + 1;
    let warming = backend.warming.load(Ordering::Relaxed);
    if state == Reachability::Up && !warming {
        return;
    }
    if good < health.healthy_threshold && state == Reachability::Down {
        return;
    }
    if warming {
        if let Err(why) = warm_up(pool, backend).await {
            backend.set_last_error(&why);
            tracing::warn!(backend = %backend.base, error = %why, "backend warm-up failed; trying again at the next probe");
            return;
        }
        backend.warming.store(false, Ordering::Relaxed);
        tracing::info!(backend = %backend.base, requests = pool.config.warmup.requests, "backend warmed up");
    }
    if state != Reachability::Up {
        tracing::info!(backend = %backend.base, "backend reachable");
    }
    backend.mark(Reachability::Up);
    // Waiting requests may be served by a backend that came back.
    pool.shared.dispatch();
}

/// Read a backend's own load from its Prometheus text: vLLM's running + waiting requests and
/// KV-cache usage. An unreadable answer counts as no information (load 0: local counts only).
async fn scrape(pool: &Pool, backend: &Backend) {
    let mut req = Request::get(backend.metrics_uri.clone());
    if let Some(auth) = &backend.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let Ok(req) = req.body(Full::new(Bytes::new())) else {
        return;
    };
    let text = tokio::time::timeout(pool.config.health.timeout, async {
        let resp = pool.client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .ok()
            .map(|c| c.to_bytes())
    })
    .await
    .ok()
    .flatten();
    let (load, kv) = text.as_deref().map_or((0.0, 0.0), vllm_load);
    backend.remote_load.store(
        load.clamp(0.0, f64::from(u32::MAX)) as u32,
        Ordering::Relaxed,
    );
    backend
        .kv_usage_permille
        .store((kv.clamp(0.0, 1.0) * 1000.0) as u32, Ordering::Relaxed);
}

/// (running + waiting, KV-cache usage) summed over a vLLM `/metrics` text's series.
pub fn vllm_load(text: &[u8]) -> (f64, f64) {
    let text = String::from_utf8_lossy(text);
    let mut load = 0.0;
    let mut kv: f64 = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        match name {
            "vllm:num_requests_running" | "vllm:num_requests_waiting" => load += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => kv = kv.max(value),
            _ => {}
        }
    }
    (load, kv)
}

/// Send the pool's warm-up requests (a small non-streaming completion each) to `backend`;
/// all must succeed.
async fn warm_up(pool: &Pool, backend: &Backend) -> Result<(), String> {
    let w = &pool.config.warmup;
    let body = Bytes::from(
        serde_json::json!({
            "model": &*pool.served_name,
            "messages": [{"role": "user", "content": &w.prompt}],
            "max_tokens": 1,
            "stream": false,
        })
        .to_string(),
    );
    let limit = pool.timeouts.first_token.min(Duration::from_secs(60));
    for i in 0..w.requests {
        let mut req = Request::post(backend.chat_uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &backend.upstream_auth {
            req = req.header(http::header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(Full::new(body.clone()))
            .map_err(|e| e.to_string())?;
        let status = tokio::time::timeout(limit, async {
            let resp = pool.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            Ok::<_, String>(status)
        })
        .await
        .map_err(|_| {
            format!(
                "warm-up request {} timed out after {} ms",
                i + 1,
                limit.as_millis()
            )
        })??;
        if !status.is_success() {
            return Err(format!("warm-up request {} answered {status}", i + 1));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_cfg(n: usize) -> PoolConfig {
        PoolConfig::new(
            "m",
            (0..n)
                .map(|i| format!("http://127.0.0.1:{}", 10 + i).parse().unwrap())
                .collect(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn slow_start_ramps_the_share_up() {
        let mut cfg = pool_cfg(1);
        cfg.warmup.slow_start = Duration::from_secs(10);
        let b = Backend::new(&cfg.backends[0], 0, &cfg, None).unwrap();
        b.mark(Reachability::Up);
        assert!((b.ramp() - 0.05).abs() < 1e-9, "a floor at once");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!((b.ramp() - 0.5).abs() < 0.01);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(b.ramp(), 1.0);
        assert_eq!(
            b.up_since.load(Ordering::Relaxed),
            0,
            "no clock reads after the ramp"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ejection_backs_off_exponentially_and_success_resets_it() {
        let cfg = pool_cfg(1);
        let b = Backend::new(&cfg.backends[0], 0, &cfg, None).unwrap();
        let e = EjectionConfig {
            consecutive_failures: 2,
            base: Duration::from_secs(1),
            max: Duration::from_secs(4),
        };
        assert!(!b.record_failure(&e, "x"));
        assert!(b.record_failure(&e, "x"));
        assert!(!b.eligible());
        assert_eq!(b.state(), BackendState::Ejected);
        tokio::time::advance(Duration::from_millis(1200)).await;
        assert!(b.eligible(), "first ejection ≤ 1.2 s");
        // Second ejection in a row: about 2 s.
        b.record_failure(&e, "x");
        b.record_failure(&e, "x");
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(!b.eligible());
        tokio::time::advance(Duration::from_millis(1000)).await;
        assert!(b.eligible());
        // Capped at max (4 s ± 20 %) however many follow.
        for _ in 0..10 {
            b.record_failure(&e, "x");
            b.record_failure(&e, "x");
        }
        tokio::time::advance(Duration::from_millis(4900)).await;
        assert!(b.eligible());
        b.record_success();
        b.record_failure(&e, "x");
        assert!(b.record_failure(&e, "x"));
        tokio::time::advance(Duration::from_millis(1200)).await;
        assert!(b.eligible(), "a success resets the backoff");
    }

    #[test]
    fn affinity_prefers_one_backend_until_it_is_overloaded() {
        let pools = Pools::new(&[pool_cfg(3)], &QueueConfig::default()).unwrap();
        let shared = &pools.get("m").unwrap().shared;
        let key = fnv1a(b"\"alice\"");
        let first = shared.try_acquire_affine(key, 0, 2).unwrap();
        let preferred = first.position();
        let second = shared.try_acquire_affine(key, 0, 2).unwrap();
        assert_eq!(second.position(), preferred, "same key, same backend");
        // Two in flight there, none elsewhere: 2 ≤ max(2 × 0, 0 + 2) still; a third is too many.
        let third = shared.try_acquire_affine(key, 0, 2).unwrap();
        assert_eq!(third.position(), preferred);
        let fourth = shared.try_acquire_affine(key, 0, 2).unwrap();
        assert_ne!(
            fourth.position(),
            preferred,
            "an overloaded preference is skipped"
        );
        // Other keys spread over the backends.
        drop((first, second, third, fourth));
        let mut used = std::collections::HashSet::new();
        for u in 0..64u32 {
            let s = shared
                .try_acquire_affine(fnv1a(&u.to_le_bytes()), 0, 2)
                .unwrap();
            used.insert(s.position());
        }
        assert_eq!(used.len(), 3);
    }

    #[test]
    fn reads_vllm_load() {
        let text = b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"a\"} 7.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 3\nvllm:num_requests_waiting_by_reason{r=\"x\"} 99\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.42\n";
        let (load, kv) = vllm_load(text);
        assert_eq!(load, 10.0);
        assert!((kv - 0.42).abs() < 1e-9);
        assert_eq!(vllm_load(b"<html>not metrics</html>"), (0.0, 0.0));
    }

    #[test]
    fn weighted_draws_follow_the_weights() {
        let mut cfg = pool_cfg(3);
        for (b, w) in cfg.backends.iter_mut().zip([1, 2, 7]) {
            b.weight = w;
        }
        let pools = Pools::new(&[cfg], &QueueConfig::default()).unwrap();
        let shared = &pools.get("m").unwrap().shared;
        let mut firsts = [0u32; 3];
        for _ in 0..10_000 {
            let (a, b) = shared.draw_two();
            assert_ne!(a, b);
            firsts[a] += 1;
        }
        // Expected 1000 / 2000 / 7000.
        assert!((800..1200).contains(&firsts[0]), "{firsts:?}");
        assert!((1750..2250).contains(&firsts[1]), "{firsts:?}");
        assert!((6700..7300).contains(&firsts[2]), "{firsts:?}");
    }
}
