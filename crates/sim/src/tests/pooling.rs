//! The pooling runner (`--runner pooling`): embeddings, score and rerank, classify, and which
//! routes each runner serves.

use http::StatusCode;
use serde_json::{Value, json};

use crate::{Convert, Runner, SimArgs, start, tokens};

use super::{KEYED, client, keys_of, read_all, send, zero_delay};

fn pooling_sim(convert: Convert) -> SimArgs {
    SimArgs {
        runner: Runner::Pooling,
        convert,
        embedding_size: 16,
        api_key: Some("sekret".into()),
        ..zero_delay()
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[tokio::test]
async fn embeddings_are_deterministic_unit_vectors_in_both_encodings() {
    use base64::Engine as _;
    let sim = start(pooling_sim(Convert::Embed)).await.unwrap();
    let c = client();
    let ask = |input: Value, format: &str| json!({"model": "qwen32b", "input": input, "encoding_format": format});
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!(["hello there", "hello there", "other"]), "float")),
        &KEYED,
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["object"], "list");
    assert!(v["id"].as_str().unwrap().starts_with("embd-"));
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let (a, b, o) = (
        floats(&data[0]["embedding"]),
        floats(&data[1]["embedding"]),
        floats(&data[2]["embedding"]),
    );
    assert_eq!(a.len(), 16);
    assert!((a.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);
    assert_eq!(a, b, "the same text, the same vector");
    assert_ne!(a, o);
    // Counted by the sim's tokenizer, the one /tokenize answers with.
    let n = 2 * tokens::count("hello there") + tokens::count("other");
    assert_eq!(v["usage"]["prompt_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], n);
    assert_eq!(v["usage"]["completion_tokens"], 0);

    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!("hello there"), "base64")),
        &KEYED,
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = raw
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // (JSON floats are f32s widened; narrowing them back is exact.)
    let narrowed: Vec<f32> = a.iter().map(|x| *x as f32).collect();
    assert_eq!(
        decoded, narrowed,
        "base64 holds the same little-endian f32s"
    );

    // Not a Matryoshka model: vLLM refuses `dimensions` whatever its value.
    let mut dims = ask(json!("x"), "float");
    dims["dimensions"] = json!(8);
    let r = send(&c, &sim, "POST", "/v1/embeddings", Some(dims), &KEYED).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Matryoshka"),
        "{e}"
    );

    // Token ids and lists of them.
    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/embeddings",
        Some(ask(json!([[1, 2, 3], [4]]), "float")),
        &KEYED,
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    sim.shutdown().await;
}

#[tokio::test]
async fn rerank_sorts_and_score_compares_like_vllm() {
    let sim = start(pooling_sim(Convert::Embed)).await.unwrap();
    let c = client();
    let body =
        json!({"query": "apple pie", "documents": ["zebra", "apple pie", "car"], "top_n": 2});
    // /rerank is not under /v1 or /v2: vLLM's key does not guard it.
    let r = send(&c, &sim, "POST", "/rerank", Some(body.clone()), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "top_n");
    assert_eq!(results[0]["index"], 1, "the identical document first");
    assert_eq!(results[0]["document"]["text"], "apple pie");
    assert!((results[0]["relevance_score"].as_f64().unwrap() - 1.0).abs() < 1e-5);
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    assert_eq!(
        keys_of(&v["usage"]),
        ["prompt_tokens", "total_tokens"],
        "rerank's usage has two keys"
    );
    let r = send(&c, &sim, "POST", "/v2/rerank", Some(body), &[]).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "/v2 is guarded");

    let r = send(
        &c,
        &sim,
        "POST",
        "/score",
        Some(json!({"text_1": ["a", "b"], "text_2": ["a", "c"]})),
        &[],
    )
    .await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert!((v["data"][0]["score"].as_f64().unwrap() - 1.0).abs() < 1e-5);
    let r = send(
        &c,
        &sim,
        "POST",
        "/score",
        Some(json!({"queries": ["a", "b"], "documents": ["a", "b", "c"]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(
        e["error"]["message"],
        "Input lengths must be either 1:1, 1:N or N:N"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn each_runner_serves_its_own_routes() {
    let c = client();
    let gen_sim = start(SimArgs {
        api_key: Some("sekret".into()),
        ..zero_delay()
    })
    .await
    .unwrap();
    for path in [
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/v2/embed",
    ] {
        let r = send(
            &c,
            &gen_sim,
            "POST",
            path,
            Some(json!({"input": "x"})),
            &KEYED,
        )
        .await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path} on a generative model"
        );
        assert_eq!(&read_all(r).await[..], br#"{"detail":"Not Found"}"#);
    }
    gen_sim.shutdown().await;

    let pool = start(pooling_sim(Convert::Embed)).await.unwrap();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
        "/v1/audio/transcriptions",
        "/classify",
    ] {
        let r = send(&c, &pool, "POST", path, Some(chat.clone()), &KEYED).await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path} on an embedding model"
        );
    }
    let r = send(&c, &pool, "GET", "/v1/models", None, &KEYED).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = send(&c, &pool, "GET", "/v1/embeddings", None, &KEYED).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    let r = send(&c, &pool, "GET", "/metrics", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    pool.shutdown().await;

    let classify = start(pooling_sim(Convert::Classify)).await.unwrap();
    let r = send(
        &c,
        &classify,
        "POST",
        "/classify",
        Some(json!({"input": ["a", "b c"]})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    let first = &v["data"][0];
    assert_eq!(first["num_classes"], 2);
    assert!((floats(&first["probs"]).iter().sum::<f64>() - 1.0).abs() < 1e-5);
    assert!(first["label"].as_str().unwrap().starts_with("LABEL_"));
    for path in ["/rerank", "/v1/embeddings"] {
        let r = send(
            &c,
            &classify,
            "POST",
            path,
            Some(json!({"query": "a", "documents": ["b"]})),
            &KEYED,
        )
        .await;
        assert_eq!(
            r.status(),
            StatusCode::NOT_FOUND,
            "{path}: two labels, no scoring"
        );
    }
    classify.shutdown().await;
}
