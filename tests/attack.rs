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

// ---- Hostile clients and backends on the Responses, audio and budget surfaces -------------

/// What reached a backend: path, head and body of every request.
#[derive(Clone, Default)]
struct Reached(Arc<Mutex<Vec<(String, http::HeaderMap, bytes::Bytes)>>>);

impl Reached {
    fn to(&self, path: &str) -> Vec<(http::HeaderMap, bytes::Bytes)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| p == path)
            .map(|(_, h, b)| (h.clone(), b.clone()))
            .collect()
    }
}

/// A backend that keeps every request and answers each with `answer(path)`: status, content
/// type, and the body's frames (sent one by one).
async fn recording_backend(
    answer: fn(&str) -> (u16, &'static str, Vec<&'static str>),
) -> (String, Reached, tokio::task::JoinHandle<()>) {
    let reached = Reached::default();
    let keep = reached.clone();
    let (addr, task) = http_backend(move |req: http::Request<hyper::body::Incoming>| {
        let keep = keep.clone();
        async move {
            use http_body_util::BodyExt;
            let path = req.uri().path().to_owned();
            let head = req.headers().clone();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            keep.0.lock().unwrap().push((path.clone(), head, body));
            let (status, ct, frames) = answer(&path);
            let frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::convert::Infallible>> =
                frames
                    .into_iter()
                    .map(|f| {
                        Ok(http_body::Frame::data(bytes::Bytes::from_static(
                            f.as_bytes(),
                        )))
                    })
                    .collect();
            http::Response::builder()
                .status(status)
                .header("content-type", ct)
                .body(http_body_util::StreamBody::new(futures_util::stream::iter(
                    frames,
                )))
                .unwrap()
        }
    })
    .await;
    (format!("http://{addr}"), reached, task)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn get_as(gw: &Gateway, path: &str, key: &str) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let c = fleetgate_protocol::client::http_client();
    let req = http::Request::get(gw.url(path))
        .header("authorization", bearer(key))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

/// One key cannot take over another's stored response: a request id the client picks (the
/// `x-request-id` header, the body's `request_id`) is put in its key's namespace before vLLM
/// makes the response's id from it, the gateway's own ids are random, and a pin is never
/// moved to another key. Before: key B sent A's id as its `x-request-id`, read A's response
/// and continued it, and A's own read answered 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cannot_take_over_another_keys_stored_response() {
    let sim = sim(|a| a.responses_store = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (a, a_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let (b, b_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let create = |instructions: &str, store: bool| {
        serde_json::json!({"model": "qwen32b", "input": "hi", "max_output_tokens": 2,
                           "instructions": instructions, "store": store})
        .to_string()
    };
    let made = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&a))],
        create("A's secret instructions", true),
    )
    .await;
    assert_eq!(made.status, 200, "{:?}", made.body);
    let id = json_body(&made)["id"].as_str().unwrap().to_owned();
    assert!(
        id.starts_with(&format!("resp_{}-fg-", a_rec.public_id)),
        "a stored response's id is in its key's namespace: {id}"
    );
    // The gateway's own request ids are a process prefix and 96 random bits, not a counter.
    let rid = made.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(rid.len(), 36, "{rid}");
    let again = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&a))],
        create("x", false),
    )
    .await;
    let rid2 = again.headers["x-request-id"].to_str().unwrap();
    assert_eq!(rid[..12], rid2[..12], "one process, one prefix");
    assert_ne!(
        rid[12..28],
        rid2[12..28],
        "{rid} then {rid2}: not sequential"
    );

    // B replays A's upstream id as its own request id, header and body.
    let upstream_id = id.strip_prefix("resp_").unwrap();
    let mut body: serde_json::Value = serde_json::from_str(&create("B's", false)).unwrap();
    body["request_id"] = upstream_id.into();
    let theirs = post(
        &gw.url("/v1/responses"),
        &[
            ("authorization", &bearer(&b)),
            ("x-request-id", upstream_id),
        ],
        body.to_string(),
    )
    .await;
    assert_eq!(theirs.status, 200, "{:?}", theirs.body);
    let their_id = json_body(&theirs)["id"].as_str().unwrap().to_owned();
    assert_ne!(their_id, id);
    assert!(their_id.starts_with(&format!("resp_{}-", b_rec.public_id)));
    // B cannot read or continue A's response; A still can.
    let (status, _) = get_as(&gw, &format!("/v1/responses/{id}"), &b).await;
    assert_eq!(status, 404);
    let cont = serde_json::json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2,
                                  "previous_response_id": id});
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&b))],
        cont.to_string(),
    )
    .await;
    assert_eq!(m.status, 404);
    assert_eq!(openai_error(&m)["code"], "response_not_found");
    let (status, v) = get_as(&gw, &format!("/v1/responses/{id}"), &a).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["instructions"], "A's secret instructions");

    // The body's `request_id` reaches the backend in the key's namespace too.
    let (url, reached, _task) = recording_backend(|_| {
        (
            200,
            "application/json",
            vec![r#"{"id":"resp_x","object":"response","status":"completed","output":[],"usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2}}"#],
        )
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[url])]).await;
    let (c, c_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let mut body: serde_json::Value = serde_json::from_str(&create("c", true)).unwrap();
    body["request_id"] = "chosen\\\"id".into();
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&c)), ("x-request-id", "mine")],
        body.to_string(),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let got = reached.to("/v1/responses");
    let (head, sent) = got.last().unwrap();
    let sent: serde_json::Value = serde_json::from_slice(sent).unwrap();
    assert_eq!(
        sent["request_id"],
        format!("{}-chosen\\\"id", c_rec.public_id),
        "{sent}"
    );
    assert_eq!(head["x-request-id"], format!("{}-mine", c_rec.public_id));
    // The client keeps its own id.
    assert_eq!(m.headers["x-request-id"], "mine");
}

