//! API keys end to end, on the embedded SQLite store and on real PostgreSQL: the store's
//! lifecycle, every 401/403 message as an OpenAI client decodes it, instant revocation across
//! gateways, rotation grace, expiry, the admin API's JWT checks, brute-force slowdown, and a
//! database outage served from the snapshot.

#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use fleetgate_gateway::admin::jwt::{self, Role};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::secret::Secret;
use fleetgate_gateway::store::{CreateKey, KeyStore, StoreError};
use fleetgate_protocol::client::{self, chat_body};
use http_body_util::BodyExt;

fn create(env: Environment, name: &str) -> CreateKey {
    CreateKey {
        name: name.into(),
        environment: Some(env),
        ..CreateKey::default()
    }
}

async fn chat(gw: &Gateway, key: &str) -> client::Measured {
    post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key}"))],
        chat_body("qwen32b", "hi", 3, true),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_lifecycle_on_both_stores() {
    for (db, _guard) in stores("store_lifecycle").await {
        let kind = db.kind().as_str();
        let store = KeyStore::connect(&db).await.unwrap();
        assert!(
            store.migrate().await.unwrap() >= 1,
            "{kind}: migrations ran"
        );
        assert_eq!(store.migrate().await.unwrap(), 0, "{kind}: idempotent");

        let (full, rec) = store
            .create(&create(Environment::Prod, "svc"), "alice")
            .await
            .unwrap();
        assert!(full.starts_with("fg-prod-"), "{kind}");
        assert!(!full.contains(&hex(&rec.secret_hash)), "{kind}");
        let (_, stress) = store
            .create(&create(Environment::Stress, "load"), "alice")
            .await
            .unwrap();
        assert_eq!(
            store.get(&rec.public_id).await.unwrap().unwrap(),
            rec,
            "{kind}"
        );
        assert_eq!(
            store.list(Some(Environment::Stress)).await.unwrap().len(),
            1,
            "{kind}"
        );
        assert_eq!(store.list(None).await.unwrap().len(), 2, "{kind}");

        let bad = store
            .create(
                &CreateKey {
                    name: " ".into(),
                    ..create(Environment::Prod, "")
                },
                "a",
            )
            .await;
        assert!(
            matches!(bad, Err(StoreError::Invalid(_))),
            "{kind}: empty name"
        );
        let bad = store
            .create(
                &CreateKey {
                    environment: None,
                    ..create(Environment::Prod, "x")
                },
                "a",
            )
            .await;
        assert!(matches!(bad, Err(StoreError::Invalid(_))), "{kind}: no env");

        let revoked = store
            .revoke(&stress.public_id, "load test over", "bob")
            .await
            .unwrap();
        assert!(revoked.revoked_at.is_some(), "{kind}");
        assert_eq!(revoked.revoked_by.as_deref(), Some("bob"));
        assert!(matches!(
            store.revoke(&stress.public_id, "again", "bob").await,
            Err(StoreError::AlreadyRevoked(_))
        ));
        assert!(matches!(
            store.revoke("nope", "x", "bob").await,
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            store.revoke(&rec.public_id, " ", "bob").await,
            Err(StoreError::Invalid(_))
        ));

        let (new_full, rotated) = store
            .rotate(&rec.public_id, Duration::from_secs(60), "carol")
            .await
            .unwrap();
        assert_ne!(new_full, full);
        assert_eq!(
            rotated.previous.unwrap().0,
            rec.secret_hash,
            "{kind}: old hash kept"
        );
        assert!(matches!(
            store
                .rotate(&stress.public_id, Duration::from_secs(1), "c")
                .await,
            Err(StoreError::AlreadyRevoked(_))
        ));

        let audit = store.audit_log(None, 100).await.unwrap();
        let actions: Vec<&str> = audit.iter().rev().map(|e| e.action.as_str()).collect();
        assert_eq!(actions, ["create", "create", "revoke", "rotate"], "{kind}");
        assert_eq!(audit[0].actor, "carol");
        assert_eq!(
            store
                .audit_log(Some(&stress.public_id), 10)
                .await
                .unwrap()
                .len(),
            2
        );
        // Append-only: the database itself refuses to rewrite history.
        let upd = sqlx::query("UPDATE key_audit SET actor = 'mallory'")
            .execute(store.pool())
            .await;
        assert!(upd.is_err(), "{kind}: audit rows must not be updatable");
        let del = sqlx::query("DELETE FROM key_audit")
            .execute(store.pool())
            .await;
        assert!(del.is_err(), "{kind}: audit rows must not be deletable");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_authenticate_revoke_refuse_on_both_stores() {
    for (db, _guard) in stores("revoke_flow").await {
        let kind = db.kind().as_str();
        let sim = sim(|_| {}).await;
        let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone();
            c.admin = admin_cfg();
        })
        .await;
        let (status, created) = admin(
            &gw,
            "POST",
            "/admin/keys",
            Some(&token(Role::Admin)),
            Some(serde_json::json!({"name": "canary", "environment": "gray"})),
        )
        .await;
        assert_eq!(status, 201, "{kind}: {created}");
        let key = created["key"].as_str().unwrap().to_owned();
        let id = created["record"]["public_id"].as_str().unwrap().to_owned();
        assert_eq!(chat(&gw, &key).await.status, 200, "{kind}");
        // Also as x-api-key.
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-api-key", &key)],
            chat_body("qwen32b", "hi", 3, true),
        )
        .await;
        assert_eq!(m.status, 200, "{kind}");

        let (status, _) = admin(
            &gw,
            "POST",
            &format!("/admin/keys/{id}/revoke"),
            Some(&token(Role::Admin)),
            Some(serde_json::json!({"reason": "leaked in a screenshot"})),
        )
        .await;
        assert_eq!(status, 200, "{kind}");
        let before = sim.stats().requests.load(Ordering::SeqCst);
        let m = chat(&gw, &key).await;
        assert_eq!(m.status, 401, "{kind}: revoked key refused at once");
        let err = openai_error(&m);
        assert_eq!(err["code"], "key_revoked");
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .contains("leaked in a screenshot"),
            "{err}"
        );
        assert_eq!(
            sim.stats().requests.load(Ordering::SeqCst),
            before,
            "no upstream call"
        );

        let (_, audit) = admin(
            &gw,
            "GET",
            &format!("/admin/audit?key={id}"),
            Some(&token(Role::Viewer)),
            None,
        )
        .await;
        let actions: Vec<&str> = audit["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["action"].as_str().unwrap())
            .collect();
        assert_eq!(actions, ["revoke", "create"], "{kind}");
        assert_eq!(
            audit["data"][0]["actor"], "tester",
            "the JWT subject is audited"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_has_its_own_message_and_never_reaches_a_backend() {
    let sim = sim(|_| {}).await;
    let mut prod_only = pool("prod-model", &[sim.url()]);
    prod_only.environments = Some(vec![Environment::Prod]);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()]), prod_only], |c| {
        c.auth.failures_per_minute = 1000;
    })
    .await;
    let store = gw.server.auth.store().clone();
    let (revoked, r) = store
        .create(&create(Environment::Stress, "r"), "t")
        .await
        .unwrap();
    store
        .revoke(&r.public_id, "rotated out by ops", "t")
        .await
        .unwrap();
    let (expired, _) = store
        .create(
            &CreateKey {
                expires_in_seconds: Some(1),
                ..create(Environment::Stress, "e")
            },
            "t",
        )
        .await
        .unwrap();
    let (limited, _) = store
        .create(
            &CreateKey {
                allowed_models: Some(vec!["other".into()]),
                ..create(Environment::Prod, "m")
            },
            "t",
        )
        .await
        .unwrap();
    let mut mistyped = gw.key.clone();
    mistyped.pop();
    mistyped.push(if gw.key.ends_with('A') { 'B' } else { 'A' });
    let unknown = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // Let the expiry pass and the snapshot pick the changes up.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    gw.server.auth.replace_all(store.load_all().await.unwrap());

    let chat_for = |model: &str| chat_body(model, "hi", 3, true);
    // (case, headers, body, status, code)
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, Bytes, u16, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            "no credentials",
            vec![("x-no-auth", "1".into())],
            chat_for("qwen32b"),
            401,
            "missing_api_key",
        ),
        (
            "no space",
            vec![("authorization", format!("Bearer{}", gw.key))],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "quoted",
            vec![("authorization", format!("Bearer \"{}\"", gw.key))],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "basic",
            vec![("authorization", "Basic dXNlcjpwYXNz".into())],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "oauth",
            vec![(
                "authorization",
                "Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln".into(),
            )],
            chat_for("qwen32b"),
            401,
            "oauth_not_supported",
        ),
        (
            "openai key",
            vec![("authorization", "Bearer sk-proj-abc123".into())],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "mistyped",
            vec![("authorization", format!("Bearer {mistyped}"))],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "truncated",
            vec![(
                "authorization",
                format!("Bearer {}", &gw.key[..gw.key.len() - 3]),
            )],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "unknown",
            vec![("authorization", format!("Bearer {unknown}"))],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "revoked",
            vec![("authorization", format!("Bearer {revoked}"))],
            chat_for("qwen32b"),
            401,
            "key_revoked",
        ),
        (
            "expired",
            vec![("authorization", format!("Bearer {expired}"))],
            chat_for("qwen32b"),
            401,
            "key_expired",
        ),
        (
            "model not allowed",
            vec![("authorization", format!("Bearer {limited}"))],
            chat_for("qwen32b"),
            403,
            "model_not_allowed",
        ),
        (
            "environment not allowed",
            vec![],
            chat_for("prod-model"),
            403,
            "environment_not_allowed",
        ),
    ];
    let mut messages = std::collections::HashSet::new();
    for (name, hdrs, body, status, code) in cases {
        let hdrs: Vec<(&str, &str)> = hdrs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let m = post(&gw.url("/v1/chat/completions"), &hdrs, body).await;
        assert_eq!(m.status, status, "{name}: {:?}", m.body);
        let err = openai_error(&m);
        assert_eq!(err["code"], code, "{name}: {err}");
        assert!(
            !err["message"].as_str().unwrap().contains(&gw.key),
            "{name}: key echoed"
        );
        if status == 401 {
            assert!(m.headers.contains_key("www-authenticate"), "{name}");
        }
        messages.insert(err["message"].as_str().unwrap().to_owned());
    }
    // mistyped and truncated share the checksum message; every other cause has its own.
    assert_eq!(messages.len(), 12);
    assert_eq!(
        sim.stats().requests.load(Ordering::SeqCst),
        0,
        "a refused request reached a backend"
    );
    assert_eq!(gw.server.auth.failure_count("revoked"), 1);
    assert_eq!(gw.server.auth.failure_count("environment_not_allowed"), 1);
}

