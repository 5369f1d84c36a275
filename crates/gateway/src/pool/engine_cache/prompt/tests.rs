//! The renderer against what real vLLM 0.32 rendered for the same requests, with Qwen3's chat
//! template (tests/fixtures/vllm-0.32.0/tokenize-qwen3.json, scripts/vllm-tokenize-capture.py):
//! every captured chat request's prompt, to the byte. The token ids themselves need Qwen's
//! tokenizer, which the real-vLLM suite builds (`real_vllm::tokens`); here a word-level
//! stand-in is loaded, as the renderer does not depend on it.

use std::path::PathBuf;

use super::*;

/// The capture, read into insertion-ordered values: a tool's schema is written in the order the
/// client gave its keys, so the requests must keep theirs.
fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/vllm-0.32.0/tokenize-qwen3.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A model directory with a word-level tokenizer and Qwen3's special tokens.
fn model_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fleetgate-prompt-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

fn template() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/qwen3/chat_template.jinja"
    ))
}

#[test]
fn every_captured_chat_request_renders_as_vllm_rendered_it() {
    let f = fixture();
    let p = PromptTokens::load(&model_dir("render"), Some(&template())).unwrap();
    let mut chats = 0;
    for case in f.get_attr("cases").unwrap().try_iter().unwrap() {
        let request = case.get_attr("request").unwrap();
        if request.is_undefined() {
            continue;
        }
        let body = serde_json::to_vec(&request).unwrap();
        let ours = p.render_chat(&body).unwrap();
        let theirs = case.get_attr("prompt_text").unwrap();
        assert_eq!(
            ours,
            theirs.as_str().unwrap(),
            "{}",
            case.get_attr("name").unwrap()
        );
        chats += 1;
    }
    assert!(chats >= 8, "{chats} chat cases");
}

#[test]
fn the_template_comes_from_the_config_or_the_directory_or_nowhere() {
    let dir = model_dir("sources");
    let none = PromptTokens::load(&dir, None).unwrap();
    let body = br#"{"messages": [{"role": "user", "content": "hello"}]}"#;
    assert_eq!(
        none.render_chat(body).unwrap_err(),
        "the model has no chat template"
    );
    assert_eq!(none.completion("hello world").unwrap(), vec![1, 2]);
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ bos_token }}{{ messages[0].content }}|{{ eos_token }}",
    )
    .unwrap();
    let file = PromptTokens::load(&dir, None).unwrap();
    assert_eq!(
        file.render_chat(body).unwrap(),
        "hello|<|im_end|>",
        "bos_token is null: not defined"
    );
    let config = serde_json::json!({"eos_token": {"content": "</s>"}, "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages|length }}{{ eos_token }}"}]});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let listed = PromptTokens::load(&dir, None).unwrap();
    assert_eq!(listed.render_chat(body).unwrap(), "1</s>");
    assert!(
        PromptTokens::load(&dir.join("missing"), None)
            .unwrap_err()
            .contains("tokenizer.json")
    );
    std::fs::write(dir.join("bad.jinja"), "{% if %}").unwrap();
    assert!(
        PromptTokens::load(&dir, Some(&dir.join("bad.jinja")))
            .unwrap_err()
            .contains("does not parse")
    );
}

#[test]
fn tojson_writes_as_pythons_json_dumps() {
    let env = {
        let mut e = Environment::new();
        e.add_filter("tojson", tojson);
        e
    };
    let render = |src: &str, v: &str| {
        let ctx: Value = serde_json::from_str(v).unwrap();
        env.render_str(src, minijinja::context! { v => ctx })
            .unwrap()
    };
    assert_eq!(
        render(
            "{{ v|tojson }}",
            r#"{"b": [1, 2.5, 1e-05, true, null], "a": "naïve \"q\"\n<tag>"}"#
        ),
        r#"{"b": [1, 2.5, 1e-05, true, null], "a": "naïve \"q\"\n<tag>"}"#
    );
    assert_eq!(
        render("{{ v|tojson(indent=2) }}", r#"{"k": [1, {}]}"#),
        "{\n  \"k\": [\n    1,\n    {}\n  ]\n}"
    );
    assert_eq!(python_float(1e20), "1e+20");
    assert_eq!(python_float(0.1), "0.1");
}

#[test]
fn what_cannot_be_rendered_says_why() {
    let p = PromptTokens::load(&model_dir("errors"), Some(&template())).unwrap();
    for (body, says) in [
        (&br#"{"messages": "hi"}"#[..], "not a chat request"),
        (br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#, "`image_url` content part is not text"),
        (br#"{"messages": [{"role": "user", "content": "a"}], "continue_final_message": true, "add_generation_prompt": false}"#, ""),
    ] {
        match p.render_chat(body) {
            Ok(text) => assert!(says.is_empty() && text.ends_with('a'), "{text}"),
            Err(e) => assert!(!says.is_empty() && e.contains(says), "{e}"),
        }
    }
}

/// What vLLM published while it served the captured requests, applied to an index, holds every
/// full block of every request's prompt as `/tokenize` gave it, chained by the gateway's own
/// identities: the blocks the gateway predicts from a prompt's token ids are the engine's.
#[test]
fn the_engines_events_hold_every_block_the_prompts_tokens_predict() {
    use super::super::index::Index;
    use fleetgate_protocol::kv_events::{BlockId, decode};
    let f = fixture();
    let mut ix = Index::new(1 << 16);
    for frame in f.get_attr("frames").unwrap().try_iter().unwrap() {
        let hex = frame.get_attr("payload_hex").unwrap();
        let hex = hex.as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        for e in decode(&bytes).unwrap().events {
            ix.apply(&e);
        }
    }
    assert_eq!(ix.block_size, 128);
    let mut blocks = 0;
    for case in f.get_attr("cases").unwrap().try_iter().unwrap() {
        let ids: Vec<u32> = case
            .get_attr("prompt_token_ids")
            .unwrap()
            .try_iter()
            .unwrap()
            .map(|v| u32::try_from(v).unwrap())
            .collect();
        let predicted: Vec<BlockId> = BlockId::of_prompt(&ids, 128, None).collect();
        assert_eq!(
            ix.held_prefix(&predicted),
            predicted.len(),
            "{}: {} tokens",
            case.get_attr("name").unwrap(),
            ids.len()
        );
        blocks += predicted.len();
    }
    assert!(blocks >= 20, "{blocks} blocks predicted");
    assert_eq!(
        ix.len(),
        5,
        "three system blocks, the tools' block, the tool call's"
    );
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let dir = model_dir("kwargs");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ messages[0].content }}{% if enable_thinking is false %}|no-think{% endif %}",
    )
    .unwrap();
    let p = PromptTokens::load(&dir, None).unwrap();
    let body = br#"{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}}"#;
    assert_eq!(p.render_chat(body).unwrap(), "hi|no-think");
}
