//! Limits shared through the real Redis: one limit across replicas, the fallback when Redis is
//! unreachable or lost mid-run, settlements at shutdown, tokenize in the shared rate only, and
//! a failover handing no key a fresh burst.

use super::*;

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
    // A few more, paced: each worker that served one has opened its own connection to Redis
    // in the background by now (the cut below breaks it, and it must not outlive the outage).
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let m = post(&url, &[("authorization", &auth)], chat(2, false)).await;
        assert_eq!(header(&m, "x-ratelimit-limit-requests"), "100");
    }

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
