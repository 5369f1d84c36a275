//! What an attack on the release build found (issue 29), each defect held by a test that
//! failed before its fix: upstream requests in origin form with `Host` through servers that
//! enforce HTTP/1.1 (a raw head check, Debian's nginx, Python's h11).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failure is a test failure"
)]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const CHAT: &str = r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
const CHAT_STREAM: &str =
    r#"{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;

/// A backend that keeps every request head as it came on the wire and answers each with a
/// small JSON body (a chat completion), keeping the connection open.
struct RawBackend {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawBackend {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            let mut chunk = [0u8; 4096];
                            match sock.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        let len = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        while buf.len() < end + 4 + len {
                            let mut chunk = [0u8; 4096];
                            match sock.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..end + 4 + len);
                        seen.lock().unwrap().push(head);
                        let body = r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2},"tokens":[1]}"#;
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if sock.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, heads, task }
    }

    /// The heads of requests to `path` (probes left out).
    fn heads_to(&self, path: &str) -> Vec<String> {
        let line = format!(" {path} HTTP/1.1");
        self.heads
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.lines().next().is_some_and(|l| l.contains(&line)))
            .cloned()
            .collect()
    }
}

/// Every forwarded request — chat whole and streamed, completions, the tokenizer, and a
/// retry after a refused connection — goes out as `POST /path HTTP/1.1` with `host:` naming
/// the backend, never in the absolute form a proxy takes.
#[tokio::test]
async fn upstream_requests_are_in_origin_form_with_the_backends_host() {
    let raw = RawBackend::start().await;
    let dead = closed_port().await;
    let mut p = pool(
        "m",
        &[format!("http://{dead}"), format!("http://{}", raw.addr)],
    );
    p.retries.budget_ratio = 1.0;
    let gw = gateway(vec![p]).await;
    for (path, body) in [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", CHAT_STREAM),
        (
            "/v1/completions",
            r#"{"model":"m","prompt":"hi","max_tokens":2}"#,
        ),
        ("/tokenize", r#"{"model":"m","prompt":"hi"}"#),
    ] {
        for _ in 0..3 {
            let m = post(&gw.url(path), &[("content-type", "application/json")], body).await;
            assert_eq!(m.status, 200, "{path}: {:?}", m.body);
        }
    }
    let host = format!("host: {}", raw.addr);
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"] {
        let heads = raw.heads_to(path);
        assert!(
            !heads.is_empty(),
            "{path} reached the backend: {:?}",
            raw.heads.lock().unwrap()
        );
        for head in heads {
            let first = head.lines().next().unwrap();
            assert_eq!(first, format!("POST {path} HTTP/1.1"), "{head}");
            let hosts: Vec<&str> = head
                .lines()
                .filter(|l| l.to_ascii_lowercase().starts_with("host:"))
                .collect();
            assert_eq!(
                hosts,
                [host.as_str()],
                "exactly one Host, the backend's: {head}"
            );
        }
    }
}