/// Open a connection and send the head of a POST declaring `len` bytes of `content_type`
/// body, and `sent` of them; the connection is returned to hold it open.
async fn stalled_upload(
    gw: &Gateway,
    path: &str,
    key: &str,
    content_type: &str,
    len: usize,
    sent: usize,
) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(gw.server.local_addr)
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\ncontent-type: {content_type}\r\ncontent-length: {len}\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(&vec![b'x'; sent]).await.unwrap();
    sock
}

/// The status line and body of the answer on `sock` (read to its end or for 5 s).
async fn answer_on(sock: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                        break;
                    }
                }
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Bodies still arriving are bounded before they are read: a body holds its declared
/// length, past the key's bound a new one is refused at once with 429, past the gateway's
/// with 503, and one that stops arriving is answered 408 after the idle limit, not the whole
/// body timeout. Before: 80 uploads one byte short of 25 MiB from one key held 1.2 GB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_still_arriving_are_bounded_per_key_and_for_the_gateway() {
    const MIB: usize = 1024 * 1024;
    let sim = sim(|_| {}).await;
    let mut p = pool("asr", &[sim.url()]);
    p.kind = fleetgate_gateway::config::PoolKind::Transcription;
    let gw = gateway_with(vec![p], |c| {
        c.server.max_body_bytes = MIB;
        c.server.max_audio_body_bytes = MIB;
        c.server.max_pending_body_bytes_per_key = 2 * MIB;
        c.server.max_pending_body_bytes = 3 * MIB;
        c.server.body_idle_timeout = Duration::from_millis(1500);
        c.server.body_timeout = Duration::from_secs(30);
    })
    .await;
    let (a, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let (b, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let (c, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let audio = "multipart/form-data; boundary=X";
    let path = "/v1/audio/transcriptions";
    // Key A holds its 2 MiB with two uploads one byte short.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(stalled_upload(&gw, path, &a, audio, MIB, MIB - 1).await);
    }
    // Give the gateway the time to read the heads (the refusals below must see them held).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut third = stalled_upload(&gw, path, &a, audio, MIB, 10).await;
    let got = answer_on(&mut third).await;
    assert!(got.starts_with("HTTP/1.1 429"), "{got}");
    assert!(got.contains("key_pending_bodies"), "{got}");
    assert!(got.contains("max_pending_body_bytes_per_key"), "{got}");
    // A JSON body counts the same way.
    let mut json =
        stalled_upload(&gw, "/v1/chat/completions", &a, "application/json", 1000, 5).await;
    let got = answer_on(&mut json).await;
    assert!(got.starts_with("HTTP/1.1 429"), "{got}");
    // Another key still gets in, to the gateway's bound; past it, anyone is refused with 503.
    held.push(stalled_upload(&gw, path, &b, audio, MIB, 10).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut over = stalled_upload(&gw, path, &c, audio, MIB, 10).await;
    let got = answer_on(&mut over).await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("gateway_overloaded"), "{got}");
    assert!(got.contains("retry-after: 1"), "{got}");
    // The held uploads stopped arriving: 408 after the idle limit, well before 30 s.
    let started = std::time::Instant::now();
    let got = answer_on(&mut held[0]).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("body_idle_timeout_seconds"), "{got}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Once they are answered, their bytes are free again: a whole upload of key C is read
    // (and refused only for what it is: no form fields).
    drop(held);
    let mut ok = false;
    for _ in 0..50 {
        let m = post(
            &gw.url(path),
            &[("authorization", &bearer(&c)), ("content-type", audio)],
            vec![b'x'; MIB / 2],
        )
        .await;
        if m.status == 400 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the held bytes were given back");
}

/// A multipart body vLLM would read differently is refused before any backend sees it: a
/// `boundary` named twice (the gateway's parser took the first, Starlette the last, so a key
/// allowed `whisper` had `whisper-secret` run), and a `model` field given twice (it answered
/// 500 `internal_error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_bodies_read_differently_by_vllm_are_refused() {
    let (url, reached, _task) = recording_backend(|_| {
        (
            200,
            "application/json",
            vec![r#"{"text":"hi","usage":{"type":"duration","seconds":1}}"#],
        )
    })
    .await;
    let mut p = pool("whisper", &[url]);
    p.kind = fleetgate_gateway::config::PoolKind::Transcription;
    let gw = gateway(vec![p]).await;
    let part = |boundary: &str, name: &str, value: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        )
    };
    let file = |boundary: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n"
        )
    };
    // Parsed with AAA it names `whisper`; with BBB, `whisper-secret`.
    let body = format!(
        "{}{}--AAA--\r\n{}{}--BBB--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper"),
        file("BBB"),
        part("BBB", "model", "whisper-secret")
    );
    for ct in [
        "multipart/form-data; boundary=AAA; boundary=BBB",
        "multipart/form-data; boundary=\"AAA\"; BOUNDARY=BBB",
        "multipart/form-data; boundary=\"A;A\"; charset=x; boundary=BBB",
    ] {
        let m = post(
            &gw.url("/v1/audio/transcriptions"),
            &[("content-type", ct)],
            body.clone(),
        )
        .await;
        assert_eq!(m.status, 400, "{ct}: {:?}", m.body);
        let e = openai_error(&m);
        assert!(
            e["message"].as_str().unwrap().contains("`boundary`"),
            "{ct}: {e}"
        );
    }
    let twice = format!(
        "{}{}{}--AAA--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper"),
        part("AAA", "model", "whisper-secret")
    );
    let m = post(
        &gw.url("/v1/audio/transcriptions"),
        &[("content-type", "multipart/form-data; boundary=AAA")],
        twice,
    )
    .await;
    assert_eq!(m.status, 400, "{:?}", m.body);
    let e = openai_error(&m);
    assert_eq!(e["param"], "model", "{e}");
    assert!(reached.to("/v1/audio/transcriptions").is_empty());
    // One boundary, one model: forwarded.
    let once = format!(
        "{}{}--AAA--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper")
    );
    let m = post(
        &gw.url("/v1/audio/transcriptions"),
        &[("content-type", "multipart/form-data; boundary=AAA")],
        once,
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(reached.to("/v1/audio/transcriptions").len(), 1);
}