/// One HTTP/1.1 keep-alive connection from a chosen loopback address, written and read by
/// hand so the test sees exactly what the server does with the connection.
struct RawConn {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

/// A response read off a `RawConn`.
struct RawAnswer {
    status: u16,
    /// Header names lower-cased.
    headers: Vec<(String, String)>,
    body: serde_json::Value,
    took: Duration,
}

impl RawAnswer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl RawConn {
    /// Connect to the gateway from `from` (any 127.x.y.z address reaches the loopback
    /// listener, so tests can act as several client addresses).
    async fn connect(gw: &Gateway, from: [u8; 4]) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
        let stream = socket.connect(gw.server.local_addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// `GET /v1/models` with `key`, and its whole answer.
    async fn models(&mut self, key: &str) -> RawAnswer {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t = Instant::now();
        let req = format!(
            "GET /v1/models HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n\r\n"
        );
        self.stream.write_all(req.as_bytes()).await.unwrap();
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed before an answer");
            self.buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(self.buf[..head_end].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let len: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map_or(0, |(_, v)| v.parse().unwrap());
        while self.buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed inside the body");
            self.buf.extend_from_slice(&chunk[..n]);
        }
        let body = serde_json::from_slice(&self.buf[head_end..head_end + len]).unwrap();
        self.buf.drain(..head_end + len);
        RawAnswer {
            status,
            headers,
            body,
            took: t.elapsed(),
        }
    }

    /// Whether the server closes the connection (end of stream) within `limit`.
    async fn closed_by_server(&mut self, limit: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut chunk = [0u8; 64];
        matches!(
            tokio::time::timeout(limit, self.stream.read(&mut chunk)).await,
            Ok(Ok(0) | Err(_))
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_address_is_refused_unchecked_after_a_delay_and_its_connection_closed() {
    let sim = sim(|_| {}).await;
    let throttle_delay = Duration::from_millis(400);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 3;
        c.auth.throttle_delay = throttle_delay;
    })
    .await;
    let bad = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // One keep-alive connection guessing: the allowance is answered 401 and the connection
    // stays open.
    let mut conn = RawConn::connect(&gw, [127, 0, 0, 1]).await;
    for i in 0..3 {
        let a = conn.models(&bad).await;
        assert_eq!(a.status, 401, "guess {i}: {}", a.body);
        assert_eq!(a.header("connection"), None, "guess {i}");
    }
    // Past it: refused after the throttle delay, and the server closes the connection.
    let a = conn.models(&bad).await;
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["error"]["code"], "too_many_auth_failures");
    assert!(a.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(a.header("connection"), Some("close"));
    assert!(a.took >= throttle_delay, "answered after {:?}", a.took);
    assert!(
        conn.closed_by_server(Duration::from_secs(5)).await,
        "the server kept the throttled connection open"
    );
    // The correct key from the throttled address is refused too: while throttled, no key is
    // checked at all.
    let mut again = RawConn::connect(&gw, [127, 0, 0, 1]).await;
    let a = again.models(&gw.key).await;
    assert_eq!(
        a.status, 429,
        "a throttled address had its key checked: {}",
        a.body
    );
    assert_eq!(a.header("connection"), Some("close"));
    assert!(again.closed_by_server(Duration::from_secs(5)).await);
    // Other addresses are served as before.
    let mut other = RawConn::connect(&gw, [127, 0, 0, 2]).await;
    let a = other.models(&gw.key).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(other.models(&gw.key).await.status, 200, "kept alive");
    assert!(gw.server.auth.failure_count("too_many_failures") >= 2);
    // The unknown-key lookups that reached the store stayed within the budget.
    assert!(gw.server.auth.db_lookups() <= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_id_and_a_wrong_secret_are_answered_alike_no_sooner_than_the_floor() {
    let sim = sim(|_| {}).await;
    let floor = Duration::from_millis(300);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 1000;
        c.auth.failure_delay = floor;
        c.auth.throttle_delay = floor;
    })
    .await;
    let known = fleetgate_gateway::key::parse(&gw.key)
        .unwrap()
        .public_id
        .to_owned();
    let wrong_secret = fleetgate_gateway::key::generate(Environment::Stress, Some(&known)).full;
    let wrong_env = fleetgate_gateway::key::generate(Environment::Prod, Some(&known)).full;
    let unknown = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // The unknown id twice: once looked up in the store, once from the negative cache.
    let mut bodies = Vec::new();
    for (what, key) in [
        ("unknown id (store lookup)", &unknown),
        ("known id, wrong secret", &wrong_secret),
        ("unknown id (negative cache)", &unknown),
        ("known id, wrong environment", &wrong_env),
    ] {
        let t = Instant::now();
        let m = chat(&gw, key).await;
        let took = t.elapsed();
        assert_eq!(m.status, 401, "{what}");
        assert!(
            took >= floor,
            "{what} answered after {took:?}, before the floor"
        );
        let err = openai_error(&m);
        assert_eq!(err["code"], "invalid_api_key", "{what}");
        bodies.push(err["message"].clone());
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "{bodies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_waiting_out_their_delay_are_bounded() {
    let sim = sim(|_| {}).await;
    let delay = Duration::from_secs(3);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 1000;
        c.auth.failure_delay = delay;
        c.auth.throttle_delay = delay;
        c.auth.max_delayed_answers = 1;
    })
    .await;
    let bad = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    let waiting = |gw: &Gateway| {
        gw.server.auth.update_gauges();
        metrics_text(gw).contains("fleetgate_auth_delayed_answers 1")
    };
    let url = gw.url("/v1/chat/completions");
    let first_key = bad.clone();
    let started = Instant::now();
    let first = tokio::spawn(async move {
        post(
            &url,
            &[("authorization", &format!("Bearer {first_key}"))],
            chat_body("qwen32b", "hi", 3, false),
        )
        .await
    });
    assert!(eventually(Duration::from_secs(5), || waiting(&gw)).await);
    // The one slot is taken: the next refusal is answered without waiting, and counted.
    let second = chat(&gw, &bad).await;
    assert_eq!(second.status, 401);
    assert!(
        !first.is_finished(),
        "the second refusal waited for the first's delay"
    );
    assert!(metrics_text(&gw).contains("fleetgate_auth_delays_skipped_total 1"));
    let first = first.await.unwrap();
    assert_eq!(first.status, 401);
    assert!(started.elapsed() >= delay);
    gw.server.auth.update_gauges();
    assert!(metrics_text(&gw).contains("fleetgate_auth_delayed_answers 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_grace_and_expiry() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let id = fleetgate_gateway::key::parse(&gw.key)
        .unwrap()
        .public_id
        .to_owned();
    let (status, rotated) = admin(
        &gw,
        "POST",
        &format!("/admin/keys/{id}/rotate"),
        Some(&token(Role::Admin)),
        Some(serde_json::json!({"grace_seconds": 1})),
    )
    .await;
    assert_eq!(status, 200, "{rotated}");
    let new_key = rotated["key"].as_str().unwrap().to_owned();
    assert_eq!(chat(&gw, &new_key).await.status, 200, "new secret works");
    assert_eq!(
        chat(&gw, &gw.key).await.status,
        200,
        "old secret works during the grace"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let m = chat(&gw, &gw.key).await;
    assert_eq!(m.status, 401, "old secret refused after the grace");
    assert_eq!(openai_error(&m)["code"], "key_rotated");
    assert_eq!(chat(&gw, &new_key).await.status, 200);
}

/// An admin listener without a key to verify tokens with refuses every call, and says to
/// configure one: telling the user to mint a token would send them to `admin-token`, which
/// fails for the same reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_api_without_a_jwt_key_says_to_configure_one() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = fleetgate_gateway::config::AdminConfig {
            jwt_key: None,
            ..admin_cfg()
        }
    })
    .await;
    for t in [None, Some(token(Role::Admin))] {
        let (s, body) = admin(&gw, "GET", "/admin/keys", t.as_deref(), None).await;
        assert_eq!(s, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_admin_token");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("set admin.jwt_secret"), "{message}");
        assert!(!message.contains("mint"), "{message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_checks_its_tokens() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let create_body = || Some(serde_json::json!({"name": "x", "environment": "stress"}));
    let (s, body) = admin(&gw, "GET", "/admin/keys", None, None).await;
    assert_eq!(s, 401, "{body}");
    assert_eq!(body["error"]["code"], "invalid_admin_token");

    let expired = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &jwt::Claims {
            sub: None,
            role: Role::Admin,
            exp: 1_000_000,
            nbf: None,
            aud: None,
            iss: None,
        },
        &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap();
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&expired), None).await;
    assert_eq!(s, 401);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expired"),
        "{body}"
    );

