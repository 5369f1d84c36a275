//! Fallbacks (issue 62): a pool that cannot serve a request before its first byte hands it to
//! the next of its `fallbacks`, a prompt too long for its model goes to a
//! `context_window_fallbacks` pool (counted by the gateway, or refused by the backend with
//! vLLM's context error), and the answer, the record, the request log and the metrics say so.

use std::time::Duration;

use crate::common::*;
use fleetgate_gateway::key::Environment;
use fleetgate_protocol::client::{Measured, chat_body};

/// A sim serving `model` with a context of `max_model_len` tokens.
async fn serving(model: &str, max_model_len: u32) -> fleetgate_sim::SimServer {
    let model = model.to_owned();
    sim(move |a| {
        a.zero_delay = true;
        a.served_model_name = vec![model];
        a.max_model_len = max_model_len;
    })
    .await
}

/// A pool of one backend nothing listens on.
async fn down_pool(model: &str) -> fleetgate_gateway::config::PoolConfig {
    pool(model, &[format!("http://{}", closed_port().await)])
}

fn fallback_header(m: &Measured) -> Option<&str> {
    m.headers
        .get("x-fleetgate-fallback")
        .map(|v| v.to_str().unwrap())
}

/// `fleetgate_fallbacks_total{model,to,cause}`, summed over `causes`.
fn fallbacks_counted(gw: &Gateway, from: &str, to: &str, causes: &[&str]) -> u64 {
    let text = metrics_text(gw);
    text.lines()
        .filter(|l| l.starts_with("fleetgate_fallbacks_total{"))
        .filter(|l| l.contains(&format!("model=\"{from}\"")) && l.contains(&format!("to=\"{to}\"")))
        .filter(|l| causes.iter().any(|c| l.contains(&format!("cause=\"{c}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_pool_is_answered_by_its_fallback_and_the_answer_says_so() {
    // The fallback's backends serve it under another name: the answer names the pool.
    let small = serving("small-7b", 4096).await;
    let mut big = down_pool("big").await;
    big.fallback.on_failure = vec!["small".into()];
    let mut small_pool = pool("small", &[small.url()]);
    small_pool.served_model_name = Some("small-7b".into());
    let gw = gateway(vec![big, small_pool]).await;
    let url = gw.url("/v1/chat/completions");
    for (id, stream) in [("down-whole", false), ("down-stream", true)] {
        let m = post(
            &url,
            &[("x-request-id", id)],
            chat_body("big", "hi", 3, stream),
        )
        .await;
        assert_eq!(m.status, 200, "{id}: {:?}", m.body);
        assert_eq!(fallback_header(&m), Some("small"), "{id}");
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert!(body.contains("\"model\":\"small\""), "{id}: {body}");
        assert!(!body.contains("\"model\":\"big\""), "{id}: {body}");
        assert!(!body.contains("small-7b"), "{id}: {body}");
        let seen = gw.record_of(id).await;
        assert_eq!(seen.model.as_deref(), Some("small"), "{id}");
        assert_eq!(seen.status, 200, "{id}");
    }
    // The first finds the backend refusing connections (its attempt failed); the second may
    // find it already marked down (no backend).
    assert_eq!(
        fallbacks_counted(&gw, "big", "small", &["retries_failed", "no_backend"]),
        2
    );
    // The request log says where each went first, and why it left.
    let store = gw.server.auth.store();
    let row = eventually_row(store, "down-stream").await;
    assert_eq!(row.0.as_deref(), Some("small"));
    assert_eq!(row.1.as_deref(), Some("big"));
    let detail: serde_json::Value = serde_json::from_str(row.2.as_deref().unwrap()).unwrap();
    assert_eq!(detail[0]["model"], "big", "{detail}");
}

/// (model, fallback_from, fallback_detail) of the request log's row for `id`, once written.
async fn eventually_row(
    store: &fleetgate_gateway::store::KeyStore,
    id: &str,
) -> (Option<String>, Option<String>, Option<String>) {
    use sqlx::Row;
    for _ in 0..500 {
        let row = sqlx::query(
            "SELECT model, fallback_from, fallback_detail FROM request_log WHERE request_id = $1",
        )
        .bind(id)
        .fetch_optional(store.pool())
        .await
        .unwrap();
        if let Some(r) = row {
            return (r.get(0), r.get(1), r.get(2));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no request-log row for {id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_pools_naming_each_other_ends_when_each_was_tried_once() {
    let mut a = down_pool("a").await;
    let mut b = down_pool("b").await;
    a.fallback.on_failure = vec!["b".into()];
    b.fallback.on_failure = vec!["a".into()];
    let gw = gateway(vec![a, b]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "loop")],
        chat_body("a", "hi", 3, false),
    )
    .await;
    assert!(m.status == 502 || m.status == 503, "{}", m.status);
    assert_eq!(fallback_header(&m), None);
    let all = ["retries_failed", "no_backend"];
    assert_eq!(fallbacks_counted(&gw, "a", "b", &all), 1);
    assert_eq!(fallbacks_counted(&gw, "b", "a", &all), 0);
    // The error is the last pool's: it names `b`'s backend.
    let seen = gw.record_of("loop").await;
    assert_eq!(seen.model.as_deref(), Some("b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_the_pool_does_not_let_go_and_a_key_not_allowed_the_fallback_stay() {
    let small = serving("small", 4096).await;
    let mut big = down_pool("big").await;
    big.fallback.on_failure = vec!["small".into()];
    big.fallback.environments = Some(vec![Environment::Prod]);
    let gw = gateway(vec![big, pool("small", &[small.url()])]).await;
    let url = gw.url("/v1/chat/completions");
    // The harness key is a stress key: prod's fallback is not for it.
    let m = post(&url, &[], chat_body("big", "hi", 3, false)).await;
    assert!(m.status == 502 || m.status == 503, "stress: {}", m.status);
    assert_eq!(fallback_header(&m), None);
    let (prod, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let auth = format!("Bearer {prod}");
    let m = post(
        &url,
        &[("authorization", &auth)],
        chat_body("big", "hi", 3, false),
    )
    .await;
    assert_eq!(m.status, 200, "prod");
    assert_eq!(fallback_header(&m), Some("small"));
    // A prod key allowed only `big` never reaches `small`.
    let (only_big, _) = issue_key(&gw, Environment::Prod, |k| {
        k.allowed_models = Some(vec!["big".into()]);
    })
    .await;
    let auth = format!("Bearer {only_big}");
    let m = post(
        &url,
        &[("authorization", &auth)],
        chat_body("big", "hi", 3, false),
    )
    .await;
    assert!(
        m.status == 502 || m.status == 503,
        "allow-list: {}",
        m.status
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_wait_in_a_full_pool_ends_is_answered_by_the_fallback() {
    let slow = sim(|a| {
        a.served_model_name = vec!["big".into()];
        a.decode_step_ms = 50.0;
    })
    .await;
    let small = serving("small", 4096).await;
    let mut big = pool("big", &[slow.url()]);
    big.max_in_flight_per_backend = 1;
    big.fallback.on_failure = vec!["small".into()];
    let gw = gateway_with(vec![big, pool("small", &[small.url()])], |c| {
        c.queue.max_wait = [Duration::from_millis(200); 3];
    })
    .await;
    let url = gw.url("/v1/chat/completions");
    // Forty tokens at 50 ms hold `big`'s one slot for two seconds.
    let holder = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &[], chat_body("big", "hi", 40, true)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let m = post(
        &url,
        &[("x-request-id", "waited")],
        chat_body("big", "hi", 3, false),
    )
    .await;
    assert_eq!(m.status, 200);
    assert_eq!(fallback_header(&m), Some("small"));
    assert_eq!(
        fallbacks_counted(&gw, "big", "small", &["queue_timeout"]),
        1
    );
    let seen = gw.record_of("waited").await;
    // Its queue wait is the time it waited in `big`'s queue.
    assert!(
        seen.timeline.queue_wait() >= Duration::from_millis(200),
        "{:?}",
        seen.timeline.queue_wait()
    );
    assert_eq!(holder.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_context_goes_to_the_context_window_fallback() {
    let chat = serving("chat", 256).await;
    let long = serving("long", 8192).await;
    let mut chat_pool = pool("chat", &[chat.url()]);
    chat_pool.fallback.context_window = vec!["long".into()];
    let gw = gateway(vec![chat_pool, pool("long", &[long.url()])]).await;
    // The context is learnt from the backend's `/v1/models` card.
    let pools = gw.server.pools();
    let learnt = eventually(Duration::from_secs(5), || {
        pools.get("chat").unwrap().context_length() == Some(256)
    })
    .await;
    assert!(
        learnt,
        "the chat pool learns max_model_len from its backend"
    );
    let url = gw.url("/v1/chat/completions");
    let short = post(&url, &[], chat_body("chat", "hi", 3, false)).await;
    assert_eq!(short.status, 200);
    assert_eq!(fallback_header(&short), None);
    // About 500 tokens by the estimate: over 256 before anything is sent.
    let prompt = "lorem ipsum dolor ".repeat(110);
    let m = post(
        &url,
        &[("x-request-id", "too-long")],
        chat_body("chat", &prompt, 3, true),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(fallback_header(&m), Some("long"));
    assert_eq!(
        fallbacks_counted(&gw, "chat", "long", &["context_window"]),
        1
    );
    // A short prompt asking for more output than the context holds goes there too.
    let m = post(&url, &[], chat_body("chat", "hi", 1000, false)).await;
    assert_eq!(fallback_header(&m), Some("long"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_context_error_before_the_first_byte_sends_the_request_to_the_fallback() {
    let chat = serving("chat", 256).await;
    let long = serving("long", 8192).await;
    // The operator's figure is wrong: the gateway lets the prompt through, the engine refuses.
    let mut chat_pool = pool("chat", &[chat.url()]);
    chat_pool.fallback.context_window = vec!["long".into()];
    chat_pool.fallback.max_model_len = Some(100_000);
    let gw = gateway(vec![chat_pool, pool("long", &[long.url()])]).await;
    let prompt = "lorem ipsum dolor ".repeat(110);
    let url = gw.url("/v1/chat/completions");
    for stream in [false, true] {
        let m = post(&url, &[], chat_body("chat", &prompt, 3, stream)).await;
        assert_eq!(m.status, 200, "stream {stream}: {:?}", m.body);
        assert_eq!(fallback_header(&m), Some("long"));
    }
    assert_eq!(
        fallbacks_counted(&gw, "chat", "long", &["context_error"]),
        2
    );
    // Without a fallback that is longer, the engine's own error reaches the client.
    let gw = gateway(vec![pool("chat", &[chat.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[],
        chat_body("chat", &prompt, 3, false),
    )
    .await;
    assert_eq!(m.status, 400);
    assert!(
        openai_error(&m)["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length"),
    );
}
