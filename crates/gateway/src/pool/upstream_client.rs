//! The upstream HTTP client a pool sends through: rustls with the web PKI roots and an
//! optional extra CA, kept across reloads while its settings are unchanged.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::PoolConfig;

use super::Pool;
use super::connector::StampingConnector;
use super::upstream_conn::{Conns, SendError, UpstreamBody};

/// A pool's upstream client: requests through `send` drive their connection from their own
/// task (`upstream_conn`); probes and load scrapes go through hyper's pooled client.
#[derive(Clone, Debug)]
pub struct UpstreamClient {
    probes: Client<HttpsConnector<StampingConnector>, Full<Bytes>>,
    conns: Conns,
}

impl UpstreamClient {
    /// A probe or scrape (not on the request path).
    pub(crate) fn request(&self, req: http::Request<Full<Bytes>>) -> ResponseFuture {
        self.probes.request(req)
    }

    /// A client's request to the backend in metrics index `backend`.
    pub(crate) async fn send(
        &self,
        backend: usize,
        req: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<UpstreamBody>, SendError> {
        self.conns.send(backend, req).await
    }

    /// Idle connections kept for requests.
    #[cfg(test)]
    pub(crate) fn idle_connections(&self) -> usize {
        self.conns.idle()
    }
}

/// `prev`'s client (its open keep-alive connections) while the settings a client is built
/// from — extra CA, connect timeout — are unchanged; else a new one.
pub(super) fn client_for(cfg: &PoolConfig, prev: Option<&Pool>) -> io::Result<UpstreamClient> {
    match prev {
        Some(p)
            if p.config.ca_file == cfg.ca_file
                && p.config.timeouts.connect == cfg.timeouts.connect =>
        {
            Ok(p.client.clone())
        }
        _ => build_client(cfg, IDLE_TIMEOUT),
    }
}

/// An idle keep-alive connection to a backend is closed after this long: less than the 5 s
/// after which vLLM's server (uvicorn's `timeout_keep_alive`, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`)
/// closes it, so that a request or a probe is never sent on a connection the backend is closing
/// at that moment (it fails as "closed before message completed": a probe marked the backend
/// down, a request with no other backend got a 502). After a burst, the thousands of idle
/// connections it leaves close within seconds, and their memory with them.
const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

fn build_client(cfg: &PoolConfig, idle: Duration) -> io::Result<UpstreamClient> {
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
        .wrap_connector(StampingConnector(http));
    let probes = Client::builder(TokioExecutor::new())
        // The timer makes the idle timeout run without traffic: without it, idle connections
        // are only found expired when the pool is next used (after a burst, thousands of
        // descriptors stayed open).
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle)
        .pool_max_idle_per_host(MAX_IDLE_PER_BACKEND)
        .build(https.clone());
    Ok(UpstreamClient {
        probes,
        conns: Conns::new(https, idle, MAX_IDLE_PER_BACKEND),
    })
}

