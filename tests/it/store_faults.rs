//! The key store when its disk or its database fails: a SQLite write fault fails loudly and
//! the store recovers; a PostgreSQL connection lost during a revoke, and writes after a
//! restart.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;

/// `POST /admin/keys` with an admin token: (status, body).
async fn admin_create(
    gw: &Gateway,
    token: &str,
    name: &str,
    env: &str,
) -> (u16, serde_json::Value) {
    admin(
        gw,
        "POST",
        "/admin/keys",
        Some(token),
        Some(serde_json::json!({"name": name, "environment": env})),
    )
    .await
}

/// `POST /admin/keys/{id}/revoke` with an admin token: (status, body).
async fn admin_revoke(gw: &Gateway, token: &str, id: &str) -> (u16, serde_json::Value) {
    admin(
        gw,
        "POST",
        &format!("/admin/keys/{id}/revoke"),
        Some(token),
        Some(serde_json::json!({"reason": "leaked"})),
    )
    .await
}

/// A metric without labels, as `/metrics` shows it (0 when absent).
fn metric(gw: &Gateway, name: &str) -> i64 {
    metrics_text(gw)
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0, |v| v as i64)
}

/// `chattr` on `files` (`+i` makes them immutable: every write fails, as on a read-only
/// remount or a full disk); `None` (loudly) when it cannot be done here (not root, or a
/// filesystem without the attribute).
fn chattr(test: &str, flag: &str, files: &[&std::path::Path]) -> Option<()> {
    let ok = std::process::Command::new("chattr")
        .arg(flag)
        .args(files)
        .status()
        .is_ok_and(|s| s.success());
    tool_or_skip(
        test,
        "chattr as root on a filesystem with the immutable attribute",
        ok,
    )
}