    let wrong_alg = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS512),
        &jwt::Claims {
            sub: None,
            role: Role::Admin,
            exp: u64::MAX / 4,
            nbf: None,
            aud: None,
            iss: None,
        },
        &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap();
    let (s, body) = admin(&gw, "POST", "/admin/keys", Some(&wrong_alg), create_body()).await;
    assert_eq!(s, 401);
    assert!(
        body["error"]["message"].as_str().unwrap().contains("HS256"),
        "{body}"
    );

    let viewer = token(Role::Viewer);
    let (s, list) = admin(&gw, "GET", "/admin/keys", Some(&viewer), None).await;
    assert_eq!(s, 200);
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    assert!(
        list.to_string()
            .find("secret")
            .is_none_or(|_| !list.to_string().contains(&gw.key))
    );
    let (s, body) = admin(&gw, "POST", "/admin/keys", Some(&viewer), create_body()).await;
    assert_eq!(s, 403, "{body}");
    let id = list["data"][0]["public_id"].as_str().unwrap();
    let (s, _) = admin(
        &gw,
        "POST",
        &format!("/admin/keys/{id}/revoke"),
        Some(&viewer),
        Some(serde_json::json!({"reason": "x"})),
    )
    .await;
    assert_eq!(s, 403, "a viewer cannot revoke");
    assert_eq!(chat(&gw, &gw.key).await.status, 200, "still active");

