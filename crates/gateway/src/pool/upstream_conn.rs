//! Upstream HTTP/1.1 connections driven by the task of the request that uses them.
//!
//! hyper's pooled client runs every upstream connection as a task of its own: a chunk read
//! from a backend is decoded there and handed to the client connection's task through a
//! channel, so each chunk costs two task wake-ups, often on two threads. Here the connection
//! is polled by whoever polls its answer — the request while it waits for the head, then the
//! client connection while it writes the body — so a chunk is read, decoded and written in one
//! poll of one task, the way a plain proxy does it.
//!
//! Two wakers make that work without waking the task for its own doings:
//!
//! - the socket is polled with a *forwarding* waker that wakes whichever task polls the
//!   connection now (registered at every poll): bytes arriving wake the request's task;
//! - everything else (hyper's body channel between the connection and its answer, its
//!   fairness yield) is polled with a *flag* waker: a wake-up from inside the poll only sets a
//!   flag, and the poll loop goes round again instead of scheduling the task anew.
//!
//! A connection whose answer was read to the end goes back to its backend's idle list; one
//! whose answer was dropped half-read (the client left) is closed, which aborts the backend's
//! work. Idle connections are closed after the idle timeout or when the backend closed them.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::Connection as _;
use hyper_util::rt::TokioIo;
use tower::Service;

use super::connector::{StampingConnector, UpstreamRx};
use crate::rx_time::StampedStream;

type Io = MaybeHttpsStream<TokioIo<StampedStream>>;
type BoxError = Box<dyn StdError + Send + Sync>;

/// Why a request got no answer head.
#[derive(Debug)]
pub(crate) struct SendError {
    /// The connection could not be opened (nothing was sent).
    pub(crate) connect: bool,
    source: BoxError,
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.connect {
            f.write_str("could not connect")
        } else {
            f.write_str("the request failed")
        }
    }
}

impl StdError for SendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// The wake-up targets of one connection.
#[derive(Default)]
struct Wakers {
    /// The task polling the connection now.
    task: AtomicWaker,
    /// Something inside the connection woke it during a poll.
    flagged: AtomicBool,
}

struct Forward(Arc<Wakers>);

impl Wake for Forward {
    fn wake(self: Arc<Self>) {
        self.0.task.wake();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.task.wake();
    }
}

struct Flag(Arc<Wakers>);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.flagged.store(true, Ordering::Release);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.flagged.store(true, Ordering::Release);
    }
}

/// The socket as hyper's connection sees it: every poll wakes the task that polls the
/// connection now, whatever context hyper passes.
struct ForwardingIo {
    io: Io,
    forward: Waker,
}

macro_rules! forwarded {
    ($self:ident, $method:ident $(, $arg:expr)*) => {{
        let this = $self.get_mut();
        let mut cx = Context::from_waker(&this.forward);
        Pin::new(&mut this.io).$method(&mut cx $(, $arg)*)
    }};
}

impl Read for ForwardingIo {
    fn poll_read(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        forwarded!(self, poll_read, buf)
    }
}

impl Write for ForwardingIo {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        forwarded!(self, poll_write, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        forwarded!(self, poll_flush)
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        forwarded!(self, poll_shutdown)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        forwarded!(self, poll_write_vectored, bufs)
    }
}

/// One open connection to a backend.
struct Conn {
    conn: http1::Connection<ForwardingIo, Full<Bytes>>,
    sender: http1::SendRequest<Full<Bytes>>,
    wakers: Arc<Wakers>,
    flag: Waker,
    rx: Option<UpstreamRx>,
    /// The connection future ended (closed, or failed with this).
    ended: Option<Option<hyper::Error>>,
}

impl Conn {
    /// Poll the connection once in the flag's context.
    fn drive(&mut self) {
        drive(&mut self.conn, &self.flag, &mut self.ended);
    }

    /// Drive the connection and poll `f` in the flag's context until `f` is ready or neither
    /// can go further without the socket (which then wakes `cx`'s task).
    fn drive_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut f: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.wakers.task.register(cx.waker());
        let mut fcx = Context::from_waker(&self.flag);
        loop {
            self.wakers.flagged.store(false, Ordering::Relaxed);
            drive(&mut self.conn, fcx.waker(), &mut self.ended);
            if let Poll::Ready(out) = f(&mut fcx) {
                return Poll::Ready(out);
            }
            if !self.wakers.flagged.swap(false, Ordering::Acquire) {
                return Poll::Pending;
            }
        }
    }

    /// Ready for a new request: open, and idle.
    fn usable(&mut self) -> bool {
        self.drive();
        self.ended.is_none() && self.sender.is_ready()
    }
}

