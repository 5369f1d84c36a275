use super::*;
use serde_json::json;

fn chunk(delta: Value) -> Vec<u8> {
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]})
    .to_string()
    .into_bytes()
}

fn so_far(deltas: &[Value]) -> AnswerSoFar {
    let mut a = AnswerSoFar::new();
    for d in deltas {
        a.observe(&chunk(d.clone()));
    }
    a
}

fn body(v: Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

#[test]
fn the_answer_so_far_is_the_streamed_text_unescaped() {
    let a = so_far(&[
        json!({"role": "assistant", "content": ""}),
        json!({"content": "He said \"hi\""}),
        json!({"content": "\n caf\u{e9} \\ "}),
        json!({"content": "👋"}),
        json!({"content": ""}),
    ]);
    assert_eq!(a.text(), "He said \"hi\"\n café \\ 👋");
    // The opening chunk is not a token; an empty content without a role is one.
    assert_eq!(a.tokens(), 4);
    assert_eq!(a.blocked(), None);
    // Completions: the choice's text.
    let mut c = AnswerSoFar::new();
    c.observe(br#"{"id":"cmpl-1","choices":[{"index":0,"text":" once","finish_reason":null}]}"#);
    c.observe(br#"{"id":"cmpl-1","choices":[{"index":0,"text":" upon","finish_reason":null}]}"#);
    c.observe(br#"{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3}}"#);
    c.observe(b"not json");
    assert_eq!((c.text().as_str(), c.tokens()), (" once upon", 2));
}

#[test]
fn a_chat_continues_with_the_answer_so_far_as_its_final_message() {
    let request = body(json!({
        "model": "m", "stream": true, "max_tokens": 30, "temperature": 0.7, "seed": 3,
        "messages": [{"role": "user", "content": "Tell me"}],
    }));
    let a = so_far(&[json!({"content": "Once"}), json!({"content": " upon"})]);
    let next = continuation(Endpoint::Chat, &request, &a).unwrap().unwrap();
    let next: Value = serde_json::from_slice(&next).unwrap();
    assert_eq!(
        next,
        json!({
            "model": "m", "stream": true, "max_tokens": 28, "temperature": 0.7, "seed": 3,
            "messages": [{"role": "user", "content": "Tell me"},
                         {"role": "assistant", "content": "Once upon"}],
            "continue_final_message": true, "add_generation_prompt": false,
            "stream_options": {"include_usage": true},
        })
    );
    // max_completion_tokens is reduced as well; a reached limit leaves nothing to continue.
    let request = body(json!({"messages": [], "max_completion_tokens": 2,
                              "stream_options": {"include_usage": false, "continuous_usage_stats": true}}));
    assert_eq!(continuation(Endpoint::Chat, &request, &a).unwrap(), None);
    let request = body(json!({"messages": [], "max_completion_tokens": 3,
                              "stream_options": {"include_usage": false, "continuous_usage_stats": true}}));
    let next: Value =
        serde_json::from_slice(&continuation(Endpoint::Chat, &request, &a).unwrap().unwrap())
            .unwrap();
    assert_eq!(next["max_completion_tokens"], 1);
    assert_eq!(
        next["stream_options"],
        json!({"include_usage": true, "continuous_usage_stats": true})
    );
}

#[test]
fn a_completion_continues_from_its_prompt_and_text() {
    let a = so_far(&[]);
    let mut c = a;
    c.observe(br#"{"choices":[{"index":0,"text":" upon a"}]}"#);
    for prompt in [json!("Once"), json!(["Once"])] {
        let request = body(json!({"prompt": prompt, "max_tokens": 5}));
        let next: Value = serde_json::from_slice(
            &continuation(Endpoint::Completions, &request, &c)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(next["prompt"], "Once upon a");
        assert_eq!(next["max_tokens"], 4);
    }
}

#[test]
fn what_cannot_be_continued_exactly_is_named() {
    let text = so_far(&[json!({"content": "The END"}), json!({"content": " is E"})]);
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "q"}], "max_tokens": 9});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        continuation(Endpoint::Chat, &body(b), &text).err()
    };
    use NotResumable::{
        Body, GuidedDecoding, Logprobs, PromptNotText, Reasoning, SeveralChoices, StopAtSeam,
        ToolCall,
    };
    assert_eq!(chat(json!({"n": 2})), Some(SeveralChoices));
    assert_eq!(chat(json!({"n": 1})), None);
    assert_eq!(chat(json!({"logprobs": true})), Some(Logprobs));
    assert_eq!(chat(json!({"logprobs": false})), None);
    assert_eq!(chat(json!({"top_logprobs": 2})), Some(Logprobs));
    assert_eq!(
        chat(json!({"response_format": {"type": "json_schema", "json_schema": {}}})),
        Some(GuidedDecoding)
    );
    assert_eq!(chat(json!({"response_format": {"type": "text"}})), None);
    assert_eq!(chat(json!({"guided_json": {}})), Some(GuidedDecoding));
    assert_eq!(
        chat(json!({"structured_outputs": {"regex": "a+"}})),
        Some(GuidedDecoding)
    );
    assert_eq!(
        chat(json!({"tool_choice": "required"})),
        Some(GuidedDecoding)
    );
    assert_eq!(
        chat(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}})),
        Some(GuidedDecoding)
    );
    assert_eq!(chat(json!({"tool_choice": "auto"})), None);
    // A stop sequence whose start ends the text would straddle the seam; a whole one cannot
    // (the engine would have stopped).
    assert_eq!(chat(json!({"stop": ["xyz", "!!"]})), None);
    assert_eq!(chat(json!({"stop": "Eve"})), Some(StopAtSeam));
    assert_eq!(chat(json!({"stop": [" is EOF"]})), Some(StopAtSeam));
    // What was streamed.
    let tool = so_far(&[json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a"}}]})]);
    let b = body(json!({"messages": [], "max_tokens": 9}));
    assert_eq!(
        continuation(Endpoint::Chat, &b, &tool).err(),
        Some(ToolCall)
    );
    let thinking = so_far(&[json!({"reasoning": "hmm"}), json!({"content": "ok"})]);
    assert_eq!(
        continuation(Endpoint::Chat, &b, &thinking).err(),
        Some(Reasoning)
    );
    // Completions whose prompt is not one text, or echoed.
    for prompt in [json!([1, 2, 3]), json!(["a", "b"]), json!([[1, 2]])] {
        let b = body(json!({"prompt": prompt, "max_tokens": 9}));
        assert_eq!(
            continuation(Endpoint::Completions, &b, &text).err(),
            Some(PromptNotText)
        );
    }
    let b = body(json!({"prompt": "p", "echo": true}));
    assert_eq!(check_request(Endpoint::Completions, &b), Err(PromptNotText));
    assert_eq!(
        check_request(
            Endpoint::Completions,
            &body(json!({"prompt": "p", "best_of": 2}))
        ),
        Err(SeveralChoices)
    );
    // Endpoints vLLM continues nothing on, and bodies that are not objects.
    assert_eq!(
        check_request(Endpoint::Messages, b"{}"),
        Err(NotResumable::Endpoint)
    );
    assert_eq!(
        check_request(Endpoint::Responses, b"{}"),
        Err(NotResumable::Endpoint)
    );
    assert_eq!(check_request(Endpoint::Chat, b"[1]"), Err(Body));
    assert_eq!(StopAtSeam.as_str(), "stop_at_seam");
}

#[test]
fn a_continuations_chunks_carry_the_first_answers_identity() {
    let seam = Seam::learn(&chunk(json!({"role": "assistant", "content": ""}))).unwrap();
    let theirs = |delta: Value, extra: Value| {
        let mut c = json!({"id": "chatcmpl-2", "object": "chat.completion.chunk",
                           "created": 9, "model": "other",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c.to_string().into_bytes()
    };
    // Its opening chunk is dropped: the client had one.
    assert_eq!(
        seam.rewrite(&theirs(
            json!({"role": "assistant", "content": ""}),
            json!({})
        )),
        None
    );
    let out = seam
        .rewrite(&theirs(json!({"content": " on"}), json!({})))
        .unwrap();
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        (&out["id"], &out["created"], &out["model"]),
        (&json!("chatcmpl-1"), &json!(7), &json!("m"))
    );
    assert_eq!(out["choices"][0]["delta"]["content"], " on");
    assert!(out.get("system_fingerprint").is_none());
    // A fingerprint the first answer had replaces the continuation's.
    let mut first: Value = serde_json::from_slice(&chunk(json!({"content": "a"}))).unwrap();
    first["system_fingerprint"] = json!("fp-1");
    let seam = Seam::learn(first.to_string().as_bytes()).unwrap();
    let out = seam
        .rewrite(&theirs(
            json!({"content": "b"}),
            json!({"system_fingerprint": "fp-2"}),
        ))
        .unwrap();
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(out["system_fingerprint"], "fp-1");
    assert_eq!(seam.rewrite(b"[DONE]").as_deref(), Some(&b"[DONE]"[..]));
    assert_eq!(seam.rewrite(b"{not json"), None);
}

#[test]
fn the_original_prompt_is_counted_as_the_backend_renders_it() {
    let chat = body(json!({
        "model": "m", "messages": [{"role": "user", "content": "q"}], "stream": true,
        "max_tokens": 9, "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": false}, "temperature": 0.5,
    }));
    let t: Value = serde_json::from_slice(&tokenize_body(Endpoint::Chat, &chat).unwrap()).unwrap();
    assert_eq!(
        t,
        json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
               "tools": [{"type": "function", "function": {"name": "f"}}],
               "chat_template_kwargs": {"enable_thinking": false}})
    );
    let completion = body(json!({"model": "m", "prompt": "Once", "max_tokens": 3, "echo": false}));
    let t: Value =
        serde_json::from_slice(&tokenize_body(Endpoint::Completions, &completion).unwrap())
            .unwrap();
    assert_eq!(t, json!({"model": "m", "prompt": "Once"}));
    assert_eq!(
        tokenize_body(Endpoint::Messages, b"{}"),
        Err(NotResumable::Endpoint)
    );
}

