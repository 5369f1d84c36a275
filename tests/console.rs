//! The console (issue 18): its access rules through HTTP on both stores, and the operator's
//! whole path in a real headless Chromium driven through chromedriver.
//!
//! The browser test skips loudly when Debian's `chromium` and `chromium-driver` are not
//! installed, and fails under `CI=true` (`.ci/run` installs them). With
//! `FLEETGATE_CONSOLE_SCREENSHOTS=<dir>` it also saves a PNG of each page there (that is how
//! docs/console/*.png are made).

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
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
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_access_rules_on_both_stores() {
    for (db, _guard) in stores("console_access").await {
        let kind = db.kind().as_str();
        let (_sim, gw, admin) = console_gateway(Some(db.clone())).await;

        // `/` leads to the console; not signed in, a page says how to sign in (401).
        let root = send(admin, "GET", "/", &[], None).await;
        assert_eq!(root.status, 303);
        assert_eq!(root.headers["location"], "/console/");
        let anon = send(admin, "GET", "/console/", &[], None).await;
        assert_eq!(anon.status, 401, "{kind}");
        assert!(
            anon.body.contains("fleetgate console-login"),
            "{}",
            anon.body
        );
        let csp = anon.headers["content-security-policy"]
            .to_str()
            .unwrap_or_default();
        assert!(
            csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
            "{csp}"
        );
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(anon.headers["x-frame-options"], "DENY");

        // The assets come from the binary.
        for (path, ty) in [
            ("/console/assets/console.js", "text/javascript"),
            ("/console/assets/console.css", "text/css"),
            ("/console/assets/icon.svg", "image/svg+xml"),
        ] {
            let a = send(admin, "GET", path, &[], None).await;
            assert_eq!(a.status, 200, "{path}");
            assert!(
                a.headers["content-type"]
                    .to_str()
                    .unwrap_or_default()
                    .starts_with(ty)
            );
        }

        // A link signs in once.
        let l = link(Role::Admin);
        let first = send(
            admin,
            "GET",
            &format!("/console/login?token={l}"),
            &[],
            None,
        )
        .await;
        assert_eq!(first.status, 200);
        assert_eq!(first.headers["referrer-policy"], "no-referrer");
        let again = send(
            admin,
            "GET",
            &format!("/console/login?token={l}"),
            &[],
            None,
        )
        .await;
        assert_eq!(again.status, 401);
        assert!(again.body.contains("used already"), "{}", again.body);
        let junk = send(admin, "GET", "/console/login?token=abc.def.ghi", &[], None).await;
        assert_eq!(junk.status, 401);

        let (cookie, csrf) = sign_in(admin, Role::Admin).await;
        let session_token = cookie.split_once('=').map(|(_, v)| v).unwrap_or_default();
        // The session is no admin API token, and an admin API token is no session cookie.
        let (status, body) = admin_api(&gw, "GET", "/admin/keys", Some(session_token), None).await;
        assert_eq!(status, 401, "{body}");
        let api_token = token(Role::Admin);
        let forged = format!("fleetgate_console={api_token}");
        assert_eq!(
            send(admin, "GET", "/console/keys", &[("cookie", &forged)], None)
                .await
                .status,
            401
        );
        // …but the console takes an admin API token once as a sign-in.
        let via_token = send(
            admin,
            "GET",
            &format!("/console/login?token={api_token}"),
            &[],
            None,
        )
        .await;
        assert_eq!(via_token.status, 200, "{}", via_token.body);
        assert_eq!(
            send(
                admin,
                "GET",
                &format!("/console/login?token={api_token}"),
                &[],
                None
            )
            .await
            .status,
            401
        );

        // Issue a key whose name and metadata would break a page that did not escape.
        let evil = "<img src=x onerror=alert(1)>";
        let metadata = r#"{"owner": "the \"quoted\" team", "note": "it's <b>bold</b>"}"#;
        let issued = send(
            admin,
            "POST",
            "/console/keys",
            &[("cookie", &cookie)],
            Some(form(&[
                ("csrf", &csrf),
                ("environment", "prod"),
                ("name", evil),
                ("metadata", metadata),
                ("requests_per_minute", "600"),
                ("expires_in", "30d"),
            ])),
        )
        .await;
        assert_eq!(issued.status, 201, "{kind}: {}", issued.body);
        assert!(!issued.body.contains(evil), "escaped: {}", issued.body);
        assert!(issued.body.contains("&lt;img src=x onerror=alert(1)&gt;"));
        let key = issued
            .body
            .split("id=\"new-key\">")
            .nth(1)
            .and_then(|s| s.split('<').next())
            .unwrap_or_else(|| panic!("no key shown: {}", issued.body))
            .to_owned();
        assert!(key.starts_with("fg-prod-"), "{key}");
        assert!(
            issued.body.contains(&format!(
                "export OPENAI_API_KEY={key} OPENAI_BASE_URL=http://127.0.0.1:{}/v1",
                gw.server.local_addr.port()
            )),
            "{}",
            issued.body
        );
        let id = key.split('-').nth(2).unwrap_or_default().to_owned();
        let page = send(
            admin,
            "GET",
            &format!("/console/keys/{id}"),
            &[("cookie", &cookie)],
            None,
        )
        .await;
        assert_eq!(page.status, 200);
        assert!(
            !page.body.contains(evil) && !page.body.contains("<b>bold"),
            "{}",
            page.body
        );
        assert!(
            page.body.contains("the \\&quot;quoted\\&quot; team"),
            "{}",
            page.body
        );
        // The full key is shown once: not on the key's page, not in the list.
        assert!(!page.body.contains(&key));
        let list = send(
            admin,
            "GET",
            "/console/keys?env=prod&q=onerror",
            &[("cookie", &cookie)],
            None,
        )
        .await;
        assert!(
            list.body.contains(&id) && !list.body.contains(&key),
            "{}",
            list.body
        );
        let none = send(
            admin,
            "GET",
            "/console/keys?env=gray",
            &[("cookie", &cookie)],
            None,
        )
        .await;
        assert!(!none.body.contains(&id));

        // Bad input comes back with the form filled in and nothing issued.
        let bad = send(
            admin,
            "POST",
            "/console/keys",
            &[("cookie", &cookie)],
            Some(form(&[
                ("csrf", &csrf),
                ("environment", "prod"),
                ("name", "x"),
                ("metadata", "[1]"),
            ])),
        )
        .await;
        assert_eq!(bad.status, 400);
        assert!(bad.body.contains("must be a JSON object"), "{}", bad.body);

        // CSRF: no token, another session's token, another site's Origin — all refused.
        let revoke_form = form(&[("csrf", &csrf), ("reason", "test"), ("confirm", "yes")]);
        let path = format!("/console/keys/{id}/revoke");
        let no_token = send(
            admin,
            "POST",
            &path,
            &[("cookie", &cookie)],
            Some(form(&[("reason", "x"), ("confirm", "yes")])),
        )
        .await;
        assert_eq!(no_token.status, 403, "{}", no_token.body);
        let (_, other_csrf) = sign_in(admin, Role::Admin).await;
        let other = send(
            admin,
            "POST",
            &path,
            &[("cookie", &cookie)],
            Some(form(&[
                ("csrf", &other_csrf),
                ("reason", "x"),
                ("confirm", "yes"),
            ])),
        )
        .await;
        assert_eq!(other.status, 403);
        let cross = send(
            admin,
            "POST",
            &path,
            &[("cookie", &cookie), ("origin", "http://evil.example")],
            Some(revoke_form.clone()),
        )
        .await;
        assert_eq!(cross.status, 403);
        // Unconfirmed: nothing happens.
        let unconfirmed = send(
            admin,
            "POST",
            &path,
            &[("cookie", &cookie)],
            Some(form(&[("csrf", &csrf), ("reason", "x")])),
        )
        .await;
        assert_eq!(unconfirmed.status, 400);
        // A viewer sees the key, without the buttons, and is refused anyway.
        let (viewer, viewer_csrf) = sign_in(admin, Role::Viewer).await;
        let seen = send(
            admin,
            "GET",
            &format!("/console/keys/{id}"),
            &[("cookie", &viewer)],
            None,
        )
        .await;
        assert_eq!(seen.status, 200);
        assert!(!seen.body.contains("id=\"revoke\"") && !seen.body.contains("id=\"issue-form\""));
        let refused = send(
            admin,
            "POST",
            &path,
            &[("cookie", &viewer)],
            Some(form(&[
                ("csrf", &viewer_csrf),
                ("reason", "x"),
                ("confirm", "yes"),
            ])),
        )
        .await;
        assert_eq!(refused.status, 403, "{}", refused.body);
        assert!(refused.body.contains("role viewer"));
        let chat = gw.url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        assert_eq!(
            post(&chat, &[("authorization", &auth)], chat_body())
                .await
                .status,
            200
        );

        // The admin revokes: at once a 401 key_revoked.
        let done = send(
            admin,
            "POST",
            &path,
            &[("cookie", &cookie), ("origin", &format!("http://{admin}"))],
            Some(revoke_form),
        )
        .await;
        assert_eq!(done.status, 303, "{}", done.body);
        let m = post(&chat, &[("authorization", &auth)], chat_body()).await;
        assert_eq!(m.status, 401);
        assert_eq!(openai_error(&m)["code"], "key_revoked");

        // The audit trail has both, filterable on the admin API as in the console.
        let (status, audit) = admin_api(
            &gw,
            "GET",
            &format!("/admin/audit?key={id}&action=revoke"),
            Some(&api_token_fresh()),
            None,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(audit["data"].as_array().map(Vec::len), Some(1), "{audit}");
        let page = send(
            admin,
            "GET",
            &format!("/console/audit?key={id}"),
            &[("cookie", &cookie)],
            None,
        )
        .await;
        assert!(
            page.body.contains("data-action=\"create\"")
                && page.body.contains("data-action=\"revoke\"")
        );
        // The issue's expiry reads as a time, not as epoch milliseconds.
        assert!(
            page.body.contains("&quot;expires_at&quot;:&quot;20")
                || page.body.contains("\"expires_at\":\"20"),
            "{}",
            page.body
        );
        let signins = send(
            admin,
            "GET",
            "/console/audit?action=console_sign_in&actor=tester",
            &[("cookie", &cookie)],
            None,
        )
        .await;
        assert!(
            signins
                .body
                .matches("data-action=\"console_sign_in\"")
                .count()
                >= 3,
            "{}",
            signins.body
        );

        // Signing out ends the session even for a copy of the cookie.
        let out = send(
            admin,
            "POST",
            "/console/logout",
            &[("cookie", &cookie)],
            Some(form(&[("csrf", &csrf)])),
        )
        .await;
        assert_eq!(out.status, 200);
        assert!(
            out.headers["set-cookie"]
                .to_str()
                .unwrap_or_default()
                .contains("Max-Age=0")
        );
        assert_eq!(
            send(admin, "GET", "/console/keys", &[("cookie", &cookie)], None)
                .await
                .status,
            401
        );
        // The live fragment tells the page's script the same.
        assert_eq!(
            send(admin, "GET", "/console/live", &[("cookie", &cookie)], None)
                .await
                .status,
            401
        );
    }
}

/// `fleetgate console-login` prints a link that signs in on a running gateway with the same
/// secret; without an HS256 secret, or asked for too long a session, it says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_login_prints_a_working_link() {
    let (_sim, _gw, admin) = console_gateway(None).await;
    let dir = TempDir(temp_dir("console-login"));
    let config = dir.0.join("fleetgate.toml");
    let write = |text: String| std::fs::write(&config, text).unwrap_or_else(|e| panic!("{e}"));
    write(format!(
        "[admin]\nlisten = \"0.0.0.0:18081\"\njwt_secret = \"{JWT_SECRET}\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n"
    ));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleetgate"))
            .arg("console-login")
            .arg("--config")
            .arg(&config)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // From admin.listen (every address: the link names 127.0.0.1).
    let (code, out, err) = run(&["--role", "viewer"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.starts_with("http://127.0.0.1:18081/console/login?token="),
        "{out}"
    );
    assert!(err.contains("signs in once"), "{err}");
    // With --url, straight into the running gateway.
    let (code, out, err) = run(&[
        "--url",
        &format!("http://{admin}/"),
        "--sub",
        "alice",
        "--ttl",
        "2h",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let path = out
        .strip_prefix(&format!("http://{admin}"))
        .unwrap_or_else(|| panic!("{out}"));
    let a = send(admin, "GET", path, &[], None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.body.contains("alice") && a.body.contains("(admin)"),
        "{}",
        a.body
    );
    let set = a.headers["set-cookie"]
        .to_str()
        .unwrap_or_default()
        .to_owned();
    assert!(set.contains("Max-Age=7"), "two hours: {set}");
    let (code, _, err) = run(&["--ttl", "8d"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("at most 7d"), "{err}");
    write("[admin]\njwt_algorithm = \"ES256\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n".to_owned());
    let (code, _, err) = run(&[]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("/console/login?token=<an admin API token"),
        "{err}"
    );
}

/// With `admin.tls`, the console is served over TLS and its cookie is `Secure`; behind a TLS
/// proxy, `X-Forwarded-Proto: https` does the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cookie_is_secure_over_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = TempDir(temp_dir("console-tls"));
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])
        .unwrap_or_else(|e| panic!("certificate: {e}"));
    let (cert_path, key_path) = (dir.0.join("cert.pem"), dir.0.join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap_or_else(|e| panic!("{e}"));
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg();
        c.admin.tls = Some(fleetgate_gateway::config::TlsConfig {
            cert: cert_path.clone(),
            key: key_path.clone(),
        });
    })
    .await;
    let admin = gw
        .server
        .admin_addr
        .unwrap_or_else(|| panic!("admin listener"));
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(cert.cert.der().clone())
        .unwrap_or_else(|e| panic!("{e}"));
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .build();
    let c: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(conn);
    let req = http::Request::get(format!(
        "https://localhost:{}/console/login?token={}",
        admin.port(),
        link(Role::Admin)
    ))
    .body(http_body_util::Full::new(Bytes::new()))
    .unwrap_or_else(|e| panic!("{e}"));
    let r = c
        .request(req)
        .await
        .unwrap_or_else(|e| panic!("TLS console: {e}"));
    assert_eq!(r.status(), 200);
    let set = r.headers()["set-cookie"].to_str().unwrap_or_default();
    assert!(set.contains("; Secure"), "{set}");
    // Plain HTTP to that listener is not served.
    let plain = fleetgate_protocol::client::http_client()
        .request(
            http::Request::get(format!("http://{admin}/console/"))
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap_or_else(|e| panic!("{e}")),
        )
        .await;
    assert!(plain.map(|r| r.status().as_u16() != 200).unwrap_or(true));

    // Plain HTTP behind a proxy that terminated TLS.
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let admin = gw
        .server
        .admin_addr
        .unwrap_or_else(|| panic!("admin listener"));
    let a = send(
        admin,
        "GET",
        &format!("/console/login?token={}", link(Role::Viewer)),
        &[("x-forwarded-proto", "https")],
        None,
    )
    .await;
    assert!(
        a.headers["set-cookie"]
            .to_str()
            .unwrap_or_default()
            .contains("; Secure")
    );
}

