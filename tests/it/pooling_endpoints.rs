//! The rest of a vLLM fleet behind the same key: embedding, reranking, scoring,
//! classifying and pooling models, and the chat batch route, through a real gateway in front of
//! real sims standing in for `vllm serve --runner pooling` servers.

use crate::common::*;
use fleetgate_gateway::config::{PoolConfig, PoolKind};
use fleetgate_gateway::key::Environment;
use fleetgate_sim::{Convert, Runner, SimServer};
use serde_json::{Value, json};

const EMBEDDING_SIZE: u32 = 48;

async fn pooling_sim(convert: Convert, model: &str) -> SimServer {
    sim(|a| {
        a.runner = Runner::Pooling;
        a.convert = convert;
        a.embedding_size = EMBEDDING_SIZE;
        a.served_model_name = vec![model.to_owned()];
    })
    .await
}

/// A pool of `kind` that warms each backend up with one request before it takes traffic.
fn warmed(model: &str, sim: &SimServer, kind: PoolKind) -> PoolConfig {
    let mut p = pool(model, &[sim.url()]);
    p.kind = kind;
    p.warmup.requests = 1;
    p
}

fn body(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// One key, one gateway, a chat pool and an embeddings pool: each route reaches the pool its
/// body's `model` names, each backend was warmed up with a request its kind of model accepts
/// (a chat warm-up would have kept the embedding server out: it has no chat route), and a
/// route the model's kind does not serve is refused with what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_reaches_a_chat_pool_and_an_embeddings_pool() {
    let chat_sim = sim(|a| a.served_model_name = vec!["chat-m".into()]).await;
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let gw = gateway_with(
        vec![
            warmed("chat-m", &chat_sim, PoolKind::Generate),
            warmed("embed-m", &embed_sim, PoolKind::Embed),
        ],
        |c| c.admin = admin_cfg(),
    )
    .await;
    let states = backend_states_become(&gw, &["healthy", "healthy"]).await;
    assert_eq!(states, ["healthy", "healthy"], "both warmed up");

    let e = post(
        &gw.url("/v1/embeddings"),
        &[("x-request-id", "emb-1")],
        body(&json!({"model": "embed-m", "input": ["the license", "a color"]})),
    )
    .await;
    assert_eq!(e.status, 200, "{:?}", e.body);
    let v = json_body(&e);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        v["data"][0]["embedding"].as_array().unwrap().len(),
        EMBEDDING_SIZE as usize
    );
    let seen = gw.record_of("emb-1").await;
    assert_eq!(seen.endpoint, Some("embeddings"));
    assert_eq!(seen.model.as_deref(), Some("embed-m"));
    assert_eq!(seen.error, None);
    // Its tokens are the answer's input count; its first token is its whole answer, which
    // gives the gateway's hop on it.
    let usage = seen.timeline.stream().usage.expect("usage read");
    assert_eq!(
        usage.prompt_tokens,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(usage.completion_tokens, 0);
    assert!(seen.timeline.upstream_ttft().is_some());
    assert!(seen.timeline.hop().is_some(), "the hop was measured");
    let timing = e.headers["server-timing"].to_str().unwrap();
    assert!(timing.contains("hop;dur="), "{timing}");
    assert!(seen.timeline.admitted().is_some(), "it took a backend slot");

    let c = post(
        &gw.url("/v1/chat/completions"),
        &[],
        body(&json!({"model": "chat-m", "max_tokens": 3,
                     "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(c.status, 200);

    // Each kind of model refuses the other's routes, as vLLM does (404: no such route), and
    // the client is told why.
    let wrong = post(
        &gw.url("/v1/embeddings"),
        &[],
        body(&json!({"model": "chat-m", "input": "hi"})),
    )
    .await;
    assert_eq!(wrong.status, 404);
    let err = openai_error(&wrong);
    assert_eq!(err["code"], "endpoint_not_supported");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("generative model") && msg.contains("--runner pooling"),
        "{msg}"
    );
    // The reason comes first, the backend's bare 404 after it.
    assert!(msg.starts_with("Model `chat-m` does not serve"), "{msg}");
    let wrong = post(
        &gw.url("/v1/chat/completions"),
        &[],
        body(&json!({"model": "embed-m", "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(wrong.status, 404);
    let err = openai_error(&wrong);
    assert_eq!(err["code"], "endpoint_not_supported");
    assert!(
        err["message"].as_str().unwrap().contains("pooling model"),
        "{err}"
    );

    // Both models are listed.
    let models = client_get(&gw, "/v1/models").await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(
        ids.contains(&"chat-m") && ids.contains(&"embed-m"),
        "{ids:?}"
    );

    // The metrics name the family, never the path.
    let metrics = metrics_text(&gw);
    assert!(
        metrics.contains("endpoint=\"embeddings\""),
        "no embeddings series in:\n{metrics}"
    );
}

async fn client_get(gw: &Gateway, path: &str) -> Value {
    let auth = format!("Bearer {}", gw.key);
    let (status, body) = get_body(&gw.url(path), &[("authorization", &auth)]).await;
    assert_eq!(status, 200);
    serde_json::from_slice(&body).unwrap()
}

/// Every pooling route reaches its own path on the backend and comes back in vLLM's shape,
/// recorded under its own endpoint name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pooling_route_is_forwarded_in_its_shape() {
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let classify_sim = pooling_sim(Convert::Classify, "classify-m").await;
    let gw = gateway_with(
        vec![
            warmed("embed-m", &embed_sim, PoolKind::Embed),
            warmed("classify-m", &classify_sim, PoolKind::Classify),
        ],
        |c| c.admin = admin_cfg(),
    )
    .await;
    backend_states_become(&gw, &["healthy", "healthy"]).await;

    let docs = json!(["the license is Apache-2.0", "a color", "the license"]);
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v2/embed",
            json!({"model": "embed-m", "texts": ["a", "b"], "embedding_types": ["float"]}),
            "embed_v2",
            "embeddings",
        ),
        (
            "/pooling",
            json!({"model": "embed-m", "input": "the license"}),
            "pooling",
            "data",
        ),
        (
            "/rerank",
            json!({"model": "embed-m", "query": "license?", "documents": docs, "top_n": 2}),
            "rerank",
            "results",
        ),
        (
            "/v1/rerank",
            json!({"model": "embed-m", "query": "license?", "documents": docs}),
            "rerank_v1",
            "results",
        ),
        (
            "/v2/rerank",
            json!({"model": "embed-m", "query": "license?", "documents": docs}),
            "rerank_v2",
            "results",
        ),
        (
            "/score",
            json!({"model": "embed-m", "queries": "license?", "documents": docs}),
            "score",
            "data",
        ),
        (
            "/v1/score",
            json!({"model": "embed-m", "text_1": "license?", "text_2": ["a", "b"]}),
            "score_v1",
            "data",
        ),
        (
            "/classify",
            json!({"model": "classify-m", "input": ["the license", "a color"]}),
            "classify",
            "data",
        ),
    ];
    for (path, req, name, key) in cases {
        let id = format!("pool-{name}");
        let m = post(&gw.url(path), &[("x-request-id", &id)], body(&req)).await;
        assert_eq!(m.status, 200, "{path}: {:?}", m.body);
        let v = json_body(&m);
        assert!(!v[key].is_null(), "{path}: no `{key}` in {v}");
        let seen = gw.record_of(&id).await;
        assert_eq!(seen.endpoint, Some(name), "{path}");
        let usage = seen.timeline.stream().usage;
        assert!(
            usage.is_some_and(|u| u.prompt_tokens > 0),
            "{path}: its input tokens were read from the answer ({usage:?}): {v}"
        );
    }
    // The rerank answer is sorted by relevance and cut to top_n.
    let m = post(
        &gw.url("/rerank"),
        &[],
        body(&json!({"model": "embed-m", "query": "q", "documents": ["a", "b", "c"], "top_n": 2})),
    )
    .await;
    let results = json_body(&m)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 2);
    assert!(
        results[0]["relevance_score"].as_f64().unwrap()
            >= results[1]["relevance_score"].as_f64().unwrap()
    );
}

/// A pooling request reserves its input, never `default_max_tokens`: a key whose budget is
/// below that default still embeds, and is charged what the answer's usage says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooling_spends_its_input_tokens_only() {
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let gw = gateway(vec![pool("embed-m", &[embed_sim.url()])]).await;
    // default_max_tokens is 1024: a reservation of it would be refused outright.
    let (key, _) = issue_key(&gw, Environment::Gray, |k| k.tokens_per_minute = Some(600)).await;
    let auth = format!("Bearer {key}");
    let text = "word ".repeat(100); // 500 characters: about 125 tokens by the sim's count
    let first = post(
        &gw.url("/v1/embeddings"),
        &[("authorization", &auth)],
        body(&json!({"model": "embed-m", "input": text})),
    )
    .await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let used = json_body(&first)["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(used > 50, "usage {used}");
    let second = post(
        &gw.url("/v1/embeddings"),
        &[("authorization", &auth)],
        body(&json!({"model": "embed-m", "input": "hi"})),
    )
    .await;
    assert_eq!(second.status, 200);
    let remaining: u64 = second.headers["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // 600 − the first request's real usage − the second's small reservation (+ a little
    // refill): nowhere near 600 − 1024.
    assert!(
        (580..=610).contains(&(remaining + used)),
        "remaining {remaining} after a request that used {used}"
    );
}

/// Bad pooling and batch bodies are answered by the gateway, in OpenAI's shape, naming the
/// field, before anything reaches a backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pooling_bodies_name_the_field() {
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let gw = gateway(vec![pool("embed-m", &[embed_sim.url()])]).await;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/v1/embeddings", json!({"model": "embed-m"}), "input"),
        ("/v1/embeddings", json!({"input": "hi"}), "model"),
        ("/v2/embed", json!({"model": "embed-m"}), "texts"),
        (
            "/rerank",
            json!({"model": "embed-m", "documents": ["a"]}),
            "query",
        ),
        (
            "/v1/rerank",
            json!({"model": "embed-m", "query": "q"}),
            "documents",
        ),
        (
            "/score",
            json!({"model": "embed-m", "queries": "q"}),
            "queries",
        ),
        ("/classify", json!({"model": "embed-m"}), "input"),
        ("/pooling", json!({"model": "embed-m"}), "input"),
        (
            "/v1/chat/completions/batch",
            json!({"model": "embed-m", "messages": []}),
            "messages",
        ),
        (
            "/v1/chat/completions/batch",
            json!({"model": "embed-m", "stream": true,
                   "messages": [[{"role": "user", "content": "hi"}]]}),
            "stream",
        ),
    ];
    for (i, (path, req, param)) in cases.into_iter().enumerate() {
        let id = format!("bad-{i}");
        let m = post(&gw.url(path), &[("x-request-id", &id)], body(&req)).await;
        assert_eq!(m.status, 400, "{path} {req}");
        let err = openai_error(&m);
        assert_eq!(err["param"], param, "{path} {req}: {err}");
        assert_eq!(err["type"], "invalid_request_error");
        let seen = gw.record_of(&id).await;
        assert_eq!(seen.backend, None, "{path} {req} reached a backend");
    }
}

/// `/v1/chat/completions/batch`: several conversations, one choice each, recorded as chat
/// with the answer's usage; it reserves `max_tokens` for each conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_batch_is_forwarded_and_counted() {
    let chat_sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[chat_sim.url()])]).await;
    let m = post(
        &gw.url("/v1/chat/completions/batch"),
        &[("x-request-id", "batch-1")],
        body(&json!({"model": "qwen32b", "max_tokens": 4, "messages": [
            [{"role": "user", "content": "one"}],
            [{"role": "user", "content": "two"}],
            [{"role": "user", "content": "three"}]
        ]})),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let v = json_body(&m);
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    let seen = gw.record_of("batch-1").await;
    assert_eq!(seen.endpoint, Some("chat_batch"));
    let usage = seen.timeline.stream().usage.unwrap();
    assert_eq!(
        usage.completion_tokens,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(usage.completion_tokens, 12);

    // Three conversations of 500 tokens each do not fit a budget of 1200.
    let (key, _) = issue_key(&gw, Environment::Gray, |k| k.tokens_per_minute = Some(1200)).await;
    let over = post(
        &gw.url("/v1/chat/completions/batch"),
        &[("authorization", &format!("Bearer {key}"))],
        body(&json!({"model": "qwen32b", "max_tokens": 500, "messages": [
            [{"role": "user", "content": "one"}],
            [{"role": "user", "content": "two"}],
            [{"role": "user", "content": "three"}]
        ]})),
    )
    .await;
    assert_eq!(over.status, 429);
    assert_eq!(openai_error(&over)["code"], "request_exceeds_token_budget");
}

/// A key limited to some endpoint families (set through the admin API) calls those and is
/// refused the others, in the client's own dialect, before anything reaches a backend; a bad
/// family name is refused when the key is issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_endpoint_families_bound_what_it_calls() {
    let chat_sim = sim(|a| a.served_model_name = vec!["chat-m".into()]).await;
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let gw = gateway_with(
        vec![
            pool("chat-m", &[chat_sim.url()]),
            pool("embed-m", &[embed_sim.url()]),
        ],
        |c| c.admin = admin_cfg(),
    )
    .await;
    let admin_token = token(fleetgate_gateway::admin::jwt::Role::Admin);
    let (status, created) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&admin_token),
        Some(json!({"name": "indexer", "environment": "prod",
                    "allowed_endpoints": ["embeddings", "rerank"]})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(
        created["record"]["allowed_endpoints"],
        json!(["embeddings", "rerank"])
    );
    let auth = format!("Bearer {}", created["key"].as_str().unwrap());

    let ok = post(
        &gw.url("/v1/embeddings"),
        &[("authorization", &auth)],
        body(&json!({"model": "embed-m", "input": "hi"})),
    )
    .await;
    assert_eq!(ok.status, 200);
    let ok = post(
        &gw.url("/v2/rerank"),
        &[("authorization", &auth)],
        body(&json!({"model": "embed-m", "query": "q", "documents": ["a"]})),
    )
    .await;
    assert_eq!(ok.status, 200);

    let refused = post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &auth), ("x-request-id", "fam-chat")],
        body(&json!({"model": "chat-m", "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(refused.status, 403);
    let err = openai_error(&refused);
    assert_eq!(err["code"], "endpoint_not_allowed");
    assert_eq!(err["type"], "permission_error");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("/v1/chat/completions")
            && msg.contains("`chat`")
            && msg.contains("`embeddings`, `rerank`"),
        "{msg}"
    );
    assert_eq!(gw.record_of("fam-chat").await.backend, None);
    // An Anthropic client reads an Anthropic error.
    let refused = post(
        &gw.url("/v1/messages"),
        &[
            ("x-api-key", &auth["Bearer ".len()..]),
            ("x-request-id", "fam-msg"),
        ],
        body(&json!({"model": "chat-m", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    assert_eq!(refused.status, 403);
    let v = json_body(&refused);
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`messages`"),
        "{v}"
    );
    assert_eq!(gw.record_of("fam-msg").await.backend, None);
    let metrics = metrics_text(&gw);
    assert!(
        metrics.contains("reason=\"endpoint_not_allowed\""),
        "the refusal is counted"
    );

    // A family that does not exist is refused at issue time, naming the families.
    let (status, bad) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&admin_token),
        Some(json!({"name": "typo", "environment": "prod",
                    "allowed_endpoints": ["embedding"]})),
    )
    .await;
    assert_eq!(status, 400, "{bad}");
    let msg = bad["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("`embedding`") && msg.contains("embeddings, rerank, score"),
        "{msg}"
    );
}

/// An embedding server put in a pool whose kind says generative is warmed up with a chat it has
/// no route for: it stays out of the pool, and its last error says what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_the_wrong_kind_says_so() {
    let embed_sim = pooling_sim(Convert::Embed, "embed-m").await;
    let gw = gateway_with(
        vec![warmed("embed-m", &embed_sim, PoolKind::Generate)],
        |c| c.admin = admin_cfg(),
    )
    .await;
    let mut last = String::new();
    for _ in 0..100 {
        let (_, v) = admin(
            &gw,
            "GET",
            "/admin/backends",
            Some(&token(fleetgate_gateway::admin::jwt::Role::Viewer)),
            None,
        )
        .await;
        last = v["data"][0]["last_error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if !last.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        last.contains("POST /v1/chat/completions") && last.contains("pools[].kind"),
        "{last}"
    );
    assert_ne!(admin_backends(&gw, "state").await, ["healthy"]);
}
