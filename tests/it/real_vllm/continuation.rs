//! How real vLLM continues an answer, which a stream resumed on another backend builds on
//! (issue 60): chat's `continue_final_message` with `add_generation_prompt: false` continues
//! the final message, streaming only the new text after the usual opening chunk, with the
//! answer so far counted in the prompt; left at its default, `add_generation_prompt` makes vLLM
//! refuse it. `/v1/messages` and `/v1/responses` take no prefill: an assistant message last is
//! rendered as a closed turn and a new one is begun (their prompt is exactly chat's with the
//! generation prompt), so those answers cannot be continued in their own protocol.

use super::*;
use serde_json::{Value, json};

/// The `data:` payloads of an SSE body (Anthropic's `event:` lines skipped).
fn payloads(m: &fleetgate_protocol::client::Measured) -> Vec<Value> {
    text(m)
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// `/tokenize`'s count for a chat request's messages and template switches.
async fn chat_prompt_tokens(r: &Real, messages: &Value, switches: Value) -> u64 {
    let mut body = json!({"model": r.model, "messages": messages});
    for (k, v) in switches.as_object().unwrap() {
        body[k] = v.clone();
    }
    let m = direct(r, "/tokenize", &body).await;
    assert_eq!(m.status, 200, "{}", text(&m));
    serde_json::from_slice::<Value>(m.body.as_deref().unwrap()).unwrap()["count"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn vllm_continues_a_final_assistant_message_on_chat_only() {
    let _serial = SERIAL.lock().await;
    let Some(r) = real("vllm_continues_a_final_assistant_message_on_chat_only").await else {
        return;
    };
    let question = json!([{"role": "user", "content": "Tell me about the sea"}]);
    let mut first = chat(&r.model, 8, true);
    first["stream_options"] = json!({"include_usage": true});
    let m = direct(&r, "/v1/chat/completions", &first).await;
    assert_eq!(m.status, 200, "{}", text(&m));
    let so_far: String = payloads(&m)
        .iter()
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert!(!so_far.is_empty(), "{}", text(&m));

    // The continuation: the answer so far as the final message.
    let mut messages = question.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": so_far}));
    let messages = Value::from(messages);
    let mut body = first.clone();
    body["messages"] = messages.clone();
    body["max_tokens"] = json!(4);
    body["continue_final_message"] = json!(true);
    body["add_generation_prompt"] = json!(false);
    let m = direct(&r, "/v1/chat/completions", &body).await;
    assert_eq!(m.status, 200, "{}", text(&m));
    let events = payloads(&m);
    // The usual opening chunk, then only the new text.
    assert_eq!(
        events[0]["choices"][0]["delta"]["role"],
        "assistant",
        "{}",
        text(&m)
    );
    assert_eq!(events[0]["choices"][0]["delta"]["content"], "");
    let finish: Vec<&Value> = events
        .iter()
        .map(|v| &v["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")], "{}", text(&m));
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 4, "{}", text(&m));
    // The answer so far is prompt: exactly the template with the final message left open.
    let open = json!({"add_generation_prompt": false, "continue_final_message": true});
    assert_eq!(
        usage["prompt_tokens"].as_u64().unwrap(),
        chat_prompt_tokens(&r, &messages, open).await
    );
    // Without `add_generation_prompt: false`, refused.
    body.as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let m = direct(&r, "/v1/chat/completions", &body).await;
    assert_eq!(m.status, 400, "{}", text(&m));
    assert!(
        text(&m).contains("continue_final_message and add_generation_prompt are not compatible"),
        "{}",
        text(&m)
    );

    // /v1/messages and /v1/responses: the assistant message is a closed turn, whatever the
    // request says.
    let closed = chat_prompt_tokens(&r, &messages, json!({"add_generation_prompt": true})).await;
    let anthropic = json!({"model": r.model, "messages": messages, "max_tokens": 2,
        "continue_final_message": true, "add_generation_prompt": false});
    let m = direct(&r, "/v1/messages", &anthropic).await;
    assert_eq!(m.status, 200, "{}", text(&m));
    let v: Value = serde_json::from_slice(m.body.as_deref().unwrap()).unwrap();
    assert_eq!(v["usage"]["input_tokens"].as_u64().unwrap(), closed, "{v}");
    let responses = json!({"model": r.model, "input": messages, "max_output_tokens": 2,
        "continue_final_message": true, "add_generation_prompt": false});
    let m = direct(&r, "/v1/responses", &responses).await;
    assert_eq!(m.status, 200, "{}", text(&m));
    let v: Value = serde_json::from_slice(m.body.as_deref().unwrap()).unwrap();
    assert_eq!(v["usage"]["input_tokens"].as_u64().unwrap(), closed, "{v}");
}

/// A stream cut after five of twelve tokens, continued by vLLM from the request
/// `fleetgate_protocol::resume` builds, its chunks made the first answer's: one answer of twelve
/// token events, one chunk id, one opening chunk, the continuation's `finish_reason`, the
/// continuation billing the seven tokens it generated, and one usage equal to the uninterrupted
/// answer's (the original prompt counted by vLLM's `/tokenize` from `resume::tokenize_body`). (Not the uninterrupted run's exact tokens:
/// the tiny model's greedy choice after the re-tokenized text so far may differ.)
#[tokio::test]
async fn a_cut_stream_continued_by_vllm_is_one_answer() {
    use fleetgate_protocol::Endpoint;
    use fleetgate_protocol::resume::{AnswerSoFar, Seam, continuation, one_usage, tokenize_body};
    let _serial = SERIAL.lock().await;
    let Some(r) = real("a_cut_stream_continued_by_vllm_is_one_answer").await else {
        return;
    };
    let is_token = |v: &Value| {
        let c = &v["choices"][0];
        c["text"].is_string() || (c["delta"]["content"].is_string() && c["delta"]["role"].is_null())
    };
    for (endpoint, path, mut request) in [
        (
            Endpoint::Chat,
            "/v1/chat/completions",
            chat(&r.model, 12, true),
        ),
        (
            Endpoint::Completions,
            "/v1/completions",
            completion(&r.model, 12, true),
        ),
    ] {
        request["stream_options"] = json!({"include_usage": true});
        let m = direct(&r, path, &request).await;
        assert_eq!(m.status, 200, "{}", text(&m));
        let whole = payloads(&m);
        let whole_usage = whole.last().unwrap()["usage"].clone();
        let mut so_far = AnswerSoFar::new();
        let mut client = Vec::new();
        let mut tokens = 0;
        for v in whole {
            if tokens == 5 {
                break;
            }
            if is_token(&v) {
                tokens += 1;
                so_far.observe(v.to_string().as_bytes());
            }
            client.push(v);
        }
        let seam = Seam::learn(client[0].to_string().as_bytes()).unwrap();
        let next = continuation(endpoint, request.to_string().as_bytes(), &so_far)
            .unwrap()
            .unwrap();
        let next: Value = serde_json::from_slice(&next).unwrap();
        let m = direct(&r, path, &next).await;
        assert_eq!(m.status, 200, "{}", text(&m));
        let rest = payloads(&m);
        let usage = rest.last().unwrap()["usage"].clone();
        // The original prompt, counted by vLLM's /tokenize as the request renders.
        let count = direct(
            &r,
            "/tokenize",
            &serde_json::from_slice(
                &tokenize_body(endpoint, request.to_string().as_bytes()).unwrap(),
            )
            .unwrap(),
        )
        .await;
        assert_eq!(count.status, 200, "{}", text(&count));
        let prompt_tokens = serde_json::from_slice::<Value>(count.body.as_deref().unwrap())
            .unwrap()["count"]
            .as_u64()
            .unwrap();
        for v in rest {
            if let Some(p) = seam.rewrite(v.to_string().as_bytes()) {
                let p = one_usage(&p, prompt_tokens, 5).unwrap_or(p);
                client.push(serde_json::from_slice(&p).unwrap());
            }
        }
        // One usage, as the uninterrupted answer's: its prompt, twelve completion tokens.
        let merged = &client.last().unwrap()["usage"];
        assert_eq!(
            merged["prompt_tokens"], whole_usage["prompt_tokens"],
            "{merged} {whole_usage}"
        );
        assert_eq!(merged["completion_tokens"], 12);
        assert_eq!(merged["total_tokens"], whole_usage["total_tokens"]);
        let id = &client[0]["id"];
        assert!(client.iter().all(|c| &c["id"] == id), "{client:?}");
        assert_eq!(
            client.iter().filter(|c| is_token(c)).count(),
            12,
            "{client:?}"
        );
        let opening = client
            .iter()
            .filter(|c| !c["choices"][0]["delta"]["role"].is_null())
            .count();
        assert_eq!(
            opening,
            usize::from(endpoint == Endpoint::Chat),
            "{client:?}"
        );
        let finish: Vec<&Value> = client
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("length")], "{client:?}");
        assert_eq!(usage["completion_tokens"], 7, "{usage}");
        eprintln!(
            "{endpoint:?}: so far {:?}, continued with prompt {} tokens",
            so_far.text(),
            usage["prompt_tokens"]
        );
    }
}

