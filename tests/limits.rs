//! Rate limits, token budgets, concurrency caps and the admission queue, end to end: a real
//! gateway in front of real sims, each limit exceeded and its 429/503 read as a client reads
//! it; two gateways sharing one limit through the real Redis.

#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use fleetgate_gateway::config::{EnvLimits, SharedLimits};
use fleetgate_gateway::key::Environment;
use http_body_util::BodyExt;

fn chat(max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "qwen32b",
            "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
        .to_string(),
    )
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn header<'a>(m: &'a fleetgate_protocol::client::Measured, name: &str) -> &'a str {
    m.headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header: {:?}", m.headers))
        .to_str()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_minute_refuses_with_openai_headers() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, Environment::Prod, |k| k.requests_per_minute = Some(2)).await;
    let auth = bearer(&key);
    let url = gw.url("/v1/chat/completions");
    let first = post(&url, &[("authorization", &auth)], chat(4, false)).await;
    assert_eq!(first.status, 200);
    assert_eq!(header(&first, "x-ratelimit-limit-requests"), "2");
    assert_eq!(header(&first, "x-ratelimit-remaining-requests"), "1");
    let second = post(&url, &[("authorization", &auth)], chat(4, true)).await;
    assert_eq!(second.status, 200);
    assert_eq!(header(&second, "x-ratelimit-remaining-requests"), "0");
    let third = post(&url, &[("authorization", &auth)], chat(4, true)).await;
    assert_eq!(third.status, 429);
    let err = openai_error(&third);
    assert_eq!(err["type"], "rate_limit_error");
    assert_eq!(err["code"], "requests_per_minute_exceeded");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("requests per minute") && msg.contains("limit 2"),
        "{msg}"
    );
    // 2 per minute: the next request is possible 30 s after the last one.
    let retry: u64 = header(&third, "retry-after").parse().unwrap();
    assert!((29..=30).contains(&retry), "retry-after {retry}");
    assert_eq!(header(&third, "x-ratelimit-remaining-requests"), "0");
    assert!(!third.headers["x-request-id"].is_empty());
    // The refused request never reached a backend, and is recorded as refused.
    let seen = gw
        .record_of(third.headers["x-request-id"].to_str().unwrap())
        .await;
    assert_eq!(seen.error, Some("rate_limited"));
    assert_eq!(seen.backend, None);
    let metrics = metrics_text(&gw);
    assert!(
        metrics.contains("fleetgate_rejections_total{limit=\"key_requests\"} 1"),
        "{metrics}"
    );
    // Another key is not affected.
    let other = post(&url, &[], chat(4, false)).await;
    assert_eq!(other.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budget_settles_against_the_backends_usage() {
    let sim = sim(|a| a.max_model_len = 2048).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, Environment::Gray, |k| k.tokens_per_minute = Some(3000)).await;
    let auth = bearer(&key);
    let url = gw.url("/v1/chat/completions");

    // More than the whole budget: refused at once, and it says what to change.
    let big = post(&url, &[("authorization", &auth)], chat(5000, true)).await;
    assert_eq!(big.status, 429);
    let err = openai_error(&big);
    assert_eq!(err["code"], "request_exceeds_token_budget");
    assert_eq!(err["param"], "max_tokens");
    assert!(big.headers.get("retry-after").is_none());
    // Like every refusal, it says where the budget stands (docs/errors.md).
    assert_eq!(big.headers["x-ratelimit-limit-tokens"], "3000");
    assert_eq!(big.headers["x-ratelimit-remaining-tokens"], "3000");
    assert!(big.headers.contains_key("x-ratelimit-reset-tokens"));

    // A request the backend refuses (max_tokens beyond its context) reserves 2500 + prompt
    // and gives it all back: the same request passes the budget again right after.
    for _ in 0..2 {
        let refused = post(&url, &[("authorization", &auth)], chat(2500, false)).await;
        assert_eq!(refused.status, 400, "the backend's own 400, not a 429");
    }

    // A stream that did not ask for usage is settled with the usage the gateway asked the
    // backend for: 400 completion tokens + the prompt are charged, not zero.
    let s = post(&url, &[("authorization", &auth)], chat(400, true)).await;
    assert_eq!(s.status, 200);
    assert!(
        s.metrics.usage.is_none(),
        "usage stays hidden from the client"
    );
    let next = post(&url, &[("authorization", &auth)], chat(400, false)).await;
    assert_eq!(next.status, 200);
    let remaining: u64 = header(&next, "x-ratelimit-remaining-tokens")
        .parse()
        .unwrap();
    // 3000 − (≈410 used by the stream) − (≈403 reserved now) + a little refill.
    assert!(
        (2000..2400).contains(&remaining),
        "remaining tokens {remaining}: the stream was not charged its real usage"
    );
    assert_eq!(header(&next, "x-ratelimit-limit-tokens"), "3000");
    // Now over budget: 429 naming tokens, with a wait.
    let over = post(&url, &[("authorization", &auth)], chat(2400, false)).await;
    assert_eq!(over.status, 429);
    assert_eq!(openai_error(&over)["code"], "tokens_per_minute_exceeded");
    assert!(header(&over, "retry-after").parse::<u64>().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_per_key() {
    let sim = sim(|a| a.decode_step_ms = 20.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, Environment::Prod, |k| {
        k.max_concurrent_streams = Some(1)
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let running = open(&url, &key, chat(20, true)).await;
    assert_eq!(running.status(), 200);
    let second = post(&url, &[("authorization", &bearer(&key))], chat(2, true)).await;
    assert_eq!(second.status, 429);
    let err = openai_error(&second);
    assert_eq!(err["code"], "concurrency_limit_exceeded");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("limit 1 in flight")
    );
    // When the first ends, the slot is free again.
    let body = running.into_body().collect().await.unwrap().to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let third = post(&url, &[("authorization", &bearer(&key))], chat(2, true)).await;
    assert_eq!(third.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_aggregate_rate_covers_all_its_keys() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.limits.environments[Environment::Stress.index()] = EnvLimits {
            aggregate_requests_per_second: Some(1),
            aggregate_burst: Some(2),
            ..EnvLimits::default()
        };
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let (a, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let (b, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let (p, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    assert_eq!(
        post(&url, &[("authorization", &bearer(&a))], chat(2, false))
            .await
            .status,
        200
    );
    assert_eq!(
        post(&url, &[("authorization", &bearer(&b))], chat(2, false))
            .await
            .status,
        200
    );
    let third = post(&url, &[("authorization", &bearer(&a))], chat(2, false)).await;
    assert_eq!(third.status, 429);
    let err = openai_error(&third);
    assert_eq!(err["code"], "environment_rate_limit_exceeded");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("all stress keys together")
    );
    // prod is outside stress's cap.
    assert_eq!(
        post(&url, &[("authorization", &bearer(&p))], chat(2, false))
            .await
            .status,
        200
    );
}

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

fn shared_limits(
    c: &mut fleetgate_gateway::config::Config,
    url: &str,
    prefix: &str,
    replicas: u32,
) {
    c.limits.shared = SharedLimits::Redis;
    c.limits.redis = Some(fleetgate_gateway::config::RedisConfig {
        url: fleetgate_gateway::secret::Secret::new(url),
        timeout: Duration::from_millis(200),
        replicas,
        key_prefix: prefix.to_owned(),
    });
}

fn unique_prefix(tag: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    let n = RandomState::new().hash_one(std::time::SystemTime::now());
    format!("fgtest-{tag}-{}-{n:x}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sharing_redis_enforce_one_limit() {
    let Some(redis) = redis_url("two_replicas_sharing_redis_enforce_one_limit").await else {
        return;
    };
    let sim = sim(|_| {}).await;
    let prefix = unique_prefix("shared");
    let a = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        shared_limits(c, &redis, &prefix, 2)
    })
    .await;
    // Both replicas on one key store (as with one shared PostgreSQL).
    let store = a.db_dir.0.join("keys.db");
    let b = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        shared_limits(c, &redis, &prefix, 2);
        c.database.sqlite_path = store;
    })
    .await;
    let (key, record) = issue_key(&a, Environment::Prod, |k| {
        k.requests_per_minute = Some(4);
        k.tokens_per_minute = Some(100_000);
    })
    .await;
    b.server.auth.apply(&record.public_id, Some(record.clone()));
    let auth = bearer(&key);
    let mut statuses = Vec::new();
    let mut remaining = Vec::new();
    for i in 0..6 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("authorization", &auth)],
            chat(2, false),
        )
        .await;
        statuses.push(m.status);
        if m.status == 200 {
            remaining.push(header(&m, "x-ratelimit-remaining-requests").to_owned());
        } else {
            assert_eq!(openai_error(&m)["code"], "requests_per_minute_exceeded");
        }
    }
    // One limit of 4 across both replicas (alone, each would have allowed 4).
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    assert_eq!(remaining, ["3", "2", "1", "0"]);
    let metrics = metrics_text(&a);
    assert!(metrics.contains("fleetgate_limits_redis_up 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_falls_back_to_limit_over_replicas_and_says_so() {
    let sim = sim(|_| {}).await;
    let dead = closed_port().await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        shared_limits(c, &format!("redis://{dead}"), "fgtest-dead", 2)
    })
    .await;
    let (key, _) = issue_key(&gw, Environment::Prod, |k| k.requests_per_minute = Some(4)).await;
    let url = gw.url("/v1/chat/completions");
    let auth = bearer(&key);
    // 4 per minute over 2 replicas: this replica allows 2 on its own.
    assert_eq!(
        post(&url, &[("authorization", &auth)], chat(2, false))
            .await
            .status,
        200
    );
    let m = post(&url, &[("authorization", &auth)], chat(2, false)).await;
    assert_eq!(m.status, 200);
    assert_eq!(header(&m, "x-ratelimit-limit-requests"), "2");
    assert_eq!(
        post(&url, &[("authorization", &auth)], chat(2, false))
            .await
            .status,
        429
    );
    let metrics = metrics_text(&gw);
    assert!(metrics.contains("fleetgate_limits_redis_up 0"), "{metrics}");
    assert!(
        metrics.contains("fleetgate_limits_fallback_total 1"),
        "{metrics}"
    );
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

/// A gateway whose shared limits reach Redis through a proxy the test can cut and restore
/// (`Cuttable::start(port, upstream)` again on the same port), in front of a sim.
struct BehindCut {
    upstream: std::net::SocketAddr,
    proxy: Cuttable,
    sim: fleetgate_sim::SimServer,
    gw: Gateway,
}

async fn behind_cuttable_redis(test: &str, tag: &str, replicas: u32) -> Option<BehindCut> {
    let redis = redis_url(test).await?;
    let upstream: std::net::SocketAddr = redis
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|_| "127.0.0.1:6379".parse().unwrap());
    let proxy = Cuttable::start(0, upstream).await;
    let port = proxy.port;
    let sim = sim(|_| {}).await;
    let prefix = unique_prefix(tag);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        shared_limits(c, &format!("redis://127.0.0.1:{port}"), &prefix, replicas)
    })
    .await;
    Some(BehindCut {
        upstream,
        proxy,
        sim,
        gw,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_redis_mid_run_falls_back_and_recovers() {
    let Some(BehindCut {
        upstream,
        proxy,
        sim: _sim,
        gw,
    }) = behind_cuttable_redis("losing_redis_mid_run_falls_back_and_recovers", "recover", 2).await
    else {
        return;
    };
    let (key, _) = issue_key(&gw, Environment::Prod, |k| {
        k.requests_per_minute = Some(100)
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let auth = bearer(&key);
    let metric = |name: &str| {
        let text = metrics_text(&gw);
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let m = post(&url, &[("authorization", &auth)], chat(2, false)).await;
    assert_eq!(
        header(&m, "x-ratelimit-limit-requests"),
        "100",
        "shared: the whole limit"
    );
    assert_eq!(metric("fleetgate_limits_redis_up"), Some(1.0));

    // Redis goes away: the next request falls back to limit/replicas, and it shows.
    let port = proxy.cut();
    let m = post(&url, &[("authorization", &auth)], chat(2, false)).await;
    assert_eq!(m.status, 200, "requests go on while Redis is away");
    assert_eq!(header(&m, "x-ratelimit-limit-requests"), "50");
    assert_eq!(metric("fleetgate_limits_redis_up"), Some(0.0));
    assert_eq!(metric("fleetgate_limits_fallback_total"), Some(1.0));

    // It comes back: within a few probes the limits are shared again.
    let _proxy = Cuttable::start(port, upstream).await;
    assert!(
        eventually(Duration::from_secs(10), || metric(
            "fleetgate_limits_redis_up"
        ) == Some(1.0))
        .await,
        "Redis was not found again"
    );
    let m = post(&url, &[("authorization", &auth)], chat(2, false)).await;
    assert_eq!(header(&m, "x-ratelimit-limit-requests"), "100");
}

#[tokio::test]
async fn settlements_queued_at_shutdown_still_reach_redis() {
    let Some(redis) = redis_url("settlements_queued_at_shutdown_still_reach_redis").await else {
        return;
    };
    let prefix = unique_prefix("settle");
    let cfg = fleetgate_gateway::config::RedisConfig {
        url: fleetgate_gateway::secret::Secret::new(redis.clone()),
        timeout: Duration::from_millis(200),
        replicas: 1,
        key_prefix: prefix.clone(),
    };
    let tasks = tokio_util::task::TaskTracker::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let settle_stop = tokio_util::sync::CancellationToken::new();
    let shared = fleetgate_gateway::limits::shared::Shared::start(
        &cfg,
        None,
        &tasks,
        stop.clone(),
        settle_stop.clone(),
    )
    .await
    .unwrap();
    assert!(shared.is_up());
    // On this single-threaded runtime the settle task has not run yet when shutdown starts:
    // the settlement is still queued, and shutdown must wait for it to be sent.
    shared.settle(7, 1000, -300);
    stop.cancel();
    settle_stop.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the limit tasks end at shutdown");
    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let level: Option<String> = redis::cmd("HGET")
        .arg(format!("{{{prefix}}}:k:7:t"))
        .arg("l")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(level.as_deref(), Some("700.000"), "the settlement was sent");
}

/// Tokenization through shared limits: one request in the shared rate, nothing in the shared
/// token bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_in_the_shared_rate_but_not_in_the_shared_tokens() {
    let Some(redis) =
        redis_url("tokenize_counts_in_the_shared_rate_but_not_in_the_shared_tokens").await
    else {
        return;
    };
    let sim = sim(|_| {}).await;
    let prefix = unique_prefix("tokenize");
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        shared_limits(c, &redis, &prefix, 1)
    })
    .await;
    let (key, _) = issue_key(&gw, Environment::Prod, |k| {
        k.requests_per_minute = Some(3);
        k.tokens_per_minute = Some(50);
    })
    .await;
    let auth = bearer(&key);
    let tokenize = || {
        Bytes::from(
            serde_json::json!({"model": "qwen32b", "prompt": "word ".repeat(400)}).to_string(),
        )
    };
    let url = gw.url("/tokenize");
    // 500 tokens of prompt against a budget of 50 a minute: not a token budget matter.
    let m = post(&url, &[("authorization", &auth)], tokenize()).await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(header(&m, "x-ratelimit-remaining-requests"), "2");
    assert!(m.headers.get("x-ratelimit-remaining-tokens").is_none());
    // The whole budget is still there for a chat.
    let c = post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &auth)],
        chat(40, false),
    )
    .await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    assert_eq!(header(&c, "x-ratelimit-remaining-requests"), "1");
    let m = post(&url, &[("authorization", &auth)], tokenize()).await;
    assert_eq!(m.status, 200);
    let m = post(&url, &[("authorization", &auth)], tokenize()).await;
    assert_eq!(m.status, 429);
    assert_eq!(openai_error(&m)["code"], "requests_per_minute_exceeded");
}