/// A backend's usage past any plausible count is not settled: before, 2^64 - 1 output tokens
/// locked the key's token budget for centuries and the request log stored i64::MAX.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_usage_from_a_backend_is_not_settled() {
    let (url, _reached, _task) = recording_backend(|_| {
        (
            200,
            "application/json",
            vec![r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":18446744073709551615,"total_tokens":18446744073709551615}}"#],
        )
    })
    .await;
    let gw = gateway_with(vec![pool("m", &[url])], |c| c.admin = admin_cfg()).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.tokens_per_minute = Some(10_000);
    })
    .await;
    for i in 0..3 {
        let id = format!("absurd-{i}");
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("authorization", &bearer(&key)), ("x-request-id", &id)],
            CHAT,
        )
        .await;
        assert_eq!(m.status, 200, "request {i}: {:?}", m.body);
        let remaining: u64 = m.headers["x-ratelimit-remaining-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(remaining > 9_000, "request {i}: {remaining} left");
        let seen = gw.record_of(&id).await;
        assert_eq!(seen.timeline.stream().usage, None, "treated as no usage");
        assert!(seen.timeline.stream().implausible_usage);
    }
    let text = metrics_text(&gw);
    let line = text
        .lines()
        .find(|l| l.starts_with("fleetgate_upstream_implausible_usage_total{"))
        .unwrap_or_default();
    assert!(line.ends_with(" 3"), "{line}");
}

