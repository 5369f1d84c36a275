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
use hyper_util::rt::{TokioExecutor, TokioIo};
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
    Pin<Box<dyn Future<Output = Result<TokioIo<UpstreamStream>, ConnectError>> + Send + 'static>>;
type ConnectError = <HttpConnector as Service<Uri>>::Error;

impl Service<Uri> for StampingConnector {
    type Response = TokioIo<UpstreamStream>;
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
            Ok(TokioIo::new(UpstreamStream(StampedStream::new(tcp, clock))))
        })
    }
}

/// An upstream TCP connection with its receive stamps.
pub struct UpstreamStream(StampedStream);

impl Connection for UpstreamStream {
    fn connected(&self) -> Connected {
        Connected::new().extra(UpstreamRx(self.0.clock().clone()))
    }
}

impl tokio::io::AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
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
        _ => build_client(cfg),
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
        .wrap_connector(StampingConnector(http));
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(https))
}
