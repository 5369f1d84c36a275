//! The listener: accepts TCP (optionally TLS via rustls, ALPN h2 / http/1.1), serves HTTP/1.1
//! and HTTP/2 (prior knowledge or ALPN) on each connection, routes requests, and drains
//! in-flight streams on shutdown within the grace period.
//!
//! Request path, in order (see `route`):
//! 1. route by method and path; open routes (`/healthz`, `/readyz`) answer here;
//! 2. `proxy::forward` — body, view, pool, backend, upstream, relay — stamping the Timeline;
//! 3. the `RequestRecord` created here travels with the response body and records the
//!    request when dropped, whatever ended it.

pub mod tls;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::pool::Pools;
use crate::proxy::error::ApiError;
use crate::proxy::relay::GatewayBody;
use crate::proxy::view::Endpoint;
use crate::proxy::{self, ProxyState};
use crate::telemetry::{Recorder, RequestRecord};

/// Everything the request path reads, built once at start.
#[derive(Debug)]
pub struct AppState {
    pub proxy: ProxyState,
}

impl AppState {
    pub fn new(config: &Config, recorder: Recorder) -> io::Result<Self> {
        let pools = Arc::new(Pools::new(&config.pools)?);
        Ok(Self {
            proxy: ProxyState {
                pools,
                max_body_bytes: config.server.max_body_bytes,
                recorder: Arc::new(recorder),
            },
        })
    }

    pub fn pools(&self) -> &Arc<Pools> {
        &self.proxy.pools
    }
}

static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");

fn json(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, APPLICATION_JSON.clone());
    r
}

/// Route one request.
pub async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<GatewayBody> {
    let received = Instant::now();
    let path = req.uri().path();
    let endpoint = match path {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    };
    // Open routes: no record, no auth.
    match (path, req.method()) {
        ("/healthz", &Method::GET | &Method::HEAD) => {
            return json(StatusCode::OK, r#"{"status":"ok"}"#);
        }
        ("/readyz", &Method::GET | &Method::HEAD) => return readyz(&state),
        _ => {}
    }
    let request_id = proxy::request_id(req.headers());
    let mut record = RequestRecord::new(received, request_id, state.proxy.recorder.clone());
    let method = req.method().clone();
    let fail = |err: ApiError, mut record: RequestRecord| {
        record.status = err.status().as_u16();
        record.error = Some(err.kind());
        record.timeline.done = Some(Instant::now());
        proxy::error_response(&err, &record.request_id)
    };
    match (endpoint, path) {
        (Some(ep), _) if method == Method::POST => {
            proxy::forward(&state.proxy, ep, req, record).await
        }
        (Some(ep), _) => fail(
            ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: ep.path(),
                allow: "POST",
            },
            record,
        ),
        (None, "/v1/models") if method == Method::GET || method == Method::HEAD => {
            let mut resp = json(StatusCode::OK, state.pools().models_body.clone());
            resp.headers_mut()
                .insert(proxy::X_REQUEST_ID.clone(), record.request_id.clone());
            record.status = 200;
            record.timeline.done = Some(Instant::now());
            resp
        }
        (None, "/v1/models") => fail(
            ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: "/v1/models",
                allow: "GET",
            },
            record,
        ),
        (None, _) => {
            let err = ApiError::RouteNotFound {
                method: method.to_string(),
                path: path.chars().take(200).collect(),
            };
            fail(err, record)
        }
    }
}

fn readyz(state: &AppState) -> Response<GatewayBody> {
    let pools = state.pools();
    let backends: Vec<serde_json::Value> = pools
        .iter()
        .flat_map(|p| {
            p.backends.iter().map(move |b| {
                serde_json::json!({
                    "model": &*p.model,
                    "backend": &*b.base,
                    "state": format!("{:?}", b.reachability()).to_lowercase(),
                    "in_flight": b.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                })
            })
        })
        .collect();
    let ready = pools.any_reachable();
    let body = serde_json::json!({
        "ready": ready,
        "detail": if ready { "at least one backend is reachable" } else { "no backend is reachable yet" },
        "backends": backends,
    });
    json(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        serde_json::to_vec(&body).unwrap_or_default(),
    )
}

/// A running gateway listener.
pub struct Server {
    pub local_addr: SocketAddr,
    pub tls: bool,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Server {
    /// Bind, start the health probe and the accept loop. Returns once listening.
    pub async fn start(config: &Config) -> io::Result<Server> {
        let recorder = Recorder::new(config.server.request_log_events);
        let listener = TcpListener::bind(config.server.listen).await.map_err(|e| {
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
        recorder: Recorder,
    ) -> io::Result<Server> {
        let state = Arc::new(AppState::new(config, recorder)?);
        let tls = match &config.server.tls {
            Some(t) => Some(tls::acceptor(&t.cert, &t.key)?),
            None => None,
        };
        let local_addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(
            state
                .pools()
                .clone()
                .probe_loop(config.server.health_interval, shutdown.child_token()),
        );
        let is_tls = tls.is_some();
        tasks.spawn(accept_loop(
            listener,
            state,
            tls,
            shutdown.clone(),
            config.server.shutdown_grace,
        ));
        tasks.close();
        Ok(Server {
            local_addr,
            tls: is_tls,
            shutdown,
            tasks,
        })
    }

    pub fn base_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.local_addr)
    }

    /// Stop accepting, let in-flight streams finish within the grace period, then return.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tasks.wait().await;
    }

    /// Resolves when shutdown has been requested.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<AppState>,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let graceful = GracefulShutdown::new();
    // Connection tasks live in a set so that the ones still open after the grace period can be
    // aborted, and so none outlives the server.
    let mut conns = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let service = hyper::service::service_fn(move |req| {
            let state = state.clone();
            async move { Ok::<_, std::convert::Infallible>(route(state, req).await) }
        });
        match &tls {
            None => {
                let conn = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                let conn = graceful.watch(conn);
                conns.spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            Some(acceptor) => {
                let acceptor = acceptor.clone();
                let builder = builder.clone();
                let watcher = graceful.watcher();
                conns.spawn(async move {
                    let tls_stream = match tokio::time::timeout(
                        Duration::from_secs(10),
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = builder
                        .serve_connection(TokioIo::new(tls_stream), service)
                        .into_owned();
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "stopped accepting; draining in-flight requests"
    );
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!(
            open = conns.len(),
            "grace period over; closing the remaining connections"
        ),
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}
