//! The engine under load: cancellation of dropped and abandoned requests, queueing beyond
//! `max_num_seqs`, and `priority` under each scheduling policy.

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::json;

use crate::{SimArgs, args, start};

use super::{client, eventually, read_all, send, timed};

/// Reads from a streaming body until `n` content events have arrived.
async fn read_events(body: &mut Incoming, n: usize) -> String {
    let mut seen = String::new();
    while seen.matches("\"content\":").count() < n {
        let frame = body.frame().await.unwrap().unwrap();
        if let Ok(data) = frame.into_data() {
            seen.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
    seen
}

#[tokio::test]
async fn dropped_stream_is_cancelled_and_leaves_the_batch() {
    let sim = start(SimArgs {
        decode_step_ms: 2.0,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000,
        "stream": true});
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req),
        &[("x-request-id", "gone")],
    )
    .await;
    let mut body = r.into_body();
    let seen = read_events(&mut body, 3).await;
    assert_eq!(sim.stats().running.load(Relaxed), 1);
    drop(body);
    let stats = sim.stats().clone();
    eventually("cancellation", || stats.cancelled.load(Relaxed) == 1).await;
    eventually("batch to empty", || stats.running.load(Relaxed) == 0).await;
    assert_eq!(stats.completed.load(Relaxed), 0);
    // What was captured begins with what the client saw and has no [DONE].
    eventually("capture", || stats.captured("gone").is_some()).await;
    let captured = stats.captured("gone").unwrap();
    assert!(captured.starts_with(seen.as_bytes()));
    assert!(!captured.ends_with(b"data: [DONE]\n\n"));
    sim.shutdown().await;
}

#[tokio::test]
async fn abandoned_non_streaming_request_is_cancelled() {
    let sim = start(SimArgs {
        decode_step_ms: 2.0,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000});
    let stats = sim.stats().clone();
    let pending = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]);
    tokio::select! {
        _ = pending => panic!("a 30000-token answer cannot be ready yet"),
        () = eventually("sequence to run", || stats.running.load(Relaxed) == 1) => {}
    }
    eventually("cancellation", || stats.cancelled.load(Relaxed) == 1).await;
    eventually("batch to empty", || stats.running.load(Relaxed) == 0).await;
    sim.shutdown().await;
}

#[tokio::test]
async fn queueing_beyond_max_num_seqs() {
    let sim = start(SimArgs {
        max_num_seqs: 1,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000,
        "stream": true});
    let a = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req.clone()),
        &[],
    )
    .await;
    let b = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let stats = sim.stats().clone();
    eventually("one running, one waiting", || {
        stats.running.load(Relaxed) == 1 && stats.waiting.load(Relaxed) == 1
    })
    .await;
    drop(a);
    // The waiting one is admitted once the first leaves.
    let mut b = b.into_body();
    read_events(&mut b, 1).await;
    sim.shutdown().await;
}

/// The sim reads a request's `priority` as vLLM 0.32 does: with `--scheduling-policy priority`
/// a waiting request of a lower priority is admitted before earlier ones of a higher priority;
/// without it (`fcfs`, the default) it is accepted and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_orders_the_waiting_queue_only_under_the_priority_policy() {
    for policy in [
        args::SchedulingPolicy::Priority,
        args::SchedulingPolicy::Fcfs,
    ] {
        let sim = start(SimArgs {
            max_num_seqs: 1,
            decode_step_ms: 5.0,
            scheduling_policy: policy,
            ..timed()
        })
        .await
        .unwrap();
        let stats = sim.stats().clone();
        let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // The slot is taken; then three wait: priority 10, 10, and 0 last.
        for (name, priority, waiting) in [("long", 0, 0), ("a", 10, 1), ("b", 10, 2), ("p0", 0, 3)]
        {
            let url = sim.url();
            let done = done.clone();
            tasks.push(tokio::spawn(async move {
                let c = client();
                // The first holds the slot long enough for the others to queue behind it.
                let max_tokens = if name == "long" { 200 } else { 12 };
                let body = json!({"model": "qwen32b", "max_tokens": max_tokens, "priority": priority,
                                  "messages": [{"role": "user", "content": "hi"}]});
                let req = Request::post(format!("{url}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let resp = c.request(req).await.unwrap();
                assert_eq!(resp.status(), StatusCode::OK);
                read_all(resp).await;
                done.lock().unwrap().push(name);
            }));
            let engine = stats.clone();
            eventually("the request is in", || {
                engine.running.load(Relaxed) == 1 && engine.waiting.load(Relaxed) == waiting
            })
            .await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = done.lock().unwrap().clone();
        let want = match policy {
            args::SchedulingPolicy::Priority => ["long", "p0", "a", "b"],
            args::SchedulingPolicy::Fcfs => ["long", "a", "b", "p0"],
        };
        assert_eq!(order, want, "{policy:?}");
    }
}

/// `--first-token-at-once`: the first token leaves on arrival, before the scheduler's first
/// step (an hour long here), and the step that would have made it makes the second.
#[tokio::test]
async fn the_first_token_can_leave_before_the_first_step() {
    let sim = start(SimArgs {
        decode_step_ms: 3_600_000.0,
        first_token_at_once: true,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 3,
        "stream": true});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let mut body = r.into_body();
    let seen = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        read_events(&mut body, 1),
    )
    .await
    .expect("the first token waits for no step");
    assert_eq!(seen.matches("\"content\":").count(), 1, "{seen}");
    assert_eq!(
        sim.stats().running.load(Relaxed),
        1,
        "the rest waits for steps"
    );
    drop(body);
    sim.shutdown().await;

    // With short steps the answer is whole: every token once, then the end.
    let sim = start(SimArgs {
        first_token_at_once: true,
        ..timed()
    })
    .await
    .unwrap();
    let req = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 5,
        "stream": true});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let text = read_all(r).await;
    let events = super::sse_events(&text);
    let tokens = events
        .iter()
        .filter(|e| e.contains("\"content\":\""))
        .count();
    // The role chunk carries `"content":""`; five tokens follow it.
    assert_eq!(tokens, 6, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(sim.stats().completed.load(Relaxed), 1);
    sim.shutdown().await;
}
