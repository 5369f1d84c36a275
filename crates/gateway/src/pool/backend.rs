//! One backend's state: reachability, ejection with backoff, slow start, draining, warm-up,
//! the EWMA of its TTFT and its last error, as the balancer, the probes and the admin API read
//! them.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use bytes::Bytes;
use http::{HeaderValue, Uri};

use crate::clock::mono_ms;
use crate::config::{BackendConfig, EjectionConfig, PoolConfig};
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::TABLE;

/// Reachability as last observed (probe or real traffic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reachability {
    Unknown = 0,
    Up = 1,
    Down = 2,
}

/// A backend's last failure, as `GET /admin/backends` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastError {
    pub message: String,
    /// Wall-clock epoch milliseconds.
    pub(crate) at_ms: i64,
}

#[derive(Debug)]
pub struct Backend {
    /// Base URL as configured (log and error text; never a label from a client).
    pub base: Arc<str>,
    /// Its name, `<model>#<metrics index>`: what clients are told instead of its address.
    pub(crate) name: Arc<str>,
    /// How clients' error messages name it: `name`, or its address when the server says so
    /// (`server.expose_backend_addresses`). Operators see `base` and `name` in the admin API,
    /// `base` in the logs and the metrics.
    pub(crate) shown: Arc<str>,
    /// Its metrics index in the pool: stable across reloads (a request recorded after a reload
    /// still lands on its backend's series), never reused for another backend.
    pub(crate) metrics_index: usize,
    /// Its URI of each route of the endpoint table, made once (`uri`).
    uris: Box<[Uri]>,
    pub(crate) health_uri: Uri,
    pub(crate) metrics_uri: Uri,
    /// The `Host` every request to it carries (its authority), made once.
    pub(crate) host: HeaderValue,
    pub in_flight: AtomicU32,
    /// Requests running + waiting on the backend by its own `/metrics` (all gateways' and
    /// anyone else's), when the pool is load-aware; 0 otherwise or when unread.
    pub remote_load: AtomicU32,
    /// Of `remote_load`, what was not this gateway's own (`in_flight` when the scrape was
    /// sent): the other replicas' and anyone else's requests at the last scrape. A backend's
    /// load is this plus this gateway's own requests now (`load`), so a replica sees its own
    /// choices at once and the others' at the next scrape.
    others_load: AtomicU32,
    /// What its engines' KV events say they hold, when the pool subscribes to them (set by
    /// `Fleet::kv_events_loop`).
    pub(crate) engine_cache: ArcSwapOption<super::engine_cache::EngineCache>,
    /// Prompt tokens this gateway sent it (KV-event routing) that are not prefilled yet: the
    /// prompts of its requests without a first token, less what the engine held of each.
    pub(crate) prefill_pending: AtomicU64,
    /// Prompt tokens the other replicas sent it (longest-prefix routing, shared through
    /// Redis) that are not prefilled yet: the sum of each replica's last published count.
    pub(crate) others_prefill: AtomicU64,
    /// Its engine's KV event port when it is not the pool's (`kv_events_port`).
    pub(crate) kv_events_port: Option<u16>,
    /// Its engine publishes KV events (`kv_events = false`: its cache is estimated).
    pub(crate) kv_events: bool,
    /// Its KV-cache usage in thousandths, from the same scrape.
    pub(super) kv_usage_permille: AtomicU32,
    /// Share of new requests relative to the pool's other backends (a reload may change it).
    weight: AtomicU32,
    /// Requests served at once (0: no cap; a reload may change it).
    capacity: AtomicU32,
    labels: ArcSwap<Vec<String>>,
    /// No longer configured (a reload or DNS removed it): takes no new requests; the ones in
    /// flight finish.
    pub(super) removed: AtomicBool,
    /// `Authorization` sent to this backend (its own key, else the pool's).
    pub(crate) upstream_auth: Option<HeaderValue>,
    /// The part of a forwarded request's head that this backend decides: the longest request
    /// line of its endpoints, `Host` and `Authorization` (the head limit counts it).
    pub(crate) head_bytes: usize,
    reachability: AtomicU8,
    /// Consecutive connect errors / 5xx answers.
    failures: AtomicU32,
    /// Ejections in a row (the backoff exponent); reset by a success.
    ejections: AtomicU32,
    /// `mono_ms()` until which the backend gets no new requests (0: not ejected).
    ejected_until: AtomicU64,
    pub(super) draining: AtomicBool,
    /// Consecutive good and failed health probes.
    pub(super) probes_ok: AtomicU32,
    pub(super) probes_bad: AtomicU32,
    /// Must pass warm-up requests before it takes traffic (new, or back from down).
    pub(super) warming: AtomicBool,
    warmup_required: bool,
    /// `mono_ms()` when it last became healthy, while its slow start lasts (0: full share).
    pub(super) up_since: AtomicU64,
    slow_start_ms: u64,
    /// Exponentially weighted mean upstream TTFT in µs (f64 bits; 0: none yet).
    ewma_ttft_us: AtomicU64,
    last_error: ArcSwapOption<LastError>,
    pub(super) models_uri: Uri,
    /// `GET /v1/models` refused the gateway's upstream key: the backend stays down (whatever
    /// its `/health` says, which needs no key) until the check passes.
    pub(super) misconfigured: AtomicBool,
    /// `GET /v1/models` was read since the backend was configured or came back from down.
    pub(super) card_checked: AtomicBool,
    /// What the backend says about the pool's model (vLLM's ModelCard: `max_model_len`,
    /// `root`, `created`, …), served by the gateway's `/v1/models`.
    model_card: ArcSwapOption<serde_json::Value>,
    /// The LoRA adapters its `/v1/models` lists (`adapters`).
    adapters: arc_swap::ArcSwap<super::adapters::Served>,
    /// `mono_ms()` of the last `GET /v1/models` (its cards and adapters).
    pub(super) models_read_ms: AtomicU64,
    /// The card's `max_model_len` (0: not said): the context length the pool's
    /// `context_window_fallbacks` are decided by.
    max_model_len: AtomicU32,
    /// The `system_fingerprint` of the last usage chunk seen from this backend: put into the
    /// finish chunks of streams whose usage chunk the gateway removes (the relay).
    fingerprint: ArcSwapOption<Bytes>,
}