/// Most idle connections kept to one backend.
const MAX_IDLE_PER_BACKEND: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A raw backend's next connection: its request read, `ok` answered with a length.
    async fn answer_once(listener: &tokio::net::TcpListener) -> (tokio::net::TcpStream, Vec<u8>) {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = sock.read(&mut buf).await.unwrap();
        buf.truncate(n);
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        (sock, buf)
    }

    /// Wait (at most 10 s) for the client to close `sock`: the last read's length and how long
    /// it took.
    async fn until_closed(mut sock: tokio::net::TcpStream) -> (usize, Duration) {
        let mut buf = vec![0u8; 4096];
        let started = std::time::Instant::now();
        let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut buf))
            .await
            .expect("the idle connection was closed within 10 s")
            .unwrap();
        (n, started.elapsed())
    }

    /// An idle connection is closed by the client's own timer, with no further traffic.
    #[tokio::test]
    async fn idle_connections_close_without_traffic() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = PoolConfig::new("m", vec![]);
        let client = build_client(&cfg, Duration::from_millis(200)).unwrap();
        let server = tokio::spawn(async move {
            let (sock, request) = answer_once(&listener).await;
            assert!(request.starts_with(b"GET / HTTP/1.1"));
            until_closed(sock).await
        });
        let uri: hyper::Uri = format!("http://{addr}/").parse().unwrap();
        let resp = client
            .request(
                http::Request::get(uri)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(&body[..], b"ok");
        let (n, after) = server.await.unwrap();
        assert_eq!(n, 0, "closed, not reused");
        assert!(
            after >= Duration::from_millis(150),
            "closed after {after:?}"
        );
        drop(client);
    }

    /// A backend that counts its connections and the ones that ended: `/len` answers with a
    /// length, `/chunked` with three chunks, `/hang` with one chunk and then nothing.
    struct Counting {
        addr: std::net::SocketAddr,
        opened: Arc<std::sync::atomic::AtomicUsize>,
        closed: Arc<std::sync::atomic::AtomicUsize>,
    }

    async fn counting_backend() -> Counting {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let opened = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (o, c) = (opened.clone(), closed.clone());
        tokio::spawn(async move {
            loop {
                let (sock, _) = listener.accept().await.unwrap();
                o.fetch_add(1, Ordering::SeqCst);
                let c = c.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        |req: http::Request<hyper::body::Incoming>| async move {
                            let path = req.uri().path().to_owned();
                            let (tx, rx) = tokio::sync::mpsc::channel::<
                                Result<http_body::Frame<Bytes>, std::io::Error>,
                            >(4);
                            let body = http_body_util::StreamBody::new(tokio_stream_rx(rx));
                            match path.as_str() {
                                "/len" => {
                                    return Ok::<_, std::convert::Infallible>(http::Response::new(
                                        http_body_util::Either::Left(Full::new(
                                            Bytes::from_static(b"ok"),
                                        )),
                                    ));
                                }
                                "/chunked" => {
                                    tokio::spawn(async move {
                                        for part in ["a", "b", "c"] {
                                            let _ = tx
                                                .send(Ok(http_body::Frame::data(Bytes::from(part))))
                                                .await;
                                        }
                                    });
                                }
                                _ => {
                                    tokio::spawn(async move {
                                        let _ = tx
                                            .send(Ok(http_body::Frame::data(Bytes::from("x"))))
                                            .await;
                                        tx.closed().await;
                                    });
                                }
                            }
                            Ok(http::Response::new(http_body_util::Either::Right(body)))
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(sock), svc)
                        .await;
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Counting {
            addr,
            opened,
            closed,
        }
    }

    fn tokio_stream_rx<T: Send + 'static>(
        mut rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    fn get(addr: std::net::SocketAddr, path: &str) -> http::Request<Full<Bytes>> {
        http::Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..200 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not within 2 s: {what}");
    }

    /// Requests driven by their own task reuse one connection when each answer was read to the
    /// end (also when the reader stopped at the known length, or read nothing of an answer
    /// that had all arrived), and close the connection of an answer dropped before its end
    /// arrived.
    #[tokio::test]
    async fn driven_connections_are_reused_and_closed_when_they_must() {
        use std::sync::atomic::Ordering::SeqCst;
        let b = counting_backend().await;
        let cfg = PoolConfig::new("m", vec![]);
        let client = build_client(&cfg, Duration::from_secs(60)).unwrap();
        for path in ["/len", "/chunked", "/len", "/chunked"] {
            let resp = client.send(0, get(b.addr, path)).await.unwrap();
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
                .to_bytes();
            assert!(matches!(&body[..], b"ok" | b"abc"), "{body:?}");
        }
        // Read up to the length only, then dropped: still reusable.
        let mut resp = client.send(0, get(b.addr, "/len")).await.unwrap();
        let frame = http_body_util::BodyExt::frame(resp.body_mut())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(frame.into_data().unwrap(), "ok");
        drop(resp);
        assert_eq!(b.opened.load(SeqCst), 1, "one connection for five answers");
        assert_eq!(client.idle_connections(), 1);

        // Dropped half-read: that connection closes, the next request opens another.
        let mut resp = client.send(0, get(b.addr, "/hang")).await.unwrap();
        let frame = http_body_util::BodyExt::frame(resp.body_mut())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(frame.into_data().unwrap(), "x");
        drop(resp);
        until("the half-read answer's connection closes", || {
            b.closed.load(SeqCst) == 1
        })
        .await;
        assert_eq!(client.idle_connections(), 0);
        let resp = client.send(0, get(b.addr, "/len")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(resp);
        assert_eq!(
            client.idle_connections(),
            1,
            "the unread answer was drained"
        );
        drop(client.send(0, get(b.addr, "/len")).await.unwrap());
        assert_eq!(b.opened.load(SeqCst), 2);
    }

    /// A connection the backend closes while idle is noticed (the sweep) and not used again;
    /// an idle connection past the timeout is closed without traffic.
    #[tokio::test]
    async fn idle_driven_connections_close_when_the_backend_or_the_timeout_says() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            // First connection: one answer, then the server closes it.
            drop(answer_once(&listener).await);
            // Second connection: one answer, then wait for the client to close it.
            let (sock, _) = answer_once(&listener).await;
            until_closed(sock).await
        });
        let cfg = PoolConfig::new("m", vec![]);
        let client = build_client(&cfg, Duration::from_millis(1500)).unwrap();
        drop(client.send(0, get(addr, "/")).await.unwrap());
        until("the closed connection leaves the idle list", || {
            client.idle_connections() == 0
        })
        .await;
        // The request goes on a new connection, with no error.
        drop(client.send(0, get(addr, "/")).await.unwrap());
        assert_eq!(client.idle_connections(), 1);
        let (n, after) = server.await.unwrap();
        assert_eq!(n, 0, "closed, not reused");
        assert!(
            after >= Duration::from_millis(1000),
            "closed after {after:?}"
        );
        assert_eq!(client.idle_connections(), 0);
    }
}
