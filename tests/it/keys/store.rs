//! Keys in the store, on SQLite and on real PostgreSQL: the lifecycle, create → authenticate
//! → revoke → refuse, rotation grace and expiry, two gateways sharing keys and revocations,
//! and a database outage served from the snapshot.

use super::*;

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
