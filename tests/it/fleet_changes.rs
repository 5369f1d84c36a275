//! The fleet changing under traffic: a reload adds and removes backends while streams
//! continue and changes weights in place; DNS discovery makes each address a backend, and
//! changing answers move traffic while streams finish.

use std::time::Duration;

use crate::balancing::{backend, chat, per_backend};
use crate::common::*;
use fleetgate_gateway::config::{BackendConfig, PoolConfig};

fn base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_adds_and_removes_backends_while_streams_continue() {
    let old = sim(|a| a.decode_step_ms = 20.0).await;
    let new = sim(|a| a.zero_delay = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[old.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    // Three streams of 40 tokens (~0.8 s each) running on the old backend.
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                post(
                    &url,
                    &[("x-request-id", &format!("long-{i}"))],
                    chat("qwen32b", 40, true),
                )
                .await
            })
        })
        .collect();
    let stats = old.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 3)
        .await
    );

    // The old backend leaves, the new one joins.
    let next = fleetgate_gateway::config::Config::with_pools(vec![pool("qwen32b", &[new.url()])]);
    let summary = gw.server.reload(&next).unwrap();
    assert_eq!(
        summary.backends_added,
        [format!("qwen32b {}", base(&new.url()))]
    );
    assert_eq!(
        summary.backends_removed,
        [format!("qwen32b {}", base(&old.url()))]
    );
    assert_eq!(summary.generation, 2);

    // New requests go to the new backend at once.
    for _ in 0..10 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    // The streams that began before the reload finish whole on the old backend.
    for s in streams {
        let m = s.await.unwrap();
        assert_eq!(m.status, 200);
        assert!(m.metrics.done, "a stream was cut by the reload");
        assert_eq!(m.metrics.content_events, 40);
    }
    let counts = per_backend(&gw);
    assert_eq!(counts.get(&base(&old.url())), Some(&3), "{counts:?}");
    assert_eq!(counts.get(&base(&new.url())), Some(&10), "{counts:?}");
    for r in gw.records.lock().unwrap().iter() {
        assert!(r.error.is_none(), "{r:?}");
    }
    // The admin API lists the new membership; the metrics say a reload happened and drop the
    // removed backend's gauges.
    assert_eq!(admin_backends(&gw, "backend").await, [base(&new.url())]);
    let text = metrics_text(&gw);
    assert!(text.contains("fleetgate_config_generation 2"), "{text}");
    assert!(
        text.contains("fleetgate_config_reloads_total{result=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        !text.contains(&format!(
            "fleetgate_backend_info{{backend=\"{}\"",
            base(&old.url())
        )),
        "{text}"
    );
    // Upstream TTFT of requests recorded after the reload landed on their own backends.
    let ttft_new = format!(
        "fleetgate_ttft_seconds_count{{backend=\"{}\",endpoint=\"chat\",environment=\"stress\",model=\"qwen32b\",side=\"upstream\"}} 10",
        base(&new.url())
    );
    assert!(text.contains(&ttft_new), "{text}");
    let ttft_old = format!(
        "fleetgate_ttft_seconds_count{{backend=\"{}\",endpoint=\"chat\",environment=\"stress\",model=\"qwen32b\",side=\"upstream\"}} 3",
        base(&old.url())
    );
    assert!(text.contains(&ttft_old), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_weights_in_place() {
    let a = sim(|s| s.zero_delay = true).await;
    let b = sim(|s| s.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(a.url(), 1), backend(b.url(), 1)];
    let gw = gateway(vec![p.clone()]).await;
    // Promote b from an even split to 9 of 10: same backends, nothing added or removed.
    p.backends[1].weight = 9;
    p.backends[1].labels = vec!["promoted".into()];
    let summary = gw
        .server
        .reload(&fleetgate_gateway::config::Config::with_pools(vec![p]))
        .unwrap();
    assert!(summary.is_empty(), "{summary}");
    let url = gw.url("/v1/chat/completions");
    for _ in 0..200 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    let b_n = counts[&base(&b.url())];
    // Expected 180 of 200 (σ ≈ 4.2).
    assert!(
        (160..=195).contains(&b_n),
        "weight 9 of 10 got {b_n}: {counts:?}"
    );
    let pools = gw.server.pools();
    let kept = pools.find_backend("qwen32b", &b.url()).unwrap();
    assert_eq!(kept.weight(), 9);
    assert_eq!(*kept.labels(), ["promoted"]);
    let text = metrics_text(&gw);
    assert!(
        text.contains("labels=\"promoted\",model=\"qwen32b\",weight=\"9\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_makes_each_address_a_backend() {
    let s = sim(|a| a.zero_delay = true).await;
    let port = s.addr().port();
    let mut p = PoolConfig::new("qwen32b", vec![]);
    let mut entry = BackendConfig::new(format!("http://localhost:{port}").parse().unwrap());
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(200),
    };
    entry.labels = vec!["discovered".into()];
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for _ in 0..5 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    let pools = gw.server.pools();
    let found: Vec<String> = pools
        .get("qwen32b")
        .unwrap()
        .backends
        .iter()
        .map(|b| b.base.to_string())
        .collect();
    assert!(
        found.contains(&format!("http://127.0.0.1:{port}")),
        "localhost resolved to {found:?}"
    );
    assert!(
        pools.get("qwen32b").unwrap().backends[0]
            .labels()
            .contains(&"discovered".to_owned())
    );
    // The failure counter is exported from the first answer on, at 0.
    assert!(
        metrics_text(&gw).contains("fleetgate_dns_discovery_failures_total{model=\"qwen32b\"} 0"),
        "{}",
        metrics_text(&gw)
    );

    // A name that does not resolve leaves its pool without backends: a clear 503.
    let mut p = PoolConfig::new("ghost", vec![]);
    let mut entry = BackendConfig::new("http://fleetgate-test.invalid:8000".parse().unwrap());
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(200),
    };
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let m = post(&gw.url("/v1/chat/completions"), &[], chat("ghost", 2, true)).await;
    assert_eq!(m.status, 503);
    let e = openai_error(&m);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("no backends right now"),
        "{e}"
    );
    assert!(
        eventually(Duration::from_secs(5), || metrics_text(&gw)
            .lines()
            .any(|l| l.starts_with(
                "fleetgate_dns_discovery_failures_total{model=\"ghost\"}"
            ) && !l.ends_with(" 0")))
        .await,
        "failed lookups are counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_answers_that_change_move_traffic_and_streams_finish() {
    use std::collections::BTreeSet;
    use std::net::IpAddr;
    use std::sync::{Arc, Mutex};
    // Two backends on one port, at 127.0.0.1 and 127.0.0.2 (both loopback on Linux): what a
    // headless Service answers as its pods come and go.
    let a = sim(|s| s.decode_step_ms = 20.0).await;
    let port = a.addr().port();
    let b = sim(|s| {
        s.host = "127.0.0.2".into();
        s.port = port;
        s.zero_delay = true;
    })
    .await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    let mut entry = BackendConfig::new(
        format!("http://vllm.fleetgate-test.invalid:{port}")
            .parse()
            .unwrap(),
    );
    entry.discover = fleetgate_gateway::config::Discover::Dns {
        interval: Duration::from_millis(100),
    };
    p.backends = vec![entry];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    // The name does not resolve yet: no backend.
    assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 503);

    let answer: Arc<Mutex<BTreeSet<IpAddr>>> = Arc::new(Mutex::new(BTreeSet::new()));
    let answer2 = answer.clone();
    gw.server.fleet.set_resolver(Arc::new(move |_host, _port| {
        let a = answer2.lock().unwrap().clone();
        Box::pin(async move { Ok(a) })
    }));
    let set = |ips: &[&str]| {
        *answer.lock().unwrap() = ips.iter().map(|i| i.parse().unwrap()).collect();
    };
    let backends = |gw: &Gateway| -> Vec<String> {
        gw.server
            .pools()
            .get("qwen32b")
            .unwrap()
            .backends
            .iter()
            .map(|b| b.base.to_string())
            .collect()
    };
    let (at_a, at_b) = (
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.2:{port}"),
    );

    set(&["127.0.0.1"]);
    assert!(eventually(Duration::from_secs(5), || backends(&gw) == [at_a.clone()]).await);
    assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);

    // A long stream on a; then the answer moves to b.
    let long = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &[], chat("qwen32b", 40, true)).await })
    };
    let stats = a.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1)
        .await
    );
    set(&["127.0.0.2"]);
    assert!(eventually(Duration::from_secs(5), || backends(&gw) == [at_b.clone()]).await);
    for _ in 0..5 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, true)).await.status, 200);
    }
    let m = long.await.unwrap();
    assert_eq!(m.status, 200);
    assert!(
        m.metrics.done,
        "the stream on the address that left was cut"
    );
    assert_eq!(m.metrics.content_events, 40);
    let counts = per_backend(&gw);
    assert_eq!(counts.get(&at_b), Some(&5), "{counts:?}");
    assert_eq!(counts.get(&at_a), Some(&2), "{counts:?}");
    assert_eq!(
        b.stats().requests.load(std::sync::atomic::Ordering::SeqCst),
        5,
        "the backend at 127.0.0.2 served them"
    );

    // An empty answer is not taken at its word: the last addresses stay, the failure counts.
    set(&[]);
    let text = || metrics_text(&gw);
    assert!(
        eventually(Duration::from_secs(5), || text().contains(
            "fleetgate_dns_discovery_failures_total{model=\"qwen32b\"}"
        ))
        .await
    );
    assert_eq!(backends(&gw), std::slice::from_ref(&at_b));
    assert!(
        text().contains("fleetgate_config_generation 3"),
        "{}",
        text()
    );
}
