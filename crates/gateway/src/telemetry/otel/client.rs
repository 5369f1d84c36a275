//! The exporter's HTTP client: hyper with rustls (the gateway's own stack; the exporter's
//! bundled clients would bring reqwest), held to the exporter's timeout, reading at most
//! 4 MiB of a collector's answer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{HttpClient, HttpError};

/// The most of a collector's answer read (it is a small protobuf message).
const MAX_ANSWER: usize = 4 << 20;

#[derive(Debug, Clone)]
pub(super) struct Collector {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

impl Collector {
    /// A client for `http://` and `https://` collectors (the web's public roots: a collector
    /// behind a private CA is reached through a local OpenTelemetry Collector).
    pub(super) fn new(timeout: Duration) -> Result<Self, rustls::Error> {
        let roots =
            rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(2)
                .build(https),
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl HttpClient for Collector {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let request = Request::from_parts(parts, Full::new(body));
        let exchange = async {
            let resp = self.client.request(request).await?;
            let (head, body) = resp.into_parts();
            let body = Limited::new(body, MAX_ANSWER).collect().await?.to_bytes();
            Ok::<_, HttpError>(Response::from_parts(head, body))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the collector did not answer within {} ms",
                self.timeout.as_millis()
            )
            .into()),
        }
    }
}
