//! The listener: accepts TCP (optionally TLS via rustls, ALPN h2 / http/1.1), serves HTTP/1.1
//! and HTTP/2 (prior knowledge or ALPN) on each connection, routes requests, and drains
//! in-flight streams on shutdown within the grace period.
//!
//! `router::route` routes each request by method and path (open routes such as `/healthz`
//! answer there), creates its `RequestRecord`, and hands a forwarded route to
//! `proxy::forward`, whose phases docs/architecture.md lists.
//!
//! One worker thread per core, each a single-threaded event loop with its own upstream clients,
//! accepts from the one socket. TCP_NODELAY; hyper-util's auto server (HTTP/1.1, and h2 by prior
//! knowledge or ALPN) with keep-alive; one request-head limit for both protocols
//! (`server.max_request_head_bytes`); connection caps per listener and per address
//! (`conn_limit`).

pub mod conn_limit;
pub mod idle;
pub mod reload;
pub mod router;
pub mod tls;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::admin::AdminState;
use crate::auth::Authenticator;
use crate::config::Config;
use crate::key::KeyRecord;
use crate::pool::Generation;
use crate::pool::fleet::{Fleet, ReloadError, ReloadSummary};
use crate::proxy::{self, state::ProxyState};
use crate::rx_time::{self, RxClock, Side, StampedStream};
use crate::store::{KeyStore, StoreError};
use crate::telemetry::Recorder;
use crate::telemetry::metrics::RequestMetrics;
use conn_limit::{AcceptBackoff, ConnLimit, ConnPermit};

/// Everything the request path reads, built once at start.
#[derive(Debug)]
pub struct AppState {
    pub proxy: Arc<ProxyState>,
}

impl AppState {
    /// This worker's pools as they are now.
    pub fn pools(&self) -> Arc<Generation> {
        self.proxy.generation.load_full()
    }

