//! Streams resumed through the gateway (issue 60, `[pools.resume]`): a backend that closes
//! the connection, says its engine died, or stalls mid-answer leaves the client one
//! uninterrupted answer — the uninterrupted answer's tokens and usage, one chunk id, its finish
//! reason, `[DONE]`, no error event — and what cannot be continued exactly ends as before, its
//! error event naming the reason, counted.

use crate::common::*;
use serde_json::{Value, json};

/// The `data:` payloads of a streamed answer, parsed (`[DONE]` as the string "[DONE]").
fn events(m: &fleetgate_protocol::client::Measured) -> Vec<Value> {
    let body = m.body.as_deref().expect("body kept");
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter_map(|e| e.trim_start_matches('\n').strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_owned())))
        .collect()
}

fn usages(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| !e["usage"].is_null())
        .map(|e| e["usage"].clone())
        .collect()
}

/// What a client must see of a stream that was resumed: exactly the uninterrupted answer.
fn assert_one_answer(got: &[Value], whole: &[Value], what: &str) {
    assert!(
        got.iter().all(|e| e.get("error").is_none()),
        "{what}: no error event: {got:?}"
    );
    assert_eq!(
        token_texts(got),
        token_texts(whole),
        "{what}: the same tokens"
    );
    let ids: std::collections::HashSet<&Value> = got
        .iter()
        .filter(|e| e.is_object())
        .map(|e| &e["id"])
        .collect();
    assert_eq!(ids.len(), 1, "{what}: one chunk id: {ids:?}");
    let finishes: Vec<&Value> = got
        .iter()
        .map(|e| &e["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&json!("length")], "{what}");
    assert_eq!(
        usages(got),
        usages(whole),
        "{what}: one usage, the uninterrupted one"
    );
    assert_eq!(got.last(), Some(&json!("[DONE]")), "{what}");
}

/// The request log's row of `id`: (resumes, resume_detail, fleet_tokens, prompt_tokens,
/// completion_tokens), once written.
async fn logged(
    gw: &Gateway,
    id: &str,
) -> (
    Option<i32>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
) {
    use sqlx::Row;
    let store = gw.server.auth.store().clone();
    for _ in 0..500 {
        let row = sqlx::query(
            "SELECT resumes, resume_detail, fleet_tokens, prompt_tokens, completion_tokens \
             FROM request_log WHERE request_id = $1",
        )
        .bind(id)
        .fetch_optional(store.pool())
        .await
        .unwrap();
        if let Some(r) = row {
            return (
                r.get("resumes"),
                r.get("resume_detail"),
                r.get("fleet_tokens"),
                r.get("prompt_tokens"),
                r.get("completion_tokens"),
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("no request-log row for {id}");
}

fn resuming_pool(backends: &[String], max_resumes: u8) -> fleetgate_gateway::config::PoolConfig {
    let mut p = pool("qwen32b", backends);
    p.resume.max_resumes = max_resumes;
    p
}

fn counter(gw: &Gateway, name: &str, label: &str) -> u64 {
    metrics_text(gw)
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Both backends cut every stream after 8 tokens (chat) — or say their engine died after 5
/// (completions): a 24-token answer needs two continuations, each on the other backend, and
/// the client gets the answer a healthy backend gives, with its usage, whether it asked for
/// usage or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_fails_mid_answer_is_resumed_on_another() {
    let healthy = sim(|a| a.zero_delay = true).await;
    let cases = [
        (
            "closed",
            "/v1/chat/completions",
            json!({"model": "qwen32b", "stream": true, "max_tokens": 24,
                   "stream_options": {"include_usage": true},
                   "messages": [{"role": "user", "content": "Tell me everything."}]}),
        ),
        (
            "engine_dead",
            "/v1/completions",
            json!({"model": "qwen32b", "stream": true, "max_tokens": 12,
                   "stream_options": {"include_usage": true}, "prompt": "Once upon a time"}),
        ),
        (
            "closed",
            "/v1/chat/completions",
            json!({"model": "qwen32b", "stream": true, "max_completion_tokens": 20,
                   "messages": [{"role": "user", "content": "No usage asked."}]}),
        ),
    ];
    for (cause, path, request) in cases {
        let faulty = || async {
            sim(|a| {
                a.zero_delay = true;
                if cause == "closed" {
                    a.drop_after_chunks = Some(8);
                } else {
                    a.error_after_chunks = Some(5);
                }
            })
            .await
        };
        let (a, b) = (faulty().await, faulty().await);
        let gw = gateway(vec![resuming_pool(&[a.url(), b.url()], 2)]).await;
        let whole = events(
            &post(
                &format!("{}{path}", healthy.url()).parse().unwrap(),
                &[],
                request.to_string(),
            )
            .await,
        );
        let m = post(
            &gw.url(path),
            &[("x-request-id", "resumed-1")],
            request.to_string(),
        )
        .await;
        assert_eq!(m.status, 200);
        assert!(m.body_error.is_none(), "{:?}", m.body_error);
        assert_one_answer(&events(&m), &whole, &format!("{cause} {path}"));
        assert_eq!(
            counter(
                &gw,
                "fleetgate_stream_resumes_total",
                &format!("cause=\"{cause}\"")
            ),
            2,
            "{cause} {path}: two continuations counted"
        );
        let seen = gw.record_of("resumed-1").await;
        assert_eq!(seen.error, None, "{cause} {path}");
        let n = token_texts(&whole).len();
        assert_eq!(
            usize::try_from(seen.timeline.stream().content_events).unwrap(),
            n
        );
        // The request log: two continuations, the parts that failed (each the sim's fault
        // apart), and the fleet's spend: the client's usage plus each continuation's prompt
        // (the original prompt and the answer so far).
        let (resumes, detail, fleet, prompt, completion) = logged(&gw, "resumed-1").await;
        assert_eq!(resumes, Some(2), "{cause} {path}");
        let detail: Value = serde_json::from_str(&detail.unwrap()).unwrap();
        let part = if cause == "closed" { 8 } else { 5 };
        let parts = detail["parts"].as_array().unwrap();
        assert_eq!(parts.len(), 2, "{detail}");
        assert!(
            parts
                .iter()
                .all(|p| p["cause"] == cause && p["tokens"] == part),
            "{detail}"
        );
        assert_ne!(
            parts[0]["backend"], parts[1]["backend"],
            "each on the other"
        );
        assert!(detail.get("refused").is_none(), "{detail}");
        let (prompt, completion) = (prompt.unwrap(), completion.unwrap());
        assert_eq!(completion, i64::try_from(n).unwrap());
        assert_eq!(
            fleet,
            Some(prompt + completion + 2 * prompt + part + 2 * part),
            "{cause} {path}"
        );
        a.shutdown().await;
        b.shutdown().await;
    }
    healthy.shutdown().await;
}

/// A backend that stops sending mid-answer, its connection left open, is given up after
/// `stall_ms` and the answer continued elsewhere; a pool with nowhere to continue waits out
/// its idle limit as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_backend_is_resumed_on_another() {
    let healthy = sim(|a| a.zero_delay = true).await;
    let stalling = || async {
        sim(|a| {
            a.zero_delay = true;
            a.stall_after_chunks = Some(6);
        })
        .await
    };
    let (a, b) = (stalling().await, stalling().await);
    let mut p = resuming_pool(&[a.url(), b.url()], 2);
    p.resume.stall = std::time::Duration::from_millis(300);
    let gw = gateway(vec![p]).await;
    let request = json!({"model": "qwen32b", "stream": true, "max_tokens": 14,
                         "stream_options": {"include_usage": true},
                         "messages": [{"role": "user", "content": "Go on."}]});
    let whole = events(
        &post(
            &format!("{}/v1/chat/completions", healthy.url())
                .parse()
                .unwrap(),
            &[],
            request.to_string(),
        )
        .await,
    );
    let m = post(&gw.url("/v1/chat/completions"), &[], request.to_string()).await;
    assert_one_answer(&events(&m), &whole, "stalled");
    assert_eq!(
        counter(&gw, "fleetgate_stream_resumes_total", "cause=\"stalled\""),
        2
    );
    a.shutdown().await;
    b.shutdown().await;
    healthy.shutdown().await;
}

/// What cannot be continued exactly ends as it did before resuming existed — an error event,
/// then `[DONE]` — the event naming the reason, each reason counted. (`n` above 1, which the
/// sim does not serve, and the refusals read from the answer are in the protocol crate's
/// `resume` tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_resumed_ends_naming_the_reason() {
    let cutting = || async {
        sim(|a| {
            a.zero_delay = true;
            a.drop_after_chunks = Some(3);
        })
        .await
    };
    let (a, b) = (cutting().await, cutting().await);
    let gw = gateway(vec![resuming_pool(&[a.url(), b.url()], 2)]).await;
    let chat = |extra: Value| {
        let mut body = json!({"model": "qwen32b", "stream": true, "max_tokens": 10,
                              "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    let cases = [
        (
            "logprobs",
            "/v1/chat/completions",
            chat(json!({"logprobs": true})),
        ),
        (
            "guided_decoding",
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"}})),
        ),
        (
            "endpoint",
            "/v1/messages",
            json!({"model": "qwen32b", "stream": true, "max_tokens": 10,
                   "messages": [{"role": "user", "content": "hi"}]})
            .to_string(),
        ),
    ];
    for (reason, path, body) in cases {
        let m = post(&gw.url(path), &[], body).await;
        assert_eq!(
            m.status,
            200,
            "{reason}: {:?}",
            m.body.as_deref().map(String::from_utf8_lossy)
        );
        let text = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
        assert!(
            text.contains(&format!("(reason `{reason}`)")),
            "{reason}: the error event names it: {text}"
        );
        assert!(m.metrics.error, "{reason}: an error event");
        assert_eq!(
            counter(
                &gw,
                "fleetgate_stream_resume_refused_total",
                &format!("reason=\"{reason}\"")
            ),
            1,
            "{reason}: counted"
        );
    }
    assert_eq!(
        counter(&gw, "fleetgate_stream_resumes_total", ""),
        0,
        "nothing was resumed"
    );
    // Resumed as often as allowed, then refused (10 tokens, cut every 3: three continuations
    // needed, one allowed).
    let once = gateway(vec![resuming_pool(&[a.url(), b.url()], 1)]).await;
    let m = post(&once.url("/v1/chat/completions"), &[], chat(json!({}))).await;
    let text = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
    assert!(text.contains("(reason `max_resumes`)"), "{text}");
    assert_eq!(m.metrics.content_events, 6, "two parts of 3 tokens: {text}");
    assert_eq!(
        counter(&once, "fleetgate_stream_resumes_total", "cause=\"closed\""),
        1
    );
    // One backend: nowhere to continue.
    let alone = gateway(vec![resuming_pool(&[a.url()], 2)]).await;
    let m = post(&alone.url("/v1/chat/completions"), &[], chat(json!({}))).await;
    let text = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
    assert!(text.contains("(reason `no_backend`)"), "{text}");
    assert!(
        text.contains(r#""code":"upstream_stream_error""#),
        "the failure's code stays: {text}"
    );
    // Turned off: the stream ends as it always did, nothing counted.
    let mut off = resuming_pool(&[a.url(), b.url()], 2);
    off.resume.enabled = false;
    let off = gateway(vec![off]).await;
    let m = post(&off.url("/v1/chat/completions"), &[], chat(json!({}))).await;
    let text = String::from_utf8_lossy(m.body.as_deref().unwrap()).into_owned();
    assert!(m.metrics.error && !text.contains("reason `"), "{text}");
    assert_eq!(
        counter(&off, "fleetgate_stream_resume_refused_total", ""),
        0
    );
    a.shutdown().await;
    b.shutdown().await;
}
