//! Automatic prefix caching through a sim: cached tokens in usage, LRU eviction, and the
//! prefix-cache metrics.

use http::StatusCode;
use serde_json::{Value, json};

use crate::{SimArgs, SimServer, start};

use super::{TestClient, client, read_all, send, sse_events, timed, zero_delay};

/// The value of the sample `name{engine="0",model_name="qwen32b"<extra>}` in a /metrics text.
fn sample(text: &str, name: &str, extra: &str) -> f64 {
    let head = format!("{name}{{engine=\"0\",model_name=\"qwen32b\"{extra}}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no {head}in\n{text}"));
    line[head.len()..].parse().unwrap()
}

async fn metrics_text(c: &TestClient, sim: &SimServer) -> String {
    let r = send(c, sim, "GET", "/metrics", None, &[]).await;
    String::from_utf8(read_all(r).await.to_vec()).unwrap()
}

/// ASCII text of exactly `tokens` sim tokens (four characters each), distinct per `tag`.
fn text_of(tag: char, tokens: usize) -> String {
    (0..tokens).map(|i| format!("{tag}{i:03}")).collect()
}

async fn chat_usage(c: &TestClient, sim: &SimServer, messages: Value) -> (Value, String) {
    let req = json!({"model": "qwen32b", "messages": messages, "max_tokens": 4});
    let r = send(c, sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    (v["usage"].clone(), text)
}

#[tokio::test]
async fn repeated_prefix_is_cached_and_only_the_rest_is_prefilled() {
    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let long = text_of('a', 100);
    let (u1, _) = chat_usage(&c, &sim, json!([{"role": "user", "content": long}])).await;
    assert_eq!(u1["prompt_tokens"], 100);
    assert_eq!(u1["prompt_tokens_details"]["cached_tokens"], 0);
    // The same 100 tokens and then a question: six full blocks of 16 are found.
    let (u2, _) = chat_usage(
        &c,
        &sim,
        json!([{"role": "user", "content": long}, {"role": "user", "content": text_of('q', 10)}]),
    )
    .await;
    assert_eq!(u2["prompt_tokens"], 110);
    assert_eq!(
        u2["prompt_tokens_details"],
        json!({"cached_tokens": 96, "created_cache_tokens": null, "multimodal_tokens": null})
    );
    // The streamed answer's usage chunk says the same.
    let req = json!({
        "model": "qwen32b",
        "messages": [{"role": "user", "content": long}],
        "max_tokens": 2,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 310.0);
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 192.0);
    assert_eq!(sample(&m, "vllm:prompt_tokens_cached_total", ""), 192.0);
    assert_eq!(sample(&m, "vllm:prompt_tokens_total", ""), 310.0);
    // What the scheduler prefilled (and paid prefill time for): all of the first prompt, the
    // uncached 14 tokens of the second, the last 4 of the third.
    let by_source = "vllm:prompt_tokens_by_source_total";
    assert_eq!(
        sample(&m, by_source, ",source=\"local_compute\""),
        100.0 + 14.0 + 4.0
    );
    assert_eq!(sample(&m, by_source, ",source=\"local_cache_hit\""), 192.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn cached_tokens_are_reported_only_as_vllm_does() {
    // Without --enable-prompt-tokens-details chat and completions say null, as vLLM; the
    // Responses API always reports them; the metrics count either way.
    let sim = start(SimArgs {
        kv_cache_tokens: 1_000_000,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let long = text_of('b', 40);
    for _ in 0..2 {
        let (u, _) = chat_usage(&c, &sim, json!([{"role": "user", "content": long}])).await;
        assert!(u["prompt_tokens_details"].is_null(), "{u}");
    }
    let req = json!({"model": "qwen32b", "prompt": long, "max_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    let req = json!({"model": "qwen32b", "input": long, "max_output_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/responses", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 32);
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 96.0);
    sim.shutdown().await;

    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..zero_delay()
    })
    .await
    .unwrap();
    let messages = json!([{"role": "user", "content": long}]);
    for expected in [0, 32] {
        let req = json!({"model": "qwen32b", "messages": messages, "max_tokens": 2});
        let r = send(&c, &sim, "POST", "/v1/messages", Some(req), &[]).await;
        let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 40 - expected, "output_tokens": 2, "cache_read_input_tokens": expected}),
        );
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn small_cache_evicts_least_recently_used_blocks() {
    let sim = start(SimArgs {
        kv_cache_tokens: 64,
        enable_prompt_tokens_details: true,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let cached = |u: &Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let a = json!([{"role": "user", "content": text_of('a', 100)}]);
    let b = json!([{"role": "user", "content": text_of('b', 100)}]);
    assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 0);
    // Four blocks fit: the head of the prompt stayed, its tail went first.
    assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 64);
    // Another prompt pushes all of it out.
    assert_eq!(cached(&chat_usage(&c, &sim, b.clone()).await.0), 0);
    assert_eq!(cached(&chat_usage(&c, &sim, a).await.0), 0);
    sim.shutdown().await;

    // --kv-cache-tokens 0: no prefix caching at all.
    let sim = start(SimArgs {
        kv_cache_tokens: 0,
        enable_prompt_tokens_details: true,
        ..zero_delay()
    })
    .await
    .unwrap();
    let a = json!([{"role": "user", "content": text_of('a', 100)}]);
    for _ in 0..2 {
        assert_eq!(cached(&chat_usage(&c, &sim, a.clone()).await.0), 0);
    }
    let m = metrics_text(&c, &sim).await;
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", ""), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_growing_conversation_hits_more_each_turn() {
    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let mut messages = vec![json!({"role": "system", "content": text_of('s', 50)})];
    let mut last_prompt = 0u64;
    let mut last_cached = 0u64;
    for turn in 0..5 {
        messages.push(json!({"role": "user", "content": text_of('u', 20 + turn)}));
        let (u, answer) = chat_usage(&c, &sim, Value::Array(messages.clone())).await;
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if turn > 0 {
            assert!(
                cached > last_cached,
                "turn {turn}: {cached} after {last_cached}"
            );
            // All of the previous prompt but its last, partly filled block.
            assert!(
                cached + 2 * 16 > last_prompt,
                "turn {turn}: {cached} of {last_prompt}"
            );
        }
        assert_eq!(cached % 16, 0);
        (last_prompt, last_cached) = (prompt, cached);
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    let m = metrics_text(&c, &sim).await;
    assert!(sample(&m, "vllm:prefix_cache_hits_total", "") >= last_cached as f64);
    sim.shutdown().await;
}

/// As vLLM caches a block once prefill has computed it: two identical prompts prefilling at
/// once both miss (neither has finished the blocks the other would find), and the next one
/// finds them. Prefill is slowed (2 ms a token, 200 ms a prompt) so both are in it together.
#[tokio::test]
async fn blocks_enter_the_cache_when_prefill_has_computed_them() {
    let sim = start(SimArgs {
        enable_prompt_tokens_details: true,
        kv_cache_tokens: 1_000_000,
        prefill_us_per_token: 2000.0,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let messages = json!([{"role": "user", "content": text_of('s', 100)}]);
    let (a, b) = tokio::join!(
        chat_usage(&c, &sim, messages.clone()),
        chat_usage(&c, &sim, messages.clone())
    );
    for (u, _) in [&a, &b] {
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0, "{u}");
    }
    let (after, _) = chat_usage(&c, &sim, messages).await;
    assert_eq!(
        after["prompt_tokens_details"]["cached_tokens"], 96,
        "{after}"
    );
}