/// A backend that forwards everything to the real server and cuts every stream's connection
/// after `after` token events: a vLLM server dying mid-answer, as the gateway sees it.
async fn cutting_proxy(r: &Real, after: usize) -> (String, tokio::task::JoinHandle<()>) {
    use futures_util::StreamExt;
    let upstream = r.url.clone();
    let (addr, task) = http_backend(move |req: http::Request<hyper::body::Incoming>| {
        let upstream = upstream.clone();
        async move {
            let (head, body) = req.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let path = head.uri.path_and_query().map_or("/", |p| p.as_str());
            let mut out = http::Request::builder()
                .method(head.method.clone())
                .uri(format!("{upstream}{path}"));
            for (k, v) in &head.headers {
                if k != http::header::HOST {
                    out = out.header(k, v);
                }
            }
            let resp = fleetgate_protocol::client::http_client()
                .request(out.body(http_body_util::Full::new(body)).unwrap())
                .await
                .unwrap();
            let (head, body) = resp.into_parts();
            let sse = head
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            let mut tokens = 0;
            type Failure = Box<dyn std::error::Error + Send + Sync>;
            let frames = body.into_data_stream().map(move |frame| {
                let frame = frame.map_err(|e| -> Failure { Box::new(e) })?;
                if sse {
                    let text = String::from_utf8_lossy(&frame);
                    tokens += text.matches(r#""delta":{"content":"#).count()
                        + text.matches(r#""text":"#).count();
                    if tokens > after {
                        return Err(Failure::from("cut mid-answer"));
                    }
                }
                Ok::<_, Failure>(hyper::body::Frame::data(frame))
            });
            http::Response::from_parts(head, http_body_util::StreamBody::new(frames))
        }
    })
    .await;
    (format!("http://{addr}"), task)
}

/// Issue 60's real-vLLM case: the gateway in front of two backends that each die mid-answer
/// (cutting proxies in front of the real server, which the machine can run once). vLLM accepts
/// every continuation the gateway sends, and the client receives the answer an uninterrupted
/// stream gives: its tokens, one chunk id, its finish reason and its usage.
#[tokio::test]
async fn a_stream_resumed_through_the_gateway_is_vllms_uninterrupted_answer() {
    let _serial = SERIAL.lock().await;
    let Some(r) = real("a_stream_resumed_through_the_gateway_is_vllms_uninterrupted_answer").await
    else {
        return;
    };
    let (a, task_a) = cutting_proxy(&r, 5).await;
    let (b, task_b) = cutting_proxy(&r, 5).await;
    let mut p = pool(&r.model, &[a, b]);
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new(&r.key));
    p.resume.max_resumes = 3;
    let gw = gateway(vec![p]).await;
    for (path, mut request) in [
        ("/v1/chat/completions", chat(&r.model, 16, true)),
        ("/v1/completions", completion(&r.model, 16, true)),
    ] {
        request["stream_options"] = json!({"include_usage": true});
        let whole = payloads(&direct(&r, path, &request).await);
        let m = post(&gw.url(path), &[], Bytes::from(request.to_string())).await;
        assert_eq!(m.status, 200, "{}", text(&m));
        let got = payloads(&m);
        assert!(
            got.iter().all(|v| v.get("error").is_none()),
            "{path}: no error event: {}",
            text(&m)
        );
        assert_eq!(
            token_texts(&got),
            token_texts(&whole),
            "{path}: {}",
            text(&m)
        );
        let ids: std::collections::HashSet<&Value> = got.iter().map(|v| &v["id"]).collect();
        assert_eq!(ids.len(), 1, "{path}: one chunk id");
        let finish = |events: &[Value]| -> Vec<Value> {
            events
                .iter()
                .map(|v| v["choices"][0]["finish_reason"].clone())
                .filter(|f| !f.is_null())
                .collect()
        };
        assert_eq!(finish(&got), finish(&whole), "{path}");
        let usage = |events: &[Value]| events.last().unwrap()["usage"].clone();
        assert_eq!(usage(&got), usage(&whole), "{path}: one usage");
        assert!(text(&m).trim_end().ends_with("data: [DONE]"), "{path}");
    }
    let resumed: u64 = metrics_text(&gw)
        .lines()
        .filter(|l| l.starts_with("fleetgate_stream_resumes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(
        resumed >= 4,
        "16 tokens cut every 5: three continuations a stream (counted {resumed})"
    );
    task_a.abort();
    task_b.abort();
}