    pub fn auth(&self) -> &Arc<Authenticator> {
        &self.proxy.auth
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("key store ({where_}): {source}")]
    Store { where_: String, source: StoreError },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("admin API: {0}")]
    Admin(#[from] crate::admin::jwt::KeyConfigError),
    #[error("tracing: {0}")]
    Tracing(#[from] crate::telemetry::otel::StartError),
}

/// How a listener stops: the grace period for in-flight requests, and the signal that ends
/// the streams still open after it (the API listener's).
struct Drain {
    grace: Duration,
    streams_end: Option<CancellationToken>,
}

/// After the grace period: how long the streams still open get to write their last events.
const FINAL_WRITES: Duration = Duration::from_secs(1);

/// Client connections open at once on the admin listener.
const ADMIN_MAX_CONNECTIONS: usize = 256;

/// A running gateway: the API listener, the admin listener and their background tasks.
pub struct Server {
    pub local_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub tls: bool,
    pub auth: Arc<Authenticator>,
    pub registry: prometheus::Registry,
    /// The pools (backends' in-flight counts, admission queues), live: see `reload`.
    pub fleet: Arc<Fleet>,
    pub limits: Arc<crate::limits::Limits>,
    shutdown: CancellationToken,
    /// Stops the background writers (request log, Redis token settlements) once the workers
    /// are done, so the last rows and settlements are still written.
    writers_stop: CancellationToken,
    tasks: TaskTracker,
    workers: Vec<tokio::sync::oneshot::Receiver<()>>,
    /// `server.shutdown_grace`, for the shutdown's log line.
    grace: Duration,
}

impl Server {
    /// Bind, connect the key store, start everything. Returns once listening.
    pub async fn start(config: &Config) -> Result<Server, StartError> {
        let recorder = Recorder::new(config.server.request_log_events);
        let listener = listen(config.server.listen, config.server.listen_backlog).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on {}: {e}", config.server.listen),
            )
        })?;
        Self::start_on(listener, config, recorder).await
    }

    /// Serve on an already bound listener (tests bind 127.0.0.1:0), recording into `recorder`.
    pub async fn start_on(
        listener: TcpListener,
        config: &Config,
        mut recorder: Recorder,
    ) -> Result<Server, StartError> {
        let (store, keys) = open_store(config).await?;
        let registry = prometheus::Registry::new();
        let auth = Arc::new(Authenticator::new(
            store,
            config.auth.clone(),
            keys,
            &registry,
        )?);
        let fleet =
            Arc::new(Fleet::start(pools_of(config), config.queue.clone(), Some(&registry)).await?);
        let metrics = Arc::new(RequestMetrics::new(&registry, &fleet.current())?);
        let relayout = metrics.clone();
        fleet.on_relayout(Arc::new(move |generation, removed| {
            relayout.relayout(generation, removed);
        }));
        recorder.set_metrics(metrics.clone());
        let shutdown = CancellationToken::new();
        let writers_stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let limits = crate::limits::Limits::start(
            config.limits.clone(),
            Some(crate::limits::LimitMetrics::new(&metrics.rejections)),
            Some(&registry),
            &tasks,
            shutdown.child_token(),
            writers_stop.clone(),
        )
        .await?;
        if config.request_log.enabled {
            let log = crate::telemetry::request_log::start(
                auth.store().clone(),
                config.request_log.clone(),
                &registry,
                writers_stop.clone(),
                &tasks,
            )?;
            recorder.set_request_log(log);
        }
        if let Some(export) = &config.tracing.export {
            recorder.set_tracing(crate::telemetry::otel::Pipeline::start(
                export,
                &registry,
                &tasks,
                writers_stop.clone(),
            )?);
        }
        let recorder = Arc::new(recorder);
        let tls = match &config.server.tls {
            Some(t) => Some(tls::acceptor(&t.cert, &t.key)?),
            None => None,
        };
        let admin_listener = bind_admin(config).await?;
        let admin_tls = match &config.admin.tls {
            Some(t) => Some(tls::acceptor(&t.cert, &t.key)?),
            None => None,
        };
        let conn_metrics = conn_limit::ConnMetrics::new(&registry)?;
        let descriptors = conn_limit::raise_descriptor_limit();
        let max_connections = match config.server.max_connections {
            0 => conn_limit::derived_max_connections(descriptors),
            n => n,
        };
        tracing::info!(
            max_connections,
            descriptor_limit = descriptors,
            "client connections capped (server.max_connections)"
        );
        let api_limit = ConnLimit::new(
            "api",
            max_connections,
            &config.server,
            Some(conn_metrics.clone()),
        );
        let local_addr = listener.local_addr()?;
        let admin_addr = match &admin_listener {
            Some(l) => Some(l.local_addr()?),
            None => None,
        };
        tasks.spawn(
            fleet
                .clone()
                .probe_loop(config.server.health_interval, shutdown.child_token()),
        );
        tasks.spawn(crate::auth::sync::run(auth.clone(), shutdown.child_token()));
        tasks.spawn(fleet.clone().load_loop(shutdown.child_token()));
        tasks.spawn(fleet.clone().discovery_loop(shutdown.child_token()));
        tasks.spawn(limits.clone().prune_loop(shutdown.child_token()));
        // Longest-prefix records cross to the other replicas through the limits' Redis
        // (whichever pools route by longest prefix, now or after a reload).
        let prefix_share = match limits.shared() {
            Some(shared) => Some(crate::proxy::prefix_share::PrefixShare::start(
                shared.link(),
                fleet.clone(),
                config.server.max_body_bytes,
                Some(&registry),
                &tasks,
                shutdown.child_token(),
            )?),
            _ => None,
        };
        let grace = config.server.shutdown_grace;
        if let Some(admin_listener) = admin_listener {
            let admin = Arc::new(AdminState {
                auth: auth.clone(),
                verifier: crate::admin::jwt::Verifier::new(&config.admin)
                    .map_err(StartError::Admin)?,
                registry: registry.clone(),
                fleet: fleet.clone(),
                metrics: metrics.clone(),
                limits: limits.clone(),
                prefix_share: prefix_share.clone(),
                tls: config.admin.tls.is_some(),
                console: crate::admin::console::Console::new(
                    &config.admin,
                    crate::admin::console::ApiAddress {
                        scheme: if config.server.tls.is_some() {
                            "https"
                        } else {
                            "http"
                        },
                        host: (!local_addr.ip().is_unspecified()).then(|| match local_addr.ip() {
                            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
                            ip @ std::net::IpAddr::V4(_) => ip.to_string(),
                        }),
                        port: local_addr.port(),
                    },
                ),
            });
            let admin_service = crate::admin::middleware::service(admin);
            // The admin listener has its own places, so operators get in when the API
            // listener is full.
            let admin_limit = ConnLimit::new(
                "admin",
                ADMIN_MAX_CONNECTIONS,
                &config.server,
                Some(conn_metrics),
            );
            tasks.spawn(accept_loop(
                admin_listener,
                admin_tls,
                shutdown.clone(),
                Drain {
                    grace,
                    streams_end: None,
                },
                admin_limit,
                move |req, _peer, _arrival| {
                    let served = admin_service.clone().oneshot(req);
                    async move {
                        match served.await {
                            Ok(resp) => resp,
                            Err(never) => match never {},
                        }
                    }
                },
            ));
        }
        let is_tls = tls.is_some();
        // Cancelled by the workers when the grace period runs out: the streams still open end
        // with an error event.
        let streams_end = CancellationToken::new();
        // Each worker's own state: its own copy of the pools (its own upstream clients), the
        // rest shared.
        // One map of stored responses for every worker (each has its own copy of the pools;
        // a pin names its backend by address).
        let pins = Arc::new(
            crate::proxy::pins::Pins::new(
                config.server.response_pin_capacity,
                config.server.response_pin_ttl,
            )
            .shared(
                limits
                    .shared()
                    .map(crate::limits::shared::Shared::pin_store),
            ),
        );
        // One bound on the bodies still arriving for every worker.
        let pending_bodies = Arc::new(crate::proxy::body::PendingBodies::new(
            config.server.max_pending_body_bytes,
            config.server.max_pending_body_bytes_per_key,
        ));
        let worker_state = || -> Result<ProxyState, StartError> {
            Ok(ProxyState {
                pins: pins.clone(),
                prefix_share: prefix_share.clone(),
                generation: fleet.for_worker()?,
                max_body_bytes: config.server.max_body_bytes,
                max_audio_body_bytes: config.server.max_audio_body_bytes,
                body_timeouts: crate::proxy::body::BodyTimeouts {
                    total: config.server.body_timeout,
                    idle: config.server.body_idle_timeout,
                },
                pending_bodies: pending_bodies.clone(),
                max_stream_line: config.server.max_stream_line_bytes,
                forwarding: crate::proxy::headers::Forwarding::new(&config.server),
                head_limits: crate::proxy::headers::HeadLimits {
                    max_head: config.server.max_upstream_head_bytes,
                    max_value: config.server.max_upstream_header_value_bytes,
                },
                recorder: recorder.clone(),
                auth: auth.clone(),
                limits: limits.clone(),
                queue: config.queue.clone(),
                queue_metrics: Some(crate::queue::QueueMetrics::new(&metrics.rejections)),
                closing: proxy::state::Closing {
                    token: streams_end.child_token(),
                    grace,
                },
            })
        };
        let worker_done = spawn_workers(
            listener,
            config,
            worker_state,
            tls,
            api_limit,
            &shutdown,
            &streams_end,
        )?;
        tasks.close();
        Ok(Server {
            local_addr,
            admin_addr,
            tls: is_tls,
            auth,
            registry,
            fleet,
            limits,
            shutdown,
            writers_stop,
            tasks,
            workers: worker_done,
            grace: config.server.shutdown_grace,
        })
    }

    pub fn base_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.local_addr)
    }

    /// Stop accepting, let in-flight streams finish within the grace period, then return.
    pub async fn shutdown(mut self) {
        // Said once here for every listener and worker (each logs only what is its own: a
        // grace period that ran out on it).
        tracing::info!(
            grace_s = self.grace.as_secs_f64(),
            "stopped accepting; draining in-flight requests"
        );
        self.shutdown.cancel();
        for done in std::mem::take(&mut self.workers) {
            let _ = done.await;
        }
        self.writers_stop.cancel();
        self.tasks.wait().await;
        tracing::info!("drained: every connection closed, the last log rows written");
    }

    /// The pools as they are now.
    pub fn pools(&self) -> Arc<Generation> {
        self.fleet.current()
    }

    /// Apply `config`'s `[[pools]]` without a restart: streams in flight continue on the
    /// backends they started on. Other sections need a restart; the caller is told which
    /// differ (`Config::restart_needed_for`).
    pub fn reload(&self, config: &Config) -> Result<ReloadSummary, ReloadError> {
        self.fleet.reload(pools_of(config))
    }

    /// Resolves when shutdown has been requested.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }
}

