//! Prometheus exposition after real requests through the sim: successes, errors, refusals and
//! client disconnects each counted exactly once, histograms filled, labels from config only.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_protocol::client::{self, chat_body};
use http_body_util::BodyExt;

/// `name{labels} value` lines → map (labels kept as written).
async fn scrape(gw: &Gateway) -> HashMap<String, f64> {
    let c = client::http_client();
    let req = http::Request::get(format!("http://{}/metrics", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

fn get(m: &HashMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_counted_once_with_config_labels() {
    let sim = sim(|a| a.decode_step_ms = 5.0).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let chat = gw.url("/v1/chat/completions");
    let body = |n| {
        Bytes::from(
            serde_json::json!({"model": "qwen32b", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": n, "stream": true, "stream_options": {"include_usage": true}})
            .to_string(),
        )
    };
    for _ in 0..3 {
        assert_eq!(post(&chat, &[], body(10)).await.status, 200);
    }
    assert_eq!(
        post(&chat, &[], chat_body("no-such-model", "hi", 3, true))
            .await
            .status,
        404
    );
    assert_eq!(
        post(&chat, &[("x-no-auth", "1")], body(3)).await.status,
        401
    );
    // A client that goes away mid-stream.
    let c = client::http_client();
    let req = authed(&gw, "POST", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body(500)))
        .unwrap();
    let mut stream = c.request(req).await.unwrap().into_body();
    stream.frame().await.unwrap().unwrap();
    drop(stream);
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await
    );

    let mut m = HashMap::new();
    for _ in 0..200 {
        m = scrape(&gw).await;
        if get(
            &m,
            r#"fleetgate_requests_total{endpoint="chat",environment="stress",error="client_disconnected",model="qwen32b",status_class="2xx"}"#,
        ) == 1.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ok = r#"fleetgate_requests_total{endpoint="chat",environment="stress",error="none",model="qwen32b",status_class="2xx"}"#;
    assert_eq!(get(&m, ok), 3.0, "{m:#?}");
    assert_eq!(
        get(
            &m,
            r#"fleetgate_requests_total{endpoint="chat",environment="stress",error="model_not_found",model="none",status_class="4xx"}"#
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            r#"fleetgate_requests_total{endpoint="chat",environment="none",error="unauthenticated",model="none",status_class="4xx"}"#
        ),
        1.0,
        "{m:#?}"
    );
    assert_eq!(
        get(
            &m,
            r#"fleetgate_requests_total{endpoint="chat",environment="stress",error="client_disconnected",model="qwen32b",status_class="2xx"}"#
        ),
        1.0
    );
    let total: f64 = m
        .iter()
        .filter(|(k, _)| k.starts_with("fleetgate_requests_total{"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, 6.0, "each request exactly once");

    // Histograms: the three complete streams and the cut one have a client TTFT.
    assert_eq!(
        get(
            &m,
            r#"fleetgate_ttft_seconds_count{backend="-",endpoint="chat",environment="stress",model="qwen32b",side="client"}"#
        ),
        4.0
    );
    let upstream = format!(
        r#"fleetgate_ttft_seconds_count{{backend="{}",endpoint="chat",environment="stress",model="qwen32b",side="upstream"}}"#,
        sim.url()
    );
    assert_eq!(get(&m, &upstream), 4.0, "{m:#?}");
    assert_eq!(
        get(
            &m,
            r#"fleetgate_overhead_seconds_count{endpoint="chat",environment="stress",model="qwen32b",phase="pre"}"#
        ),
        4.0
    );
    assert!(
        get(
            &m,
            r#"fleetgate_overhead_seconds_sum{endpoint="chat",environment="stress",model="qwen32b",phase="total"}"#
        ) > 0.0
    );
    // 3 streams × (10 token events − 1) gaps, plus the cut stream's gaps.
    assert!(
        get(
            &m,
            r#"fleetgate_itl_seconds_count{endpoint="chat",environment="stress",model="qwen32b"}"#
        ) >= 27.0
    );
    assert_eq!(
        get(
            &m,
            r#"fleetgate_tpot_seconds_count{endpoint="chat",environment="stress",model="qwen32b"}"#
        ),
        3.0
    );
    assert!(
        get(
            &m,
            r#"fleetgate_tokens_total{endpoint="chat",environment="stress",kind="completion",model="qwen32b"}"#
        ) >= 30.0
    );
    assert!(
        get(
            &m,
            r#"fleetgate_tokens_total{endpoint="chat",environment="stress",kind="prompt",model="qwen32b"}"#
        ) >= 3.0
    );
    // Backend gauges and auth failures.
    assert_eq!(
        get(
            &m,
            &format!(
                r#"fleetgate_backend_up{{backend="{}",model="qwen32b"}}"#,
                sim.url()
            )
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            &format!(
                r#"fleetgate_backend_in_flight{{backend="{}",model="qwen32b"}}"#,
                sim.url()
            )
        ),
        0.0
    );
    assert_eq!(
        get(&m, r#"fleetgate_auth_failures_total{reason="missing"}"#),
        1.0
    );
    // No label value comes from the client: the unknown model name appears nowhere.
    assert!(m.keys().all(|k| !k.contains("no-such-model")));
    assert!(m.keys().all(|k| !k.contains(&gw.key)));
}

/// The Grafana dashboard only queries metrics the gateway exports (a renamed metric fails here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_exported_metrics() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/fleetgate-dashboard.json"
    );
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    assert_eq!(
        post(
            &gw.url("/v1/chat/completions"),
            &[],
            chat_body("qwen32b", "hi", 3, true)
        )
        .await
        .status,
        200
    );
    let exported = scrape(&gw).await;
    let names: std::collections::HashSet<String> = exported
        .keys()
        .map(|k| k.split('{').next().unwrap().to_owned())
        .collect();
    let mut checked = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("fleetgate_") {
                    assert!(
                        names.contains(word),
                        "panel {:?} queries {word}, which is not exported",
                        panel["title"]
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 15, "{checked}");
}

/// Each endpoint family has its own series (label `endpoint`), so the agents' traffic can be
/// told from chat's; a route outside the table is counted under "none".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_are_labelled_by_endpoint_family() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let json = |v: serde_json::Value| Bytes::from(v.to_string());
    let responses = post(
        &gw.url("/v1/responses"),
        &[],
        json(
            serde_json::json!({"model": "qwen32b", "input": "hi", "stream": true,
            "max_output_tokens": 4}),
        ),
    )
    .await;
    assert_eq!(responses.status, 200);
    let messages = json(
        serde_json::json!({"model": "qwen32b", "max_tokens": 4, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    for _ in 0..2 {
        assert_eq!(
            post(&gw.url("/v1/messages"), &[], messages.clone())
                .await
                .status,
            200
        );
    }
    let count = post(
        &gw.url("/v1/messages/count_tokens"),
        &[],
        json(serde_json::json!({"model": "qwen32b",
            "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(count.status, 200);
    assert_eq!(
        post(
            &gw.url("/v1/no-such-route"),
            &[],
            json(serde_json::json!({}))
        )
        .await
        .status,
        404
    );

    let mut m = HashMap::new();
    for _ in 0..200 {
        m = scrape(&gw).await;
        let total: f64 = m
            .iter()
            .filter(|(k, _)| k.starts_with("fleetgate_requests_total{"))
            .map(|(_, v)| v)
            .sum();
        if total >= 5.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ok = |family: &str| {
        format!(
            r#"fleetgate_requests_total{{endpoint="{family}",environment="stress",error="none",model="qwen32b",status_class="2xx"}}"#
        )
    };
    assert_eq!(get(&m, &ok("responses")), 1.0, "{m:#?}");
    assert_eq!(get(&m, &ok("messages")), 2.0, "{m:#?}");
    assert_eq!(get(&m, &ok("tokenize")), 1.0, "{m:#?}");
    assert_eq!(get(&m, &ok("chat")), 0.0, "{m:#?}");
    let unrouted: f64 = m
        .iter()
        .filter(|(k, _)| {
            k.starts_with(r#"fleetgate_requests_total{endpoint="none","#)
                && k.contains(r#"status_class="4xx""#)
        })
        .map(|(_, v)| v)
        .sum();
    assert_eq!(unrouted, 1.0, "{m:#?}");
    // The latency figures of each generating family, in its own series.
    let ttft = |family: &str| {
        format!(
            r#"fleetgate_ttft_seconds_count{{backend="-",endpoint="{family}",environment="stress",model="qwen32b",side="client"}}"#
        )
    };
    assert_eq!(get(&m, &ttft("responses")), 1.0, "{m:#?}");
    assert_eq!(get(&m, &ttft("messages")), 2.0, "{m:#?}");
    let upstream = format!(
        r#"fleetgate_ttft_seconds_count{{backend="{}",endpoint="messages",environment="stress",model="qwen32b",side="upstream"}}"#,
        sim.url()
    );
    assert_eq!(get(&m, &upstream), 2.0, "{m:#?}");
    assert!(
        get(
            &m,
            r#"fleetgate_tokens_total{endpoint="messages",environment="stress",kind="completion",model="qwen32b"}"#
        ) >= 8.0,
        "{m:#?}"
    );
    assert!(
        get(
            &m,
            r#"fleetgate_itl_seconds_count{endpoint="responses",environment="stress",model="qwen32b"}"#
        ) >= 3.0,
        "{m:#?}"
    );
    // No series was made for a family without traffic.
    assert!(
        m.keys().all(|k| !k.contains(r#"endpoint="completions""#)),
        "{m:#?}"
    );
}
