//! Startup: `Server::start` binds the API listener and `start_on` builds everything a running
//! gateway has, in this order: the key store (migrated when asked) and the key snapshot; the
//! pools (`Fleet`) and the request metrics; the limits (in process, or shared through Redis:
//! `Limits::start` spawns Redis's health loop, stopped by the shutdown token, and the token
//! settlements, stopped with the other writers once the workers have ended); the request log's
//! writer and the trace exporter, when on; the TLS acceptors; then the background tasks, each
//! stopped by the shutdown token:
//!
//! - health probes of every backend (`Fleet::probe_loop`);
//! - the key snapshot's sync with the store (`auth::sync::run`);
//! - the backends' load scrape (`Fleet::load_loop`) and DNS discovery (`Fleet::discovery_loop`);
//! - the subscribers to the engines' KV events, for pools with `kv_events`
//!   (`Fleet::kv_events_loop`);
//! - the limits' pruning of idle keys (`Limits::prune_loop`);
//! - longest-prefix sharing with the other replicas, with Redis (`PrefixShare::start`);
//! - the admin listener's accept loop, when `admin.listen` is set;
//! - the request-path workers, one per core (`workers`), each accepting from the API socket.
//!
//! Shutdown (`Server::shutdown`) runs in this order: stop accepting on every listener; the
//! workers drain their connections within `server.shutdown_grace`, then end the streams still
//! open with a `gateway_shutdown` event; once every worker has ended, the writers stop (so the
//! last request-log rows, spans and Redis settlements are written), and the background tasks
//! are awaited.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::conn_limit::{self, ConnLimit};
use super::workers::{Drain, accept_loop, spawn_workers};
use super::{Server, StartError, pools_of, tls};
use crate::admin::AdminState;
use crate::auth::Authenticator;
use crate::config::Config;
use crate::key::KeyRecord;
use crate::pool::fleet::Fleet;
use crate::proxy::state::{Closing, ProxyState};
use crate::store::KeyStore;
use crate::telemetry::Recorder;
use crate::telemetry::metrics::RequestMetrics;

/// Client connections open at once on the admin listener.
const ADMIN_MAX_CONNECTIONS: usize = 256;

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
        tasks.spawn(fleet.clone().kv_events_loop(shutdown.child_token()));
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
                closing: Closing {
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
            shutdown,
            writers_stop,
            tasks,
            workers: worker_done,
            grace: config.server.shutdown_grace,
        })
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