/// Through Debian's nginx in front of the sim: nginx answers 400 to a request without Host.
#[tokio::test]
async fn a_backend_behind_nginx_gets_every_request() {
    let s = sim(|_| {}).await;
    let Some((_nginx, addr, _dir)) =
        nginx_in_front("a_backend_behind_nginx_gets_every_request", s.addr()).await
    else {
        return;
    };
    let gw = gateway(vec![pool("qwen32b", &[format!("http://{addr}")])]).await;
    let body = |stream: bool| {
        format!(
            r#"{{"model":"qwen32b","stream":{stream},"max_tokens":4,"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    for stream in [false, true, false, true] {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("content-type", "application/json")],
            body(stream),
        )
        .await;
        assert_eq!(m.status, 200, "stream={stream}: {:?}", m.body);
        if stream {
            let text = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        }
    }
    let m = post(
        &gw.url("/tokenize"),
        &[("content-type", "application/json")],
        r#"{"model":"qwen32b","prompt":"hi"}"#,
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
}

/// Python's h11 (under httpx and uvicorn) refuses a request without Host; each request it
/// saw names the path alone and the backend's host.
#[tokio::test]
async fn a_strict_h11_backend_gets_every_request() {
    let test = "a_strict_h11_backend_gets_every_request";
    let has_h11 = std::process::Command::new("python3")
        .args(["-c", "import h11"])
        .status()
        .is_ok_and(|s| s.success());
    if tool_or_skip(test, "Python's h11 (pip install h11)", has_h11).is_none() {
        return;
    }
    let log = temp_dir("h11").join("requests.log");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h11_backend.py");
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let _child = Child(child);
    let addr: SocketAddr = format!("127.0.0.1:{}", line.trim()).parse().unwrap();
    let gw = gateway(vec![pool("m", &[format!("http://{addr}")])]).await;
    for body in [CHAT, CHAT_STREAM, CHAT, CHAT_STREAM] {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("content-type", "application/json")],
            body,
        )
        .await;
        assert_eq!(m.status, 200, "{:?}", m.body);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = std::fs::read_to_string(&log).unwrap();
    assert!(!seen.contains("refused"), "h11 refused a request: {seen}");
    let chats: Vec<&str> = seen
        .lines()
        .filter(|l| l.contains("/v1/chat/completions"))
        .collect();
    assert_eq!(chats.len(), 4, "{seen}");
    for l in chats {
        assert_eq!(
            l,
            format!("POST /v1/chat/completions host={addr}"),
            "{seen}"
        );
    }
}

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
) -> impl std::future::Future<Output = fleetgate::client::Measured> {
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
    use fleetgate::admin::jwt::Role;
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
    use fleetgate::admin::jwt::Role;
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
        c.database.url = Some(fleetgate::secret::Secret::new(via_proxy.clone()));
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

/// A backend that answers a stream with `data: {...` and then megabytes with no newline: the
/// relay carries at most `server.max_stream_line_bytes` of it, then ends the stream with an
/// `upstream_protocol_error` event and `[DONE]`, closes the backend's connection, and records
/// the request with that error. Before, the gateway's memory grew by the line's whole length.
#[tokio::test]
async fn an_sse_line_without_an_end_is_cut_at_the_limit() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<u64>();
    let backend = tokio::spawn(async move {
        let mut closed_tx = Some(closed_tx);
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut buf = vec![0u8; 65536];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).into_owned();
            if !head.starts_with("POST /v1/chat/completions") {
                let body = r#"{"object":"list","data":[]}"#;
                let _ = sock
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
                continue;
            }
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let first = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"";
            let chunk = |data: &[u8]| {
                let mut c = format!("{:x}\r\n", data.len()).into_bytes();
                c.extend_from_slice(data);
                c.extend_from_slice(b"\r\n");
                c
            };
            sock.write_all(&chunk(first)).await.unwrap();
            // Up to 64 MiB of one line, until the gateway closes the connection.
            let junk = chunk(&vec![b'a'; 64 * 1024]);
            let mut sent = 0u64;
            while sent < 64 << 20 {
                if sock.write_all(&junk).await.is_err() {
                    break;
                }
                sent += junk.len() as u64;
            }
            if let Some(tx) = closed_tx.take() {
                let _ = tx.send(sent);
            }
        }
    });
    let gw = gateway_with(vec![pool("m", &[format!("http://{addr}")])], |c| {
        c.server.max_stream_line_bytes = 256 * 1024;
    })
    .await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("x-request-id", "endless-line"),
        ],
        CHAT_STREAM,
    )
    .await;
    assert_eq!(m.status, 200);
    let body = m.body.as_ref().unwrap();
    let tail = String::from_utf8_lossy(&body[body.len().saturating_sub(600)..]).into_owned();
    assert!(
        tail.contains("\"code\":\"upstream_protocol_error\""),
        "{tail}"
    );
    assert!(tail.contains("max_stream_line_bytes"), "{tail}");
    assert!(tail.ends_with("data: [DONE]\n\n"), "{tail}");
    let sent = tokio::time::timeout(Duration::from_secs(10), closed_rx)
        .await
        .expect("the gateway closed the backend's connection")
        .unwrap();
    assert!(
        sent < 64 << 20,
        "stopped reading at the limit, not at the end ({sent} bytes)"
    );
    let seen = gw.record_of("endless-line").await;
    assert_eq!(seen.error, Some("upstream_protocol_error"));
    backend.abort();
}

