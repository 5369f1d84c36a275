//! Which backend a request reaches: weights, least in flight, load seen from outside the
//! gateway, warm-up, one user's requests on one backend, long prompts to their pool, gray keys
//! pinned to the canary, and each environment's priority passed to the engine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::config::{BackendConfig, PoolConfig};
use http::HeaderMap;

pub(crate) fn chat(model: &str, max_tokens: u32, stream: bool) -> Bytes {
    fleetgate_protocol::client::chat_body(model, "Say something", max_tokens, stream)
}

pub(crate) fn backend(url: String, weight: u32) -> BackendConfig {
    BackendConfig {
        weight,
        ..BackendConfig::new(url.parse().unwrap())
    }
}

/// Requests per backend among the gateway's records so far.
pub(crate) fn per_backend(gw: &Gateway) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in gw.records.lock().unwrap().iter() {
        if let Some(b) = &r.backend {
            *counts.entry(b.clone()).or_default() += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_share_traffic() {
    let light = sim(|a| a.zero_delay = true).await;
    let heavy = sim(|a| a.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![backend(light.url(), 1), backend(heavy.url(), 3)];
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    for _ in 0..400 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    let heavy_n = counts[heavy.url().trim_end_matches('/')];
    // Expected 300 of 400 (σ ≈ 8.7): a wide band that still rules out an even split.
    assert!(
        (250..=350).contains(&heavy_n),
        "weight 3 of 4 got {heavy_n} of 400: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_go_to_their_pool_when_the_environment_may_use_it() {
    let short = sim(|a| a.zero_delay = true).await;
    let long = sim(|a| a.zero_delay = true).await;
    let mut main = pool("qwen32b", &[short.url()]);
    main.long_prompt = Some(fleetgate_gateway::config::LongPromptConfig {
        min_prompt_tokens: 100,
        pool: "qwen32b-long".into(),
    });
    let mut long_pool = pool("qwen32b-long", &[long.url()]);
    long_pool.served_model_name = Some("qwen32b".into());
    long_pool.environments = Some(vec![fleetgate_gateway::key::Environment::Prod]);
    let gw = gateway(vec![main, long_pool]).await;
    let (prod, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let url = gw.url("/v1/chat/completions");
    let long_prompt = "word ".repeat(120); // 600 characters ≈ 150 tokens
    let body = |prompt: &str| fleetgate_protocol::client::chat_body("qwen32b", prompt, 2, true);
    let auth = format!("Bearer {prod}");
    for (id, prompt, key) in [
        ("short-prod", "hi", auth.as_str()),
        ("long-prod", long_prompt.as_str(), auth.as_str()),
    ] {
        let m = post(
            &url,
            &[("authorization", key), ("x-request-id", id)],
            body(prompt),
        )
        .await;
        assert_eq!(m.status, 200, "{id}");
    }
    // The harness key is a stress key: the long pool is prod-only, so it stays.
    let m = post(&url, &[("x-request-id", "long-stress")], body(&long_prompt)).await;
    assert_eq!(m.status, 200);
    let at = |id: &str| {
        let r = gw
            .records
            .lock()
            .unwrap()
            .iter()
            .find(|r| r.request_id == id)
            .cloned()
            .unwrap();
        (r.model.unwrap(), r.backend.unwrap())
    };
    let short_url = short.url().trim_end_matches('/').to_owned();
    let long_url = long.url().trim_end_matches('/').to_owned();
    assert_eq!(at("short-prod"), ("qwen32b".to_owned(), short_url.clone()));
    assert_eq!(at("long-prod"), ("qwen32b-long".to_owned(), long_url));
    assert_eq!(at("long-stress"), ("qwen32b".to_owned(), short_url));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gray_keys_are_pinned_to_the_canary() {
    let stable = sim(|a| a.zero_delay = true).await;
    let canary = sim(|a| a.zero_delay = true).await;
    let mut p = PoolConfig::new("qwen32b", vec![]);
    p.backends = vec![
        backend(stable.url(), 19),
        BackendConfig {
            labels: vec!["canary".into()],
            ..backend(canary.url(), 1)
        },
    ];
    p.gray_canary_label = Some("canary".into());
    let gw = gateway(vec![p]).await;
    let (gray, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Gray, |_| {}).await;
    let url = gw.url("/v1/chat/completions");
    let auth = format!("Bearer {gray}");
    for _ in 0..20 {
        let m = post(&url, &[("authorization", &auth)], chat("qwen32b", 2, false)).await;
        assert_eq!(m.status, 200);
    }
    let canary_url = canary.url().trim_end_matches('/').to_owned();
    assert_eq!(
        per_backend(&gw).get(&canary_url),
        Some(&20),
        "every gray request on the canary"
    );
    // The canary drained: gray traffic goes on, to the stable backend.
    gw.server
        .pools()
        .find_backend("qwen32b", &canary.url())
        .unwrap()
        .set_draining(true);
    let m = post(&url, &[("authorization", &auth)], chat("qwen32b", 2, false)).await;
    assert_eq!(m.status, 200);
    assert_eq!(per_backend(&gw).get(&canary_url), Some(&20));
    // The canary's labels are on the info metric, to compare it with the stable backend.
    let text = metrics_text(&gw);
    assert!(
        text.contains(&format!(
            "fleetgate_backend_info{{backend=\"{canary_url}\",labels=\"canary\",model=\"qwen32b\",weight=\"1\"}} 1"
        )),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_gets_traffic_only_after_its_warm_up() {
    let ready = sim(|a| a.zero_delay = true).await;
    // Refuses connections for its first second, like a vLLM loading its weights.
    let cold = sim(|a| {
        a.zero_delay = true;
        a.warmup_secs = 1.0;
    })
    .await;
    let mut p = pool("qwen32b", &[ready.url(), cold.url()]);
    p.warmup.requests = 2;
    let gw = gateway(vec![p]).await;
    let cold_backend = gw
        .server
        .pools()
        .find_backend("qwen32b", &cold.url())
        .unwrap()
        .clone();
    assert_eq!(cold_backend.state().as_str(), "warming");
    let url = gw.url("/v1/chat/completions");
    let cold_url = cold.url().trim_end_matches('/').to_owned();
    // While the cold backend refuses connections, every request goes to the warm one, never
    // to the cold one (which would show as a retry). The state is read after each answer: a
    // request sent while the backend warmed may rightly reach it if the warm-up ends while it
    // is on its way, so only what was answered before the backend became healthy counts.
    let started = std::time::Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "never warmed: {:?}",
            cold_backend.last_error()
        );
        let m = post(&url, &[], chat("qwen32b", 2, false)).await;
        assert_eq!(m.status, 200);
        if cold_backend.state().as_str() == "healthy" {
            break;
        }
        let before = per_backend(&gw).get(&cold_url).copied().unwrap_or(0);
        assert_eq!(
            before, 0,
            "no client request reached the cold backend before its warm-up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gw.records.lock().unwrap().iter().all(|r| r.retries == 0));
    for _ in 0..30 {
        assert_eq!(post(&url, &[], chat("qwen32b", 2, false)).await.status, 200);
    }
    assert!(
        per_backend(&gw).get(&cold_url).copied().unwrap_or(0) > 0,
        "it takes traffic once warm"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_balancing_sees_load_from_outside_the_gateway() {
    let busy = sim(|a| a.decode_step_ms = 20.0).await;
    let idle = sim(|a| a.decode_step_ms = 20.0).await;
    let mut p = pool("qwen32b", &[busy.url(), idle.url()]);
    p.load_aware = Some(fleetgate_gateway::config::LoadAwareConfig {
        metrics_path: "/metrics".into(),
        interval: Duration::from_millis(50),
    });
    let gw = gateway(vec![p]).await;
    // Another gateway (or a direct client) keeps 8 long streams on one backend.
    let direct: http::Uri = format!("{}/v1/chat/completions", busy.url().trim_end_matches('/'))
        .parse()
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(open(&direct, "unused", chat("qwen32b", 500, true)).await);
    }
    let busy_backend = gw
        .server
        .pools()
        .find_backend("qwen32b", &busy.url())
        .unwrap()
        .clone();
    assert!(
        eventually(Duration::from_secs(10), || busy_backend
            .remote_load
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 8)
        .await,
        "the scrape never saw the load"
    );
    let url = gw.url("/v1/chat/completions");
    for _ in 0..10 {
        assert_eq!(post(&url, &[], chat("qwen32b", 1, false)).await.status, 200);
    }
    let counts = per_backend(&gw);
    assert_eq!(
        counts.get(idle.url().trim_end_matches('/')),
        Some(&10),
        "every request went to the idle backend: {counts:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_one_user_stay_on_one_backend() {
    let sims = [
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
        sim(|a| a.zero_delay = true).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut p = pool("qwen32b", &urls);
    p.affinity = Some(fleetgate_gateway::config::AffinityConfig {
        by: fleetgate_gateway::config::AffinityBy::User,
        prefix_bytes: 512,
        slack: 4,
        block_bytes: 256,
        max_blocks: 4096,
        max_age: std::time::Duration::from_secs(600),
    });
    let gw = gateway(vec![p]).await;
    let url = gw.url("/v1/chat/completions");
    let body = |user: &str| {
        Bytes::from(
            serde_json::json!({
                "model": "qwen32b", "user": user, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            })
            .to_string(),
        )
    };
    for i in 0..20 {
        let m = post(
            &url,
            &[("x-request-id", &format!("alice-{i}"))],
            body("alice"),
        )
        .await;
        assert_eq!(m.status, 200);
    }
    let backends: std::collections::HashSet<String> = gw
        .records
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| r.backend.clone())
        .collect();
    assert_eq!(backends.len(), 1, "one user, one backend: {backends:?}");
    for u in 0..30 {
        post(&url, &[], body(&format!("user-{u}"))).await;
    }
    assert!(
        per_backend(&gw).len() >= 2,
        "users spread over the backends"
    );
}

/// `[pools.priority]`: each environment's vLLM `priority` reaches the backend, and with a
/// backend that orders its waiting queue by it (`--scheduling-policy priority`, one slot) a prod
/// request overtakes the gray ones that waited before it. A stress client that claims a better
/// priority than its environment's is given its environment's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_environments_priority_reaches_the_engine() {
    use fleetgate_gateway::key::Environment;
    let sim = sim(|a| {
        a.max_num_seqs = 1;
        a.decode_step_ms = 5.0;
        a.scheduling_policy = fleetgate_sim::SchedulingPolicy::Priority;
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.priority = Some(fleetgate_gateway::config::EnginePriority {
        by_env: [20, 10, 0],
        override_client: false,
    });
    let gw = gateway(vec![p]).await;
    let (stress, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let (gray, _) = issue_key(&gw, Environment::Gray, |_| {}).await;
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let stats = sim.stats().clone();
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // A stress request takes the one slot; then a gray request waits, a stress one claiming
    // priority -5 (it gets stress's 20), and a prod one.
    for (name, key, tokens, claim, waiting) in [
        ("stress", &stress, 200, None, 0),
        ("gray", &gray, 10, None, 1),
        ("stress-claiming", &stress, 10, Some(-5), 2),
        ("prod", &prod, 10, None, 3),
    ] {
        let url = gw.url("/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let done = done.clone();
        let mut body = serde_json::json!({"model": "qwen32b", "max_tokens": tokens,
                                          "messages": [{"role": "user", "content": "hi"}]});
        if let Some(c) = claim {
            body["priority"] = c.into();
        }
        tasks.push(tokio::spawn(async move {
            // The claim goes in vLLM's header too, which vLLM reads before the body's field.
            let claim = claim.map(|c: i64| c.to_string()).unwrap_or_default();
            let mut headers = vec![("authorization", auth.as_str())];
            if !claim.is_empty() {
                headers.push(("x-vllm-priority", claim.as_str()));
            }
            let m = post(&url, &headers, body.to_string()).await;
            assert_eq!(m.status, 200, "{name}: {:?}", m.body);
            done.lock().unwrap().push(name);
        }));
        let engine = stats.clone();
        assert!(
            eventually(Duration::from_secs(10), || {
                engine.running.load(std::sync::atomic::Ordering::SeqCst) == 1
                    && engine.waiting.load(std::sync::atomic::Ordering::SeqCst) == waiting
            })
            .await,
            "{name} is at the backend"
        );
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *done.lock().unwrap(),
        ["stress", "prod", "gray", "stress-claiming"],
        "the backend admitted prod before the requests that waited before it, and gray before stress"
    );
}

/// A stress key's `priority`, in every spelling a client can give it, reaches the backend as
/// its environment's 20 on every route vLLM orders by it (chat, completions, Responses, the
/// chat batch, every pooling route), and not at all where vLLM reads none (Messages, the
/// tokenizer); a value that is no integer, or a key given twice, is refused before any
/// backend sees it; the gateway never sends the field twice; vLLM's `X-Vllm-Priority` header
/// never reaches the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_priority_is_held_to_its_environment_on_every_route() {
    use fleetgate_gateway::key::Environment;
    let seen: Arc<Mutex<Vec<(String, HeaderMap, Bytes)>>> = Arc::default();
    let log = seen.clone();
    let (addr, task) = http_backend(move |req: http::Request<hyper::body::Incoming>| {
        let log = log.clone();
        async move {
            use http_body_util::BodyExt;
            let (head, body) = req.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            if head.uri.path() != "/health" {
                log.lock()
                    .unwrap()
                    .push((head.uri.path().to_owned(), head.headers, body));
            }
            http::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from_static(
                    br#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
                )))
                .unwrap()
        }
    })
    .await;
    let mut p = pool("m", &[format!("http://{addr}")]);
    p.priority = Some(fleetgate_gateway::config::EnginePriority {
        by_env: [20, 10, 0],
        override_client: false,
    });
    let gw = gateway(vec![p]).await;
    let (stress, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let auth = format!("Bearer {stress}");
    let routes: [(&str, &str, bool); 14] = [
        (
            "/v1/chat/completions",
            r#""messages":[{"role":"user","content":"hi"}]"#,
            true,
        ),
        ("/v1/completions", r#""prompt":"hi""#, true),
        ("/v1/responses", r#""input":"hi","store":false"#, true),
        (
            "/v1/chat/completions/batch",
            r#""messages":[[{"role":"user","content":"hi"}]]"#,
            true,
        ),
        ("/v1/embeddings", r#""input":"hi""#, true),
        ("/v2/embed", r#""texts":["hi"]"#, true),
        ("/pooling", r#""input":"hi""#, true),
        ("/classify", r#""input":"hi""#, true),
        ("/score", r#""queries":"a","documents":["b"]"#, true),
        ("/v1/rerank", r#""query":"a","documents":["b"]"#, true),
        (
            "/v1/messages",
            r#""max_tokens":4,"messages":[{"role":"user","content":"hi"}]"#,
            false,
        ),
        (
            "/v1/messages/count_tokens",
            r#""messages":[{"role":"user","content":"hi"}]"#,
            false,
        ),
        ("/tokenize", r#""prompt":"hi""#, false),
        ("/detokenize", r#""tokens":[1,2]"#, false),
    ];
    for (path, rest, ordered) in routes {
        for spelling in [
            r#""priority":-5,"#,
            r#""priority":-9223372036854775808,"#,
            r#""pr\u0069ority":-5,"#,
            r#""priority":-0,"#,
            r#""priority":null,"#,
            r#""priority" : 50 ,"#,
            "",
        ] {
            let body = format!(r#"{{"model":"m",{spelling}{rest}}}"#);
            seen.lock().unwrap().clear();
            let m = post(
                &gw.url(path),
                &[("authorization", &auth), ("x-vllm-priority", "-100")],
                body.clone(),
            )
            .await;
            assert_eq!(m.status, 200, "{path} {body}: {:?}", m.body);
            let got = seen.lock().unwrap().clone();
            assert_eq!(got.len(), 1, "{path} {body}");
            let (at, head, sent) = &got[0];
            assert_eq!(at, path);
            assert!(head.get("x-vllm-priority").is_none(), "{path}: header kept");
            let text = String::from_utf8_lossy(sent);
            let v: serde_json::Value = serde_json::from_slice(sent)
                .unwrap_or_else(|e| panic!("{path} {body}: sent {text}: {e}"));
            assert!(
                text.matches("priority").count() <= 1,
                "{path} {body}: the field twice: {text}"
            );
            let expected = match (ordered, spelling) {
                (false, _) => serde_json::Value::Null,
                // A worse priority than the environment's is the client's to keep.
                (true, s) if s.contains("50") => 50.into(),
                (true, _) => 20.into(),
            };
            assert_eq!(
                v.get("priority").cloned().unwrap_or_default(),
                expected,
                "{path} {body}: {text}"
            );
        }
        // (body, given twice): a key given twice is refused on every route, as serde reads it.
        for (refused, twice) in [
            (r#""priority":"-5","#, false),
            (r#""priority":1e309,"#, false),
            (r#""priority":20,"priority":-5,"#, true),
            (r#""priority":20,"pr\u0069ority":-5,"#, true),
        ] {
            let body = format!(r#"{{"model":"m",{refused}{rest}}}"#);
            seen.lock().unwrap().clear();
            let m = post(&gw.url(path), &[("authorization", &auth)], body.clone()).await;
            if ordered || twice {
                assert_eq!(m.status, 400, "{path} {body}: {:?}", m.body);
                assert!(seen.lock().unwrap().is_empty(), "{path} {body}: forwarded");
            } else {
                // Unread there: taken out, whatever it holds.
                assert_eq!(m.status, 200, "{path} {body}: {:?}", m.body);
                let sent = seen.lock().unwrap()[0].2.clone();
                let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
                assert!(v.get("priority").is_none(), "{path} {body}");
            }
        }
    }
    task.abort();
}

/// The environment the backends put first passes the pool's capacity only where the backend
/// is told who goes first: at a full backend (two slots, both taken by stress), a prod chat
/// request overflows to the backend at once, while a prod Messages request (whose vLLM request
/// has no `priority`) waits in the gateway's queue, though the overflow has room for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overflow_applies_only_where_the_engine_orders_by_priority() {
    use fleetgate_gateway::key::Environment;
    use std::sync::atomic::Ordering::SeqCst;
    let sim = sim(|a| {
        a.max_num_seqs = 1;
        a.decode_step_ms = 5.0;
        a.scheduling_policy = fleetgate_sim::SchedulingPolicy::Priority;
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.max_in_flight_per_backend = 2;
    p.priority = Some(fleetgate_gateway::config::EnginePriority {
        by_env: [20, 10, 0],
        override_client: false,
    });
    let gw = gateway(vec![p]).await;
    let (stress, _) = issue_key(&gw, Environment::Stress, |_| {}).await;
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let stats = sim.stats().clone();
    let send = |key: &str, path: &str, tokens: u32| {
        let url = gw.url(path);
        let auth = format!("Bearer {key}");
        let body = serde_json::json!({"model": "qwen32b", "max_tokens": tokens,
                                      "messages": [{"role": "user", "content": "hi"}]});
        tokio::spawn(async move {
            let m = post(&url, &[("authorization", &auth)], body.to_string()).await;
            assert_eq!(m.status, 200, "{:?}", m.body);
        })
    };
    let at_backend = || stats.running.load(SeqCst) + stats.waiting.load(SeqCst);
    let queued = || metrics_text(&gw).contains("fleetgate_queue_depth{model=\"qwen32b\"} 1");
    let holder = send(&stress, "/v1/chat/completions", 600);
    assert!(eventually(Duration::from_secs(10), || at_backend() == 1).await);
    let second = send(&stress, "/v1/chat/completions", 10);
    assert!(eventually(Duration::from_secs(10), || at_backend() == 2).await);
    let chat = send(&prod, "/v1/chat/completions", 10);
    assert!(
        eventually(Duration::from_secs(10), || at_backend() == 3).await,
        "prod's chat request passes the capacity"
    );
    let messages = send(&prod, "/v1/messages", 10);
    assert!(
        eventually(Duration::from_secs(10), queued).await,
        "prod's Messages request waits in the gateway's queue: {} at the backend; {}",
        at_backend(),
        metrics_text(&gw)
            .lines()
            .filter(|l| l.contains("queue"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(at_backend(), 3, "and not at the backend");
    for t in [holder, second, chat, messages] {
        t.await.unwrap();
    }
}
