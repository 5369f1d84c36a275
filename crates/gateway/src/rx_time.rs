//! Kernel receive timestamps: the instant a socket's bytes reached this host, which an
//! in-process clock cannot see (a request waits in the kernel until a worker wakes and reads
//! it). Linux stamps every received packet when a socket asks for it (`SO_TIMESTAMPNS`); the
//! stamp comes back beside the bytes of a `recvmsg`. Elsewhere nothing is stamped and the
//! gateway records only its in-process figures.
//!
//! A [`StampedStream`] reads with `recvmsg` only while its [`RxClock`] wants a stamp (once per
//! request on either side); every other read is a plain `read`.
//!
//! - Client side ([`Side::Client`]): the first read after the previous response was written
//!   is the arrival of the next request's first bytes. The request path takes it with
//!   [`RxClock::take_arrival`].
//! - Upstream side ([`Side::Upstream`]): writing a request arms the clock and stamps the write;
//!   every read until the relay has seen the first token updates the latest arrival, which the
//!   relay takes with [`RxClock::first_token_arrival`] (it disarms the clock).
//!
//! Stamps are nanoseconds on this module's monotonic base (0 = none), so they compare with
//! `std::time::Instant`s taken in process.

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Whether this platform stamps received bytes.
pub const SUPPORTED: bool = cfg!(target_os = "linux");

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// `at` as nanoseconds on the stamps' base (at least 1: 0 means "none").
pub(crate) fn to_ns(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base()).as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A stamp back as an `Instant`; `None` for 0.
pub(crate) fn from_ns(ns: u64) -> Option<Instant> {
    (ns != 0).then(|| base() + Duration::from_nanos(ns))
}

/// Which end of the gateway a socket is on: decides which reads are stamped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Upstream,
}

/// One connection's receive stamps, shared between its stream and the request path.
#[derive(Debug)]
pub(crate) struct RxClock {
    side: Side,
    armed: AtomicBool,
    /// Kernel arrival (client: of the request's first bytes; upstream: of the latest read).
    arrival: AtomicU64,
    /// Upstream: when the request's last bytes were written.
    written: AtomicU64,
}

impl RxClock {
    pub(crate) fn new(side: Side) -> Self {
        Self {
            side,
            // A client connection's first read is a request's first bytes.
            armed: AtomicBool::new(side == Side::Client),
            arrival: AtomicU64::new(0),
            written: AtomicU64::new(0),
        }
    }

    fn wants_stamp(&self) -> bool {
        self.armed.load(Relaxed)
    }

    fn on_read_stamp(&self, ns: u64) {
        self.arrival.store(ns, Relaxed);
        if self.side == Side::Client {
            self.armed.store(false, Relaxed);
        }
    }

    fn on_write(&self) {
        match self.side {
            // A response went out: the next read starts a request.
            Side::Client => self.armed.store(true, Relaxed),
            Side::Upstream => {
                self.written.store(to_ns(Instant::now()), Relaxed);
                self.arrival.store(0, Relaxed);
                self.armed.store(true, Relaxed);
            }
        }
    }

    /// Client side: the kernel arrival of this request's first bytes, once.
    pub(crate) fn take_arrival(&self) -> Option<Instant> {
        from_ns(self.arrival.swap(0, Relaxed))
    }

    /// Upstream side: (request written, kernel arrival of the bytes read last). Called when
    /// the first token (or a non-streamed answer's head) is seen; later reads are not stamped.
    pub(crate) fn first_token_arrival(&self) -> (Option<Instant>, Option<Instant>) {
        self.armed.store(false, Relaxed);
        (
            from_ns(self.written.load(Relaxed)),
            from_ns(self.arrival.load(Relaxed)),
        )
    }
}

/// Ask the kernel to stamp what this socket receives. Accepted sockets inherit it from their
/// listener.
pub fn enable(sock: &impl std::os::fd::AsFd) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::ReceiveTimestampns, &true)
            .map_err(io::Error::from)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "kernel receive timestamps need Linux",
        ))
    }
}

