//! LoRA adapters: `--enable-lora` and `--lora-modules`, the model list, requests naming an
//! adapter, the load and unload routes of VLLM_ALLOW_RUNTIME_LORA_UPDATING, `--max-loras` in
//! the running batch and `vllm:lora_requests_info`.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use http::StatusCode;
use http::header::CONTENT_TYPE;
use serde_json::{Value, json};

use crate::{Convert, Runner, SimArgs, SimServer, start};

use super::{TestClient, client, eventually, openai_error, read_all, send, timed, zero_delay};

/// A directory that exists, standing for an adapter's files (the sim reads none of them).
const ADAPTER_DIR: &str = env!("CARGO_MANIFEST_DIR");

fn with_lora(modules: &[&str]) -> SimArgs {
    SimArgs {
        enable_lora: true,
        lora_modules: modules.iter().map(|m| (*m).to_owned()).collect(),
        lora_load_delay_ms: 0.0,
        ..zero_delay()
    }
}

/// With the load and unload routes (the environment flag, set in the config, not the process).
fn runtime_updates(args: SimArgs) -> SimArgs {
    SimArgs {
        runtime_lora_updating: true,
        ..args
    }
}

async fn json_of(r: http::Response<hyper::body::Incoming>) -> Value {
    serde_json::from_slice(&read_all(r).await).unwrap()
}

