//! Client connections cannot take the gateway offline: silent and trickling sockets are closed
//! after the header timeout, idle kept-alive ones after the keep-alive timeout, and at
//! `server.max_connections` the listener stops accepting until a place frees (raw TCP against a
//! real gateway on 127.0.0.1:0).

use std::time::{Duration, Instant};

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous: the behaviour is "closed at all", the timeouts under test are 0.5 s.
const CLOSED_WITHIN: Duration = Duration::from_secs(8);

/// Reads until the server closes; `None` if it is still open after `limit`.
async fn closed_by_server(s: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = Instant::now() + limit;
    loop {
        let left = end.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// `GET /healthz` on an open connection: the whole answer, or `None` if none within 2 s.
async fn healthz_on(s: &mut TcpStream) -> Option<String> {
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = closed_by_server(s, Duration::from_secs(2)).await?;
    Some(String::from_utf8_lossy(&answer).into_owned())
}

async fn short_timeouts(max_connections: usize) -> (Gateway, fleetgate_sim::SimServer) {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.max_connections = max_connections;
        // These tests come from one address: its share is the whole cap here (the share has
        // a test of its own).
        c.server.max_connections_per_address = u32::try_from(max_connections).unwrap();
        c.server.header_timeout = Duration::from_millis(500);
        c.server.keepalive_timeout = Duration::from_millis(500);
    })
    .await;
    (gw, sim)
}

/// A streamed chat of `max_tokens` through the gateway, with its key.
async fn stream(gw: &Gateway, max_tokens: u32) -> fleetgate_protocol::client::Measured {
    post(
        &gw.url("/v1/chat/completions"),
        &[],
        fleetgate_protocol::client::chat_body("qwen32b", "hi", max_tokens, true),
    )
    .await
}

fn metric(gw: &Gateway, event: &str) -> f64 {
    let text = metrics_text(gw);
    let prefix =
        format!("fleetgate_client_connection_events_total{{event=\"{event}\",listener=\"api\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn silent_connections_are_closed_and_the_cap_lets_the_next_client_in() {
    let (gw, _sim) = short_timeouts(3).await;
    let addr = gw.server.local_addr;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // A fourth client: at the cap the gateway does not accept it yet; it is served once a
    // silent one has been closed.
    let mut next = TcpStream::connect(addr).await.unwrap();
    next.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    for s in &mut silent {
        let got = closed_by_server(s, CLOSED_WITHIN).await;
        assert_eq!(
            got.as_deref(),
            Some(&b""[..]),
            "a connection that sends nothing is closed, without an answer"
        );
    }
    let answer = closed_by_server(&mut next, CLOSED_WITHIN)
        .await
        .expect("the client waiting at the cap is served");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        metric(&gw, "header_timeout") >= 3.0,
        "{}",
        metrics_text(&gw)
    );
    assert!(metric(&gw, "limit_reached") >= 1.0, "{}", metrics_text(&gw));
    // And the gateway serves as before.
    assert_eq!(stream(&gw, 4).await.status, 200);
}

#[tokio::test]
async fn a_head_sent_a_byte_at_a_time_is_cut_at_the_header_timeout() {
    let (gw, _sim) = short_timeouts(0).await;
    let mut s = TcpStream::connect(gw.server.local_addr).await.unwrap();
    let started = Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut = false;
    for b in head {
        if s.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if started.elapsed() > CLOSED_WITHIN {
            break;
        }
    }
    if !cut {
        // The writes may still succeed into a closed socket's buffer; the read tells.
        cut = closed_by_server(&mut s, Duration::from_millis(500))
            .await
            .is_some();
    }
    assert!(
        cut,
        "a trickled head is cut (it would take {} s to send)",
        head.len() / 10
    );
    assert!(started.elapsed() < CLOSED_WITHIN);
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout() {
    let (gw, _sim) = short_timeouts(0).await;
    let mut s = TcpStream::connect(gw.server.local_addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let got = closed_by_server(&mut s, CLOSED_WITHIN)
        .await
        .expect("the idle connection is closed after its answer");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
}

#[tokio::test]
async fn a_stream_longer_than_the_header_timeout_is_not_cut() {
    let sim = sim(|a| a.decode_step_ms = 30.0).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.header_timeout = Duration::from_millis(300);
        c.server.keepalive_timeout = Duration::from_millis(300);
    })
    .await;
    let started = Instant::now();
    let m = stream(&gw, 40).await;
    assert_eq!(m.status, 200);
    assert!(
        started.elapsed() > Duration::from_millis(600),
        "the stream outlived both timeouts"
    );
    let body = String::from_utf8_lossy(m.body.as_deref().unwrap());
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
}

#[tokio::test]
async fn a_body_trickled_past_the_body_timeout_gets_408() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.body_timeout = Duration::from_millis(500);
    })
    .await;
    let mut s = TcpStream::connect(gw.server.local_addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\":",
        gw.key
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let got = closed_by_server(&mut s, CLOSED_WITHIN)
        .await
        .expect("answered and closed");
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("\"code\":\"body_timeout\""), "{got}");
    let seen = gw.records.lock().unwrap().clone();
    assert_eq!(seen.last().unwrap().error, Some("body_timeout"));
}

