//! The console's access rules through HTTP on both stores, its sign-in link, and its cookie
//! over TLS.

use super::*;

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