/// The forwarding headers a backend gets, as a reverse proxy sets them: a client's own
/// `X-Forwarded-*`, `Forwarded` and `X-Real-IP` are replaced by the gateway's (the peer's
/// address, the scheme, the Host it was asked for), and the path overrides
/// `X-Original-URL`/`X-Rewrite-URL` never reach a backend. Before, all of them passed as the
/// client sent them and the gateway added none.
#[tokio::test]
async fn forwarding_headers_are_the_gateways_unless_a_trusted_proxy_sent_them() {
    let rec = HeadRecorder::start(&[]).await;
    let claims: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-host", "evil.example"),
        ("x-forwarded-proto", "https"),
        ("forwarded", "for=6.6.6.6;host=evil.example"),
        ("x-real-ip", "6.6.6.6"),
        ("x-original-url", "/admin/keys"),
        ("x-rewrite-url", "/admin/keys"),
    ];
    let stripped = ["forwarded", "x-real-ip", "x-original-url", "x-rewrite-url"];

    // Anyone: replaced.
    let gw = gateway(vec![pool("m", &[rec.url()])]).await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(
        h["x-forwarded-host"],
        gw.server.local_addr.to_string().as_str(),
        "the Host the client asked the gateway for"
    );
    for name in stripped {
        assert!(!h.contains_key(name), "{name} reached the backend: {h:?}");
    }
    assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);

    // A trusted proxy in front: its chain is kept and extended, its host and scheme believed;
    // path overrides still go.
    let gw = gateway_with(vec![pool("m", &[rec.url()])], |c| {
        c.server.trusted_proxies = vec!["127.0.0.0/8".parse().unwrap()];
    })
    .await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    assert_eq!(h["x-forwarded-for"], "6.6.6.6, 127.0.0.1");
    assert_eq!(h["x-forwarded-host"], "evil.example");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert!(h.contains_key("forwarded"));
    assert!(!h.contains_key("x-original-url") && !h.contains_key("x-rewrite-url"));

    // Switched off: the client's go, none are added.
    let gw = gateway_with(vec![pool("m", &[rec.url()])], |c| {
        c.server.forwarded_headers = false;
    })
    .await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    for name in ["x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"]
        .into_iter()
        .chain(stripped)
    {
        assert!(!h.contains_key(name), "{name}: {h:?}");
    }
}

/// Clients' error messages name a backend as `<model>#<number>`, not by its address (which
/// the admin API, the logs and the metrics still show); `server.expose_backend_addresses`
/// brings the address back.
#[tokio::test]
async fn clients_see_a_backends_name_not_its_address() {
    let dead = closed_port().await;
    let gw = gateway(vec![pool("m", &[format!("http://{dead}")])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        CHAT,
    )
    .await;
    assert!(m.status == 502 || m.status == 503, "{}", m.status);
    let err = openai_error(&m);
    let message = err["message"].as_str().unwrap();
    assert!(message.contains("m#0"), "{message}");
    assert!(!message.contains(&dead.to_string()), "{message}");
    let text = metrics_text(&gw);
    assert!(
        text.contains(&dead.to_string()),
        "operators still see the address"
    );

    let gw = gateway_with(vec![pool("m", &[format!("http://{dead}")])], |c| {
        c.server.expose_backend_addresses = true;
    })
    .await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        CHAT,
    )
    .await;
    let message = openai_error(&m)["message"].as_str().unwrap().to_owned();
    assert!(message.contains(&dead.to_string()), "{message}");
}