/// `POST <path> HTTP/1.1`, `host: <authority>` and `authorization: <value>`, each with its
/// line end, for the longest of `uris`.
fn head_bytes(uris: &[Uri], auth: Option<&HeaderValue>) -> usize {
    let line = |name: usize, value: usize| name + 2 + value + 2;
    let path = uris
        .iter()
        .map(|u| u.path_and_query().map_or(1, |p| p.as_str().len()))
        .max()
        .unwrap_or(1);
    let host = uris[0].authority().map_or(0, |a| a.as_str().len());
    "POST ".len()
        + path
        + " HTTP/1.1\r\n".len()
        + line("host".len(), host)
        + auth.map_or(0, |a| line("authorization".len(), a.len()))
}

/// A backend's state as the admin API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendState {
    Healthy,
    Unknown,
    Down,
    Warming,
    Ejected,
    Draining,
    Removed,
    /// Refuses the gateway's upstream key (`GET /v1/models` answered 401/403).
    Misconfigured,
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
            BackendState::Misconfigured => "misconfigured",
        }
    }
}

impl Backend {
    pub(super) fn new(
        cfg: &BackendConfig,
        metrics_index: usize,
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
        // (The rows naming a stored response get their template path: never sent, their
        // requests carry their own target.)
        let uris = TABLE
            .iter()
            .map(|row| join(row.path))
            .collect::<io::Result<Box<[Uri]>>>()?;
        let head_bytes = head_bytes(&uris, upstream_auth.as_ref());
        let authority = uris[0].authority().map_or("", |a| a.as_str());
        let host = HeaderValue::from_str(authority)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e}")))?;
        let name: Arc<str> = Arc::from(format!("{model}#{metrics_index}"));
        let shown = if pool.expose_backend_addresses {
            Arc::from(trimmed)
        } else {
            name.clone()
        };
        Ok(Self {
            base: Arc::from(trimmed),
            name,
            shown,
            host,
            metrics_index,
            uris,
            health_uri: join(&pool.health.path)?,
            metrics_uri: join(
                pool.load_aware
                    .as_ref()
                    .map_or("/metrics", |l| l.metrics_path.as_str()),
            )?,
            in_flight: AtomicU32::new(0),
            remote_load: AtomicU32::new(0),
            others_load: AtomicU32::new(0),
            kv_usage_permille: AtomicU32::new(0),
            engine_cache: ArcSwapOption::empty(),
            prefill_pending: AtomicU64::new(0),
            others_prefill: AtomicU64::new(0),
            kv_events_port: cfg.kv_events_port,
            kv_events: cfg.kv_events,
            weight: AtomicU32::new(weight_of(cfg)),
            capacity: AtomicU32::new(capacity_of(cfg, pool)),
            labels: ArcSwap::from_pointee(cfg.labels.clone()),
            removed: AtomicBool::new(false),
            upstream_auth,
            head_bytes,
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
            models_uri: join("/v1/models")?,
            misconfigured: AtomicBool::new(false),
            card_checked: AtomicBool::new(false),
            model_card: ArcSwapOption::empty(),
            max_model_len: AtomicU32::new(0),
            adapters: arc_swap::ArcSwap::from_pointee(super::adapters::Served::default()),
            models_read_ms: AtomicU64::new(0),
            fingerprint: ArcSwapOption::empty(),
        })
    }

    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    pub fn labels(&self) -> Arc<Vec<String>> {
        self.labels.load_full()
    }

    /// The same backend as `fresh` (built from a reloaded config): same address, credentials,
    /// probe and warm-up settings. Such a backend is kept across a reload, with its state and
    /// in-flight count; only its weight, capacity and labels are taken from `fresh`.
    pub(super) fn same_as(&self, fresh: &Backend) -> bool {
        self.base == fresh.base
            && self.upstream_auth == fresh.upstream_auth
            && self.health_uri == fresh.health_uri
            && self.metrics_uri == fresh.metrics_uri
            && self.warmup_required == fresh.warmup_required
            && self.slow_start_ms == fresh.slow_start_ms
            && self.kv_events_port == fresh.kv_events_port
    }

    /// Take the weight, capacity and labels of `cfg` (a reload), and count as configured.
    pub(super) fn configure(&self, cfg: &BackendConfig, pool: &PoolConfig) {
        // A reload checks the key and reads the card again (the served name may have changed).
        self.card_checked.store(false, Ordering::Relaxed);
        self.weight.store(weight_of(cfg), Ordering::Relaxed);
        self.capacity
            .store(capacity_of(cfg, pool), Ordering::Relaxed);
        if **self.labels.load() != cfg.labels {
            self.labels.store(Arc::new(cfg.labels.clone()));
        }
        self.removed.store(false, Ordering::Relaxed);
    }

    /// Removed from the configuration: no new requests.
    pub(crate) fn retire(&self) {
        self.removed.store(true, Ordering::Relaxed);
    }

    pub(crate) fn reachability(&self) -> Reachability {
        match self.reachability.load(Ordering::Relaxed) {
            1 => Reachability::Up,
            2 => Reachability::Down,
            _ => Reachability::Unknown,
        }
    }

    pub(crate) fn mark(&self, r: Reachability) {
        let was = self.reachability.swap(r as u8, Ordering::Relaxed);
        if r == Reachability::Down {
            // Back from down means warm-up again, and a restarted server may serve another
            // model length: its card is read again. (One comparison on the request path's
            // `mark(Up)`, as before.)
            if self.warmup_required {
                self.warming.store(true, Ordering::Relaxed);
            }
            self.card_checked.store(false, Ordering::Relaxed);
            // A restarted server may be another version: its fingerprint is learned again.
            self.fingerprint.store(None);
        }
        if r == Reachability::Up && was != Reachability::Up as u8 && self.slow_start_ms > 0 {
            self.up_since.store(mono_ms(), Ordering::Relaxed);
        }
    }

    /// The share of draws a backend in slow start accepts (1: full).
    pub(super) fn ramp(&self) -> f64 {
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
    pub(crate) fn eligible(&self) -> bool {
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

    /// The backend's card for the pool's model, from its last `GET /v1/models`.
    pub(crate) fn model_card(&self) -> Option<Arc<serde_json::Value>> {
        self.model_card.load_full()
    }

    pub(super) fn set_model_card(&self, card: Option<serde_json::Value>) {
        let len = card
            .as_ref()
            .and_then(|c| c.get("max_model_len")?.as_u64())
            .map_or(0, |l| u32::try_from(l).unwrap_or(u32::MAX));
        self.max_model_len.store(len, Ordering::Relaxed);
        self.model_card.store(card.map(Arc::new));
    }

    /// The LoRA adapters its `/v1/models` listed last.
    pub(crate) fn adapters(&self) -> arc_swap::Guard<Arc<super::adapters::Served>> {
        self.adapters.load()
    }

    pub(super) fn set_adapters(&self, served: super::adapters::Served) {
        self.adapters.store(Arc::new(served));
    }

    /// The context length the backend's `/v1/models` card says (`max_model_len`), if any.
    pub(crate) fn max_model_len(&self) -> Option<u32> {
        Some(self.max_model_len.load(Ordering::Relaxed)).filter(|l| *l > 0)
    }

    /// The `system_fingerprint` this backend's last usage chunk carried.
    pub(crate) fn fingerprint(&self) -> Option<Bytes> {
        self.fingerprint.load().as_deref().cloned()
    }

    /// What a usage chunk said (`None`: no fingerprint); stored only when it changed, so a
    /// stream pays a comparison, not an allocation.
    pub(crate) fn learn_fingerprint(&self, seen: Option<&[u8]>) {
        if self.fingerprint.load().as_deref().map(|b| &b[..]) != seen {
            self.fingerprint
                .store(seen.map(|v| Arc::new(Bytes::copy_from_slice(v))));
        }
    }

    /// Its URI of `endpoint`'s route, made when the backend was configured.
    pub(crate) fn uri(&self, endpoint: Endpoint) -> &Uri {
        &self.uris[endpoint.index()]
    }

    /// The URI of `path_and_query` on this backend (a path naming a stored response, or a
    /// query string passed through): formatted per request, only for those.
    pub(crate) fn uri_for(&self, path_and_query: &str) -> Option<Uri> {
        let mut text = String::with_capacity(self.base.len() + path_and_query.len());
        text.push_str(&self.base);
        text.push_str(path_and_query);
        text.parse().ok()
    }

    pub fn state(&self) -> BackendState {
        if self.removed.load(Ordering::Relaxed) {
            BackendState::Removed
        } else if self.misconfigured.load(Ordering::Relaxed) {
            BackendState::Misconfigured
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
    pub(crate) fn record_success(&self) {
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
    pub(crate) fn record_failure(&self, cfg: &EjectionConfig, why: &str) -> bool {
        self.set_last_error(why);
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
    pub(crate) fn observe_ttft(&self, d: std::time::Duration) {
        let x = d.as_secs_f64() * 1e6;
        let old = f64::from_bits(self.ewma_ttft_us.load(Ordering::Relaxed));
        let new = if old == 0.0 { x } else { old + 0.2 * (x - old) };
        self.ewma_ttft_us.store(new.to_bits(), Ordering::Relaxed);
    }

    /// The mean upstream TTFT (None before the first).
    pub(crate) fn ewma_ttft(&self) -> Option<std::time::Duration> {
        let v = f64::from_bits(self.ewma_ttft_us.load(Ordering::Relaxed));
        (v > 0.0).then(|| std::time::Duration::from_secs_f64(v / 1e6))
    }

    /// The last failure seen (request, probe or warm-up) and when; cleared when the backend
    /// comes back up.
    pub fn last_error(&self) -> Option<Arc<LastError>> {
        self.last_error.load_full()
    }

    pub(crate) fn set_last_error(&self, why: &str) {
        self.last_error.store(Some(Arc::new(LastError {
            message: why.to_owned(),
            at_ms: crate::clock::wall_ms(),
        })));
    }

    pub(crate) fn clear_last_error(&self) {
        self.last_error.store(None);
    }

    /// Its load with `f` of this gateway's requests in flight on it: those plus the others'
    /// at the last scrape (load-aware pools; else just `f`).
    pub(crate) fn load(&self, f: u32) -> u64 {
        u64::from(f) + u64::from(self.others_load.load(Ordering::Relaxed))
    }

    /// A scrape's reading: `remote` requests running and waiting on the backend, of which
    /// `own` were this gateway's when the scrape was sent (a request the engine has not seen
    /// yet, or one it has finished, can make `own` the larger: then nobody else's).
    pub(crate) fn set_remote_load(&self, remote: u32, own: u32) {
        self.remote_load.store(remote, Ordering::Relaxed);
        self.others_load
            .store(remote.saturating_sub(own), Ordering::Relaxed);
    }

    /// Another replica sent it a request (its record came through Redis): one more of the
    /// others' until the next scrape counts them all again. Load-aware pools only (nothing
    /// else would ever count them down).
    pub(crate) fn count_others_request(&self) {
        self.others_load.fetch_add(1, Ordering::Relaxed);
    }

    /// KV-cache usage (0..1) from the last scrape, if the pool is load-aware.
    pub(crate) fn kv_usage(&self) -> f64 {
        f64::from(self.kv_usage_permille.load(Ordering::Relaxed)) / 1000.0
    }

    pub(super) fn has_room(&self) -> Option<u32> {
        self.has_room_within(1)
    }

    /// Room within `times` its capacity (the in-flight count now).
    pub(super) fn has_room_within(&self, times: u32) -> Option<u32> {
        let n = self.in_flight.load(Ordering::SeqCst);
        let cap = self.capacity().saturating_mul(times);
        (cap == 0 || n < cap).then_some(n)
    }
}

/// A backend's share of new requests (≥ 1).
pub(super) fn weight_of(cfg: &BackendConfig) -> u32 {
    cfg.weight.max(1)
}

/// A backend's own capacity, else its pool's (0: no cap).
fn capacity_of(cfg: &BackendConfig, pool: &PoolConfig) -> u32 {
    cfg.capacity.unwrap_or(pool.max_in_flight_per_backend)
}

pub(super) fn bearer(key: &str, model: &str) -> io::Result<HeaderValue> {
    let mut v = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("pool `{model}`: upstream_api_key holds characters not allowed in a header"),
        )
    })?;
    v.set_sensitive(true);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pool::pool_cfg;

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
}