/// Bind `addr` with an accept queue of `backlog` (as `TcpListener::bind` does, SO_REUSEADDR on,
/// but with our backlog instead of tokio's 1 024). Warns when the kernel caps it lower.
pub fn listen(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    if let Some(cap) = somaxconn()
        && cap < backlog
    {
        tracing::warn!(
            listen_backlog = backlog,
            somaxconn = cap,
            "the kernel caps the listen backlog at net.core.somaxconn: in a reconnect storm, \
             connections past it have their SYN dropped and wait 1 s to retry; raise \
             net.core.somaxconn (sysctl) to at least server.listen_backlog"
        );
    }
    socket.listen(backlog)
}

/// `net.core.somaxconn`, the kernel's cap on any listen backlog (Linux; None elsewhere).
fn somaxconn() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Connect to the key store, migrate it when asked, and read every key.
async fn open_store(config: &Config) -> Result<(KeyStore, Vec<KeyRecord>), StartError> {
    let where_ = config.database.describe();
    let store_err = |source| StartError::Store {
        where_: where_.clone(),
        source,
    };
    let store = KeyStore::connect(&config.database)
        .await
        .map_err(store_err)?;
    if config.migrate_on_start {
        let applied = store.migrate().await.map_err(store_err)?;
        if applied > 0 {
            tracing::info!(applied, store = %where_, "migrations applied");
        }
    }
    let keys = store.load_all().await.map_err(store_err)?;
    tracing::info!(keys = keys.len(), store = %where_, "key snapshot loaded");
    Ok((store, keys))
}

