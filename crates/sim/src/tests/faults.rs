//! The failures a sim can be told to show: a warm-up that refuses connections, and injected
//! faults.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::{SimArgs, start};

use super::{client, openai_error, read_all, send, sse_events, zero_delay};

#[tokio::test]
async fn warmup_refuses_then_accepts() {
    let sim = start(SimArgs {
        warmup_secs: 1.0,
        ..zero_delay()
    })
    .await
    .unwrap();
    let err = tokio::net::TcpStream::connect(sim.addr())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    let mut connected = false;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(sim.addr()).await.is_ok() {
            connected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connected, "accepting after the warm-up");
    let r = send(&client(), &sim, "GET", "/health", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    sim.shutdown().await;
}

/// `GET /health` on a kept-alive connection, then how long until the sim closes it (None: still
/// open after `limit`).
async fn closed_after_answer(sim: &crate::SimServer, limit: Duration) -> Option<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(sim.addr()).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before answering");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let answered = std::time::Instant::now();
    // The body of /health is small: whatever else arrives is it, then the close.
    loop {
        match tokio::time::timeout(limit, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(answered.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// `--timeout-keep-alive` closes an idle kept-alive connection as vLLM's server does; without
/// it the sim keeps it.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout() {
    let sim = start(SimArgs {
        timeout_keep_alive: 0.3,
        ..zero_delay()
    })
    .await
    .unwrap();
    let closed = closed_after_answer(&sim, Duration::from_secs(10)).await;
    let after = closed.expect("the idle connection is closed");
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}"
    );
    sim.shutdown().await;

    let sim = start(zero_delay()).await.unwrap();
    assert_eq!(
        closed_after_answer(&sim, Duration::from_secs(1)).await,
        None,
        "kept without the flag"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn injected_faults() {
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 10,
        "stream": true});

    let sim = start(SimArgs {
        drop_after_chunks: Some(3),
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut body = r.into_body();
    let mut got = Vec::new();
    let ended_with_error = loop {
        match body.frame().await {
            Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap()),
            Some(Err(_)) => break true,
            None => break false,
        }
    };
    assert!(ended_with_error, "body error, no [DONE]");
    let events = sse_events(&got);
    assert_eq!(
        events.len(),
        1 + 3,
        "role + 3 content chunks reach the client"
    );
    assert_eq!(sim.stats().failed_injected.load(Relaxed), 1);
    assert_eq!(sim.stats().cancelled.load(Relaxed), 0);
    sim.shutdown().await;

    let sim = start(SimArgs {
        error_after_chunks: Some(2),
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 1 + 2 + 2);
    let err: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(err["error"]["type"], "InternalServerError");
    assert_eq!(err["error"]["code"], 500);
    // vLLM 0.32's EngineDeadError, as its chat stream sends it.
    assert_eq!(
        err["error"]["message"],
        "EngineCore encountered an issue. See stack trace (above) for the root cause."
    );
    assert_eq!(events[4], "[DONE]");
    sim.shutdown().await;

    let sim = start(SimArgs {
        fail_rate: 1.0,
        ..zero_delay()
    })
    .await
    .unwrap();
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let (_, kind, _, code) = openai_error(&read_all(r).await);
    assert_eq!((kind.as_str(), code), ("InternalServerError", 500));
    assert_eq!(sim.stats().failed_injected.load(Relaxed), 1);
    sim.shutdown().await;
}