    let (s, body) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&token(Role::Admin)),
        Some(serde_json::json!({"name": "x"})),
    )
    .await;
    assert_eq!(s, 400, "environment is required: {body}");
    let (s, body) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&token(Role::Admin)),
        Some(serde_json::json!({"name": "x", "environment": "dev"})),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    let (s, _) = admin(&gw, "GET", "/admin/keys/nope", Some(&viewer), None).await;
    assert_eq!(s, 404);

    // Metrics are open on the admin listener and carry the auth counters.
    let c = client::http_client();
    let req = http::Request::get(format!("http://{}/metrics", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let text = String::from_utf8(
        c.request(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert!(text.contains("fleetgate_key_store_up 1"), "{text}");
    assert!(text.contains("fleetgate_keys_loaded 1"), "{text}");
    assert!(
        text.contains("fleetgate_auth_failures_total{reason=\"missing\"}"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_tokens_not_valid_yet_are_refused_saying_when_they_become_valid() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Claims as any issuer writes them (the `nbf` claim of RFC 7519).
    let signed = |nbf: u64| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &serde_json::json!({"sub": "early", "role": "admin", "exp": nbf.max(now) + 3600, "nbf": nbf}),
            &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
        )
        .unwrap()
    };
    // An hour early: refused, and the message says when the token becomes valid.
    let nbf = 2_000_000_000;
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(nbf)), None).await;
    assert_eq!(s, 401, "{body}");
    assert_eq!(body["error"]["code"], "invalid_admin_token");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("not valid yet"), "{message}");
    assert!(message.contains("2033-05-18T03:33:20Z"), "{message}");
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now + 3600)), None).await;
    assert_eq!(s, 401, "{body}");
    // Within the same leeway as `exp` (5 s), and in the past: accepted.
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now + 2)), None).await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now - 60)), None).await;
    assert_eq!(s, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_list_shows_only_what_the_key_may_use() {
    let sim = sim(|_| {}).await;
    let mut prod_only = pool("prod-model", &[sim.url()]);
    prod_only.environments = Some(vec![Environment::Prod]);
    let gw = gateway(vec![pool("qwen32b", &[sim.url()]), prod_only]).await;
    let c = client::http_client();
    let req = authed(&gw, "GET", "/v1/models")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(
        &c.request(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes(),
    )
    .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["qwen32b"],
        "a stress key does not see the prod-only pool"
    );
}

/// Two gateways on one store: a key created through one works on the other, and a revocation
/// through one is refused by the other within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_keys_and_revocations() {
    for (db, _guard) in stores("two_gateways").await {
        let kind = db.kind().as_str();
        let sim = sim(|_| {}).await;
        let a = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone();
            c.admin = admin_cfg();
        })
        .await;
        let b = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone();
        })
        .await;
        let (s, created) = admin(
            &a,
            "POST",
            "/admin/keys",
            Some(&token(Role::Admin)),
            Some(serde_json::json!({"name": "shared", "environment": "prod"})),
        )
        .await;
        assert_eq!(s, 201);
        let key = created["key"].as_str().unwrap().to_owned();
        let id = created["record"]["public_id"].as_str().unwrap().to_owned();
        assert_eq!(
            chat(&b, &key).await.status,
            200,
            "{kind}: a key created on A works on B at once"
        );

        let (s, _) = admin(
            &a,
            "POST",
            &format!("/admin/keys/{id}/revoke"),
            Some(&token(Role::Admin)),
            Some(serde_json::json!({"reason": "emergency"})),
        )
        .await;
        assert_eq!(s, 200);
        let start = Instant::now();
        let mut refused = false;
        while start.elapsed() < Duration::from_secs(5) {
            if chat(&b, &key).await.status == 401 {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused, "{kind}: B still accepts a key revoked on A");
        eprintln!(
            "{kind}: revocation on A refused by B after {:?}",
            start.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_keeps_cached_keys_working_and_recovers() {
    let Some(db) = pg_database("database_outage").await else {
        return;
    };
    let upstream: std::net::SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let admin_url: http::Uri = pg_admin_url().parse().unwrap();
    let upstream = match admin_url.port_u16() {
        Some(p) => std::net::SocketAddr::from(([127, 0, 0, 1], p)),
        None => upstream,
    };
    let proxy = Cuttable::start(0, upstream).await;
    let via_proxy = db.url.replacen(
        &format!(":{}/", upstream.port()),
        &format!(":{}/", proxy.port),
        1,
    );
    assert_ne!(via_proxy, db.url, "the URL goes through the cuttable proxy");
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.database.url = Some(Secret::new(via_proxy.clone()));
        c.database.connect_timeout = Duration::from_millis(500);
        c.auth.resync_interval = Duration::from_millis(300);
        c.admin = admin_cfg();
    })
    .await;
    assert_eq!(chat(&gw, &gw.key).await.status, 200);

    let port = proxy.cut();
    let auth = gw.server.auth.clone();
    assert!(
        eventually(Duration::from_secs(10), || auth.store_health()
            == fleetgate_gateway::auth::StoreHealth::Down)
        .await,
        "the outage was never noticed"
    );
    assert_eq!(
        chat(&gw, &gw.key).await.status,
        200,
        "cached key still accepted while the store is down"
    );
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let (status, ready) = admin(&gw, "GET", "/admin/ready", Some(&viewer), None).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["key_store"]["state"], "degraded", "{ready}");

    let _proxy = Cuttable::start(port, upstream).await;
    assert!(
        eventually(Duration::from_secs(20), || auth.store_health()
            == fleetgate_gateway::auth::StoreHealth::Up)
        .await,
        "never recovered after the store came back"
    );
    assert_eq!(chat(&gw, &gw.key).await.status, 200);
    drop(db);
}