/// A failover between Redis and the local limits hands no key a fresh burst, in either
/// direction: the local limits start from what Redis counted for the key, and Redis, once back,
/// counts what the local limits admitted while it was away. Each key gets about its limit
/// across the failover: its burst plus what its rate refills while the test runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_failover_hands_no_key_a_fresh_burst() {
    let Some(BehindCut {
        upstream,
        proxy,
        sim: _sim,
        gw,
    }) = behind_cuttable_redis("a_redis_failover_hands_no_key_a_fresh_burst", "failover", 1).await
    else {
        return;
    };
    let started = std::time::Instant::now();
    // Requests: 4 a minute (a burst of 4, then one per 15 s). Tokens: 100 a minute, each
    // request reserving about 45 (two at once, then one per ~27 s).
    let rate_key = || {
        issue_key(&gw, Environment::Prod, |k| {
            k.requests_per_minute = Some(4);
        })
    };
    let token_key = || {
        issue_key(&gw, Environment::Prod, |k| {
            k.tokens_per_minute = Some(100);
        })
    };
    let (rate_before, _) = rate_key().await;
    let (rate_during, _) = rate_key().await;
    let (tokens_before, _) = token_key().await;
    let (tokens_during, _) = token_key().await;
    let url = gw.url("/v1/chat/completions");
    let admitted = |key: String, max_tokens: u32, n: usize| {
        let url = url.clone();
        async move {
            let mut ok = 0;
            for _ in 0..n {
                let m = post(
                    &url,
                    &[("authorization", &bearer(&key))],
                    chat(max_tokens, false),
                )
                .await;
                match m.status {
                    200 => ok += 1,
                    429 => {}
                    s => panic!("status {s}: {:?}", m.body),
                }
            }
            ok
        }
    };
    let metric = |name: &str| {
        metrics_text(&gw)
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };

    // Through Redis: the bursts.
    let mut rate_before_n = admitted(rate_before.clone(), 2, 6).await;
    let mut tokens_before_n = admitted(tokens_before.clone(), 40, 4).await;
    assert_eq!((rate_before_n, tokens_before_n), (4, 2));

    // Redis goes away. The local limits know what those keys used; the other keys, untouched
    // so far, get their local share (replicas = 1: the whole limit).
    let port = proxy.cut();
    rate_before_n += admitted(rate_before.clone(), 2, 4).await;
    tokens_before_n += admitted(tokens_before.clone(), 40, 3).await;
    assert_eq!(metric("fleetgate_limits_redis_up"), Some(0.0));
    let mut rate_during_n = admitted(rate_during.clone(), 2, 6).await;
    let mut tokens_during_n = admitted(tokens_during.clone(), 40, 4).await;
    assert_eq!((rate_during_n, tokens_during_n), (4, 2));

    // Redis comes back: it counts what the local limits admitted.
    let _proxy = Cuttable::start(port, upstream).await;
    assert!(
        eventually(Duration::from_secs(10), || metric(
            "fleetgate_limits_redis_up"
        ) == Some(1.0))
        .await,
        "Redis was not found again"
    );
    rate_during_n += admitted(rate_during.clone(), 2, 4).await;
    tokens_during_n += admitted(tokens_during.clone(), 40, 3).await;
    rate_before_n += admitted(rate_before.clone(), 2, 2).await;

    // What the rates refill while the test runs (generously rounded up) is all a key may
    // have beyond its burst.
    let secs = started.elapsed().as_secs();
    let rate_refill = 1 + secs / 15;
    let token_refill = 1 + secs / 27;
    assert!(
        rate_before_n <= 4 + rate_refill,
        "requests admitted across the fallback: {rate_before_n} in {secs} s (limit 4/min)"
    );
    assert!(
        rate_during_n <= 4 + rate_refill,
        "requests admitted across the recovery: {rate_during_n} in {secs} s (limit 4/min)"
    );
    assert!(
        tokens_before_n <= 2 + token_refill,
        "requests of ~45 tokens admitted across the fallback: {tokens_before_n} in {secs} s (limit 100 tokens/min)"
    );
    assert!(
        tokens_during_n <= 2 + token_refill,
        "requests of ~45 tokens admitted across the recovery: {tokens_during_n} in {secs} s (limit 100 tokens/min)"
    );
}
