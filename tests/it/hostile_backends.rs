//! Backends that misbehave: an SSE line without an end, absurd usage, bytes after the
//! terminal event and vLLM's internal headers; clients see a backend's name, never its
//! address.

use std::time::Duration;

use crate::common::*;
use crate::hostile_clients::{CHAT, CHAT_STREAM, bearer, recording_backend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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
