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

/// A streamed chat's content deltas, its finish reason and its usage.
async fn streamed_chat(sim: &crate::SimServer, body: Value) -> (Vec<String>, String, Value) {
    let r = send(
        &client(),
        sim,
        "POST",
        "/v1/chat/completions",
        Some(body),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut deltas = Vec::new();
    let (mut finish, mut usage) = (String::new(), Value::Null);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
            && v["choices"][0]["delta"].get("role").is_none()
        {
            deltas.push(c.to_owned());
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_owned();
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (deltas, finish, usage)
}

/// `continue_final_message` as vLLM takes it: the final message is the answer so far, and the
/// answer goes on from it. The sim's words depend on the conversation before that message, so
/// a continuation of its own start is the rest of the same answer, token for token — what a
/// resumed stream must give. `add_generation_prompt` left at its default is refused, as vLLM
/// 0.32 refuses it.
#[tokio::test]
async fn a_continued_answer_goes_on_where_it_stopped() {
    const QUESTION: &str = "Tell me the whole story, please.";
    for natural_end in [None, Some(20)] {
        let sim = start(SimArgs {
            output_tokens: natural_end,
            ..zero_delay()
        })
        .await
        .unwrap();
        let question = json!([{"role": "user", "content": QUESTION}]);
        let options = json!({"include_usage": true});
        let (whole, finish, usage) = streamed_chat(
            &sim,
            json!({"messages": question, "max_tokens": 30, "stream": true, "stream_options": options}),
        )
        .await;
        let (len, want_finish) = match natural_end {
            Some(n) => (n as usize, "stop"),
            None => (30, "length"),
        };
        assert_eq!((whole.len(), finish.as_str()), (len, want_finish));
        assert_eq!(usage["prompt_tokens"], tokens::count(QUESTION) as u64);
        for cut in [1, 12, len - 1] {
            let so_far: String = whole[..cut].concat();
            let mut messages = question.as_array().unwrap().clone();
            messages.push(json!({"role": "assistant", "content": so_far}));
            let body = json!({
                "messages": messages, "max_tokens": 30 - cut, "stream": true,
                "stream_options": options, "continue_final_message": true,
                "add_generation_prompt": false,
            });
            let (rest, finish, usage) = streamed_chat(&sim, body).await;
            assert_eq!(rest, whole[cut..], "cut after {cut} tokens");
            assert_eq!(finish, want_finish);
            assert_eq!(usage["completion_tokens"], (len - cut) as u64);
            // The answer so far is part of the continuation's prompt.
            assert_eq!(
                usage["prompt_tokens"].as_u64().unwrap(),
                tokens::count(&format!("{QUESTION}{so_far}")) as u64
            );
        }
        // Text that is not the sim's own start is continued with a new answer, in full.
        let mut messages = question.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": "Once upon a time"}));
        let (rest, _, _) = streamed_chat(
            &sim,
            json!({"messages": messages, "max_tokens": 5, "stream": true,
                   "continue_final_message": true, "add_generation_prompt": false}),
        )
        .await;
        assert_eq!(rest.len(), 5.min(len));
        // Without add_generation_prompt: false, refused as vLLM does.
        let r = send(
            &client(),
            &sim,
            "POST",
            "/v1/chat/completions",
            Some(json!({"messages": messages, "max_tokens": 5, "continue_final_message": true})),
            &[],
        )
        .await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let (message, kind, _, _) = super::openai_error(&read_all(r).await);
        assert!(
            message.starts_with(
                "continue_final_message and add_generation_prompt are not compatible."
            ),
            "{message}"
        );
        assert_eq!(kind, "BadRequestError");
        sim.shutdown().await;
    }
}
