//! The gateway's view of a prompt as tokens against real vLLM's own `POST /tokenize`, for a
//! model with a real BPE tokenizer and a chat template with tools (`scripts/real-vllm.sh model
//! --qwen`, then `start --qwen`): every request shape of tests/fixtures/vllm-0.32.0/
//! tokenize-qwen3.json — a system prompt, several turns, tools, an assistant tool call and its
//! results, text content parts, reasoning, a continued answer, CJK and emoji — and a
//! completions prompt, token for token. Skipped, saying so, against another model.

use super::*;
use fleetgate_gateway::pool::PromptTokens;
use serde_json::{Value, json};

#[tokio::test]
async fn the_gateways_tokens_are_vllms_for_every_request_shape() {
    let _serial = SERIAL.lock().await;
    let test = "the_gateways_tokens_are_vllms_for_every_request_shape";
    let Some(r) = real(test).await else { return };
    if !r.root.ends_with("tiny-qwen") {
        eprintln!(
            "\n*** SKIPPED {test}: the server does not serve the Qwen-token model (scripts/real-vllm.sh start --qwen). ***\n"
        );
        return;
    }
    let tokens = PromptTokens::load(std::path::Path::new(&r.root), None).unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/vllm-0.32.0/tokenize-qwen3.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let tokenize = |body: Value| {
        let url: http::Uri = format!("{}/tokenize", r.url).parse().unwrap();
        let key = format!("Bearer {}", r.key);
        async move {
            let m = post(
                &url,
                &[("authorization", &key)],
                Bytes::from(body.to_string()),
            )
            .await;
            assert_eq!(m.status, 200);
            let v: Value = serde_json::from_slice(m.body.as_deref().unwrap()).unwrap();
            v["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                .collect::<Vec<u32>>()
        }
    };
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (ours, theirs) = match case.get("request") {
            Some(request) => {
                let mut body = request.clone();
                body["model"] = json!(r.model);
                let started = std::time::Instant::now();
                let ours = tokens.chat(&serde_json::to_vec(&body).unwrap()).unwrap();
                eprintln!(
                    "{name}: {} tokens rendered and cut in {:?}",
                    ours.len(),
                    started.elapsed()
                );
                (ours, tokenize(body).await)
            }
            None => {
                let prompt = case["prompt"].as_str().unwrap();
                (
                    tokens.completion(prompt).unwrap(),
                    tokenize(json!({"model": r.model, "prompt": prompt})).await,
                )
            }
        };
        assert_eq!(ours, theirs, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 9);
}
