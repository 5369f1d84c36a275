//! Backend pools: which backends serve a model, the upstream HTTP client each pool uses, the
//! least-in-flight choice among a pool's backends with a per-backend capacity (beyond it
//! requests wait in the pool's admission queue, see `crate::queue`), and a light reachability
//! probe for `/readyz`. (Weights, warm-up and load-aware balancing come later.)

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio_util::sync::CancellationToken;

use crate::config::{PoolConfig, QueueConfig, Timeouts};
use crate::queue::{AdmissionQueue, Place, Ticket, TimedOut};

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
    /// Position in its pool.
    pub index: usize,
    pub chat_uri: Uri,
    pub completions_uri: Uri,
    pub health_uri: Uri,
    pub in_flight: AtomicU32,
    reachability: AtomicU8,
}

impl Backend {
    fn new(base: &Uri, index: usize) -> io::Result<Self> {
        let text = base.to_string();
        let trimmed = text.trim_end_matches('/');
        let join = |p: &str| -> io::Result<Uri> {
            format!("{trimmed}{p}")
                .parse()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e}")))
        };
        Ok(Self {
            base: Arc::from(trimmed),
            index,
            chat_uri: join("/v1/chat/completions")?,
            completions_uri: join("/v1/completions")?,
            health_uri: join("/health")?,
            in_flight: AtomicU32::new(0),
            reachability: AtomicU8::new(Reachability::Unknown as u8),
        })
    }

    pub fn reachability(&self) -> Reachability {
        match self.reachability.load(Ordering::Relaxed) {
            1 => Reachability::Up,
            2 => Reachability::Down,
            _ => Reachability::Unknown,
        }
    }

    pub fn mark(&self, r: Reachability) {
        self.reachability.store(r as u8, Ordering::Relaxed);
    }
}

/// What all workers' copies of a pool share: the backends (in-flight counts, reachability),
/// the per-backend capacity and the admission queue in front of them.
#[derive(Debug)]
pub struct PoolShared {
    pub backends: Vec<Arc<Backend>>,
    /// Requests one backend serves at once (0: no cap).
    pub capacity: u32,
    pub queue: AdmissionQueue<InFlight>,
}

impl PoolShared {
    /// A free slot on the least loaded backend not known to be down, if any has one.
    pub fn try_acquire(self: &Arc<Self>) -> Option<InFlight> {
        for _ in 0..8 {
            let mut best: Option<(usize, u32)> = None;
            for (i, b) in self.backends.iter().enumerate() {
                if b.reachability() == Reachability::Down {
                    continue;
                }
                let n = b.in_flight.load(Ordering::SeqCst);
                if self.capacity > 0 && n >= self.capacity {
                    continue;
                }
                if best.is_none_or(|(_, m)| n < m) {
                    best = Some((i, n));
                }
            }
            let (i, n) = best?;
            // Another thread may have taken that slot since: then look again.
            if self.backends[i]
                .in_flight
                .compare_exchange(n, n + 1, Ordering::SeqCst, Ordering::SeqCst)
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

    /// Some backend is not known to be down (a waiter could ever be served).
    pub fn any_usable(&self) -> bool {
        self.backends
            .iter()
            .any(|b| b.reachability() != Reachability::Down)
    }

    /// Give free slots to waiting requests (after a slot was freed or a backend came back).
    pub fn dispatch(self: &Arc<Self>) {
        if self.queue.has_waiters() {
            self.queue.dispatch(|| self.try_acquire());
        }
    }
}

/// A request's place in a pool's admission queue, owning its pool (so it can outlive the
/// request handler: a streaming request that waits while `: queued` comments go out). Dropping
/// it leaves the queue.
pub struct Waiting {
    pool: Arc<PoolShared>,
    place: Option<Place<InFlight>>,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting")
    }
}

impl Waiting {
    pub fn new(pool: Arc<PoolShared>, ticket: Ticket<'_, InFlight>) -> Self {
        Self {
            place: ticket.detach(),
            pool,
        }
    }

