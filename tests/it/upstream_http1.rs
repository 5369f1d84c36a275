//! Upstream requests in origin form with the backend's `Host`, through servers that enforce
//! HTTP/1.1: a raw head check, Debian's nginx and Python's h11.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use crate::hostile_clients::{CHAT, CHAT_STREAM};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A backend that keeps every request head as it came on the wire and answers each with a
/// small JSON body (a chat completion), keeping the connection open.
struct RawBackend {
    addr: SocketAddr,
    /// Each request's head with the number of the connection it came on (0, 1, ...).
    heads: Arc<Mutex<Vec<(usize, String)>>>,
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
            let mut conn = 0;
            while let Ok((mut sock, _)) = listener.accept().await {
                let seen = seen.clone();
                let this = conn;
                conn += 1;
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
                        seen.lock().unwrap().push((this, head));
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
            .map(|(_, h)| h)
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

/// A connection idle past the gateway's idle timeout (4 s) is not used again: vLLM's server
/// closes its idle connections after 5 s, and a request sent as that close crosses it fails
/// ("connection closed before message completed": a health probe marked the backend down, a
/// request with no other backend to retry got a 502). Within the timeout it is reused.
#[tokio::test]
async fn a_connection_idle_past_four_seconds_is_not_reused() {
    let raw = RawBackend::start().await;
    let gw = gateway_with(vec![pool("m", &[format!("http://{}", raw.addr)])], |c| {
        // No probe in between to muddle the count, and one worker: each worker keeps its own
        // idle connections.
        c.server.health_interval = Duration::from_secs(600);
        c.server.workers = 1;
    })
    .await;
    let chat = |gw: &Gateway| {
        let url = gw.url("/v1/chat/completions");
        async move { post(&url, &[("content-type", "application/json")], CHAT).await }
    };
    for wait in [Duration::from_millis(500), Duration::from_millis(4500)] {
        assert_eq!(chat(&gw).await.status, 200);
        tokio::time::sleep(wait).await;
        assert_eq!(chat(&gw).await.status, 200);
    }
    let on: Vec<usize> = raw
        .heads
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, l)| l.starts_with("POST /v1/chat/completions"))
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(on.len(), 4, "{on:?}");
    assert_eq!(on[0], on[1], "reused after 0.5 s idle: {on:?}");
    assert_eq!(on[1], on[2], "reused at once: {on:?}");
    assert_ne!(on[2], on[3], "a new connection after 4.5 s idle: {on:?}");
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
