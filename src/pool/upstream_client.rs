//! The upstream HTTP client a pool sends through: rustls with the web PKI roots and an
//! optional extra CA, kept across reloads while its settings are unchanged.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Uri;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tower::Service;

use crate::rx_time::{self, RxClock, Side, StampedStream};

use crate::config::PoolConfig;

use super::Pool;

pub type UpstreamClient = Client<HttpsConnector<StampingConnector>, Full<Bytes>>;

/// The receive stamps of the upstream connection an answer came on, in its extensions.
#[derive(Debug, Clone)]
pub struct UpstreamRx(pub Arc<RxClock>);

/// hyper's TCP connector, with every connection's reads stamped by the kernel up to the first
/// token of each answer (`rx_time`).
#[derive(Clone)]
pub struct StampingConnector(HttpConnector);

type Connecting =
    Pin<Box<dyn Future<Output = Result<TokioIo<StampedStream>, ConnectError>> + Send + 'static>>;
type ConnectError = <HttpConnector as Service<Uri>>::Error;

impl Service<Uri> for StampingConnector {
    type Response = TokioIo<StampedStream>;
    type Error = ConnectError;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            // Without the option the connection works as before; its answers carry no hop.
            let _ = rx_time::enable(&tcp);
            let clock = Arc::new(RxClock::new(Side::Upstream));
            Ok(TokioIo::new(StampedStream::new(tcp, clock)))
        })
    }
}

/// An answer's connection tells the client its receive stamps (`UpstreamRx` in the answer's
/// extensions).
impl Connection for StampedStream {
    fn connected(&self) -> Connected {
        Connected::new().extra(UpstreamRx(self.clock().clone()))
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

/// An idle keep-alive connection to a backend is closed after this long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

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
    Ok(Client::builder(TokioExecutor::new())
        // The timer makes the idle timeout run without traffic: without it, idle connections
        // are only found expired when the pool is next used (after a burst, thousands of
        // descriptors stayed open).
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle)
        .pool_max_idle_per_host(1024)
        .build(https))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An idle connection is closed by the client's own timer, with no further traffic.
    #[tokio::test]
    async fn idle_connections_close_without_traffic() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cfg = PoolConfig::new("m", vec![]);
        let client = build_client(&cfg, Duration::from_millis(200)).unwrap();
        let server = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = sock.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"GET / HTTP/1.1"));
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            // The next read ends when the client closes the idle connection.
            let started = std::time::Instant::now();
            let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut buf))
                .await
                .expect("the idle connection was closed within 10 s")
                .unwrap();
            (n, started.elapsed())
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
}