/// The admin listener, when `admin.listen` names one.
async fn bind_admin(config: &Config) -> Result<Option<TcpListener>, StartError> {
    let Some(addr) = config.admin.listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot listen on {addr} (admin.listen): {e}"),
        )
    })?;
    Ok(Some(listener))
}

/// The request path runs on worker threads, each with its own single-threaded event loop,
/// accepting from the same listening socket: a request, its upstream connection and its relay
/// stay on one thread, so no frame crosses threads (the way nginx workers run). Backends'
/// in-flight counts and the key snapshot are shared. `worker_state` gives each worker its
/// state. Each returned receiver completes when its worker has ended.
fn spawn_workers(
    listener: TcpListener,
    config: &Config,
    worker_state: impl Fn() -> Result<ProxyState, StartError>,
    tls: Option<TlsAcceptor>,
    limit: Arc<ConnLimit>,
    shutdown: &CancellationToken,
    streams_end: &CancellationToken,
) -> Result<Vec<tokio::sync::oneshot::Receiver<()>>, StartError> {
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let grace = config.server.shutdown_grace;
    let std_listener = listener.into_std()?;
    // Accepted sockets inherit the option: each request's first bytes carry the kernel's
    // arrival stamp, the start of the hop cost.
    match rx_time::enable(&std_listener) {
        Ok(()) => tracing::debug!("kernel receive timestamps on"),
        Err(e) => tracing::warn!(
            error = %e,
            "no kernel receive timestamps: the hop cost (hop_us, fleetgate_hop_added_seconds, \
             Server-Timing hop) is not recorded, only the in-process overhead"
        ),
    }
    let mut worker_done = Vec::with_capacity(workers);
    for i in 0..workers {
        let state = Arc::new(AppState {
            proxy: Arc::new(worker_state()?),
        });
        let sock = std_listener.try_clone()?;
        let tls = tls.clone();
        let limit = limit.clone();
        let stop = shutdown.clone();
        let streams_end = streams_end.clone();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_park(idle::parked)
            .build()?;
        std::thread::Builder::new()
            .name(format!("fleetgate-worker-{i}"))
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(sock) {
                        Ok(listener) => {
                            accept_loop(
                                listener,
                                tls,
                                stop,
                                Drain {
                                    grace,
                                    streams_end: Some(streams_end),
                                },
                                limit,
                                move |req, peer, arrival| {
                                    router::route(state.clone(), req, peer, arrival)
                                },
                            )
                            .await
                        }
                        Err(e) => tracing::error!(error = %e, "worker cannot use the listener"),
                    }
                });
                // The runtime (and any connection still open past the grace) ends here.
                drop(runtime);
                let _ = done_tx.send(());
            })?;
        worker_done.push(done_rx);
    }
    Ok(worker_done)
}

impl Drop for Server {
    /// A server dropped without `shutdown` still stops: its worker threads drain and exit.
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.writers_stop.cancel();
    }
}