/// One raw request to the admin listener: (status, headers, body as sent on the wire).
async fn admin_raw(
    gw: &Gateway,
    req: http::request::Builder,
    body: Bytes,
) -> (u16, http::HeaderMap, Bytes) {
    let path = req.uri_ref().unwrap().to_string();
    let req = req
        .uri(format!("http://{}{path}", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(body))
        .unwrap();
    let resp = client::http_client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (
        status,
        headers,
        resp.into_body().collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_gives_request_ids_security_headers_gzip_and_one_body_limit() {
    use std::io::Read;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let bearer = format!("Bearer {}", token(Role::Admin));

    // A request id: made when the caller brings none, the caller's kept when it does.
    let get = || http::Request::builder().method("GET").uri("/admin/keys");
    let (s, h, _) = admin_raw(&gw, get().header("authorization", &bearer), Bytes::new()).await;
    assert_eq!(s, 200);
    let made = h["x-request-id"].to_str().unwrap();
    assert!(made.starts_with("fg-") && made.len() > 10, "{made}");
    let (_, h, _) = admin_raw(
        &gw,
        get()
            .header("authorization", &bearer)
            .header("x-request-id", "ops-42"),
        Bytes::new(),
    )
    .await;
    assert_eq!(h["x-request-id"], "ops-42");

    // Security headers on the JSON API and on a refusal, not only on the console's pages.
    let (s, h, _) = admin_raw(&gw, get(), Bytes::new()).await;
    assert_eq!(s, 401);
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["referrer-policy"], "same-origin");
    // An asset keeps its own caching.
    let (s, h, _) = admin_raw(
        &gw,
        http::Request::builder().uri("/console/assets/console.css"),
        Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["cache-control"], "no-cache");

    // gzip for a client that asks for it (a Prometheus scrape), plain text otherwise.
    let metrics = || http::Request::builder().uri("/metrics");
    let (s, h, plain) = admin_raw(&gw, metrics(), Bytes::new()).await;
    assert_eq!(s, 200);
    assert!(h.get("content-encoding").is_none(), "{h:?}");
    let (s, h, zipped) = admin_raw(
        &gw,
        metrics().header("accept-encoding", "gzip"),
        Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["content-encoding"], "gzip");
    assert!(
        zipped.len() * 3 < plain.len(),
        "{} against {}",
        zipped.len(),
        plain.len()
    );
    let mut text = String::new();
    flate2::read::GzDecoder::new(&zipped[..])
        .read_to_string(&mut text)
        .unwrap();
    assert!(text.contains("# TYPE fleetgate_"), "{text:.200}");

    // One body limit, answered in OpenAI's format: a Content-Length over it before the body
    // is read, and a chunked body that grows past it.
    let count = async || {
        let (_, keys) = admin(&gw, "GET", "/admin/keys", Some(&token(Role::Admin)), None).await;
        keys["data"].as_array().unwrap().len()
    };
    let keys_before = count().await;
    let big = Bytes::from(vec![b' '; 70 * 1024]);
    let post = || {
        http::Request::builder()
            .method("POST")
            .uri("/admin/keys")
            .header("authorization", &bearer)
            .header("content-type", "application/json")
    };
    let (s, h, body) = admin_raw(&gw, post(), big.clone()).await;
    assert_eq!(s, 413, "{body:?}");
    assert_eq!(h["content-type"], "application/json");
    let e: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(e["error"]["code"], "request_too_large", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("65536"),
        "{e}"
    );
    // Chunked, over raw HTTP/1.1: no length to refuse up front.
    let mut conn = tokio::net::TcpStream::connect(gw.server.admin_addr.unwrap())
        .await
        .unwrap();
    let mut wire = format!(
        "POST /admin/keys HTTP/1.1\r\nhost: admin\r\nauthorization: {bearer}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    .into_bytes();
    for chunk in big.chunks(8 * 1024) {
        wire.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    // The gateway may answer and close before the whole body is written.
    let _ = conn.write_all(&wire).await;
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains(r#""code":"request_too_large""#), "{answer}");
    // Nothing was created.
    assert_eq!(count().await, keys_before);
}
