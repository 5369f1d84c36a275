//! The listener: accepts TCP (optionally TLS via rustls, ALPN h2 / http/1.1), serves HTTP/1.1
//! and HTTP/2 (prior knowledge or ALPN) on each connection, routes requests, and drains
//! in-flight streams on shutdown within the grace period.
//!
//! `router::dispatch` dispatches each request by method and path (open routes such as `/healthz`
//! answer there), creates its `RequestRecord`, and hands a route of the endpoint table to
//! `proxy::forward`, whose `phases()` takes the steps of docs/architecture.md's table.
//!
//! `startup` builds a running gateway and lists its background tasks and the shutdown order;
//! `workers` holds the request-path threads and the accept loop; `conn_limit` the connection
//! caps per listener and per address; `allocator` the idle workers' hand-back of their
//! allocator caches; `reload` the configuration watcher.

pub mod allocator;
mod conn_limit;
mod preface;
pub mod reload;
mod router;
mod startup;
mod tls;
mod workers;

pub use startup::listen;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::Authenticator;
use crate::config::Config;
use crate::pool::Generation;
use crate::pool::fleet::{Fleet, ReloadError, ReloadSummary};
use crate::proxy::state::ProxyState;
use crate::store::StoreError;

/// Everything the request path reads, built once at start.
#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) proxy: Arc<ProxyState>,
}

impl AppState {
    /// This worker's pools as they are now.
    pub(crate) fn pools(&self) -> Arc<Generation> {
        self.proxy.generation.load_full()
    }

    pub(crate) fn auth(&self) -> &Arc<Authenticator> {
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

/// A running gateway: the API listener, the admin listener and their background tasks.
pub struct Server {
    pub local_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub(crate) tls: bool,
    pub auth: Arc<Authenticator>,
    pub registry: prometheus::Registry,
    /// The pools (backends' in-flight counts, admission queues), live: see `reload`.
    pub fleet: Arc<Fleet>,
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
}

impl Drop for Server {
    /// A server dropped without `shutdown` still stops: its worker threads drain and exit.
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.writers_stop.cancel();
    }
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