/// Issue 31 §3, the console's charts: the overview's window follows the data (a few requests
/// just now are drawn over 5 minutes, not squashed into the edge of an hour) and says itself;
/// a key whose traffic was yesterday opens on yesterday — its window ending at its last
/// request, said on the page — with a hop chart beside TTFT and processing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_windows_follow_the_data() {
    for (db, _guard) in stores("console_windows").await {
        let kind = db.kind().as_str();
        let (_sim, gw, admin) = console_gateway(Some(db.clone())).await;
        let (cookie, _) = sign_in(admin, Role::Viewer).await;
        let get = |path: String| {
            let cookie = cookie.clone();
            async move {
                let a = send(admin, "GET", &path, &[("cookie", &cookie)], None).await;
                assert_eq!(a.status, 200, "{path}: {}", a.body);
                a.body
            }
        };

        // The overview: three requests just now.
        let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
        let auth = format!("Bearer {key}");
        let chat = gw.url("/v1/chat/completions");
        for _ in 0..3 {
            let m = post(&chat, &[("authorization", &auth)], chat_body()).await;
            assert_eq!(m.status, 200);
        }
        let mut charts = String::new();
        for _ in 0..500 {
            charts = get("/console/charts".into()).await;
            if charts.contains("data-env=\"prod\"><td><span class=\"env prod\">prod</span></td><td class=\"num\">3<") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            charts.contains(">3<"),
            "{kind}: the log has the 3 requests: {charts}"
        );
        // Drawn over 5 minutes in 10-second buckets, and the page says so on each chart.
        assert_eq!(
            charts.matches("per 10 s, ").count(),
            5,
            "{kind}: every chart says its window: {charts}"
        );
        assert!(charts.contains(" UTC (5 min)"), "{charts}");
        assert!(
            charts.contains("From the request log, ") && !charts.contains("-1h"),
            "{charts}"
        );
        // Hop and processing in µs, TTFT in ms, in the table as in the charts.
        for unit in ["TTFT p50 (ms)", "hop p50 (µs)", "processing p99 (µs)"] {
            assert!(charts.contains(unit), "{unit}: {charts}");
        }

        // A gray key whose 40 requests, one a minute, ended 26 hours ago.
        let (_, quiet) = issue_key(&gw, Environment::Gray, |c| c.name = "yesterday".into()).await;
        let id = quiet.public_id.to_string();
        let last = fleetgate_gateway::clock::wall_ms() - 26 * 3_600_000;
        for i in 0..40i64 {
            sqlx::query(
                "INSERT INTO request_log (row_id, at, request_id, key_id, environment, status, \
                 stream, usage_source, content_events, client_ttft_us, overhead_pre_us, \
                 overhead_relay_us, hop_us) \
                 VALUES ($1, $2, $3, $4, 'gray', 200, 1, 'backend', 3, $5, 90, 30, $6)",
            )
            .bind(format!("yesterday-{i}"))
            .bind(last - (39 - i) * 60_000)
            .bind(format!("request-{i}"))
            .bind(id.clone())
            .bind(150_000 + i * 1000)
            .bind(40 + i)
            .execute(gw.server.auth.store().pool())
            .await
            .unwrap_or_else(|e| panic!("{kind}: insert: {e}"));
        }
        let page = get(format!("/console/keys/{id}")).await;
        let note = page
            .split("id=\"usage-note\">")
            .nth(1)
            .and_then(|s| s.split("</p>").next())
            .unwrap_or_else(|| panic!("{kind}: no usage note: {page}"));
        let last_text = fleetgate_gateway::clock::format_wall_ms(last);
        assert!(
            note.contains(&format!(
                "the window ends at its last request, {last_text} (1 d 2 h ago)"
            )),
            "{kind}: {note}"
        );
        // 39 minutes and a bit: 40 one-minute buckets, on yesterday's date.
        assert!(note.contains(" (40 min)."), "{kind}: {note}");
        let yesterday = &last_text[..10];
        assert!(
            page.contains(&format!("per minute, {yesterday} ")),
            "{kind}: the charts say the day: {page}"
        );
        assert!(page.contains("id=\"usage-requests\">40<"), "{kind}: {page}");
        // The hop chart, p50 solid and p99 dashed, in µs like the percentiles table.
        let hop = page
            .split("id=\"key-chart-hop\"")
            .nth(1)
            .and_then(|s| s.split("</figure>").next())
            .unwrap_or_else(|| panic!("{kind}: no hop chart: {page}"));
        assert!(hop.contains("(µs)"), "{hop}");
        assert_eq!(
            hop.matches("<path class=\"series gray\"").count(),
            2,
            "{hop}"
        );
        assert!(hop.contains("stroke-dasharray=\"5 3\""), "{hop}");
        assert!(
            page.contains("<tr data-figure=\"hop\"><td>hop (added TTFT)</td><td class=\"unit\">µs</td><td class=\"num\">59.0<"),
            "{kind}: hop p50 of 40..=79 µs: {page}"
        );
        // Asked for the last hour: nothing, and the page says when its last request was.
        let hour = get(format!("/console/keys/{id}?since=1h")).await;
        assert!(
            hour.contains(&format!(
                "No request in the last hour; its last request was at {last_text}"
            )) && hour.contains(&format!("href=\"/console/keys/{id}?since=latest\"")),
            "{kind}: {hour}"
        );
        // A key without any request says that, too.
        let (_, fresh) = issue_key(&gw, Environment::Stress, |_| {}).await;
        let none = get(format!("/console/keys/{}", fresh.public_id)).await;
        assert!(
            none.contains("No request with this key is in the request log."),
            "{kind}: {none}"
        );
    }
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