#[tokio::test]
async fn a_header_flood_is_refused_before_it_costs_anything() {
    let (gw, _sim) = short_timeouts(0).await;
    let mut s = TcpStream::connect(gw.server.local_addr).await.unwrap();
    let mut req = String::from("GET /healthz HTTP/1.1\r\nHost: x\r\n");
    for i in 0..2_000 {
        req.push_str(&format!("X-Flood-{i}: {}\r\n", "v".repeat(64)));
    }
    req.push_str("\r\n");
    // The server may stop reading once it has refused the head.
    let _ = s.write_all(req.as_bytes()).await;
    let got = closed_by_server(&mut s, CLOSED_WITHIN)
        .await
        .expect("refused and closed");
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.is_empty() || got.starts_with("HTTP/1.1 431"),
        "a 2 000-line head is refused: {got}"
    );
    // The gateway serves as before.
    assert_eq!(stream(&gw, 4).await.status, 200);
}

/// Silent sockets from one address hold at most its share of the places
/// (`server.max_connections_per_address`): its further connections are closed at once and
/// counted, a client from another address (127.0.0.2) is served at once, and the admin
/// listener's `/healthz` — where liveness is asked — answers throughout. Before the share,
/// 448 sockets from one address kept every other client waiting for as long as they came back.
#[tokio::test]
async fn one_address_cannot_take_every_connection_place() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.max_connections = 8;
        c.server.max_connections_per_address = 4;
        // The silent ones stay for the whole test.
        c.server.header_timeout = Duration::from_secs(30);
    })
    .await;
    let addr = gw.server.local_addr;
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // Those past the share were closed as soon as they were accepted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut open = 0;
    for s in &mut silent {
        if closed_by_server(s, Duration::from_millis(200))
            .await
            .is_none()
        {
            open += 1;
        }
    }
    assert_eq!(open, 4, "one address holds its share, no more");
    assert!(
        metric(&gw, "address_limit") >= 16.0,
        "{}",
        metrics_text(&gw)
    );

    // Another address gets a place at once.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = tokio::time::timeout(Duration::from_secs(2), sock.connect(addr))
        .await
        .unwrap()
        .unwrap();
    let answer = healthz_on(&mut other)
        .await
        .expect("another address is served at once");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Liveness on the admin listener, whatever the API listener's clients do.
    let mut admin = TcpStream::connect(gw.server.admin_addr.unwrap())
        .await
        .unwrap();
    let answer = healthz_on(&mut admin)
        .await
        .expect("the admin listener answers");
    assert!(answer.starts_with("HTTP/1.1 200"));
    drop(silent);
}

/// `count` connections to `addr` opened at once: how many completed their handshake within
/// `limit` (each one is kept open until the end of the call).
async fn connect_many(addr: std::net::SocketAddr, count: usize, limit: Duration) -> usize {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..count {
        set.spawn(async move { tokio::time::timeout(limit, TcpStream::connect(addr)).await });
    }
    let mut open = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(Ok(Ok(s))) = r {
            open.push(s);
        }
    }
    open.len()
}

/// A reconnect storm waits in the accept queue (`server.listen_backlog`): with the gateway at
/// its connection cap, so that it accepts none of them, 1 500 connections opened at once all
/// complete their handshake, where tokio's own backlog (1 024) would drop the SYNs past it and
/// make each of those clients wait its 1 s retransmission, again and again. A small backlog
/// shows the same check can fail.
#[tokio::test]
async fn a_reconnect_storm_waits_in_the_listen_backlog() {
    let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .map_or(4096, |s| s.trim().parse().unwrap_or(4096));
    assert!(
        somaxconn >= 2048,
        "net.core.somaxconn is {somaxconn}: the kernel caps every backlog below this test's 2048 (Linux has defaulted to 4096 since 5.4)"
    );
    for (backlog, storm) in [(2048u32, 1500usize), (16, 100)] {
        let sim = sim(|_| {}).await;
        let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.server.listen_backlog = backlog;
            c.server.max_connections = 1;
            c.server.max_connections_per_address = 1;
        })
        .await;
        let addr = gw.server.local_addr;
        // The one place, taken: the listener stops accepting.
        let mut first = TcpStream::connect(addr).await.unwrap();
        assert!(
            healthz_on(&mut TcpStream::connect(addr).await.unwrap())
                .await
                .is_none(),
            "at the cap a new connection waits unanswered"
        );
        let limit = if backlog > 16 {
            Duration::from_secs(30)
        } else {
            // Long enough for a dropped SYN's first retransmission (1 s).
            Duration::from_millis(2500)
        };
        let connected = connect_many(addr, storm, limit).await;
        if backlog > 16 {
            assert_eq!(connected, storm, "every connection of the storm completes");
        } else {
            // Linux queues backlog + 1 completed connections (one is the probe above).
            assert!(
                connected <= backlog as usize + 2,
                "with a backlog of {backlog}, {connected} of {storm} completed: the setting is not applied"
            );
        }
        // The place frees: the queue is served.
        first.shutdown().await.unwrap();
        drop(first);
    }
}
