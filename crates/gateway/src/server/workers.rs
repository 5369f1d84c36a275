//! The request-path workers: one thread per core, each a single-threaded event loop with its
//! own upstream clients, accepting from the one API socket (`spawn_workers`); and the accept
//! loop every listener runs (`accept_loop`): TCP_NODELAY, TLS, hyper-util's server (HTTP/1.1,
//! and h2 by prior knowledge or ALPN, told before hyper reads: `preface`) with keep-alive, one request-head limit for
//! both protocols, the connection caps (`conn_limit`), and the graceful drain.

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

use super::conn_limit::{AcceptBackoff, ConnLimit, ConnPermit};
use super::preface::{self, Proto};
use super::{AppState, StartError, router};
use crate::config::Config;
use crate::proxy::state::ProxyState;
use crate::rx_time::{self, RxClock, Side, StampedStream};

/// How a listener stops: the grace period for in-flight requests, and the signal that ends
/// the streams still open after it (the API listener's).
pub(super) struct Drain {
    pub(super) grace: Duration,
    pub(super) streams_end: Option<CancellationToken>,
}

/// After the grace period: how long the streams still open get to write their last events.
const FINAL_WRITES: Duration = Duration::from_secs(1);

/// The request path runs on worker threads, each with its own single-threaded event loop,
/// accepting from the same listening socket: a request, its upstream connection and its relay
/// stay on one thread, so no frame crosses threads (the way nginx workers run). Backends'
/// in-flight counts and the key snapshot are shared. `worker_state` gives each worker its
/// state. Each returned receiver completes when its worker has ended.
pub(super) fn spawn_workers(
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
            .on_thread_park(super::allocator::parked)
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
                                    router::dispatch(state.clone(), req, peer, arrival)
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

/// The server's builders: one per protocol, and the auto builder for a connection whose
/// protocol its bytes must tell.
struct Builders {
    http1: auto::Builder<TokioExecutor>,
    http2: auto::Builder<TokioExecutor>,
    auto: auto::Builder<TokioExecutor>,
}

impl Builders {
    fn of(&self, proto: Proto) -> &auto::Builder<TokioExecutor> {
        match proto {
            Proto::Http1 => &self.http1,
            Proto::Http2 => &self.http2,
            Proto::Unknown => &self.auto,
        }
    }
}

/// Serve `listener` until `shutdown`, within `limit`'s bounds (connections, timeouts, the
/// largest request head read, the same for HTTP/1.1 and HTTP/2).
pub(super) async fn accept_loop<H, F, B>(
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
    // The protocol is known before hyper reads (`preface`): a connection is served by the
    // builder of its protocol, and by the auto builder's own detection only where TLS named
    // none.
    let builders = Arc::new(Builders {
        http1: builder.clone().http1_only(),
        http2: builder.clone().http2_only(),
        auto: builder,
    });
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
        let builders = builders.clone();
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
                        let proto = match preface::sniff(&stream).await {
                            Ok(Some(proto)) => proto,
                            Ok(None) => return,
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "connection failed before its first byte");
                                return;
                            }
                        };
                        let conn = builders
                            .of(proto)
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
                        let proto = preface::from_alpn(tls_stream.get_ref().1.alpn_protocol());
                        let conn = builders
                            .of(proto)
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
