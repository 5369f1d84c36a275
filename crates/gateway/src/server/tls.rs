//! Inbound TLS with rustls: certificate chain and key from PEM files, ALPN offering h2 and
//! http/1.1 so HTTP/2 clients negotiate it.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

pub(super) fn acceptor(cert: &Path, key: &Path) -> io::Result<TlsAcceptor> {
    let named = |p: &Path, e: &dyn std::fmt::Display| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {e}", p.display()))
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| named(cert, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| named(cert, &e))?;
    if certs.is_empty() {
        return Err(named(cert, &"no certificate found in the file"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| named(key, &e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(io::Error::other)?
    .with_no_client_auth()
    .with_single_cert(certs, key_der)
    .map_err(|e| named(cert, &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