/// Serve `listener` until `shutdown`, within `limit`'s bounds (connections, timeouts, the
/// largest request head read, the same for HTTP/1.1 and HTTP/2).
async fn accept_loop<H, F, B>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
    drain: Drain,
    limit: Arc<ConnLimit>,
    handler: H,
) where
    H: Fn(Request<Incoming>, SocketAddr, Option<Instant>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // One head limit for both protocols, above what is forwarded (`proxy::headers::check_head`
    // answers a head the backends would refuse with its own 431): HTTP/1.1 reads the head into
    // a buffer of at most `max_buf_size` (hyper's default ~400 KiB, at most 100 fields), HTTP/2
    // announces `SETTINGS_MAX_HEADER_LIST_SIZE` (h2's default 16 KiB). Beyond it, hyper and h2
    // answer a bare 431 themselves. Between requests on a kept-alive HTTP/1.1 connection,
    // hyper's header timer runs from the end of the last response: it is the idle timeout too.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limit.keepalive_timeout)
        .max_buf_size(limit.max_head)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .max_header_list_size(u32::try_from(limit.max_head).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let graceful = GracefulShutdown::new();
    // Connection tasks live in a set so that the ones still open after the grace period can be
    // aborted, and so none outlives the server.
    let mut conns = JoinSet::new();
    let mut backoff = AcceptBackoff::default();
    let mut place: Option<ConnPermit> = None;
    loop {
        if place.is_none() {
            place = limit.try_acquire();
        }
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            // At the cap: stop accepting until a connection closes (new ones wait in the
            // listen backlog).
            p = limit.acquire(), if place.is_none() => {
                place = p;
                continue;
            }
            accepted = listener.accept(), if place.is_some() => match accepted {
                Ok(a) => {
                    backoff.reset();
                    a
                }
                Err(e) => {
                    limit.count("accept_error");
                    let wait = backoff.on_error(&e, limit.listener());
                    if !wait.is_zero() {
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                    continue;
                }
            },
        };
        // One address never holds more than its share of the places: past it the connection
        // is closed at once, and the place stays for the next one.
        let Some(address_place) = limit.admit(peer.ip()) else {
            drop(stream);
            continue;
        };
        let Some(permit) = place.take() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        // The kernel's arrival stamp of each request's first bytes (`rx_time`).
        let clock = Arc::new(RxClock::new(Side::Client));
        let stream = StampedStream::new(stream, clock.clone());
        // Set when the connection's first request head has arrived: until then the
        // connection lives only `limit.header_timeout`.
        let started = Arc::new(AtomicBool::new(false));
        let started_by_request = started.clone();
        let service = hyper::service::service_fn(move |req| {
            started_by_request.store(true, Ordering::Relaxed);
            // Boxed: hyper's HTTP/1 connection keeps the allocation of its service future for
            // the connection's life (and an HTTP/2 stream's task, the future's size beside its
            // body), so an inline request future — every phase's state, kilobytes — would stay
            // allocated while the stream it answered is relayed. Boxed, the connection keeps a
            // pointer, and the request's state is freed when its response head is out.
            let fut = Box::pin(handler(req, peer, clock.take_arrival()));
            async move { Ok::<_, std::convert::Infallible>(fut.await) }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let acceptor = tls.clone();
        let limit = limit.clone();
        conns.spawn(async move {
            // The address's place is freed before the listener's: a client waiting at the cap
            // is accepted as soon as the listener's place frees, and must find its address's
            // share freed already (in the other order it could be closed as over its share).
            let _places = (address_place, permit);
            let deadline = tokio::time::sleep(limit.header_timeout);
            let serve = async move {
                let result = match acceptor {
                    None => {
                        let conn = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .into_owned();
                        watcher.watch(conn).await
                    }
                    Some(acceptor) => {
                        let tls_stream = match acceptor.accept(stream).await {
                            Ok(s) => s,
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                        };
                        let conn = builder
                            .serve_connection(TokioIo::new(tls_stream), service)
                            .into_owned();
                        watcher.watch(conn).await
                    }
                };
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            };
            tokio::pin!(serve);
            tokio::select! {
                () = &mut serve => {}
                () = deadline => {
                    if started.load(Ordering::Relaxed) {
                        serve.await;
                    } else {
                        limit.count("header_timeout");
                        tracing::debug!(%peer, "no request head in time; connection closed");
                    }
                }
            }
        });
    }
    drop(listener);
    let grace = drain.grace;
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    if tokio::time::timeout(grace, &mut drained).await.is_ok() {
        tracing::debug!(listener = limit.name(), "connections drained");
    } else {
        tracing::warn!(
            listener = limit.name(),
            open = conns.len(),
            "grace period over; ending the remaining streams with a `gateway_shutdown` error"
        );
        // Each stream still open writes its error event, `[DONE]` and its chunked terminator
        // (HTTP/1.1 connections then close); what has not finished in a moment is cut.
        if let Some(end) = &drain.streams_end {
            end.cancel();
            if tokio::time::timeout(FINAL_WRITES, &mut drained)
                .await
                .is_err()
            {
                tracing::warn!(
                    listener = limit.name(),
                    open = conns.len(),
                    "closing the remaining connections"
                );
            }
        }
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// The configured pools, with what the server section decides for every pool: how clients'
/// error messages name backends.
fn pools_of(config: &Config) -> Vec<crate::config::PoolConfig> {
    let mut pools = config.pools.clone();
    for p in &mut pools {
        p.expose_backend_addresses = config.server.expose_backend_addresses;
    }
    pools
}
