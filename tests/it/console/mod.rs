//! The console: its access rules through HTTP on both stores, and the operator's
//! whole path in a real headless Chromium driven through chromedriver.
//!
//! The browser test skips loudly when Debian's `chromium` and `chromium-driver` are not
//! installed, and fails under `CI=true` (`.ci/run` installs them). With
//! `FLEETGATE_CONSOLE_SCREENSHOTS=<dir>` it also saves a PNG of each page there (that is how
//! docs/console/*.png are made).

mod access;
mod browser;
mod requests;
mod windows;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::admin::jwt::Role;
use fleetgate_gateway::key::Environment;
use http_body_util::BodyExt;

fn chat_body() -> Bytes {
    Bytes::from(
        serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hello"}]})
            .to_string(),
    )
}

fn link(role: Role) -> String {
    fleetgate_gateway::admin::console::session::mint_login(
        &admin_cfg(),
        role,
        "tester",
        Duration::from_secs(3600),
    )
    .unwrap_or_else(|e| panic!("mint: {e}"))
}

struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: String,
}

async fn send(
    admin: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> Answer {
    let c = fleetgate_protocol::client::http_client();
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{admin}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if body.is_some() {
        req = req.header("content-type", "application/x-www-form-urlencoded");
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from(
            body.unwrap_or_default(),
        )))
        .unwrap_or_else(|e| panic!("request: {e}"));
    let r = c
        .request(req)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r
        .into_body()
        .collect()
        .await
        .unwrap_or_else(|e| panic!("body: {e}"))
        .to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// A console page a signed-in operator opens: 200, its HTML.
async fn page_ok(admin: SocketAddr, cookie: &str, path: impl AsRef<str>) -> String {
    let path = path.as_ref();
    let a = send(admin, "GET", path, &[("cookie", cookie)], None).await;
    assert_eq!(a.status, 200, "{path}: {}", a.body);
    a.body
}

/// Sign in with a link; returns the `Cookie` header value and the session's CSRF token.
async fn sign_in(admin: SocketAddr, role: Role) -> (String, String) {
    let a = send(
        admin,
        "GET",
        &format!("/console/login?token={}", link(role)),
        &[],
        None,
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let set = a
        .headers
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no cookie set: {:?}", a.headers))
        .to_owned();
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        assert!(set.contains(flag), "{flag} in {set}");
    }
    let max_age: u64 = set
        .split("Max-Age=")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("Max-Age in {set}"));
    assert!(
        (3590..=3600).contains(&max_age),
        "the link's session length: {set}"
    );
    assert!(!set.contains("Secure"), "plain HTTP: no Secure flag: {set}");
    let cookie = set.split(';').next().unwrap_or_default().to_owned();
    let page = send(admin, "GET", "/console/keys", &[("cookie", &cookie)], None).await;
    assert_eq!(page.status, 200, "{}", page.body);
    let csrf = page
        .body
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no csrf field: {}", page.body))
        .to_owned();
    (cookie, csrf)
}

/// A gateway with the console on its admin listener, in front of one sim; on `db` when given
/// (else the helper's own SQLite store): (the sim, the gateway, the admin listener's address).
async fn console_gateway(
    db: Option<fleetgate_gateway::config::DatabaseConfig>,
) -> (fleetgate_sim::SimServer, Gateway, SocketAddr) {
    let sim = sim(|_| {}).await;
    let mut p = pool("qwen32b", &[sim.url()]);
    // A gray canary's label, shown on the Backends page.
    p.backends[0].labels = vec!["canary".into()];
    let gw = gateway_with(vec![p], |c| {
        if let Some(db) = db {
            c.database = db;
        }
        c.admin = admin_cfg();
    })
    .await;
    let admin = gw
        .server
        .admin_addr
        .unwrap_or_else(|| panic!("admin listener"));
    (sim, gw, admin)
}

fn form(pairs: &[(&str, &str)]) -> String {
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

fn api_token_fresh() -> String {
    token(Role::Viewer)
}

/// (status, JSON body) of an admin API call with a bearer token.
async fn admin_api(
    gw: &Gateway,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    admin(gw, method, path, bearer, body).await
}

// ---------------------------------------------------------------------------------------------
// The browser