/// Poll a connection once with the flag waker; note when it ends.
fn drive(
    conn: &mut http1::Connection<ForwardingIo, Full<Bytes>>,
    flag: &Waker,
    ended: &mut Option<Option<hyper::Error>>,
) {
    if ended.is_some() {
        return;
    }
    let mut cx = Context::from_waker(flag);
    if let Poll::Ready(r) = Pin::new(conn).poll(&mut cx) {
        *ended = Some(r.err());
    }
}

/// The answer's body, read by driving its connection.
pub(crate) struct UpstreamBody {
    incoming: Incoming,
    conn: Option<Box<Conn>>,
    home: Option<Home>,
    rx: Option<UpstreamRx>,
}

/// Where a connection goes back when its answer was read to the end.
struct Home {
    pool: Weak<Shared>,
    backend: usize,
}

impl UpstreamBody {
    /// The upstream connection's receive stamps.
    pub(crate) fn rx(&self) -> Option<&UpstreamRx> {
        self.rx.as_ref()
    }

    /// The answer was read to the end: its connection goes back to the idle list.
    fn release(&mut self) {
        let (Some(mut conn), Some(home)) = (self.conn.take(), self.home.take()) else {
            return;
        };
        // One more turn lets the connection see its answer finished and become idle.
        conn.drive();
        if conn.ended.is_some() {
            return;
        }
        let _ = conn.wakers.task.take();
        if let Some(pool) = home.pool.upgrade() {
            pool.put(home.backend, conn);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let Some(conn) = this.conn.as_mut() else {
            // Released (the end was seen) or never driven here.
            return Pin::new(&mut this.incoming)
                .poll_frame(cx)
                .map_err(std::io::Error::other);
        };
        let incoming = &mut this.incoming;
        let polled = conn.drive_with(cx, |fcx| Pin::new(&mut *incoming).poll_frame(fcx));
        match polled {
            Poll::Ready(None) => {
                this.release();
                Poll::Ready(None)
            }
            Poll::Ready(Some(r)) => Poll::Ready(Some(r.map_err(std::io::Error::other))),
            Poll::Pending => match &conn.ended {
                // The connection is gone and its body channel said nothing: the answer is cut.
                Some(e) => {
                    let detail = e.as_ref().map_or_else(
                        || "connection closed before the answer ended".to_owned(),
                        ToString::to_string,
                    );
                    this.conn = None;
                    Poll::Ready(Some(Err(std::io::Error::other(detail))))
                }
                None => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

impl Drop for UpstreamBody {
    /// An answer dropped once its last bytes arrived (a client connection stops polling a
    /// body whose length it has written) still gives its connection back; one whose end has
    /// not arrived (the client left a stream) closes it.
    fn drop(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if !self.incoming.is_end_stream() {
            // The rest of the answer may have arrived already (a chunked answer's end, a
            // short body nobody read): drain what is there without waiting.
            let incoming = &mut self.incoming;
            let mut cx = Context::from_waker(Waker::noop());
            let mut drained = 0;
            let ended = loop {
                match conn.drive_with(&mut cx, |fcx| Pin::new(&mut *incoming).poll_frame(fcx)) {
                    Poll::Ready(None) => break true,
                    Poll::Ready(Some(Ok(f))) if drained < MAX_DRAIN => {
                        drained += f.data_ref().map_or(0, Bytes::len);
                    }
                    _ => break false,
                }
            };
            if !ended {
                return;
            }
        }
        self.release();
    }
}

/// Most bytes of an unread answer read away on drop to keep its connection.
const MAX_DRAIN: usize = 64 * 1024;

/// The idle connections of one pool's backends, keyed by backend metrics index.
struct Shared {
    idle: Mutex<HashMap<usize, Vec<Idle>>>,
    idle_timeout: Duration,
    max_idle_per_backend: usize,
}

struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

impl Shared {
    fn put(&self, backend: usize, conn: Box<Conn>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(backend).or_default();
        if list.len() < self.max_idle_per_backend {
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// The most recently used idle connection to `backend` that is still usable.
    fn take(&self, backend: usize) -> Option<Box<Conn>> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(&backend)?;
        while let Some(mut entry) = list.pop() {
            if now.saturating_duration_since(entry.since) < self.idle_timeout && entry.conn.usable()
            {
                return Some(entry.conn);
            }
        }
        None
    }

    /// Close expired connections and the ones their backend closed.
    fn sweep(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|_, list| {
            list.retain_mut(|e| {
                now.saturating_duration_since(e.since) < self.idle_timeout && e.conn.usable()
            });
            !list.is_empty()
        });
    }

    fn idle_count(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.values().map(Vec::len).sum()
    }
}

/// Sends requests over connections driven by the caller's task (see the module's notes).
#[derive(Clone)]
pub(crate) struct Conns {
    connector: HttpsConnector<StampingConnector>,
    shared: Arc<Shared>,
}

impl fmt::Debug for Conns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conns")
            .field("idle", &self.shared.idle_count())
            .finish()
    }
}

/// How often idle connections are looked at (closed by their backend, or expired).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Conns {
    pub(crate) fn new(
        connector: HttpsConnector<StampingConnector>,
        idle_timeout: Duration,
        max_idle_per_backend: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            idle: Mutex::new(HashMap::new()),
            idle_timeout,
            max_idle_per_backend,
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&shared);
            rt.spawn(async move {
                let mut tick = tokio::time::interval(SWEEP_EVERY.min(idle_timeout));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    match weak.upgrade() {
                        Some(shared) => shared.sweep(),
                        None => return,
                    }
                }
            });
        }
        Self { connector, shared }
    }

    /// Idle connections kept now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.shared.idle_count()
    }

    /// Send `req` to `backend` (its metrics index names its idle
    /// connections) and read the answer's
    /// head. A kept connection the backend closed meanwhile is replaced by a new one when the
    /// request was not sent on it.
    pub(crate) async fn send(
        &self,
        backend: usize,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        // The request goes out in origin form (`POST /v1/chat/completions`) with the
        // backend's `Host`, as RFC 9112 §3.2 asks of a request to an origin server: hyper's
        // connection writes the URI as given, and nginx and h11 refuse a request without Host.
        let target = origin_form(&mut req);
        loop {
            let (mut conn, reused) = match self.shared.take(backend) {
                Some(c) => (c, true),
                // Boxed: the connect future (DNS, TCP, TLS) is large, and an inline one would
                // grow every request's future — which the client connection keeps allocated
                // for its whole life — for the rare request that opens a connection.
                None => (Box::pin(self.connect(target.clone())).await?, false),
            };
            let mut answer = std::pin::pin!(conn.sender.try_send_request(req));
            let got = poll_fn(|cx| conn.drive_with(cx, |fcx| answer.as_mut().poll(fcx))).await;
            match got {
                Ok(resp) => {
                    let rx = conn.rx.clone();
                    let home = Home {
                        pool: Arc::downgrade(&self.shared),
                        backend,
                    };
                    return Ok(resp.map(|incoming| UpstreamBody {
                        incoming,
                        conn: Some(conn),
                        home: Some(home),
                        rx,
                    }));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => req = unsent,
                    _ => {
                        return Err(SendError {
                            connect: false,
                            source: Box::new(e.into_error()),
                        });
                    }
                },
            }
        }
    }

    async fn connect(&self, uri: http::Uri) -> Result<Box<Conn>, SendError> {
        if uri.authority().is_none() {
            return Err(SendError {
                connect: true,
                source: "the request names no backend (its URI has no authority)".into(),
            });
        }
        let connect_error = |e: BoxError| SendError {
            connect: true,
            source: e,
        };
        let mut connector = self.connector.clone();
        poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(connect_error)?;
        let io = connector.call(uri).await.map_err(connect_error)?;
        let mut extras = http::Extensions::new();
        io.connected().get_extras(&mut extras);
        let rx = extras.remove::<UpstreamRx>();
        let wakers = Arc::new(Wakers::default());
        let forward = Waker::from(Arc::new(Forward(wakers.clone())));
        let flag = Waker::from(Arc::new(Flag(wakers.clone())));
        let (sender, conn) = http1::handshake(ForwardingIo { io, forward })
            .await
            .map_err(|e| SendError {
                connect: true,
                source: Box::new(e),
            })?;
        Ok(Box::new(Conn {
            conn,
            sender,
            wakers,
            flag,
            rx,
            ended: None,
        }))
    }
}

/// Put `req` in origin form: its URI becomes the path and query alone, and `Host` is set from
/// the authority (without userinfo) unless the caller set it already (the request path sets
/// the backend's precomputed value, so nothing is formatted per request). Returns the URI to
/// connect to: the one given, scheme and authority included.
fn origin_form<B>(req: &mut Request<B>) -> http::Uri {
    let target = req.uri().clone();
    let Some(authority) = target.authority() else {
        return target;
    };
    if !req.headers().contains_key(http::header::HOST) {
        let host = authority
            .as_str()
            .rsplit_once('@')
            .map_or(authority.as_str(), |(_, h)| h);
        if let Ok(v) = http::HeaderValue::from_str(host) {
            req.headers_mut().insert(http::header::HOST, v);
        }
    }
    let path = target
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    *req.uri_mut() = http::Uri::from(path);
    target
}
