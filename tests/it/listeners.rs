//! The client listener: HTTP/2 with prior knowledge, TLS with ALPN, and graceful shutdown
//! (streams finish within the grace period; those still open then get an error event and
//! `[DONE]`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use crate::relay::stream_body;
use bytes::Bytes;
use http_body_util::BodyExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    let c: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build(http);
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-request-id", "h2-1")
        .body(http_body_util::Full::new(stream_body(5)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(got, sim.stats().captured("h2-1").unwrap());
}

/// A gateway serving TLS with a fresh self-signed certificate for `localhost`, in front of
/// `backend`: the gateway, the certificate, its PEM file, and the directory holding both.
pub(crate) async fn tls_gateway(
    backend: &str,
) -> (
    Gateway,
    rcgen::CertifiedKey<rcgen::KeyPair>,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempdir();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])
        .unwrap_or_else(|e| panic!("certificate: {e}"));
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    for (path, pem) in [
        (&cert_path, cert.cert.pem()),
        (&key_path, cert.signing_key.serialize_pem()),
    ] {
        std::fs::write(path, pem).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let gw = gateway_with(vec![pool("qwen32b", &[backend.to_owned()])], |c| {
        c.server.tls = Some(fleetgate_gateway::config::TlsConfig {
            cert: cert_path.clone(),
            key: key_path,
        })
    })
    .await;
    (gw, cert, cert_path, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_with_alpn() {
    let sim = sim(|_| {}).await;
    let (gw, cert, _cert_path, dir) = tls_gateway(&sim.url()).await;
    assert!(gw.server.base_url().starts_with("https://"));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    for (h2, version) in [
        (true, http::Version::HTTP_2),
        (false, http::Version::HTTP_11),
    ] {
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_only();
        let conn = if h2 {
            builder.enable_http2().build()
        } else {
            builder.enable_http1().build()
        };
        let c: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(conn);
        let uri = format!(
            "https://localhost:{}/v1/chat/completions",
            gw.server.local_addr.port()
        );
        let req = http::Request::post(uri)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", gw.key))
            .body(http_body_util::Full::new(stream_body(4)))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), version);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_streams_finish() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let uri = gw.url("/v1/chat/completions");
    let stream = tokio::spawn(async move { post(&uri, &[], stream_body(60)).await });
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    let addr = gw.server.local_addr;
    gw.server.shutdown().await;
    let m = stream.await.unwrap();
    assert_eq!(m.status, 200);
    assert!(m.metrics.done, "the stream was cut by the shutdown");
    assert_eq!(m.metrics.usage.unwrap().completion_tokens, 60);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting"
    );
}

/// Streams still open when the grace period ends are not cut silently: a relayed stream, a
/// stream waiting in the queue (answered with `: queued` comments) and a request waiting for
/// its backend's head each get an error the client can read (`gateway_shutdown`, then
/// `[DONE]` and a clean end of the chunked body for the streams), and are recorded as
/// `shutdown`, not as a client that left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_open_when_the_grace_period_ends_get_an_error_event_and_done() {
    let sim = sim(|a| a.decode_step_ms = 50.0).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.backends[0].capacity = Some(1);
    let gw = gateway_with(vec![p], |c| {
        c.server.shutdown_grace = Duration::from_millis(300);
        c.queue.keepalive_interval = Some(Duration::from_millis(100));
    })
    .await;
    let uri = gw.url("/v1/chat/completions");
    let relayed = {
        let uri = uri.clone();
        tokio::spawn(
            async move { post(&uri, &[("x-request-id", "relayed")], stream_body(200)).await },
        )
    };
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    let queued = {
        let uri = uri.clone();
        tokio::spawn(async move { post(&uri, &[("x-request-id", "queued")], stream_body(5)).await })
    };
    let pools = gw.server.pools();
    let queue = pools.get("qwen32b").unwrap().balancer.queue.clone();
    assert!(eventually(Duration::from_secs(5), || queue.has_waiters()).await);
    let records = gw.records.clone();
    gw.server.shutdown().await;
    for (name, task) in [("relayed", relayed), ("queued", queued)] {
        let m = task.await.unwrap();
        assert_eq!(m.status, 200, "{name}");
        assert!(
            m.body_error.is_none(),
            "{name}: the body ended cleanly: {:?}",
            m.body_error
        );
        let body = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
        assert!(
            body.contains("\"code\":\"gateway_shutdown\""),
            "{name}: an error event says why: {body}"
        );
        assert!(body.trim_end().ends_with("data: [DONE]"), "{name}: {body}");
    }
    let seen = records.lock().unwrap().clone();
    for id in ["relayed", "queued"] {
        let r = seen.iter().find(|r| r.request_id == id).unwrap();
        assert_eq!(r.error, Some("shutdown"), "{id}");
    }
}

fn tempdir() -> std::path::PathBuf {
    use std::hash::{BuildHasher, RandomState};
    let suffix = RandomState::new().hash_one(std::time::SystemTime::now());
    let dir = std::env::temp_dir().join(format!("fleetgate-test-{}-{suffix}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("temp dir: {e}"));
    dir
}
