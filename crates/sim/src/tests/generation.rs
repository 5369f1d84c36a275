//! Chat and completions through a sim: streamed frames, non-streaming shapes, deterministic
//! tokens, long zero-delay streams and the chat batch.

use std::sync::atomic::Ordering::Relaxed;

use http::StatusCode;
use serde_json::{Value, json};

use crate::{SimArgs, start, tokens};

use super::{client, read_all, send, sse_events, timed, zero_delay};

async fn streaming_chat_frames(args: SimArgs) {
    let sim = start(args).await.unwrap();
    let c = client();
    let req = json!({
        "model": "qwen32b",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there, sim"}]}],
        "max_tokens": 5,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(req),
        &[("x-request-id", "req-1")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    // vLLM builds the id from the header (below) and does not echo it.
    assert!(!r.headers().contains_key("x-request-id"));
    let body = read_all(r).await;
    let events = sse_events(&body);
    assert_eq!(events.len(), 1 + 5 + 1 + 1, "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..7]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for ch in &chunks {
        assert_eq!(ch["id"], "chatcmpl-req-1");
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["model"], "qwen32b");
        assert!(ch["created"].as_u64().unwrap() > 1_600_000_000);
    }
    let role = &chunks[0]["choices"][0];
    assert_eq!(role["delta"], json!({"role": "assistant", "content": ""}));
    assert!(role["finish_reason"].is_null());
    for (i, ch) in chunks[1..6].iter().enumerate() {
        let choice = &ch["choices"][0];
        assert!(!choice["delta"]["content"].as_str().unwrap().is_empty());
        let want = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], want, "chunk {i}");
    }
    let usage = &chunks[6];
    assert_eq!(usage["choices"], json!([]));
    // "hello there, sim" is 16 characters → 4 prompt tokens.
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5})
    );
    assert_eq!(sim.stats().captured("req-1").unwrap(), body);
    assert_eq!(sim.stats().completed.load(Relaxed), 1);
    assert_eq!(sim.stats().requests.load(Relaxed), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_chat_exact_frames_zero_delay() {
    streaming_chat_frames(zero_delay()).await;
}

#[tokio::test]
async fn streaming_chat_exact_frames_through_scheduler() {
    streaming_chat_frames(timed()).await;
}

#[tokio::test]
async fn streaming_completions_have_no_role_chunk() {
    let sim = start(timed()).await.unwrap();
    let c = client();
    let req = json!({"model": "qwen32b", "prompt": "abcdefgh", "max_tokens": 3, "stream": true});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 4);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(first["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(first["object"], "text_completion");
    assert!(first["choices"][0]["text"].is_string());
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(events[3], "[DONE]");
    sim.shutdown().await;
}

#[tokio::test]
async fn non_streaming_shapes() {
    let sim = start(timed()).await.unwrap();
    let c = client();
    let req = json!({"model": "qwen32b", "messages": [{"role": "user", "content": "12345678"}],
        "max_completion_tokens": 7});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "application/json");
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "chat.completion");
    let id = v["id"].as_str().unwrap();
    let hex = id.strip_prefix("chatcmpl-").unwrap();
    assert!(
        hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "vLLM's ids: {id}"
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 9);

    let req = json!({"model": "qwen32b", "prompt": [1, 2, 3], "max_tokens": 2});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(sim.stats().completed.load(Relaxed), 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn same_request_same_tokens() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "determinism"}], "max_tokens": 40});
    let mut texts = Vec::new();
    for _ in 0..2 {
        let r = send(
            &c,
            &sim,
            "POST",
            "/v1/chat/completions",
            Some(req.clone()),
            &[],
        )
        .await;
        let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
        texts.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(texts[0], texts[1]);
    sim.shutdown().await;
}

#[tokio::test]
async fn zero_delay_long_stream() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let req = json!({"prompt": "p", "max_tokens": 5000, "stream": true});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.len(), 5001);
    for e in &events[..5000] {
        let _: Value = serde_json::from_str(e).unwrap();
    }
    assert_eq!(sim.stats().running.load(Relaxed), 0);
    sim.shutdown().await;
}

#[tokio::test]
async fn chat_batch_answers_one_choice_per_conversation() {
    let sim = start(zero_delay()).await.unwrap();
    let c = client();
    let convs =
        json!([[{"role": "user", "content": "one"}], [{"role": "user", "content": "two two"}]]);
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "max_tokens": 3})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].clone(), choices[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(
        v["usage"]["prompt_tokens"],
        tokens::count("one") + tokens::count("two two")
    );
    // vLLM 0.32 does not refuse `stream`: one JSON body, each choice its last token.
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "max_tokens": 3, "stream": true})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions/batch",
        Some(json!({"messages": convs, "n": 2})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    sim.shutdown().await;
}