/// Reservations read a request as vLLM does: `max_completion_tokens: 0` falls back to
/// `max_tokens` (it reserved 1 token), and a completions list of prompts reserves for each
/// (100 prompts of `max_tokens: 1000` reserved about 1 000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_cover_what_vllm_may_generate() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.tokens_per_minute = Some(20_000);
    })
    .await;
    let chat = r#"{"model":"qwen32b","max_completion_tokens":0,"max_tokens":100000,"messages":[{"role":"user","content":"hi"}]}"#;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &bearer(&key))],
        chat,
    )
    .await;
    assert_eq!(m.status, 429, "{:?}", m.body);
    assert_eq!(openai_error(&m)["code"], "request_exceeds_token_budget");
    let prompts = vec!["\"p\""; 100].join(",");
    let completions = format!(r#"{{"model":"qwen32b","max_tokens":1000,"prompt":[{prompts}]}}"#);
    let m = post(
        &gw.url("/v1/completions"),
        &[("authorization", &bearer(&key))],
        completions,
    )
    .await;
    assert_eq!(m.status, 429, "{:?}", m.body);
    assert_eq!(openai_error(&m)["code"], "request_exceeds_token_budget");
    // Within the budget, it is served.
    let m = post(
        &gw.url("/v1/completions"),
        &[("authorization", &bearer(&key))],
        r#"{"model":"qwen32b","max_tokens":8,"prompt":"p"}"#,
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
}

/// What a backend sends after a stream's terminal event is not relayed, and its usage is not
/// what gets settled; vLLM's internal headers (`x-data-parallel-rank` picks an engine rank)
/// never come from a client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_after_the_terminal_event_and_no_vllm_internal_headers() {
    let (url, reached, _task) = recording_backend(|path| {
        let frames = match path {
            "/v1/responses" => vec![
                "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"},\"sequence_number\":0}\n\n",
                "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1,\"total_tokens\":4}},\"sequence_number\":2}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":9999999}}}\n\n",
                "data: {\"type\":\"response.output_text.delta\",\"delta\":\"smuggled\"}\n\n",
            ],
            _ => vec![
                "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n",
                "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\ndata: [DONE]\n\ndata: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":9999999}}\n\n",
                "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"smuggled\"}}]}\n\n",
            ],
        };
        (200, "text/event-stream", frames)
    })
    .await;
    let gw = gateway(vec![pool("m", &[url])]).await;
    let chat = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("x-request-id", "after-done"),
            ("x-data-parallel-rank", "3"),
            ("endpoint-load-metrics-format", "json"),
        ],
        chat,
    )
    .await;
    assert_eq!(m.status, 200);
    let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(
        !body.contains("smuggled") && !body.contains("9999999"),
        "{body}"
    );
    let seen = gw.record_of("after-done").await;
    assert_eq!(
        seen.timeline.stream().usage.map(|u| u.completion_tokens),
        Some(1)
    );
    assert_eq!(seen.error, None);
    let (head, _) = &reached.to("/v1/chat/completions")[0];
    assert!(head.get("x-data-parallel-rank").is_none(), "{head:?}");
    assert!(head.get("endpoint-load-metrics-format").is_none());

    let responses = r#"{"model":"m","stream":true,"input":"hi","max_output_tokens":4}"#;
    let m = post(
        &gw.url("/v1/responses"),
        &[("x-request-id", "after-completed")],
        responses,
    )
    .await;
    let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
    assert_eq!(
        body.matches("response.completed").count(),
        2,
        "one event: {body}"
    );
    assert!(
        !body.contains("smuggled") && !body.contains("9999999"),
        "{body}"
    );
    let seen = gw.record_of("after-completed").await;
    assert_eq!(
        seen.timeline.stream().usage.map(|u| u.completion_tokens),
        Some(1)
    );
}

