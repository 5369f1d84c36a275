//! `/v1/models`, `/healthz` and `/readyz`, and health probes that name a backend's fault and
//! clear it once it is healthy.

use std::time::Duration;

use crate::common::*;
use crate::listeners::tls_gateway;
use bytes::Bytes;
use fleetgate_protocol::client::{self, chat_body};
use http_body_util::BodyExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_readiness() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let c = client::http_client();
    let get = |path: &str| {
        let req = authed(&gw, "GET", path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        c.request(req)
    };
    let resp = get("/v1/models").await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "qwen32b");
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    let mut ready = false;
    for _ in 0..300 {
        if get("/readyz").await.unwrap().status() == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready, "/readyz never became ready with a live backend");
    // Open to anyone who reaches the listener: ready or not, nothing about the backends or
    // the key store.
    let open_get = |gw: &Gateway| {
        let req = http::Request::get(gw.url("/readyz"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let resp = c.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    assert_eq!(open_get(&gw).await, (200, r#"{"ready":true}"#.to_owned()));

    let dead = closed_port().await;
    let gw2 = gateway_with(vec![pool("qwen32b", &[format!("http://{dead}")])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = open_get(&gw2).await;
    assert_eq!(status, 503);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], false);
    for secret in [dead.port().to_string(), "key".into(), "backend\"".into()] {
        assert!(!body.contains(&secret), "/readyz shows `{secret}`: {body}");
    }
    // The details are on the admin listener, for a token holder.
    let (s, _) = admin(&gw2, "GET", "/admin/ready", None, None).await;
    assert_eq!(s, 401);
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let (s, v) = admin(&gw2, "GET", "/admin/ready", Some(&viewer), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["ready"], false);
    assert_eq!(v["backends"][0]["backend"], format!("http://{dead}"), "{v}");
    assert_eq!(v["backends"][0]["state"], "down", "{v}");
    assert!(v["backends"][0]["last_error"].is_string(), "{v}");
    assert_eq!(v["key_store"]["state"], "up", "{v}");
    assert!(v["key_store"]["keys"].as_u64().unwrap() >= 1, "{v}");
}

/// Health probes name why a backend cannot be used — a closed port, a certificate no CA vouches
/// for, a certificate for another name — with when it happened, the request path names the
/// same cause, and the reason is cleared when the backend is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_name_the_cause_and_clear_it_when_healthy() {
    // A TLS backend: a gateway with a self-signed certificate for `localhost`, before a sim.
    let sim_behind = sim(|_| {}).await;
    let (tls_backend, _cert, cert_path, dir) = tls_gateway(&sim_behind.url()).await;
    let port = tls_backend.server.local_addr.port();
    let dead = closed_port().await;
    let untrusted = pool("untrusted", &[format!("https://localhost:{port}")]);
    let mut mismatch = pool("mismatch", &[format!("https://127.0.0.1:{port}")]);
    mismatch.ca_file = Some(cert_path.clone());
    let refused = pool("refused", &[format!("http://{dead}")]);
    let gw = gateway(vec![untrusted, mismatch, refused]).await;
    let want = [
        ("untrusted", "certificate not trusted"),
        ("mismatch", "certificate name mismatch"),
        ("refused", "connection refused"),
    ];
    let named = || {
        let b = gw.server.pools().backends_json();
        want.iter().all(|(model, cause)| {
            b.iter().any(|v| {
                v["model"] == *model
                    && v["last_error"]
                        .as_str()
                        .is_some_and(|e| e.starts_with("/health failed: ") && e.contains(cause))
                    && v["last_error_at"].is_string()
            })
        })
    };
    assert!(
        eventually(Duration::from_secs(10), named).await,
        "{:#?}",
        gw.server.pools().backends_json()
    );
    // A request meets the same cause, in its 502.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("untrusted", "hi", 2, false),
    )
    .await;
    let e = openai_error(&m);
    if m.status == 502 {
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("certificate not trusted"),
            "{e}"
        );
    } else {
        // Already marked down by its probes: no backend to try.
        assert_eq!(m.status, 503, "{e}");
    }

    // The closed port starts listening: healthy again, and the old reason is gone.
    let _back = sim(|a| a.port = dead.port()).await;
    let cleared = || {
        gw.server.pools().backends_json().iter().any(|v| {
            v["model"] == "refused" && v["state"] == "healthy" && v["last_error"].is_null()
        })
    };
    assert!(
        eventually(Duration::from_secs(10), cleared).await,
        "{:#?}",
        gw.server.pools().backends_json()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