    /// Wait for a slot, at most `max_wait`.
    pub async fn wait(mut self, max_wait: std::time::Duration) -> Result<InFlight, TimedOut> {
        match self.place.as_mut() {
            Some(p) => p.recv(max_wait).await,
            None => Err(TimedOut),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(p) = &self.place {
            self.pool.queue.leave(p);
        }
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
    /// Position among the pools.
    pub index: usize,
    /// Replacement for the `model` value, as a JSON string literal, when the backends serve
    /// the model under another name.
    pub rename_json: Option<Bytes>,
    pub upstream_auth: Option<HeaderValue>,
    pub timeouts: Timeouts,
    pub backends: Vec<Arc<Backend>>,
    pub shared: Arc<PoolShared>,
    pub client: UpstreamClient,
    /// Environments whose keys may use this pool (`None`: all).
    pub environments: Option<Vec<crate::auth::key::Environment>>,
    config: PoolConfig,
}

impl Pool {
    fn new(cfg: &PoolConfig, index: usize, queue: &QueueConfig) -> io::Result<Self> {
        let backends = cfg
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| Backend::new(b, i).map(Arc::new))
            .collect::<io::Result<Vec<_>>>()?;
        let rename_json = match &cfg.served_model_name {
            Some(name) if name != &cfg.model => Some(Bytes::from(
                serde_json::to_vec(name).map_err(io::Error::other)?,
            )),
            _ => None,
        };
        let upstream_auth = match &cfg.upstream_api_key {
            Some(k) => {
                let mut v = HeaderValue::try_from(format!("Bearer {}", k.expose())).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("pool `{}`: upstream_api_key holds characters not allowed in a header", cfg.model),
                    )
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let shared = Arc::new(PoolShared {
            backends: backends.clone(),
            capacity: cfg.max_in_flight_per_backend,
            queue: AdmissionQueue::new(queue.max_size, queue.max_per_key),
        });
        Ok(Self {
            model: Arc::from(cfg.model.as_str()),
            index,
            rename_json,
            upstream_auth,
            timeouts: cfg.timeouts,
            backends,
            shared,
            client: build_client(cfg)?,
            environments: cfg.environments.clone(),
            config: cfg.clone(),
        })
    }

    /// A slot on the least loaded backend with room, without queueing. `None` when every
    /// backend is down or full.
    pub fn acquire(&self) -> Option<InFlight> {
        self.shared.try_acquire()
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
        .map(|p| {
            serde_json::json!({"id": &*p.model, "object": "model", "created": 0, "owned_by": "fleetgate"})
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
    by_model: HashMap<Arc<str>, usize>,
    /// "`a`, `b`" — for the model-not-found message.
    pub model_list: String,
    /// The `/v1/models` body, built once.
    pub models_body: Bytes,
}

impl Pools {
    pub fn new(cfgs: &[PoolConfig], queue: &QueueConfig) -> io::Result<Self> {
        let pools = cfgs
            .iter()
            .enumerate()
            .map(|(i, c)| Pool::new(c, i, queue))
            .collect::<io::Result<Vec<_>>>()?;
        let by_model = pools
            .iter()
            .enumerate()
            .map(|(i, p)| (p.model.clone(), i))
            .collect();
        let model_list = pools
            .iter()
            .map(|p| format!("`{}`", p.model))
            .collect::<Vec<_>>()
            .join(", ");
        let models_body = models_list_body(pools.iter());
        Ok(Self {
            pools,
            by_model,
            model_list,
            models_body,
        })
    }

    /// The `/v1/models` body for one key: only the models it may use.
    pub fn models_for(&self, key: &crate::auth::KeyRecord) -> Bytes {
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
    /// always runs on the thread that relays its body.
    pub fn fork(&self) -> io::Result<Self> {
        let pools = self
            .pools
            .iter()
            .map(|p| {
                Ok(Pool {
                    model: p.model.clone(),
                    index: p.index,
                    rename_json: p.rename_json.clone(),
                    upstream_auth: p.upstream_auth.clone(),
                    timeouts: p.timeouts,
                    backends: p.backends.clone(),
                    shared: p.shared.clone(),
                    client: build_client(&p.config)?,
                    environments: p.environments.clone(),
                    config: p.config.clone(),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            pools,
            by_model: self.by_model.clone(),
            model_list: self.model_list.clone(),
            models_body: self.models_body.clone(),
        })
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

    /// Probe every backend's `/health` on an interval until `stop` is cancelled.
    pub async fn probe_loop(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        loop {
            self.probe_once().await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }

    pub async fn probe_once(&self) {
        let probes = self
            .pools
            .iter()
            .flat_map(|pool| pool.backends.iter().map(move |b| probe(pool, b)));
        futures_util::future::join_all(probes).await;
    }
}

async fn probe(pool: &Pool, backend: &Backend) {
    let mut req = Request::get(backend.health_uri.clone());
    if let Some(auth) = &pool.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let Ok(req) = req.body(Full::new(Bytes::new())) else {
        return;
    };
    let timeout = pool.timeouts.connect + Duration::from_secs(2);
    let result = tokio::time::timeout(timeout, async {
        let resp = pool.client.request(req).await?;
        let ok = resp.status().is_success();
        // Drain so the connection goes back to the pool.
        let _ = resp.into_body().collect().await;
        Ok::<bool, hyper_util::client::legacy::Error>(ok)
    })
    .await;
    let state = match result {
        Ok(Ok(true)) => Reachability::Up,
        Ok(Ok(false)) | Ok(Err(_)) | Err(_) => Reachability::Down,
    };
    if backend.reachability() != state {
        match state {
            Reachability::Up => tracing::info!(backend = %backend.base, "backend reachable"),
            _ => tracing::warn!(backend = %backend.base, "backend failed its health probe"),
        }
    }
    backend.mark(state);
    if state == Reachability::Up {
        // Waiting requests may be served by a backend that came back.
        pool.shared.dispatch();
    }
}