fn chat_key(
    gw: &Gateway,
    key: &str,
) -> impl std::future::Future<Output = fleetgate_protocol::client::Measured> {
    let uri = gw.url("/v1/chat/completions");
    let auth = format!("Bearer {key}");
    async move {
        post(
            &uri,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            r#"{"model":"qwen32b","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await
    }
}

/// A SQLite file that cannot be written for a while (immutable, as a read-only remount or a
/// full disk would leave it): a revoke or create during the fault fails loudly with a 5xx
/// naming the cause and changes nothing in memory; request-log rows are spilled and counted;
/// when the fault ends the store recovers by itself — the revoke then succeeds, is on disk,
/// and every request-log row reaches the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_write_fault_fails_loudly_and_the_store_recovers() {
    use fleetgate_gateway::admin::jwt::Role;
    let test = "a_sqlite_write_fault_fails_loudly_and_the_store_recovers";
    let s = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[s.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let db = gw.db_dir.0.join("keys.db");
    let wal = gw.db_dir.0.join("keys.db-wal");
    let admin_token = token(Role::Admin);
    let (status, created) = admin_create(&gw, &admin_token, "victim", "prod").await;
    assert_eq!(status, 201, "{created}");
    let victim = created["key"].as_str().unwrap().to_owned();
    let id = created["record"]["public_id"].as_str().unwrap().to_owned();
    let mut sent = 0;
    for _ in 0..10 {
        assert_eq!(chat_key(&gw, &victim).await.status, 200);
        sent += 1;
    }
    // Wait for the first rows to be written (the WAL file exists from then on).
    assert!(eventually(Duration::from_secs(5), || wal.exists()).await);
    tokio::time::sleep(Duration::from_millis(200)).await;

    if chattr(test, "+i", &[&db, &wal]).is_none() {
        return;
    }
    // Always undo the fault, whatever fails below (a leftover immutable file cannot be removed).
    struct Undo(Vec<std::path::PathBuf>);
    impl Drop for Undo {
        fn drop(&mut self) {
            let _ = std::process::Command::new("chattr")
                .arg("-i")
                .args(&self.0)
                .status();
        }
    }
    let undo = Undo(vec![db.clone(), wal.clone()]);

    for _ in 0..20 {
        assert_eq!(chat_key(&gw, &victim).await.status, 200);
        sent += 1;
    }
    let (status, body) = admin_revoke(&gw, &admin_token, &id).await;
    assert!(
        status >= 500,
        "a revoke that cannot be stored fails loudly: {status} {body}"
    );
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("readonly")
            || message.contains("read-only")
            || message.contains("disk")
            || message.contains("permit"),
        "names the cause: {body}"
    );
    assert_eq!(
        chat_key(&gw, &victim).await.status,
        200,
        "nothing changed in memory: the key still works"
    );
    sent += 1;
    let (status, body) = admin_create(&gw, &admin_token, "during the fault", "stress").await;
    assert!(status >= 500, "{status} {body}");
    // The rows of the fault's requests were spilled (the writer flushes every 20 ms).
    let spilled = |gw: &Gateway| metric(gw, "fleetgate_request_log_spilled_rows");
    assert!(
        eventually(Duration::from_secs(10), || spilled(&gw) > 0).await,
        "rows spilled while the file cannot be written"
    );
    assert!(
        gw.db_dir.0.join("request-log.spill").exists(),
        "the spill file is real"
    );

    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(undo);

    // The fault is over: the store recovers by itself (bounded), the revoke goes through.
    let started = std::time::Instant::now();
    let revoked = loop {
        let (status, body) = admin_revoke(&gw, &admin_token, &id).await;
        if status == 200 {
            break body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the store did not recover: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "store recovered {} ms after the fault ended",
        started.elapsed().as_millis()
    );
    assert_eq!(revoked["status"], "revoked", "{revoked}");
    assert_eq!(chat_key(&gw, &victim).await.status, 401);
    let (status, body) = admin_create(&gw, &admin_token, "after the fault", "stress").await;
    assert_eq!(status, 201, "{body}");

    // On disk, read by another connection: the revoke, and every request's row.
    use sqlx::Connection;
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let revoked_at: Option<i64> =
        sqlx::query_scalar("SELECT revoked_at FROM api_keys WHERE public_id = ?")
            .bind(&id)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(revoked_at.is_some(), "the revoke is durable");
    let want = sent + 1; // and the refused request after the revoke
    let mut rows = 0i64;
    for _ in 0..100 {
        rows = sqlx::query_scalar("SELECT COUNT(*) FROM request_log")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if rows >= want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dropped = metric(&gw, "fleetgate_request_log_dropped_total");
    assert_eq!(
        rows + dropped as i64,
        want,
        "every row is in the file or counted as dropped ({rows} stored, {dropped} dropped)"
    );
    assert_eq!(dropped, 0, "the spill file held them all");
    assert_eq!(spilled(&gw), 0, "the spill file was replayed");
}

/// PostgreSQL, the same classes of fault: a revoke while the connection is lost fails loudly
/// and changes nothing in memory; once the server is back it goes through and is on disk.
/// Then every server connection is killed, as a server restart does: the next write (a
/// create, a revoke) succeeds on fresh connections, with no restart of the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_revoke_during_a_connection_loss_and_writes_after_a_restart() {
    use fleetgate_gateway::admin::jwt::Role;
    use sqlx::Connection;
    let Some(db) = pg_database("pg_revoke_during_loss").await else {
        return;
    };
    let admin_url: http::Uri = pg_admin_url().parse().unwrap();
    let upstream = SocketAddr::from(([127, 0, 0, 1], admin_url.port_u16().unwrap_or(5432)));
    let proxy = Cuttable::start(0, upstream).await;
    let via_proxy = db.url.replacen(
        &format!(":{}/", upstream.port()),
        &format!(":{}/", proxy.port),
        1,
    );
    let s = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[s.url()])], |c| {
        c.database.url = Some(fleetgate_gateway::secret::Secret::new(via_proxy.clone()));
        c.database.connect_timeout = Duration::from_millis(500);
        c.admin = admin_cfg();
    })
    .await;
    let admin_token = token(Role::Admin);
    let (status, created) = admin_create(&gw, &admin_token, "victim", "prod").await;
    assert_eq!(status, 201, "{created}");
    let victim = created["key"].as_str().unwrap().to_owned();
    let id = created["record"]["public_id"].as_str().unwrap().to_owned();
    assert_eq!(chat_key(&gw, &victim).await.status, 200);

    let port = proxy.cut();
    let revoke = || admin_revoke(&gw, &admin_token, &id);
    let (status, body) = revoke().await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{body}"
    );
    assert_eq!(
        chat_key(&gw, &victim).await.status,
        200,
        "nothing changed in memory"
    );

    let _proxy = Cuttable::start(port, upstream).await;
    let started = std::time::Instant::now();
    loop {
        let (status, body) = revoke().await;
        if status == 200 {
            assert_eq!(body["status"], "revoked", "{body}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(chat_key(&gw, &victim).await.status, 401);
    let mut direct = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let revoked_at: Option<i64> =
        sqlx::query_scalar("SELECT revoked_at FROM api_keys WHERE public_id = $1")
            .bind(&id)
            .fetch_one(&mut direct)
            .await
            .unwrap();
    assert!(revoked_at.is_some(), "the revoke is durable");

    // Every connection the gateway holds is killed, as a server restart would.
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&name)
    .fetch_all(&mut direct)
    .await
    .unwrap();
    assert!(!killed.is_empty(), "the gateway held connections");
    let (status, body) = admin_create(&gw, &admin_token, "after the restart", "stress").await;
    assert_eq!(
        status, 201,
        "a write after the restart goes through: {body}"
    );
    let id2 = body["record"]["public_id"].as_str().unwrap();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM api_keys WHERE public_id = $1")
        .bind(id2)
        .fetch_one(&mut direct)
        .await
        .unwrap();
    assert_eq!(n, 1);
    drop(direct);
    drop(gw);
    drop(db);
}