/// At most this much is read by a stamped read (the rest by the next, plain one): the size of
/// each thread's staging buffer.
const STAMPED_READ_MAX: usize = 16 * 1024;

#[cfg(target_os = "linux")]
thread_local! {
    /// Where a stamped read lands before its bytes are copied to the caller. `recvmsg` needs
    /// initialised memory and the caller's is not (hyper hands out its read buffer as it
    /// comes): initialising the caller's room would write every byte of it, the whole 8 KiB of
    /// a fresh connection's buffer where a request or an answer's first events fill a few
    /// hundred, and each such page would become resident. One buffer per thread, initialised
    /// once; only what was read is copied.
    static STAGE: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; STAMPED_READ_MAX].into_boxed_slice());
}

/// A TCP stream whose reads are stamped while its clock wants it.
pub(crate) struct StampedStream {
    io: TcpStream,
    clock: std::sync::Arc<RxClock>,
}

impl StampedStream {
    pub(crate) fn new(io: TcpStream, clock: std::sync::Arc<RxClock>) -> Self {
        Self { io, clock }
    }

    pub(crate) fn clock(&self) -> &std::sync::Arc<RxClock> {
        &self.clock
    }

    /// The next bytes to read, left in the kernel (`MSG_PEEK`; not stamped).
    pub(crate) async fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.io.peek(buf).await
    }

    #[cfg(target_os = "linux")]
    fn poll_read_stamped(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use std::os::fd::AsRawFd;
        let fd = self.io.as_raw_fd();
        loop {
            std::task::ready!(self.io.poll_read_ready(cx))?;
            let room = buf.remaining().min(STAMPED_READ_MAX);
            // A short read emptied the socket: its readiness is forgotten in the same step (a
            // `WouldBlock` from the closure clears the readiness seen before the read, as
            // tokio's own reads do), instead of learning it from one more `recvmsg` that
            // fails with EAGAIN.
            let mut got = None;
            let read = STAGE.with_borrow_mut(|stage| {
                self.io.try_io(tokio::io::Interest::READABLE, || {
                    let (n, stamp) = recv_stamped(fd, &mut stage[..room])?;
                    buf.put_slice(&stage[..n]);
                    got = Some((n, stamp));
                    if n > 0 && n < room {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    Ok(())
                })
            });
            if let Some((n, stamp)) = got {
                if let Some(ns) = stamp
                    && n > 0
                {
                    self.clock.on_read_stamp(ns);
                }
                return Poll::Ready(Ok(()));
            }
            match read {
                Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Poll::Ready(Err(e)),
                // Not ready after all (the readiness was cleared): wait for the next.
                _ => continue,
            }
        }
    }
}

/// One `recvmsg`: bytes read and the kernel's stamp of them, on the monotonic base (what a
/// stamped read does; public for benches/rx_time.rs).
#[cfg(target_os = "linux")]
pub fn recv_stamped(fd: std::os::fd::RawFd, dst: &mut [u8]) -> io::Result<(usize, Option<u64>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    // CMSG_SPACE(sizeof(struct timespec)) is 32 bytes on 64-bit Linux.
    let mut cmsg = [0u8; 64];
    let mut iov = [io::IoSliceMut::new(dst)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    let n = msg.bytes;
    let mut stamp = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmTimestampns(ts) = c {
                stamp = Some(kernel_to_mono(Duration::new(
                    u64::try_from(ts.tv_sec()).unwrap_or(0),
                    u32::try_from(ts.tv_nsec()).unwrap_or(0),
                )));
            }
        }
    }
    Ok((n, stamp))
}

/// A kernel stamp (wall clock, since the epoch) on the monotonic base: now minus how long
/// ago it was. A stamp "in the future" (the wall clock stepped) counts as now.
fn kernel_to_mono(stamp: Duration) -> u64 {
    let now = Instant::now();
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    to_ns(now.checked_sub(wall.saturating_sub(stamp)).unwrap_or(now))
}

