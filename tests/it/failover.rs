//! Backends that fail: a refused connection retried on another backend (waiting for a slot
//! when the others are full), passive ejection, a backend killed under load failing no
//! unstarted request, and draining through the admin API.

use std::time::Duration;

use crate::balancing::{backend, chat, per_backend};
use crate::common::*;
use fleetgate_gateway::admin::jwt::Role;
use fleetgate_gateway::config::{BackendConfig, PoolConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_another_backend() {
    let sim = sim(|_| {}).await;
    let dead = closed_port().await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    // The dead backend is drawn first half of the time; it must never cost a request.
    p.backends = vec![backend(format!("http://{dead}"), 1), backend(sim.url(), 1)];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for i in 0..20 {
        let m = post(
            &url,
            &[("x-request-id", &format!("r-{i}"))],
            chat("qwen32b", 2, true),
        )
        .await;
        assert_eq!(m.status, 200, "request {i}");
    }
    let records = gw.records.lock().unwrap().clone();
    assert!(
        records.iter().all(|r| r.error.is_none()),
        "{:?}",
        records.iter().map(|r| r.error).collect::<Vec<_>>()
    );
    assert!(
        records.iter().map(|r| u32::from(r.retries)).sum::<u32>() >= 1 || {
            // The probe may have marked the dead backend down before the first request.
            gw.server.pools().get("qwen32b").unwrap().backends[0]
                .state()
                .as_str()
                == "down"
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_refused_connection_waits_for_a_slot_when_the_others_are_full() {
    let live = sim(|_| {}).await;
    let doomed = sim(|_| {}).await;
    let one_slot = |url: String| BackendConfig {
        capacity: Some(1),
        ..backend(url, 1)
    };
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![one_slot(doomed.url()), one_slot(live.url())];
    // Probed once at start (both up), then not again during the test: the gateway learns
    // that `doomed` died only from the refused connection.
    let gw = gateway_with(vec![p], |c| {
        c.server.health_interval = Duration::from_secs(3600);
    })
    .await;
    assert!(all_backends_healthy(&gw, "qwen32b").await);
    doomed.shutdown().await;
    let url = gw.url("/v1/chat/completions");
    // The live backend's one slot is taken for 0.3 s...
    let pools = gw.server.pools();
    let pool = pools.get("qwen32b").unwrap();
    let held = pool
        .balancer
        .try_acquire_excluding(fleetgate_gateway::pool::bit(0))
        .expect("the live backend's slot");
    assert_eq!(held.backend().base.as_ref(), live.url().as_str());
    let busy = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
    });
    // ...so this request goes to the only free slot, on the dead backend: refused, it waits
    // for the live one instead of failing.
    let m = post(
        &url,
        &[("x-request-id", "after-refusal")],
        chat("qwen32b", 2, true),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    busy.await.unwrap();
    let records = gw.records.lock().unwrap().clone();
    let r = records
        .iter()
        .find(|r| r.request_id == "after-refusal")
        .unwrap();
    assert_eq!(r.retries, 1);
    assert_eq!(r.backend.as_deref(), Some(live.url().as_str()));
    assert!(
        r.timeline.queue_wait() > Duration::ZERO,
        "the wait for the slot is queue wait"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_backend_is_ejected() {
    let good = sim(|_| {}).await;
    let bad = sim(|a| a.fail_rate = 1.0).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(good.url(), 1), backend(bad.url(), 1)];
    p.ejection.consecutive_failures = 2;
    p.ejection.base = Duration::from_secs(30);
    p.ejection.max = Duration::from_secs(60);
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    // The balancer picks the bad backend now and then (when is up to its choice): requests go
    // until it has failed twice, which ejects it; after that, none reaches it.
    let mut statuses = Vec::new();
    while statuses.iter().filter(|s| **s == 500).count() < 2 && statuses.len() < 200 {
        statuses.push(post(&url, &[], chat("qwen32b", 2, false)).await.status);
    }
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 500),
        "{statuses:?}"
    );
    let ejected_at = statuses.len();
    for _ in 0..30 {
        statuses.push(post(&url, &[], chat("qwen32b", 2, false)).await.status);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 500).count(),
        2,
        "only the two failures that eject it: {statuses:?}"
    );
    assert!(
        statuses[ejected_at..].iter().all(|s| *s == 200),
        "{statuses:?}"
    );
    let bad_state = gw
        .server
        .pools()
        .find_backend("qwen32b", &bad.url())
        .unwrap()
        .state();
    assert_eq!(bad_state.as_str(), "ejected");
}

/// Every backend ejected and nothing in flight: a request that queues goes on when the
/// ejection ends (1 s here), instead of waiting out its queue deadline (20 s) for a slot that
/// no finishing request will ever free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_behind_an_ejection_goes_on_when_it_ends() {
    let bad = sim(|a| a.fail_rate = 1.0).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(bad.url(), 1)];
    p.ejection.consecutive_failures = 1;
    p.ejection.base = Duration::from_secs(1);
    p.ejection.max = Duration::from_secs(1);
    let gw = gateway_with(vec![p], |c| {
        c.queue.max_wait = [Duration::from_secs(20); 3];
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    let first = post(&url, &[], chat("qwen32b", 2, false)).await;
    assert_eq!(first.status, 500, "the backend's own failure ejects it");
    let state = || {
        gw.server
            .pools()
            .find_backend("qwen32b", &bad.url())
            .unwrap()
            .state()
            .as_str()
    };
    assert_eq!(state(), "ejected");
    let started = std::time::Instant::now();
    let second = post(&url, &[], chat("qwen32b", 2, false)).await;
    let took = started.elapsed();
    // It reached the backend again (which fails again): not a 503 queue timeout.
    assert_eq!(second.status, 500, "{:?}", second.body);
    assert!(
        took < Duration::from_secs(10),
        "waited {took:?}: the queue was not woken when the ejection ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_backends_under_load_fails_no_unstarted_request() {
    let sims = [
        sim(|a| a.decode_step_ms = 5.0).await,
        sim(|a| a.decode_step_ms = 5.0).await,
        sim(|a| a.decode_step_ms = 5.0).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let gw = gateway(vec![pool("qwen32b", &urls)]).await;
    let url = gw.url("/v1/chat/completions");
    let [a, victim, c] = sims;
    let mut load = Vec::new();
    for w in 0..12 {
        let url = url.clone();
        load.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in 0..25 {
                let m = post(
                    &url,
                    &[("x-request-id", &format!("k-{w}-{i}"))],
                    chat("qwen32b", 8, true),
                )
                .await;
                out.push((m.status, m.metrics.error || m.body_error.is_some()));
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim.shutdown().await;
    let mut results = Vec::new();
    for l in load {
        results.extend(l.await.unwrap());
    }
    // A request that had not started streaming never fails: every status is 200. Only
    // streams cut mid-way on the killed backend may end with an error event.
    assert!(
        results.iter().all(|(s, _)| *s == 200),
        "{:?}",
        results
            .iter()
            .filter(|(s, _)| *s != 200)
            .collect::<Vec<_>>()
    );
    let cut = results.iter().filter(|(_, e)| *e).count();
    assert!(
        cut <= 12,
        "at most the streams open on the killed backend: {cut}"
    );
    drop((a, c));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_backend_through_the_admin_api() {
    let one = sim(|a| a.zero_delay = true).await;
    let two = sim(|a| a.zero_delay = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[one.url(), two.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let admin_token = token(Role::Admin);
    let body = serde_json::json!({"model": "qwen32b", "backend": one.url()});
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&admin_token),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["state"], "draining");
    let url = gw.url("/v1/chat/completions");
    for _ in 0..20 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    assert_eq!(
        counts.get(one.url().trim_end_matches('/')),
        None,
        "{counts:?}"
    );
    assert_eq!(admin_backends(&gw, "state").await[0], "draining");
    // A viewer may look but not drain; an unknown backend is named.
    let (s, _) = admin(
        &gw,
        "POST",
        "/admin/backends/undrain",
        Some(&token(Role::Viewer)),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 403);
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&admin_token),
        Some(serde_json::json!({"model": "qwen32b", "backend": "http://10.9.9.9:1"})),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["code"], "backend_not_found");
    let (s, _) = admin(
        &gw,
        "POST",
        "/admin/backends/undrain",
        Some(&admin_token),
        Some(body),
    )
    .await;
    assert_eq!(s, 200);
    for _ in 0..40 {
        post(&url, &[], chat("qwen32b", 2, false)).await;
    }
    assert!(per_backend(&gw).contains_key(one.url().trim_end_matches('/')));
}
