//! One gateway's limits: requests per minute with OpenAI's headers, token budgets settled
//! against the backend's usage, concurrent requests per key, and an environment's aggregate
//! rate.

use super::*;

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
