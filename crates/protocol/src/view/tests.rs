//! The view's parsing, its refusals and its splices, on bodies as clients send them.

use bytes::Bytes;

use super::form::{parse as parse_form, repeated_parameter};
use super::splice::{PriorityEdit, upstream_body, upstream_body_owned};
use super::*;

fn err(body: &str, ep: Endpoint) -> (Option<String>, String) {
    match parse(body.as_bytes(), ep).unwrap_err() {
        ViewError::InvalidRequest { param, message } => (param.map(|p| p.into_owned()), message),
        ViewError::InvalidJson(m) => (Some("<json>".into()), m),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn reads_the_fields() {
    let body = br#"{"model":"qwen32b","stream":true,"max_tokens":64,"stream_options":{"include_usage":false},"messages":[{"role":"user","content":"hello"},{"role":"user","content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"data:xyz"}}]}]}"#;
    let v = parse(body, Endpoint::Chat).unwrap();
    assert_eq!(v.model, "qwen32b");
    assert_eq!(&body[v.model_span.clone()], b"\"qwen32b\"");
    assert!(v.stream);
    assert_eq!(v.max_tokens, Some(64));
    assert_eq!(v.include_usage, Some(false));
    assert_eq!(v.prompt_chars, 8);
    assert_eq!(v.n, 1);
}

#[test]
fn max_completion_tokens_wins_and_prompt_forms() {
    let v = parse(
        br#"{"model":"m","max_tokens":5,"max_completion_tokens":7,"prompt":["ab","c"]}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!(v.max_tokens, Some(7));
    assert_eq!(v.prompt_chars, 3);
    let v = parse(br#"{"model":"m","prompt":[1,2,3]}"#, Endpoint::Completions).unwrap();
    assert_eq!(v.prompt_chars, 12);
    assert_eq!(v.n, 1, "token ids are one prompt");
}

/// The vLLM `priority` is spliced: a client's value replaced in place (`null` included, never
/// a second key), or the field added after the opening brace; the rest of the body is the
/// client's bytes.
#[test]
fn priority_is_spliced() {
    let body = Bytes::from_static(br#"{"model":"m","priority": -5,"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(v.priority.as_ref().and_then(|p| p.value), Some(-5));
    let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Write(20));
    assert_eq!(&out[..], br#"{"model":"m","priority": 20,"messages":[]}"#);
    let body = Bytes::from_static(br#"{"model":"m","input":"hi"}"#);
    let v = parse(&body, Endpoint::Responses).unwrap();
    let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Write(0));
    assert_eq!(&out[..], br#"{"priority":0,"model":"m","input":"hi"}"#);
    let body = Bytes::from_static(br#"{"model":"m","priority":null,"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(v.priority.as_ref().map(|p| p.value), Some(None));
    let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Write(20));
    assert_eq!(&out[..], br#"{"model":"m","priority":20,"messages":[]}"#);
    let (p, _) = err(
        r#"{"model":"m","priority":"high","messages":[]}"#,
        Endpoint::Chat,
    );
    assert_eq!(p.as_deref(), Some("priority"));
}

/// Every route whose engine orders by `priority` reads the client's (an integer, in any
/// spelling serde reads as the key), and refuses one that is no integer or comes twice.
#[test]
fn priority_is_read_on_every_route_vllm_orders_by_it() {
    let bodies = [
        (Endpoint::Embeddings, r#""input":"hi""#),
        (Endpoint::CohereEmbed, r#""texts":["hi"]"#),
        (Endpoint::Pooling, r#""input":"hi""#),
        (Endpoint::Classify, r#""input":"hi""#),
        (Endpoint::Score, r#""queries":"a","documents":["b"]"#),
        (Endpoint::Rerank, r#""query":"a","documents":["b"]"#),
        (
            Endpoint::ChatBatch,
            r#""messages":[[{"role":"user","content":"hi"}]]"#,
        ),
        (Endpoint::Chat, r#""messages":[]"#),
    ];
    for (endpoint, rest) in bodies {
        assert!(endpoint.needs().engine_priority, "{endpoint:?}");
        for (spelling, value) in [
            (r#""priority":-5"#, -5),
            (r#""priority":-9223372036854775808"#, i64::MIN),
            (r#""pr\u0069ority":-5"#, -5),
            (r#""priority":-0"#, 0),
        ] {
            let body = Bytes::from(format!(r#"{{"model":"m",{spelling},{rest}}}"#));
            let v = parse(&body, endpoint).unwrap();
            assert_eq!(
                v.priority.as_ref().and_then(|p| p.value),
                Some(value),
                "{endpoint:?} {spelling}"
            );
            let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Write(20));
            let sent: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(sent["priority"], 20, "{endpoint:?} {spelling}");
        }
        for refused in [
            r#""priority":"-5""#,
            r#""priority":1e309"#,
            r#""priority":-5.5"#,
            r#""priority":{"a":1}"#,
            r#""priority":20,"priority":-5"#,
            r#""priority":20,"pr\u0069ority":-5"#,
        ] {
            let body = format!(r#"{{"model":"m",{refused},{rest}}}"#);
            assert!(
                parse(body.as_bytes(), endpoint).is_err(),
                "{endpoint:?} {refused}"
            );
        }
    }
}

/// Where vLLM reads no `priority` (Messages, the tokenizer), a client's is taken out whole,
/// whatever it holds and wherever it stands, and the body stays valid JSON.
#[test]
fn priority_is_removed_where_no_engine_reads_it() {
    for (endpoint, rest) in [
        (
            Endpoint::Messages,
            r#""max_tokens":8,"messages":[{"role":"user","content":"hi"}]"#,
        ),
        (Endpoint::CountTokens, r#""messages":[]"#),
        (Endpoint::Tokenize, r#""prompt":"hi""#),
    ] {
        assert!(!endpoint.needs().engine_priority, "{endpoint:?}");
        for (before, after) in [
            (r#"{"model":"m","priority":-5,"#, "}"),
            (r#"{"priority" : "-5" , "model":"m","#, "}"),
            (r#"{"model":"m","pr\u0069ority":{"x":[1,"}"]},"#, "}"),
            (r#"{"model":"m","k\"\\":1,"priority":null,"#, "}"),
        ] {
            let body = Bytes::from(format!("{before}{rest}{after}"));
            let v = parse(&body, endpoint).unwrap();
            assert!(v.priority.is_some(), "{body:?}");
            let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Remove);
            let sent: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert!(sent.get("priority").is_none(), "{body:?} -> {out:?}");
            assert_eq!(sent["model"], "m");
        }
        // As the last member, and as the only one after the model.
        let body = Bytes::from(format!(r#"{{"model":"m",{rest}, "priority": 3 }}"#));
        let v = parse(&body, endpoint).unwrap();
        let out = upstream_body_owned(&body, &v, None, false, None, PriorityEdit::Remove);
        let sent: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(sent.get("priority").is_none(), "{out:?}");
    }
}

/// A `Content-Type` parameter named twice is found whatever its case or quoting, and a
/// `;` inside a quoted value does not start a parameter.
#[test]
fn repeated_content_type_parameters() {
    let twice = |ct: &str| repeated_parameter(ct);
    assert_eq!(twice("multipart/form-data; boundary=AAA"), None);
    assert_eq!(
        twice("multipart/form-data; boundary=AAA; boundary=BBB").as_deref(),
        Some("boundary")
    );
    assert_eq!(
        twice("multipart/form-data; Boundary=\"A\"; BOUNDARY=B").as_deref(),
        Some("boundary")
    );
    assert_eq!(
        twice("multipart/form-data; boundary=\"a; boundary=b\"; charset=utf-8"),
        None
    );
    assert_eq!(
        twice("multipart/form-data; boundary=\"a\\\" x\"; boundary=c").as_deref(),
        Some("boundary")
    );
    assert_eq!(twice("multipart/form-data"), None);
}

/// What vLLM would generate at most, read as it reads it: `max_completion_tokens or
/// max_tokens` (a 0 falls back), and `n` answers for each prompt of a completions list.
#[test]
fn the_output_limit_is_read_as_vllm_reads_it() {
    let v = parse(
        br#"{"model":"m","max_completion_tokens":0,"max_tokens":100000,"messages":[]}"#,
        Endpoint::Chat,
    )
    .unwrap();
    assert_eq!(v.max_tokens, Some(100_000));
    let body = format!(
        r#"{{"model":"m","max_tokens":1000,"n":2,"prompt":[{}]}}"#,
        vec!["\"p\""; 100].join(",")
    );
    let v = parse(body.as_bytes(), Endpoint::Completions).unwrap();
    assert_eq!((v.n, v.max_tokens), (200, Some(1000)));
    let v = parse(
        br#"{"model":"m","prompt":[[1,2],[3],[4,5,6]]}"#,
        Endpoint::Completions,
    )
    .unwrap();
    assert_eq!((v.n, v.prompt_chars), (3, 24));
}

/// The pooling bodies are sized by their texts in every shape vLLM takes (token ids ≈ 4
/// characters each; image URLs are not text), and need no generation fields.
#[test]
fn pooling_bodies() {
    let size = |body: &str, ep: Endpoint| parse(body.as_bytes(), ep).unwrap().prompt_chars;
    assert_eq!(
        size(r#"{"model":"m","input":"abcd"}"#, Endpoint::Embeddings),
        4
    );
    assert_eq!(
        size(r#"{"model":"m","input":["ab","c"]}"#, Endpoint::Embeddings),
        3
    );
    assert_eq!(
        size(r#"{"model":"m","input":[1,2,3]}"#, Endpoint::Embeddings),
        12
    );
    assert_eq!(
        size(r#"{"model":"m","input":[[1,2],[3]]}"#, Endpoint::Classify),
        12
    );
    assert_eq!(
        size(
            r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#,
            Endpoint::Pooling
        ),
        5
    );
    assert_eq!(
        size(
            r#"{"model":"m","inputs":[{"content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#,
            Endpoint::CohereEmbed
        ),
        3
    );
    assert_eq!(
        size(
            r#"{"model":"m","query":"ab","documents":["cd",{"content":[{"type":"text","text":"e"}]}],"top_n":1}"#,
            Endpoint::RerankV2
        ),
        5
    );
    assert_eq!(
        size(
            r#"{"model":"m","text_1":"ab","text_2":["c","d"]}"#,
            Endpoint::ScoreV1
        ),
        4
    );
    let v = parse(
        br#"{"model":"m","input":"x","max_tokens":9,"stream":true}"#,
        Endpoint::Embeddings,
    )
    .unwrap();
    assert!(
        !v.stream && v.max_tokens.is_none(),
        "no generation fields read"
    );
    // A batch: one answer per conversation.
    let v = parse(
        br#"{"model":"m","max_tokens":7,"messages":[[{"role":"user","content":"ab"}],[{"role":"user","content":"c"}]]}"#,
        Endpoint::ChatBatch,
    )
    .unwrap();
    assert_eq!((v.n, v.max_tokens, v.prompt_chars), (2, Some(7), 3));
    let (p, _) = err(
        r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
        Endpoint::ChatBatch,
    );
    assert_eq!(p.as_deref(), Some("messages[0]"));
}

/// The `model` form field is found wherever it comes, never in a file named `model`, and
/// its span holds its bare value (a rename splices it).
#[test]
fn the_model_form_field() {
    let body = Bytes::from_static(
        b"--b1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n\r\nname=\"model\"\r\n\r\nRIFF\r\n--b1\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b1\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--b1--\r\n",
    );
    let v = futures_util::FutureExt::now_or_never(parse_form(
        &body,
        "multipart/form-data; boundary=b1",
        Endpoint::Transcriptions,
    ))
    .unwrap()
    .unwrap();
    assert_eq!(v.model, "whisper");
    assert_eq!(&body[v.model_span.clone()], b"whisper");
    assert!(v.stream);
    let renamed = upstream_body(&body, &v, Some(b"openai/whisper-large-v3"), false);
    assert!(
        memchr::memmem::find(
            &renamed,
            b"name=\"model\"\r\n\r\nopenai/whisper-large-v3\r\n"
        )
        .is_some()
    );
    let refused = futures_util::FutureExt::now_or_never(parse_form(
        &body,
        "application/json",
        Endpoint::Transcriptions,
    ))
    .unwrap();
    assert!(matches!(refused, Err(ViewError::InvalidRequest { .. })));
}

#[test]
fn specific_errors() {
    let (p, m) = err(r#"{"messages":[]}"#, Endpoint::Chat);
    assert_eq!(p.as_deref(), Some("model"));
    assert!(m.contains("required"));
    let (p, _) = err(r#"{"model":5,"messages":[]}"#, Endpoint::Chat);
    assert_eq!(p.as_deref(), Some("model"));
    let (p, m) = err(
        r#"{"model":"m","stream":"yes","messages":[]}"#,
        Endpoint::Chat,
    );
    assert_eq!(p.as_deref(), Some("stream"));
    assert!(m.contains("boolean"), "{m}");
    let (p, _) = err(r#"{"model":"m","prompt":"x"}"#, Endpoint::Chat);
    assert_eq!(p.as_deref(), Some("messages"));
    let (p, _) = err(r#"{"model":"m","messages":[]"#, Endpoint::Chat);
    assert_eq!(p.as_deref(), Some("<json>"));
    let (p, m) = err(r#"[1,2]"#, Endpoint::Chat);
    assert_eq!(p, None);
    assert!(m.contains("JSON object"));
    let (p, _) = err(
        r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        Endpoint::Chat,
    );
    assert!(p.unwrap().starts_with("messages"));
    let (p, _) = err(
        r#"{"model":"m","max_tokens":-1,"messages":[]}"#,
        Endpoint::Chat,
    );
    assert_eq!(p.as_deref(), Some("max_tokens"));
}

#[test]
fn tokenizer_bodies() {
    // Generation fields mean nothing here: not read, so never injected into.
    let body = br#"{"model":"m","prompt":"abcd","stream":"yes","n":0,"add_special_tokens":false}"#;
    let v = parse(body, Endpoint::Tokenize).unwrap();
    assert_eq!((v.model.as_ref(), v.prompt_chars), ("m", 4));
    assert!(!v.stream && v.stream_options_span.is_none() && v.max_tokens.is_none());
    let v = parse(
        br#"{"model":"m","messages":[{"role":"user","content":"abc"}]}"#,
        Endpoint::Tokenize,
    )
    .unwrap();
    assert_eq!(v.prompt_chars, 3);
    let (p, m) = err(r#"{"model":"m"}"#, Endpoint::Tokenize);
    assert_eq!(p.as_deref(), Some("prompt"));
    assert!(m.contains("`messages`"), "{m}");
    let v = parse(br#"{"model":"m","tokens":[1,2,3]}"#, Endpoint::Detokenize).unwrap();
    assert_eq!(v.prompt_chars, 12);
    let (p, _) = err(r#"{"model":"m","tokens":null}"#, Endpoint::Detokenize);
    assert_eq!(p.as_deref(), Some("tokens"));
    let (p, m) = err(r#"{"model":"m","tokens":"1 2 3"}"#, Endpoint::Detokenize);
    assert_eq!(p.as_deref(), Some("tokens"));
    assert!(m.contains("array of token ids"), "{m}");
    // A `tokens` field of any shape in a chat body is none of the view's business.
    assert!(
        parse(
            br#"{"model":"m","messages":[],"tokens":"x"}"#,
            Endpoint::Chat
        )
        .is_ok()
    );
    let (p, _) = err(r#"{"prompt":"x"}"#, Endpoint::Tokenize);
    assert_eq!(p.as_deref(), Some("model"));
}

#[test]
fn usage_is_added_to_streams_that_did_not_ask() {
    let body = Bytes::from_static(br#" {"model":"m","stream":true,"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    let out = upstream_body(&body, &v, Some(br#""served""#), true);
    assert_eq!(
        &out[..],
        br#" {"stream_options":{"include_usage":true},"model":"served","stream":true,"messages":[]}"#
    );
    let v2 = parse(&out, Endpoint::Chat).unwrap();
    assert_eq!(v2.include_usage, Some(true));
    assert_eq!(v2.model, "served");

    let body = Bytes::from_static(br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    let out = upstream_body(&body, &v, None, true);
    let v2 = parse(&out, Endpoint::Chat).unwrap();
    assert_eq!(v2.include_usage, Some(true));
    assert!(
        std::str::from_utf8(&out)
            .unwrap()
            .contains("continuous_usage_stats")
    );
    // Nothing to change: the very same bytes.
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(
        upstream_body(&body, &v, None, false).as_ptr(),
        body.as_ptr()
    );
}

/// `continuous_usage_stats` without `include_usage` gets no usage from vLLM: with the
/// injected `include_usage` it must not turn into usage on every chunk.
#[test]
fn continuous_usage_without_include_usage_stays_without_usage() {
    let body = Bytes::from_static(
        br#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true},"messages":[]}"#,
    );
    let v = parse(&body, Endpoint::Chat).unwrap();
    let out = upstream_body(&body, &v, None, true);
    let sent: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        sent["stream_options"],
        serde_json::json!({"include_usage": true, "continuous_usage_stats": false})
    );
    // Asked for by the client: nothing injected, nothing changed.
    let both = Bytes::from_static(
        br#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"messages":[]}"#,
    );
    let v = parse(&both, Endpoint::Chat).unwrap();
    assert_eq!(upstream_body(&both, &v, None, false), both);
}

/// `"stream_options": null` is replaced, never joined by a second `stream_options` key
/// (duplicate keys: the sim refuses them, vLLM keeps the last, null, and reports no usage).
#[test]
fn a_null_stream_options_is_replaced() {
    let body =
        Bytes::from_static(br#"{"model":"m","stream":true,"stream_options" : null,"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(v.include_usage, None);
    let out = upstream_body(&body, &v, None, true);
    assert_eq!(
        &out[..],
        br#"{"model":"m","stream":true,"stream_options" : {"include_usage":true},"messages":[]}"#
    );
    assert_eq!(
        parse(&out, Endpoint::Chat).unwrap().include_usage,
        Some(true)
    );
    // Not a stream, nothing injected: the same bytes.
    let body = Bytes::from_static(br#"{"model":"m","stream_options":null,"messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert!(!v.stream);
    assert_eq!(upstream_body(&body, &v, None, false), body);
}

#[test]
fn splice_rewrites_only_the_model() {
    let body = Bytes::from_static(br#"{"model" : "a\u0062", "messages":[]}"#);
    let v = parse(&body, Endpoint::Chat).unwrap();
    assert_eq!(v.model, "ab");
    let out = upstream_body(&body, &v, Some(br#""served/name""#), false);
    assert_eq!(&out[..], br#"{"model" : "served/name", "messages":[]}"#);
    assert_eq!(parse(&out, Endpoint::Chat).unwrap().model, "served/name");
}

#[test]
fn each_protocols_prompt_is_counted_by_its_grammar() {
    let chars = |body: &str, ep: Endpoint| {
        let v = parse(body.as_bytes(), ep).unwrap();
        (v.prompt_chars, v.n)
    };
    // Chat: string content, text parts (an image part's URL is not text), null content.
    assert_eq!(
        chars(
            r#"{"model":"m","messages":[{"role":"user","content":"abcd"},{"role":"user","content":[{"type":"text","text":"ef"},{"type":"image_url","image_url":{"url":"xxxxxxxx"}}]},{"role":"assistant","content":null}]}"#,
            Endpoint::Chat
        ),
        (6, 1)
    );
    // Anthropic: a tool_result block's own blocks, and the system prompt's text blocks.
    assert_eq!(
        chars(
            r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"text","text":"42"}]}]}]}"#,
            Endpoint::Messages
        ),
        (5, 1)
    );
    // Completions: each string or list of ids is one prompt (n answers each); bare ids are one.
    let completions = |prompt: &str| {
        chars(
            &format!(r#"{{"model":"m","n":2,"prompt":{prompt}}}"#),
            Endpoint::Completions,
        )
    };
    assert_eq!(completions(r#""abc""#), (3, 2));
    assert_eq!(completions(r#"["ab","cde"]"#), (5, 4));
    assert_eq!(completions("[1,2,3]"), (12, 2));
    assert_eq!(completions("[[1,2],[3]]"), (12, 4));
    assert_eq!(completions(r#"["ab",[1]]"#), (6, 4));
    // Responses: messages, a function call's arguments and its output, bare strings and ids,
    // and the instructions.
    assert_eq!(
        chars(
            r#"{"model":"m","instructions":"ab","input":[{"role":"user","content":[{"type":"input_text","text":"cd"}]},{"type":"function_call","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"xyz"},"e",[7]]}"#,
            Endpoint::Responses
        ),
        (14, 1)
    );
    // Pooling text takes any scalar: numbers count 4, booleans and null nothing.
    assert_eq!(
        chars(
            r#"{"model":"m","query":"q","documents":[1,-2,3.5,true,null,{"text":"ab","url":"zzz"}]}"#,
            Endpoint::Rerank
        )
        .0,
        15
    );
    // An `input` holds strings, ids or messages: a negative number is not a token id.
    let (param, _) = err(r#"{"model":"m","input":[1,-2]}"#, Endpoint::Embeddings);
    assert_eq!(param.as_deref(), Some("input[1]"));
    // A batch: one answer per conversation.
    assert_eq!(
        chars(
            r#"{"model":"m","messages":[[{"role":"user","content":"ab"}],[{"role":"user","content":"c"}]]}"#,
            Endpoint::ChatBatch
        ),
        (3, 2)
    );
    // Another type is refused with what the grammar expects, naming the field.
    let (param, message) = err(
        r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        Endpoint::Chat,
    );
    assert_eq!(param.as_deref(), Some("messages[0].content"), "{message}");
    assert!(
        message.contains("expected a string or an array of content parts"),
        "{message}"
    );
    let (_, message) = err(r#"{"model":"m","messages":["hi"]}"#, Endpoint::Chat);
    assert!(message.contains("expected a message object"), "{message}");
    let (_, message) = err(r#"{"model":"m","prompt":[-1]}"#, Endpoint::Completions);
    assert!(
        message.contains("expected a string, an array of strings, or an array of token ids"),
        "{message}"
    );
    let (_, message) = err(
        r#"{"model":"m","input":{"role":"user"}}"#,
        Endpoint::Responses,
    );
    assert!(
        message.contains("expected a string or a list of input items"),
        "{message}"
    );
}