/// chromedriver on a free port, stopped when dropped.
struct Driver {
    child: std::process::Child,
    port: u16,
    _profile: TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Debian's chromium and chromedriver, or `None` with a loud skip (a failure under CI=true).
fn browser_installed() -> bool {
    let missing: Vec<&str> = ["/usr/bin/chromium", "/usr/bin/chromedriver"]
        .into_iter()
        .filter(|p| !std::path::Path::new(p).exists())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{} not installed (apt-get install chromium chromium-driver; .ci/run does)",
        missing.join(" and ")
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("the console's browser test needs Chromium under CI=true: {why}");
    }
    eprintln!("\n*** SKIPPED console_in_a_real_browser: {why} ***\n");
    false
}

async fn start_driver() -> Driver {
    let port = closed_port().await.port();
    let profile = TempDir(temp_dir("chromium"));
    let child = std::process::Command::new("/usr/bin/chromedriver")
        .arg(format!("--port={port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("chromedriver: {e}"));
    let driver = Driver {
        child,
        port,
        _profile: profile,
    };
    wait_for_200(&format!("http://127.0.0.1:{port}/status")).await;
    driver
}

/// The browser's console since the last read, as (level, message).
#[derive(Debug)]
struct BrowserLog;

impl fantoccini::wd::WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/se/log",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (http::Method::POST, Some(r#"{"type":"browser"}"#.to_owned()))
    }
}

