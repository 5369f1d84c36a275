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

/// A word-level model whose vocabulary covers `w0`…`w999`, with Qwen's chat tokens added as
/// the tokenizer's added tokens (`lstrip` on them when `strip`).
fn added_tokens_dir(tag: &str, strip: bool) -> PathBuf {
    let dir = model_dir(tag);
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for i in 0..1000u32 {
        vocab.insert(format!("w{i}"), (i + 1).into());
    }
    for (i, w) in ["system", "user", "assistant"].iter().enumerate() {
        vocab.insert((*w).into(), (2000 + i).into());
    }
    let added: Vec<serde_json::Value> = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": 3000 + i, "content": t, "single_word": false, "lstrip": strip,
                "rstrip": false, "normalized": false, "special": i < 2})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// A conversation's history is encoded once: a later turn's ids are the same as the whole
/// prompt encoded at once, and its earlier messages come from what was remembered.
#[test]
fn a_later_turn_reuses_the_historys_ids_and_they_are_the_whole_prompts() {
    let p = PromptTokens::load(&added_tokens_dir("segments", false), Some(&template())).unwrap();
    let segments = p.segments.as_ref().expect("stretch by stretch");
    let words = |from: usize, n: usize| {
        (from..from + n)
            .map(|i| format!("w{}", i % 1000))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": words(0, 300)}),
        serde_json::json!({"role": "user", "content": words(300, 100)}),
    ];
    let mut held = Vec::new();
    for turn in 0..4 {
        let body = serde_json::to_vec(&serde_json::json!({"messages": messages})).unwrap();
        let ids = p.chat(&body).unwrap();
        assert_eq!(ids, p.chat_whole(&body).unwrap(), "turn {turn}");
        let start = p.tokenizer.token_to_id("<|im_start|>").unwrap();
        assert_eq!(ids[0], start, "the template's own token");
        assert!(ids.contains(&1), "w0 is a word of the vocabulary");
        held.push(segments.held_ids());
        // The answer (with a thought, which Qwen3's template drops from the history) and the
        // next question; an added token inside a message is one too.
        messages.push(serde_json::json!({"role": "assistant", "content": format!("<think> w7 </think> {}", words(400 + turn * 50, 80))}));
        messages.push(serde_json::json!({"role": "user", "content": words(600 + turn * 50, 90)}));
    }
    // Each turn remembers only what is new: the system prompt (300 ids) once.
    assert!(held[0] >= 300, "{held:?}");
    assert!(
        held.windows(2).all(|w| w[1] > w[0] && w[1] - w[0] < 300),
        "{held:?}"
    );
    // A tokenizer whose added tokens strip the spaces beside them is encoded whole.
    let stripping =
        PromptTokens::load(&added_tokens_dir("segments-strip", true), Some(&template())).unwrap();
    assert!(stripping.segments.is_none());
}