async fn models(c: &TestClient, sim: &SimServer) -> Vec<Value> {
    let r = send(c, sim, "GET", "/v1/models", None, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    json_of(r).await["data"].as_array().unwrap().clone()
}

fn ids(cards: &[Value]) -> Vec<&str> {
    cards.iter().map(|m| m["id"].as_str().unwrap()).collect()
}

async fn chat(c: &TestClient, sim: &SimServer, model: &str) -> (StatusCode, Value) {
    let req =
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = send(c, sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
    (r.status(), json_of(r).await)
}

/// A load or unload: the status, the content type and the body as text.
async fn adapter_call(
    c: &TestClient,
    sim: &SimServer,
    route: &str,
    body: Value,
) -> (StatusCode, Option<String>, String) {
    let r = send(c, sim, "POST", route, Some(body), &[]).await;
    let status = r.status();
    let content_type = r
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned());
    let body = String::from_utf8(read_all(r).await.to_vec()).unwrap();
    (status, content_type, body)
}

fn error_of(body: &str) -> (String, String, Value, u64) {
    openai_error(body.as_bytes())
}

#[tokio::test]
async fn lora_modules_are_listed_after_the_base_model_with_their_parent() {
    let on_alias =
        format!(r#"{{"name": "chat", "path": "{ADAPTER_DIR}", "base_model_name": "alias"}}"#);
    let on_unknown =
        format!(r#"{{"name": "other", "path": "{ADAPTER_DIR}", "base_model_name": "nope"}}"#);
    let sim = start(SimArgs {
        served_model_name: vec!["base".into(), "alias".into()],
        ..with_lora(&[&format!("sql={ADAPTER_DIR}"), &on_alias, &on_unknown])
    })
    .await
    .unwrap();
    let c = client();
    let cards = models(&c, &sim).await;
    assert_eq!(ids(&cards), ["base", "alias", "sql", "chat", "other"]);
    assert_eq!(cards[0]["parent"], Value::Null);
    assert_eq!(cards[0]["max_model_len"], 32768);
    for (card, parent) in cards[2..].iter().zip(["base", "alias", "base"]) {
        assert_eq!(card["root"], ADAPTER_DIR, "{card}");
        // vLLM: the module's base model when it is a served name, else the first served name.
        assert_eq!(card["parent"], parent, "{card}");
        assert_eq!(card["max_model_len"], Value::Null, "{card}");
        assert_eq!(card["object"], "model");
        assert_eq!(card["owned_by"], "vllm");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn a_request_naming_an_adapter_is_answered_under_its_name() {
    let sim = start(with_lora(&[&format!("sql={ADAPTER_DIR}")]))
        .await
        .unwrap();
    let c = client();
    let (status, v) = chat(&c, &sim, "sql").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "sql");
    let (_, v) = chat(&c, &sim, "qwen32b").await;
    assert_eq!(v["model"], "qwen32b");
    let req = json!({"model": "sql", "prompt": "hi", "max_tokens": 2, "stream": true});
    let r = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body = String::from_utf8(read_all(r).await.to_vec()).unwrap();
    let chunks: Vec<Value> = super::sse_events(body.as_bytes())
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(!chunks.is_empty());
    assert!(chunks.iter().all(|ch| ch["model"] == "sql"), "{body}");
    let req =
        json!({"model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let r = send(&c, &sim, "POST", "/v1/messages", Some(req), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(json_of(r).await["model"], "sql");
    let r = send(
        &c,
        &sim,
        "POST",
        "/tokenize",
        Some(json!({"model": "sql", "prompt": "hi"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    // An unknown name keeps vLLM's 404, which lists the served names only.
    let (status, v) = chat(&c, &sim, "nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v["error"]["message"],
        "The model `nope` does not exist. Valid aliases: qwen32b."
    );
    sim.shutdown().await;

    let pooling = start(SimArgs {
        runner: Runner::Pooling,
        convert: Convert::Embed,
        ..with_lora(&[&format!("emb={ADAPTER_DIR}")])
    })
    .await
    .unwrap();
    let r = send(
        &c,
        &pooling,
        "POST",
        "/v1/embeddings",
        Some(json!({"model": "emb", "input": "hi"})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(json_of(r).await["model"], "emb");
    pooling.shutdown().await;
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time() {
    let sim = start(runtime_updates(with_lora(&[]))).await.unwrap();
    let c = client();
    let load = json!({"lora_name": "sql", "lora_path": ADAPTER_DIR});
    let (status, content_type, body) =
        adapter_call(&c, &sim, "/v1/load_lora_adapter", load.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "Success: LoRA adapter 'sql' added successfully.");
    assert_eq!(
        content_type, None,
        "vLLM's plain Response has no content type"
    );
    assert_eq!(ids(&models(&c, &sim).await), ["qwen32b", "sql"]);
    let (status, v) = chat(&c, &sim, "sql").await;
    assert_eq!((status, &v["model"]), (StatusCode::OK, &json!("sql")));

    let (status, _, body) = adapter_call(&c, &sim, "/v1/load_lora_adapter", load.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_of(&body),
        (
            "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.".into(),
            "InvalidUserInput".into(),
            Value::Null,
            400
        )
    );
    let inplace = json!({"lora_name": "sql", "lora_path": ADAPTER_DIR, "load_inplace": true});
    let (status, _, _) = adapter_call(&c, &sim, "/v1/load_lora_adapter", inplace).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&models(&c, &sim).await), ["qwen32b", "sql"]);

    let (status, content_type, body) = adapter_call(
        &c,
        &sim,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "sql"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "Success: LoRA adapter 'sql' removed successfully.");
    assert_eq!(content_type, None);
    assert_eq!(ids(&models(&c, &sim).await), ["qwen32b"]);
    let (status, v) = chat(&c, &sim, "sql").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v["error"]["message"],
        "The model `sql` does not exist. Valid aliases: qwen32b."
    );

    let (status, _, body) = adapter_call(
        &c,
        &sim,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "sql"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        error_of(&body),
        (
            "The lora adapter 'sql' cannot be found.".into(),
            "NotFoundError".into(),
            Value::Null,
            404
        )
    );
    let (status, _, body) = adapter_call(
        &c,
        &sim,
        "/v1/unload_lora_adapter",
        json!({"lora_name": ""}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_of(&body).0,
        "'lora_name' needs to be provided to unload a LoRA adapter."
    );
    let (status, _, body) = adapter_call(
        &c,
        &sim,
        "/v1/load_lora_adapter",
        json!({"lora_name": "x", "lora_path": ""}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_of(&body).0,
        "Both 'lora_name' and 'lora_path' must be provided."
    );
    // A field left out is FastAPI's validation error.
    let (status, _, body) =
        adapter_call(&c, &sim, "/v1/load_lora_adapter", json!({"lora_name": "x"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&body).2, "body.lora_path");
    let missing = "/no/such/adapter";
    let (status, _, body) = adapter_call(
        &c,
        &sim,
        "/v1/load_lora_adapter",
        json!({"lora_name": "gone", "lora_path": missing}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        error_of(&body),
        (
            format!("Loading lora gone failed: No adapter found for {missing}"),
            "NotFoundError".into(),
            Value::Null,
            404
        )
    );
    assert_eq!(ids(&models(&c, &sim).await), ["qwen32b"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn the_adapter_routes_exist_only_with_the_environment_flag() {
    let c = client();
    let sim = start(with_lora(&[])).await.unwrap();
    for route in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] {
        let body = json!({"lora_name": "sql", "lora_path": ADAPTER_DIR});
        let (status, _, body) = adapter_call(&c, &sim, route, body).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{route}");
        assert_eq!(body, r#"{"detail":"Not Found"}"#);
    }
    assert_eq!(ids(&models(&c, &sim).await), ["qwen32b"]);
    sim.shutdown().await;

    let sim = start(runtime_updates(with_lora(&[]))).await.unwrap();
    let r = send(&c, &sim, "GET", "/v1/load_lora_adapter", None, &[]).await;
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;

    // The flag without --enable-lora: vLLM serves the routes and its engine refuses the load.
    let sim = start(runtime_updates(zero_delay())).await.unwrap();
    let body = json!({"lora_name": "sql", "lora_path": ADAPTER_DIR});
    let (status, _, body) = adapter_call(&c, &sim, "/v1/load_lora_adapter", body).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        error_of(&body),
        (
            "LoRA is not enabled. Use --enable-lora to enable LoRA.".into(),
            "InternalServerError".into(),
            Value::Null,
            500
        )
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn lora_flags_that_vllm_refuses_stop_the_start() {
    let module = format!("sql={ADAPTER_DIR}");
    for (args, says) in [
        (
            SimArgs {
                enable_lora: false,
                ..with_lora(&[&module])
            },
            "--enable-lora",
        ),
        (
            with_lora(&["sql=/no/such/adapter"]),
            "No adapter found for /no/such/adapter",
        ),
        (
            with_lora(&[&module, &module]),
            "'sql' has already been loaded",
        ),
        (
            with_lora(&[r#"{"name": "sql"}"#]),
            "Invalid fields for --lora-modules",
        ),
        (
            SimArgs {
                max_loras: 0,
                ..with_lora(&[])
            },
            "--max-loras",
        ),
    ] {
        let err = start(args).await.err().unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains(says), "{err} lacks {says}");
    }
}

#[tokio::test]
async fn a_load_answers_after_the_load_delay_and_a_second_one_finds_it_loaded() {
    let sim = start(runtime_updates(SimArgs {
        lora_load_delay_ms: 150.0,
        ..with_lora(&[])
    }))
    .await
    .unwrap();
    let c = client();
    let load = json!({"lora_name": "sql", "lora_path": ADAPTER_DIR});
    let began = Instant::now();
    let (first, second) = tokio::join!(
        adapter_call(&c, &sim, "/v1/load_lora_adapter", load.clone()),
        adapter_call(&c, &sim, "/v1/load_lora_adapter", load.clone()),
    );
    assert!(
        began.elapsed() >= Duration::from_millis(150),
        "{:?}",
        began.elapsed()
    );
    // Loads of one name take turns: one loads it, the other finds it loaded.
    let mut statuses = [first.0, second.0];
    statuses.sort();
    assert_eq!(statuses, [StatusCode::OK, StatusCode::BAD_REQUEST]);
    sim.shutdown().await;
}

/// The newest sample of `vllm:lora_requests_info` (the highest value), as a reader picks it.
async fn lora_info(c: &TestClient, sim: &SimServer) -> String {
    let r = send(c, sim, "GET", "/metrics", None, &[]).await;
    let text = String::from_utf8(read_all(r).await.to_vec()).unwrap();
    let newest = text
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .max_by(|a, b| {
            let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            value(a).total_cmp(&value(b))
        })
        .unwrap_or_else(|| panic!("no vllm:lora_requests_info in\n{text}"));
    newest[..newest.rfind(' ').unwrap()].to_owned()
}

/// Waits (bounded) until the newest sample of `vllm:lora_requests_info` is `want`.
async fn until_info(c: &TestClient, sim: &SimServer, want: &str) {
    let mut seen = String::new();
    for _ in 0..500 {
        seen = lora_info(c, sim).await;
        if seen == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the newest sample stayed {seen}, not {want}");
}

fn info(running: &str, waiting: &str) -> String {
    format!(
        "vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}}"
    )
}

/// `--max-loras 1`: a stream on a second adapter waits while one on the first runs, and runs
/// once that one has gone; `vllm:lora_requests_info` shows both states.
#[tokio::test]
async fn a_second_adapter_waits_for_the_first_under_max_loras() {
    let sim = start(SimArgs {
        enable_lora: true,
        lora_modules: vec![format!("a={ADAPTER_DIR}"), format!("b={ADAPTER_DIR}")],
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    assert_eq!(lora_info(&c, &sim).await, info("", ""));
    let stream =
        |model: &str| json!({"model": model, "prompt": "hi", "max_tokens": 20000, "stream": true});
    let a = send(&c, &sim, "POST", "/v1/completions", Some(stream("a")), &[]).await;
    assert_eq!(a.status(), StatusCode::OK);
    let b = send(&c, &sim, "POST", "/v1/completions", Some(stream("b")), &[]).await;
    assert_eq!(b.status(), StatusCode::OK);
    until_info(&c, &sim, &info("a", "b")).await;
    assert_eq!(
        sim.stats().waiting.load(Relaxed),
        1,
        "b waits although a seat is free"
    );
    drop(a);
    until_info(&c, &sim, &info("b", "")).await;
    drop(b);
    sim.shutdown().await;
}

/// Without a scheduler (all timing zero) every request runs at once: an adapter with a
/// request in flight is running.
#[tokio::test]
async fn without_a_scheduler_an_adapter_in_flight_is_running() {
    // The stream hangs after its first chunk, so it stays in flight until dropped.
    let sim = start(SimArgs {
        stall_after_chunks: Some(1),
        ..with_lora(&[&format!("a={ADAPTER_DIR}")])
    })
    .await
    .unwrap();
    let c = client();
    let req = json!({"model": "a", "prompt": "hi", "max_tokens": 50, "stream": true});
    let open = send(&c, &sim, "POST", "/v1/completions", Some(req), &[]).await;
    assert_eq!(open.status(), StatusCode::OK);
    assert_eq!(lora_info(&c, &sim).await, info("a", ""));
    drop(open);
    let stats = sim.stats().clone();
    eventually("the stream cancelled", || {
        stats.cancelled.load(Relaxed) == 1
    })
    .await;
    assert_eq!(lora_info(&c, &sim).await, info("", ""));
    sim.shutdown().await;
}

/// vLLM keys an adapter's blocks with its name: a prompt the base model has cached is not
/// found for an adapter, and is found again for the same adapter.
#[tokio::test]
async fn an_adapter_does_not_share_the_base_models_cached_blocks() {
    let sim = start(SimArgs {
        enable_lora: true,
        lora_modules: vec![format!("a={ADAPTER_DIR}")],
        kv_cache_tokens: 1_000_000,
        enable_prompt_tokens_details: true,
        ..timed()
    })
    .await
    .unwrap();
    let c = client();
    let long: String = (0..100).map(|i| format!("w{i:03}")).collect();
    let cached = |model: &'static str| {
        let (c, sim, long) = (&c, &sim, long.clone());
        async move {
            let req = json!({"model": model, "messages": [{"role": "user", "content": long}], "max_tokens": 2});
            let r = send(c, sim, "POST", "/v1/chat/completions", Some(req), &[]).await;
            assert_eq!(r.status(), StatusCode::OK);
            json_of(r).await["usage"]["prompt_tokens_details"]["cached_tokens"].clone()
        }
    };
    assert_eq!(cached("qwen32b").await, 0);
    assert_eq!(
        cached("a").await,
        0,
        "the base model's blocks are not the adapter's"
    );
    assert_eq!(cached("a").await, 96, "the adapter's own blocks are found");
    sim.shutdown().await;
}