struct Browser {
    client: fantoccini::Client,
    base: String,
    shots: Option<std::path::PathBuf>,
}

impl Browser {
    async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap_or_else(|e| panic!("goto {path}: {e}"));
    }

    async fn css(&self, selector: &str) -> fantoccini::elements::Element {
        match self
            .client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(fantoccini::Locator::Css(selector))
            .await
        {
            Ok(e) => e,
            Err(e) => {
                let url = self.client.current_url().await.map(|u| u.to_string());
                let text = match self.client.find(fantoccini::Locator::Css("body")).await {
                    Ok(body) => body.text().await.unwrap_or_default(),
                    Err(_) => String::new(),
                };
                panic!("{selector}: {e}; the page {url:?} reads:\n{text}")
            }
        }
    }

    async fn absent(&self, selector: &str) -> bool {
        self.client
            .find_all(fantoccini::Locator::Css(selector))
            .await
            .unwrap_or_else(|e| panic!("{selector}: {e}"))
            .is_empty()
    }

    async fn text(&self, selector: &str) -> String {
        self.css(selector)
            .await
            .text()
            .await
            .unwrap_or_else(|e| panic!("text of {selector}: {e}"))
    }

    async fn fill(&self, selector: &str, value: &str) {
        let e = self.css(selector).await;
        e.clear()
            .await
            .unwrap_or_else(|e| panic!("clear {selector}: {e}"));
        e.send_keys(value)
            .await
            .unwrap_or_else(|e| panic!("type into {selector}: {e}"));
    }

    async fn click(&self, selector: &str) {
        self.css(selector)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {selector}: {e}"));
    }

    /// The browser's console since the last call.
    async fn log(&self) -> Vec<(String, String)> {
        let v = self
            .client
            .issue_cmd(BrowserLog)
            .await
            .unwrap_or_else(|e| panic!("browser log: {e}"));
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        (
                            e["level"].as_str().unwrap_or_default().to_owned(),
                            e["message"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// No error, warning or CSP report in the browser's console since the last check.
    async fn no_console_errors(&self, page: &str) {
        let bad: Vec<_> = self
            .log()
            .await
            .into_iter()
            .filter(|(level, message)| {
                level != "INFO" && level != "DEBUG" || message.contains("Content Security Policy")
            })
            .collect();
        assert!(bad.is_empty(), "{page}: the browser's console: {bad:?}");
    }

    async fn shot(&self, name: &str) {
        let Some(dir) = &self.shots else { return };
        let png = self
            .client
            .screenshot()
            .await
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
        std::fs::write(dir.join(format!("{name}.png")), png)
            .unwrap_or_else(|e| panic!("write screenshot: {e}"));
    }
}

async fn open_browser(driver: &Driver, base: String) -> Browser {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-quic", "--window-size=1360,1500",
                format!("--user-data-dir={}", driver._profile.0.display()),
            ],
        }),
    );
    caps.insert(
        "goog:loggingPrefs".into(),
        serde_json::json!({"browser": "ALL"}),
    );
    let client =
        fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .unwrap_or_else(|e| panic!("chromium via chromedriver: {e}"));
    let shots = std::env::var_os("FLEETGATE_CONSOLE_SCREENSHOTS").map(std::path::PathBuf::from);
    if let Some(d) = &shots {
        std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    }
    Browser {
        client,
        base,
        shots,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_real_browser() {
    if !browser_installed() {
        return;
    }
    let (_sim, gw, admin) = console_gateway(None).await;
    let chat = gw.url("/v1/chat/completions");
    // Some traffic in each environment, so the overview has something to draw.
    let mut keys = HashMap::new();
    for env in Environment::ALL {
        let (k, _) = issue_key(&gw, env, |c| c.name = format!("{env} load test")).await;
        keys.insert(env, format!("Bearer {k}"));
    }
    for i in 0..24 {
        let env = Environment::ALL[i % 3];
        assert_eq!(
            post(&chat, &[("authorization", &keys[&env])], chat_body())
                .await
                .status,
            200
        );
    }
    let _ = post(
        &chat,
        &[("authorization", "Bearer fg-prod-nope")],
        chat_body(),
    )
    .await;

    let driver = start_driver().await;
    let b = open_browser(&driver, format!("http://{admin}")).await;

    // Sign in with a one-time link: the page moves on to the overview by itself.
    b.goto(&format!("/console/login?token={}", link(Role::Admin)))
        .await;
    b.css("#live-table").await;
    assert_eq!(b.text("#role").await, "admin");
    assert_eq!(
        b.text("#hour-table tr[data-env=prod] td:nth-child(2)")
            .await,
        "8"
    );
    b.css("#chart-ttft path.series.prod").await;
    // The live section refreshes without a reload: the script stamps it.
    b.client
        .wait()
        .at_most(Duration::from_secs(15))
        .for_element(fantoccini::Locator::Css("#live[data-updated]"))
        .await
        .unwrap_or_else(|e| panic!("the live section never refreshed: {e}"));
    b.no_console_errors("overview").await;
    b.shot("overview").await;

    // Issue a prod key whose name would run script if it were not escaped.
    b.goto("/console/keys").await;
    b.shot("keys").await;
    let evil = "<img src=x onerror=alert(1)>";
    b.fill("#issue-name", evil).await;
    b.fill("#issue-models", "qwen32b").await;
    b.fill("#issue-endpoints", "chat, embeddings").await;
    // An empty limit means the environment's default (docs/console.md), and the form says so.
    for field in ["#issue-rpm", "#issue-tpm", "#issue-streams"] {
        let placeholder = b
            .css(field)
            .await
            .attr("placeholder")
            .await
            .unwrap()
            .unwrap_or_default();
        assert_eq!(placeholder, "the environment's default", "{field}");
    }
    b.fill("#issue-rpm", "600").await;
    b.fill("#issue-metadata", r#"{"owner": "the \"quoted\" team"}"#)
        .await;
    b.click("#issue-submit").await;
    let key = b.text("#new-key").await;
    assert!(key.starts_with("fg-prod-"), "{key}");
    let export = b.text("#export-line").await;
    assert_eq!(
        export,
        format!(
            "export OPENAI_API_KEY={key} OPENAI_BASE_URL=http://127.0.0.1:{}/v1",
            gw.server.local_addr.port()
        )
    );
    b.click("button[data-copy=new-key]").await;
    b.no_console_errors("key issued").await;
    b.shot("key-issued").await;
    let auth = format!("Bearer {key}");
    assert_eq!(
        post(&chat, &[("authorization", &auth)], chat_body())
            .await
            .status,
        200
    );

    // Its page: the name shows as text, no image element was made, no alert is open.
    b.click("#key-page").await;
    assert_eq!(b.text("#key-name").await, evil);
    assert!(b.absent("main img").await);
    assert!(b.client.get_alert_text().await.is_err(), "an alert opened");
    assert!(
        b.text("#key-metadata")
            .await
            .contains(r#""the \"quoted\" team""#)
    );
    assert_eq!(b.text("#usage-requests").await, "1");
    assert_eq!(b.text("#key-endpoints").await, "chat, embeddings");
    b.no_console_errors("key page").await;
    b.shot("key").await;

    // Revoke it in the page.
    b.fill("#revoke-reason", "leaked in a log").await;
    b.click("#revoke-confirm").await;
    b.click("#revoke").await;
    b.css("#notice").await;
    assert_eq!(b.text("#key-status").await, "revoked");
    let m = post(&chat, &[("authorization", &auth)], chat_body()).await;
    assert_eq!(m.status, 401);
    assert_eq!(openai_error(&m)["code"], "key_revoked");
    b.no_console_errors("revoked").await;

    // The audit page shows both actions on that key.
    let id = key.split('-').nth(2).unwrap_or_default().to_owned();
    b.goto("/console/audit").await;
    let audit = b.text("#audit").await;
    assert!(
        audit.contains("create") && audit.contains("revoke") && audit.contains(&id),
        "{audit}"
    );
    b.css(&format!(
        "#audit tr[data-action=revoke] a[href='/console/keys/{id}']"
    ))
    .await;
    b.no_console_errors("audit").await;
    b.shot("audit").await;

    b.goto("/console/backends").await;
    b.css("tr[data-backend] .state").await;
    assert!(
        !b.absent("tr[data-backend] form button").await,
        "an admin can drain"
    );
    b.no_console_errors("backends").await;
    b.shot("backends").await;

    // Sign out: the console asks to sign in again.
    b.click("#sign-out").await;
    b.css("#signed-out").await;
    b.goto("/console/").await;
    b.css("#error").await;
    let _ = b.log().await; // the 401 of that last page is expected

    // A viewer sees everything and changes nothing: no button, and a forged POST is refused.
    let (other, other_record) =
        issue_key(&gw, Environment::Prod, |c| c.name = "still active".into()).await;
    b.goto(&format!("/console/login?token={}", link(Role::Viewer)))
        .await;
    b.css("#live-table").await;
    assert_eq!(b.text("#role").await, "viewer");
    b.goto("/console/keys").await;
    assert!(b.absent("#issue-form").await);
    b.goto(&format!("/console/keys/{}", other_record.public_id))
        .await;
    assert!(b.absent("#revoke").await && b.absent("#rotate").await);
    b.shot("viewer-key").await;
    b.goto("/console/backends").await;
    assert!(b.absent("tr[data-backend] form").await);
    b.no_console_errors("viewer pages").await;
    let status = b
        .client
        .execute(
            "const csrf = document.querySelector('input[name=csrf]').value; \
             return fetch(arguments[0], {method: 'POST', headers: {'content-type': 'application/x-www-form-urlencoded'}, \
               body: 'csrf=' + csrf + '&reason=forged&confirm=yes'}).then(r => r.status);",
            vec![serde_json::json!(format!("/console/keys/{}/revoke", other_record.public_id))],
        )
        .await
        .unwrap_or_else(|e| panic!("forged POST: {e}"));
    assert_eq!(status, serde_json::json!(403));
    let _ = b.log().await; // the 403 is expected
    let ok = post(
        &chat,
        &[("authorization", &format!("Bearer {other}"))],
        chat_body(),
    )
    .await;
    assert_eq!(ok.status, 200, "the viewer's forged revoke changed nothing");
    let _ = b.client.clone().close().await;
}
