//! Resuming a stream on another backend (issue 60): the continuation `fleetgate_protocol::
//! resume` builds from a cut answer, sent to a second sim, and its chunks made the first
//! answer's own, give the client exactly the answer an uninterrupted stream would have — the
//! same chunk id throughout, no token repeated or lost at the seam, the finish reason of the
//! continuation — for chat and completions, cut anywhere.

use crate::common::*;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::resume::{AnswerSoFar, Seam, continuation, one_usage, tokenize_body};
use serde_json::{Value, json};

/// The `data:` payloads of a streamed answer.
fn payloads(m: &fleetgate_protocol::client::Measured) -> Vec<Vec<u8>> {
    let body = m.body.as_deref().expect("body kept");
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| d.as_bytes().to_vec())
        .collect()
}

/// Is this payload a token event (content or text)?
fn is_token(p: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(p) else {
        return false;
    };
    let c = &v["choices"][0];
    c["text"].is_string() || (c["delta"]["content"].is_string() && c["delta"]["role"].is_null())
}

fn text_of(p: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(p).ok()?;
    let c = &v["choices"][0];
    c["delta"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .map(str::to_owned)
}

#[tokio::test]
async fn a_cut_answer_continued_on_another_sim_is_the_uninterrupted_answer() {
    // Two sims with the same seed: the same model on two servers.
    let first = sim(|a| a.zero_delay = true).await;
    let second = sim(|a| a.zero_delay = true).await;
    let cases = [
        (
            Endpoint::Chat,
            "/v1/chat/completions",
            json!({"model": "qwen32b", "stream": true, "max_tokens": 24,
                   "stream_options": {"include_usage": true},
                   "messages": [{"role": "user", "content": "Tell me everything."}]}),
        ),
        (
            Endpoint::Completions,
            "/v1/completions",
            json!({"model": "qwen32b", "stream": true, "max_tokens": 24,
                   "stream_options": {"include_usage": true}, "prompt": "Once upon a time"}),
        ),
    ];
    for (endpoint, path, request) in cases {
        let url = |s: &fleetgate_sim::SimServer| format!("{}{path}", s.url()).parse().unwrap();
        let whole = payloads(&post(&url(&first), &[], request.to_string()).await);
        let whole_text: Vec<String> = whole
            .iter()
            .filter(|p| is_token(p))
            .filter_map(|p| text_of(p))
            .collect();
        assert_eq!(whole_text.len(), 24);
        // Cut after `cut` token events, as a backend dying there leaves the client.
        for cut in [1, 9, 23] {
            let mut so_far = AnswerSoFar::new();
            let mut client: Vec<Vec<u8>> = Vec::new();
            let mut tokens = 0;
            for p in &whole {
                if tokens == cut {
                    break;
                }
                if is_token(p) {
                    tokens += 1;
                    so_far.observe(p);
                }
                client.push(p.clone());
            }
            let seam = Seam::learn(&client[0]).unwrap();
            let next = continuation(endpoint, request.to_string().as_bytes(), &so_far)
                .unwrap()
                .expect("tokens left");
            let rest = payloads(&post(&url(&second), &[], next).await);
            // The original prompt, counted by the backend that continues.
            let count = post(
                &format!("{}/tokenize", second.url()).parse().unwrap(),
                &[],
                tokenize_body(endpoint, request.to_string().as_bytes()).unwrap(),
            )
            .await;
            assert_eq!(count.status, 200);
            let prompt_tokens = serde_json::from_slice::<Value>(count.body.as_deref().unwrap())
                .unwrap()["count"]
                .as_u64()
                .unwrap();
            for p in &rest {
                if let Some(p) = seam.rewrite(p) {
                    client.push(one_usage(&p, prompt_tokens, cut).unwrap_or(p));
                }
            }
            // One answer: the uninterrupted answer's tokens, one id, its finish reason.
            let texts: Vec<String> = client
                .iter()
                .filter(|p| is_token(p))
                .filter_map(|p| text_of(p))
                .collect();
            assert_eq!(texts, whole_text, "{endpoint:?} cut after {cut}");
            let chunks: Vec<Value> = client
                .iter()
                .filter_map(|p| serde_json::from_slice(p).ok())
                .collect();
            let first_id = &chunks[0]["id"];
            assert!(chunks.iter().all(|c| &c["id"] == first_id), "{chunks:?}");
            let roles = chunks
                .iter()
                .filter(|c| !c["choices"][0]["delta"]["role"].is_null())
                .count();
            assert_eq!(roles, usize::from(endpoint == Endpoint::Chat));
            let finishes: Vec<&Value> = chunks
                .iter()
                .map(|c| &c["choices"][0]["finish_reason"])
                .filter(|f| !f.is_null())
                .collect();
            assert_eq!(finishes, [&json!("length")]);
            assert_eq!(client.last().map(Vec::as_slice), Some(&b"[DONE]"[..]));
            // One usage: the uninterrupted answer's.
            let usage = |chunks: &[Value]| {
                chunks.iter().rev().find(|c| !c["usage"].is_null()).unwrap()["usage"].clone()
            };
            let whole_chunks: Vec<Value> = whole
                .iter()
                .filter_map(|p| serde_json::from_slice(p).ok())
                .collect();
            assert_eq!(
                usage(&chunks),
                usage(&whole_chunks),
                "{endpoint:?} cut after {cut}"
            );
            assert_eq!(usage(&chunks)["completion_tokens"], 24);
        }
    }
    first.shutdown().await;
    second.shutdown().await;
}

/// The sim's engine failure (`--error-after-chunks`) is vLLM's `EngineDeadError` event, which
/// calls for resuming; the stream then ends with `[DONE]` as vLLM's does.
#[tokio::test]
async fn the_sims_dead_engine_is_recognised() {
    use fleetgate_protocol::resume::{Cause, failure_in};
    let s = sim(|a| {
        a.zero_delay = true;
        a.error_after_chunks = Some(3);
    })
    .await;
    let m = post(
        &format!("{}/v1/chat/completions", s.url()).parse().unwrap(),
        &[],
        json!({"model": "qwen32b", "stream": true, "max_tokens": 10,
               "messages": [{"role": "user", "content": "hi"}]})
        .to_string(),
    )
    .await;
    let events = payloads(&m);
    let causes: Vec<Option<Cause>> = events.iter().map(|p| failure_in(p)).collect();
    assert_eq!(
        causes.iter().filter(|c| c.is_some()).collect::<Vec<_>>(),
        [&Some(Cause::EngineDead)],
        "{events:?}"
    );
    assert_eq!(events.last().map(Vec::as_slice), Some(&b"[DONE]"[..]));
    s.shutdown().await;
}