#[test]
fn a_resumed_answer_reports_one_usage() {
    let usage_chunk = json!({"id": "c", "choices": [], "usage": {
        "prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
        "prompt_tokens_details": {"cached_tokens": 16}}});
    let out = one_usage(usage_chunk.to_string().as_bytes(), 14, 5).unwrap();
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        out["usage"],
        json!({"prompt_tokens": 14, "completion_tokens": 12, "total_tokens": 26,
               "prompt_tokens_details": null})
    );
    assert_eq!(out["id"], "c");
    assert_eq!(one_usage(&chunk(json!({"content": "a"})), 14, 5), None);
    assert_eq!(one_usage(b"[DONE]", 14, 5), None);
}

#[test]
fn an_engine_that_died_or_a_retryable_failure_calls_for_resuming() {
    // vLLM 0.32's events (create_streaming_error_response), and the sim's --error-after-chunks.
    let dead = br#"{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.","type":"InternalServerError","param":null,"code":500}}"#;
    assert_eq!(failure_in(dead), Some(Cause::EngineDead));
    let retry = br#"{"error":{"message":"Request failed; please retry","type":"ServiceUnavailableError","param":null,"code":503}}"#;
    assert_eq!(failure_in(retry), Some(Cause::Retryable));
    // A failed generation, a refusal, a chunk: the answer as it is.
    let failed = br#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#;
    assert_eq!(failure_in(failed), None);
    let refused =
        br#"{"error":{"message":"bad \"x\"","type":"BadRequestError","param":"x","code":400}}"#;
    assert_eq!(failure_in(refused), None);
    assert_eq!(failure_in(&chunk(json!({"content": "a"}))), None);
    assert_eq!(failure_in(b"[DONE]"), None);
    assert_eq!(Cause::EngineDead.as_str(), "engine_dead");
}