/// A refusal of a key that was identified (revoked here) is that key's in the request log,
/// so `fleetgate usage --by key` shows its refused attempts; an unknown key's stay keyless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_keys_refusals_are_its_own_in_the_log() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let revoked = gw
        .server
        .auth
        .store()
        .revoke(&rec.public_id, "incident", "test")
        .await
        .unwrap();
    gw.server.auth.apply(&rec.public_id, Some(revoked));
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("authorization", &bearer(&key)),
            ("x-request-id", "revoked-1"),
        ],
        CHAT,
    )
    .await;
    assert_eq!(m.status, 401);
    assert_eq!(openai_error(&m)["code"], "key_revoked");
    let seen = gw.record_of("revoked-1").await;
    assert_eq!(seen.key_id.as_deref(), Some(&*rec.public_id));
    // A key nobody issued stays "no key".
    let unknown = format!(
        "fg-prod-{}",
        &key["fg-prod-".len()..].replace(|c: char| c.is_ascii_digit(), "7")
    );
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("authorization", &bearer(&unknown)),
            ("x-request-id", "unknown-1"),
        ],
        CHAT,
    )
    .await;
    assert_eq!(m.status, 401);
    assert_eq!(gw.record_of("unknown-1").await.key_id, None);
}

/// Background responses count against the pool's slots for as long as their backend works on
/// them: 12 background POSTs on a pool of 2 slots never run more than 2 at once at the
/// backend (before: all 12 ran together, and the key's cap and the queue were bypassed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_stay_within_the_pools_slots() {
    let sim = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 20.0;
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.max_in_flight_per_backend = 2;
    let gw = gateway_with(vec![p], |c| {
        c.queue.max_wait = [Duration::from_millis(300); 3];
    })
    .await;
    let stats = sim.stats().clone();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watching = {
        let (stats, peak) = (stats.clone(), peak.clone());
        tokio::spawn(async move {
            loop {
                let now = stats.running.load(std::sync::atomic::Ordering::SeqCst);
                peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let body = r#"{"model":"qwen32b","input":"hi","max_output_tokens":40,"background":true}"#;
    let posts: Vec<_> = (0..12)
        .map(|_| {
            let url = gw.url("/v1/responses");
            tokio::spawn(async move { post(&url, &[], body).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for p in posts {
        statuses.push(p.await.unwrap());
    }
    let accepted = statuses.iter().filter(|s| **s == 200).count();
    assert!((2..12).contains(&accepted), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    // Let the accepted ones finish (40 tokens × 20 ms).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    watching.abort();
    let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= 2, "{peak} ran at once at the backend");
    assert!(peak >= 1);
}

/// A streamed background response whose client leaves early goes on at the backend: its key's
/// stream stays taken until the backend is done, then comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_background_response_left_early_keeps_its_slot_until_done() {
    use http_body_util::BodyExt;
    let sim = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 20.0;
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.max_concurrent_streams = Some(1);
    })
    .await;
    let body = r#"{"model":"qwen32b","input":"hi","max_output_tokens":60,"background":true,"stream":true}"#;
    let c = fleetgate_protocol::client::http_client();
    let req = http::Request::post(gw.url("/v1/responses"))
        .header("authorization", bearer(&key))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            body.as_bytes(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    // Read until the response's id has come (`response.created`), then leave.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("response.created") {
        let frame = stream.frame().await.unwrap().unwrap();
        seen.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    drop(stream);
    drop(c);
    let small = r#"{"model":"qwen32b","input":"hi","max_output_tokens":2}"#;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&key))],
        small,
    )
    .await;
    assert_eq!(
        m.status, 429,
        "the background work still holds the key's stream"
    );
    // 60 tokens at 20 ms: done within a few seconds, and the stream comes back.
    let mut status = 0;
    for _ in 0..100 {
        status = post(
            &gw.url("/v1/responses"),
            &[("authorization", &bearer(&key))],
            small,
        )
        .await
        .status;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200);
}
