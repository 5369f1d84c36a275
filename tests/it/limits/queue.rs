//! The admission queue: prod before stress, its deadline, a full queue and a disconnect, one
//! key unable to fill it, and a waiting stream's `queued` comments and timeout.

use super::*;

/// One backend with room for one request: the admission queue decides the rest.
async fn one_slot_gateway(
    sim: &fleetgate_sim::SimServer,
    f: impl FnOnce(&mut fleetgate_gateway::config::Config),
) -> Gateway {
    let mut p = pool("qwen32b", &[sim.url()]);
    p.max_in_flight_per_backend = 1;
    gateway_with(vec![p], f).await
}

fn waiting(gw: &Gateway) -> usize {
    gw.server
        .pools()
        .get("qwen32b")
        .unwrap()
        .balancer
        .queue
        .waiting()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_serves_prod_before_stress() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = one_slot_gateway(&sim, |_| {}).await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let (stress, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let holder = open(&url, &prod, chat(30, true)).await;

    let u = url.clone();
    let s = stress.clone();
    let stress_req = tokio::spawn(async move {
        post(
            &u,
            &[("authorization", &bearer(&s)), ("x-request-id", "q-stress")],
            chat(2, false),
        )
        .await
    });
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 1).await);
    let u = url.clone();
    let p = prod.clone();
    let prod_req = tokio::spawn(async move {
        post(
            &u,
            &[("authorization", &bearer(&p)), ("x-request-id", "q-prod")],
            chat(2, false),
        )
        .await
    });
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 2).await);
    let metrics = metrics_text(&gw);
    assert!(
        metrics.contains("fleetgate_queue_depth{model=\"qwen32b\"} 2"),
        "{metrics}"
    );

    // The running request ends: its slot goes to prod, which came second.
    drop(holder.into_body().collect().await.unwrap());
    assert_eq!(prod_req.await.unwrap().status, 200);
    assert_eq!(stress_req.await.unwrap().status, 200);
    let p = gw.record_of("q-prod").await;
    let s = gw.record_of("q-stress").await;
    assert!(
        p.timeline.admitted().unwrap() < s.timeline.admitted().unwrap(),
        "prod was admitted after stress"
    );
    // Both waited, and the wait is the Timeline's queue wait, not gateway overhead.
    assert!(s.timeline.queue_wait() > p.timeline.queue_wait());
    assert!(s.timeline.overhead_pre().unwrap() < s.timeline.queue_wait());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_deadline_full_queue_and_disconnect() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = one_slot_gateway(&sim, |c| {
        c.queue.max_size = 2;
        c.queue.max_wait[Environment::Stress.index()] = Duration::from_millis(300);
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let holder = open(&url, &prod, chat(200, true)).await;

    // stress waits at most 300 ms, then gets a 503 saying so.
    let timed_out = post(&url, &[], chat(2, false)).await;
    assert_eq!(timed_out.status, 503);
    let err = openai_error(&timed_out);
    assert_eq!(err["code"], "queue_timeout");
    assert_eq!(err["type"], "server_error");
    assert!(err["message"].as_str().unwrap().contains("0.3 s"), "{err}");
    assert!(timed_out.headers.contains_key("retry-after"));
    assert_eq!(waiting(&gw), 0);

    // Two prod requests fill the queue; a third is refused at once.
    let mut queued = Vec::new();
    for _ in 0..2 {
        let u = url.clone();
        let p = prod.clone();
        queued.push(tokio::spawn(
            async move { open(&u, &p, chat(2, false)).await },
        ));
    }
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 2).await);
    let full = post(&url, &[("authorization", &bearer(&prod))], chat(2, false)).await;
    assert_eq!(full.status, 503);
    assert_eq!(openai_error(&full)["code"], "queue_full");

    // Clients that hang up while waiting leave the queue at once.
    for q in &queued {
        q.abort();
    }
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 0).await);
    drop(holder);
    // With the holder gone the slot is free again: a request goes straight through.
    let ok = post(&url, &[("authorization", &bearer(&prod))], chat(2, false)).await;
    assert_eq!(ok.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_fill_the_queue() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = one_slot_gateway(&sim, |c| c.queue.max_per_key = 1).await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let holder = open(&url, &prod, chat(200, true)).await;
    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, &[], chat(2, false)).await });
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 1).await);
    let second = post(&url, &[], chat(2, false)).await;
    assert_eq!(second.status, 429);
    assert_eq!(openai_error(&second)["code"], "queue_share_exceeded");
    // Another key still gets a place.
    let u = url.clone();
    let other = tokio::spawn(async move {
        post(&u, &[("authorization", &bearer(&prod))], chat(2, false)).await
    });
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 2).await);
    drop(holder);
    assert_eq!(other.await.unwrap().status, 200);
    assert_eq!(first.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stream_gets_queued_comments_then_its_tokens() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = one_slot_gateway(&sim, |c| {
        c.queue.keepalive_interval = Some(Duration::from_millis(40));
        c.queue.max_wait[Environment::Stress.index()] = Duration::from_secs(20);
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let holder = open(&url, &prod, chat(30, true)).await;

    // The waiting stream's head comes at once, then `: queued` lines while it waits.
    let waiting_stream = open(&url, &gw.key, chat(5, true)).await;
    assert_eq!(waiting_stream.status(), 200);
    assert_eq!(
        waiting_stream.headers()["content-type"],
        "text/event-stream"
    );
    let mut body = waiting_stream.into_body();
    let mut got = Vec::new();
    while got.windows(9).filter(|w| w == b": queued\n").count() < 3 {
        let frame = body.frame().await.unwrap().unwrap();
        got.extend_from_slice(frame.data_ref().unwrap());
    }
    assert_eq!(waiting(&gw), 1);
    // A non-streaming request waits without comments.
    let u = url.clone();
    let plain = tokio::spawn(async move { post(&u, &[], chat(2, false)).await });
    assert!(eventually(Duration::from_secs(10), || waiting(&gw) == 2).await);

    drop(holder);
    while let Some(frame) = body.frame().await {
        got.extend_from_slice(frame.unwrap().data_ref().map_or(&[][..], |d| d));
    }
    assert!(
        got.ends_with(b"data: [DONE]\n\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let mut metrics = fleetgate_protocol::stream::StreamMetrics::default();
    let mut scanner = fleetgate_protocol::sse::SseScanner::new();
    scanner.feed(&got, |l| metrics.on_data(l.kind, l.usage, Duration::ZERO));
    assert_eq!(
        metrics.content_events, 5,
        "5 tokens after the comments (the role chunk is not a token)"
    );
    let plain = plain.await.unwrap();
    assert_eq!(plain.status, 200);
    assert!(!plain.body.unwrap().starts_with(b":"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stream_that_times_out_ends_with_an_error_event() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let gw = one_slot_gateway(&sim, |c| {
        c.queue.keepalive_interval = Some(Duration::from_millis(30));
        c.queue.max_wait[Environment::Stress.index()] = Duration::from_millis(200);
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let _holder = open(&url, &prod, chat(200, true)).await;
    let m = post(&url, &[("x-request-id", "q-timeout")], chat(5, true)).await;
    assert_eq!(m.status, 200);
    let body = m.body.unwrap();
    assert!(body.starts_with(b": queued\n\n"));
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    assert!(m.metrics.error, "the stream ends with an error event");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("\"code\":\"queue_timeout\""), "{text}");
    let seen = gw.record_of("q-timeout").await;
    assert_eq!(seen.error, Some("queue_timeout"));
    assert_eq!(waiting(&gw), 0);
}