impl AsyncRead for StampedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        #[cfg(target_os = "linux")]
        if this.clock.wants_stamp() {
            return this.poll_read_stamped(cx, buf);
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for StampedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let out = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(out, Poll::Ready(Ok(n)) if n > 0) {
            this.clock.on_write();
        }
        out
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let out = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(out, Poll::Ready(Ok(n)) if n > 0) {
            this.clock.on_write();
        }
        out
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The stamp of a request's bytes is the moment they arrived, not the moment they were
    /// read: bytes that wait in the kernel are stamped before the read.
    #[tokio::test]
    async fn a_client_read_is_stamped_with_the_arrival() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        enable(&listener).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (sock, _) = listener.accept().await.unwrap();
        let clock = Arc::new(RxClock::new(Side::Client));
        let mut s = StampedStream::new(sock, clock.clone());

        // The kernel turns packet stamping on for the whole host a moment after the first
        // socket asks (a deferred static key); until then a read is unstamped or stamped when
        // it happens. The listener's option must reach the accepted socket.
        // Requests keep coming until one is stamped by its arrival (at most 2 s).
        let mut buf = [0u8; 64];
        let mut waited = Duration::ZERO;
        for _ in 0..100 {
            let before = Instant::now();
            client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            std::thread::sleep(Duration::from_millis(20));
            let n = s.read(&mut buf).await.unwrap();
            let read_at = Instant::now();
            assert_eq!(&buf[..n], b"GET / HTTP/1.1\r\n\r\n");
            // Unstamped (None) or stamped at the read while the host turns stamping on.
            if let Some(arrival) = clock.take_arrival() {
                assert!(
                    arrival >= before - Duration::from_millis(1),
                    "{arrival:?} {before:?}"
                );
                waited = read_at.duration_since(arrival);
                if waited >= Duration::from_millis(15) {
                    break;
                }
            }
            // A response re-arms the clock for the next request.
            s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .await
                .unwrap();
            let _ = client.read(&mut buf).await.unwrap();
        }
        assert!(
            waited >= Duration::from_millis(15),
            "the bytes waited 20 ms in the kernel; the stamp says {waited:?}"
        );
        assert_eq!(clock.take_arrival(), None, "taken once");

        // The next read of the same request is not stamped; after a write, the next is.
        client.write_all(b"more").await.unwrap();
        let n = s.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"more");
        assert_eq!(clock.take_arrival(), None);
        s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        client.write_all(b"next").await.unwrap();
        let _ = s.read(&mut buf).await.unwrap();
        assert!(clock.take_arrival().is_some());
    }

    #[tokio::test]
    async fn an_upstream_read_is_stamped_until_the_first_token() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sock = TcpStream::connect(addr).await.unwrap();
        enable(&sock).unwrap();
        let (mut backend, _) = listener.accept().await.unwrap();
        let clock = Arc::new(RxClock::new(Side::Upstream));
        let mut s = StampedStream::new(sock, clock.clone());
        let mut buf = [0u8; 64];

        // Nothing is stamped before a request is written.
        backend.write_all(b"stray").await.unwrap();
        let _ = s.read(&mut buf).await.unwrap();
        assert_eq!(clock.first_token_arrival(), (None, None));

        // Until the host has turned stamping on (a moment after the first socket asks), a
        // read may come unstamped: requests go until one is.
        let mut stamps = (None, None);
        for _ in 0..100 {
            s.write_all(b"POST").await.unwrap();
            let _ = backend.read(&mut buf).await.unwrap();
            backend.write_all(b"head").await.unwrap();
            let _ = s.read(&mut buf).await.unwrap();
            stamps = clock.first_token_arrival();
            if stamps.1.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (written, head) = (stamps.0.unwrap(), stamps.1.expect("a stamped read"));
        assert!(head >= written);
        // Disarmed: a later read leaves the stamp alone.
        backend.write_all(b"token").await.unwrap();
        let _ = s.read(&mut buf).await.unwrap();
        assert_eq!(clock.first_token_arrival(), (Some(written), Some(head)));
    }
}
