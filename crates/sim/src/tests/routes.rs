//! The routes around generation: `--api-key`, the tokenizer, vLLM's error shapes, the model
//! list and `/metrics`.

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

use crate::{SimArgs, start};

use super::{client, openai_error, read_all, send, zero_delay};

#[tokio::test]
async fn api_key_is_enforced_on_v1_only() {
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    for headers in [
        &[][..],
        &[("authorization", "Bearersekret")][..],
        &[("authorization", "Bearer wrong")][..],
    ] {
        let r = send(
            &c,
            &sim,
            "POST",
            "/v1/chat/completions",
            Some(req.clone()),
            headers,
        )
        .await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(&read_all(r).await[..], br#"{"error":"Unauthorized"}"#);
    }
    let r = send(&c, &sim, "GET", "/v1/models", None, &[]).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let ok = [("authorization", "Bearer sekret")];
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &ok).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = send(&c, &sim, "GET", "/health", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(read_all(r).await.is_empty());
    assert!(
        format!(
            "{:?}",
            SimArgs {
                api_key: Some("sekret".into()),
                ..SimArgs::default()
            }
        )
        .contains("*****")
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_detokenize_like_vllm() {
    // As vLLM: at the root, outside the /v1 paths its --api-key guards.
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let prompt = "hello there, sim";
    let req = json!({"model": "qwen32b", "prompt": prompt, "add_special_tokens": false});
    let r = send(&c, &sim, "POST", "/tokenize", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    // The count generation reports as usage.prompt_tokens for the same prompt.
    assert_eq!(v["count"], 4);
    assert_eq!(v["max_model_len"], 32768);
    assert!(v["token_strs"].is_null());
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 4);

    // The first three tokens back to text.
    let req = json!({"model": "qwen32b", "tokens": tokens[..3]});
    let r = send(&c, &sim, "POST", "/detokenize", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v, json!({"prompt": "hello there,"}));

    // Chat messages go through the sim's template (their texts, concatenated); the same text
    // gives the same ids on any sim.
    let req = json!({"messages": [{"role": "user", "content": "hello there"},
        {"role": "user", "content": [{"type": "text", "text": ", sim"}]}],
        "return_token_strs": true});
    let r = send(&c, &sim, "POST", "/tokenize", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["tokens"], Value::Array(tokens));
    assert_eq!(v["token_strs"], json!(["hell", "o th", "ere,", " sim"]));
    assert_eq!(sim.stats().tokenizations.load(Relaxed), 3);
    assert_eq!(sim.stats().requests.load(Relaxed), 0);

    // vLLM's errors: an unknown model, a missing prompt, an id outside the vocabulary, GET.
    let r = send(
        &c,
        &sim,
        "POST",
        "/tokenize",
        Some(json!({"model": "x", "prompt": "a"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let (msg, kind, _, _) = openai_error(&read_all(r).await);
    assert!(msg.contains("`x` does not exist"), "{msg}");
    assert_eq!(kind, "NotFoundError");
    let r = send(
        &c,
        &sim,
        "POST",
        "/tokenize",
        Some(json!({"model": "qwen32b"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = send(
        &c,
        &sim,
        "POST",
        "/detokenize",
        Some(json!({"tokens": [1_114_112]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let (msg, _, _, _) = openai_error(&read_all(r).await);
    assert!(msg.contains("1114112"), "{msg}");
    let r = send(&c, &sim, "GET", "/tokenize", None, &[]).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
}

#[tokio::test]
async fn client_errors_in_vllm_shape() {
    let sim = start(SimArgs {
        max_model_len: 100,
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(json!({"model": "gpt-4", "messages": []})),
        &[("x-request-id", "bad-model")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let body = read_all(r).await;
    let (msg, kind, param, code) = openai_error(&body);
    assert_eq!(
        msg,
        "The model `gpt-4` does not exist. Valid aliases: qwen32b."
    );
    assert_eq!(
        (kind.as_str(), param, code),
        ("NotFoundError", json!("model"), 404)
    );
    assert_eq!(sim.stats().captured("bad-model").unwrap(), body);

    let bad = Request::builder()
        .method("POST")
        .uri(format!("{}/v1/completions", sim.url()))
        .body(Full::new(Bytes::from_static(b"{not json")))
        .unwrap();
    let r = c.request(bad).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // FastAPI's validation error, at the byte where the JSON breaks (vLLM 0.32).
    let (_, kind, param, code) = openai_error(&read_all(r).await);
    assert_eq!(
        (kind.as_str(), param, code),
        ("Bad Request", json!("body.1"), 400)
    );
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/chat/completions",
        Some(json!({"model": "qwen32b", "messages": "hello"})),
        &[],
    )
    .await;
    let (_, kind, param, _) = openai_error(&read_all(r).await);
    assert_eq!(
        (kind.as_str(), param),
        ("Bad Request", json!("body.messages"))
    );

    // A prompt that leaves no room, and max_tokens alone over the context, are refused naming
    // the parameter; prompt + max_tokens over it is clamped.
    let long = json!({"prompt": "x".repeat(400), "max_tokens": 10});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(long), &[]).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let (msg, _, param, _) = openai_error(&read_all(r).await);
    assert_eq!(param, json!("input_tokens"));
    assert!(
        msg.starts_with("This model's maximum context length is 100 tokens. However, your prompt contains at least 100 input tokens"),
        "{msg}"
    );
    let over = json!({"prompt": "hello", "max_tokens": 101});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(over), &[]).await;
    let (msg, _, param, _) = openai_error(&read_all(r).await);
    assert_eq!(param, json!("max_tokens"));
    assert!(
        msg.starts_with("max_tokens=101 cannot be greater than max_model_len=100"),
        "{msg}"
    );
    let clamped = json!({"prompt": "x".repeat(360), "max_tokens": 50});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(clamped), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 10, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    let r = send(&c, &sim, "GET", "/v1/nope", None, &[]).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = send(&c, &sim, "GET", "/v1/chat/completions", None, &[]).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
}

#[tokio::test]
async fn models_and_metrics() {
    let sim = start(SimArgs {
        served_model_name: vec!["a".into(), "b".into()],
        ..zero_delay()
    })
    .await
    .unwrap();
    let c = client();
    let r = send(&c, &sim, "GET", "/v1/models", None, &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "a");
    assert_eq!(v["data"][1]["id"], "b");
    assert_eq!(v["data"][0]["owned_by"], "vllm");
    assert_eq!(v["data"][0]["max_model_len"], 32768);
    assert!(v["data"][0]["parent"].is_null());
    // vLLM's root is the model it loaded, the same on every card.
    assert_eq!(v["data"][1]["root"], "a");
    let perm = v["data"][0]["permission"][0]["id"].as_str().unwrap();
    assert_eq!(perm.len(), "modelperm-".len() + 16, "{perm}");

    let req =
        json!({"model": "b", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 3});
    let r = send(&c, &sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["model"], "a", "the first served name is reported");

    let r = send(&c, &sim, "GET", "/metrics", None, &[]).await;
    let text = String::from_utf8(read_all(r).await.to_vec()).unwrap();
    for line in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 0.0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 0.0",
        "vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"a\",reason=\"capacity\"} 0.0",
        "vllm:prompt_tokens_total{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:generation_tokens_total{engine=\"0\",model_name=\"a\"} 3.0",
        "vllm:request_success_total{engine=\"0\",model_name=\"a\",finished_reason=\"length\"} 1.0",
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"a\"} 2.0",
        "vllm:request_queue_time_seconds_count{engine=\"0\",model_name=\"a\"} 1.0",
        "vllm:request_generation_tokens_sum{engine=\"0\",model_name=\"a\"} 3.0",
        "vllm:request_prompt_tokens_bucket{engine=\"0\",model_name=\"a\",le=\"1.0\"} 1.0",
        "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",model_name=\"a\",le=\"+Inf\"} 1.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
    }
    assert!(
        !text.contains("gpu_cache_usage_perc"),
        "gone since vLLM 0.10"
    );
    sim.shutdown().await;
}