/// What the relay keeps (`push`, from the span the classification found) is what a full parse
/// of each event reads (`observe`): the same text, tokens and refusals, chat and completions.
#[test]
fn what_the_relay_keeps_is_what_a_full_parse_reads() {
    let events: Vec<Vec<u8>> = vec![
        chunk(json!({"role": "assistant", "content": ""})),
        chunk(json!({"content": "He said \"hi\""})),
        chunk(json!({"content": "\n caf\u{e9} \\ "})),
        chunk(json!({"content": ""})),
        br#"{"id":"x","choices":[{"delta" : { "content" : "spaced" }}]}"#.to_vec(),
        br#"{"id":"cmpl-1","object":"text_completion","model":"text","choices":[{"index":0,"text" : " once \"q\"","finish_reason":null}]}"#.to_vec(),
        chunk(json!({"reasoning": "think"})),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})),
    ];
    let mut stream = Vec::new();
    for e in &events {
        stream.extend_from_slice(b"data: ");
        stream.extend_from_slice(e);
        stream.extend_from_slice(b"\n\n");
    }
    let (mut pushed, mut parsed) = (AnswerSoFar::new(), AnswerSoFar::new());
    let mut scanner = crate::sse::SseScanner::new();
    let mut seen = 0;
    // Fed in two reads split mid-event: a carried line is read whole too.
    let (a, b) = stream.split_at(100);
    for part in [a, b] {
        scanner.feed(part, |line| {
            if line.kind == crate::event::DataKind::Content {
                pushed.push(line.payload, line.streamed);
                parsed.observe(line.payload);
                seen += 1;
                // Each check after every event: the refusals come in the same order.
                assert_eq!(pushed.text(), parsed.text());
                assert_eq!(pushed.tokens(), parsed.tokens());
                assert_eq!(pushed.blocked(), parsed.blocked());
            }
        });
    }
    assert_eq!(seen, 7);
    assert_eq!(pushed.tokens(), 7);
    assert!(
        pushed
            .text()
            .starts_with("He said \"hi\"\n café \\ spaced once \"q\"")
    );
    assert_eq!(pushed.blocked(), Some(NotResumable::ToolCall));
}
