//! The upstream HTTP client a pool sends through: rustls with the web PKI roots and an
//! optional extra CA, kept across reloads while its settings are unchanged.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::PoolConfig;

use super::Pool;

pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

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
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(https))
}
