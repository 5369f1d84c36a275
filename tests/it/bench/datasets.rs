//! The prompts sent: ShareGPT sampled and filtered as vLLM does, multi-turn conversations
//! carrying their history (directly and through a gateway), hot conversations, and
//! prefix-repetition prompts.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_is_sampled_and_filtered_as_vllm_does() {
    let dir = temp_dir("bench-sharegpt");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sharegpt.json");
    let long = "word ".repeat(1200); // 6000 characters ≈ 1500 tokens: a prompt too long
    let data = serde_json::json!([
        {"id": "a", "conversations": [
            {"from": "human", "value": "Explain the difference between TCP and UDP in two sentences."},
            {"from": "gpt", "value": "TCP is connection oriented and reliable; UDP is connectionless and best effort."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Only one turn here, nothing to answer."}]},
        {"id": "c", "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello! How can I help you today, friend?"}]},
        {"id": "d", "conversations": [
            {"from": "human", "value": long},
            {"from": "gpt", "value": "A reply to a very long prompt that is long enough."}]},
        {"id": "e", "conversations": [
            {"from": "human", "value": "Write a haiku about inference servers at night."},
            {"from": "gpt", "value": "Ok"}]},
        {"id": "f", "conversations": [
            {"from": "human", "value": "What does TTFT stand for in LLM serving benchmarks?"},
            {"from": "gpt", "value": "Time to first token: the wait before the first output token arrives."},
            {"from": "human", "value": "A third turn is ignored."}]}
    ]);
    std::fs::write(&path, data.to_string()).unwrap();
    let (prompts, stats) =
        fleetgate_bench::dataset::sharegpt(&path, 100, None, 0, &Default::default()).unwrap();
    assert_eq!(stats.conversations, 6);
    assert_eq!(stats.fewer_than_two_turns, 1);
    assert_eq!(stats.prompt_too_short, 1, "`Hi`");
    assert_eq!(stats.output_too_short, 1, "`Ok`");
    assert_eq!(stats.prompt_too_long, 1);
    assert_eq!(stats.kept, 2);
    assert_eq!(prompts.len(), 2);
    assert!(prompts.iter().all(|p| p.output_tokens >= 4));
    // A fixed output length lifts the output check (as --sharegpt-output-len does).
    let (fixed, stats) =
        fleetgate_bench::dataset::sharegpt(&path, 100, Some(64), 0, &Default::default()).unwrap();
    assert_eq!(stats.output_too_short, 0);
    assert_eq!(fixed.len(), 3);
    assert!(fixed.iter().all(|p| p.output_tokens == 64));
    // Through the CLI against the sim, the skipped counts are in the dataset note.
    let s = sim(|a| a.zero_delay = true).await;
    let p = path.display().to_string();
    let (plan, report) = run(&[
        "--base-url",
        &s.url(),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        &p,
        "--num-prompts",
        "5",
        "--sharegpt-output-len",
        "8",
    ])
    .await;
    assert!(
        plan.dataset_note.contains("1 prompts over 1024 tokens"),
        "{}",
        plan.dataset_note
    );
    assert!(
        plan.dataset_note.contains("only 3 of the 5"),
        "{}",
        plan.dataset_note
    );
    assert_eq!(report.summaries[0].completed, 3);
    // With the model's tokenizer the counts are its own: 1100 one-letter words are ~550 tokens
    // by characters / 4 (kept) but 1100 by a word-level tokenizer (a prompt over 1024: skipped).
    let long_words = "a ".repeat(1100);
    let data = serde_json::json!([
        {"conversations": [
            {"from": "human", "value": long_words},
            {"from": "gpt", "value": "A reply that is long enough to keep."}]},
        {"conversations": [
            {"from": "human", "value": "Explain the difference between TCP and UDP in two sentences."},
            {"from": "gpt", "value": "TCP is reliable and ordered; UDP is neither."}]}
    ]);
    std::fs::write(&path, data.to_string()).unwrap();
    let approx = fleetgate_bench::dataset::sharegpt(&path, 10, None, 0, &Default::default())
        .unwrap()
        .1;
    assert_eq!((approx.kept, approx.prompt_too_long), (2, 0));
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(
        &tok_path,
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}
        })
        .to_string(),
    )
    .unwrap();
    let t = tok_path.display().to_string();
    let (plan, _) = run(&[
        "--base-url",
        &s.url(),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        &p,
        "--num-prompts",
        "10",
        "--tokenizer",
        &t,
    ])
    .await;
    assert_eq!(plan.prompts.len(), 1, "{}", plan.dataset_note);
    assert_eq!(plan.prompts[0].input_tokens, 11, "the tokenizer's count");
    assert!(
        plan.dataset_note.contains("1 prompts over 1024 tokens"),
        "{}",
        plan.dataset_note
    );
    assert!(
        plan.dataset_note.contains("by the tokenizer"),
        "{}",
        plan.dataset_note
    );
    // Not a ShareGPT file: a clear error.
    std::fs::write(&path, b"{\"not\": \"a list\"}").unwrap();
    let e = fleetgate_bench::dataset::sharegpt(&path, 5, None, 0, &Default::default()).unwrap_err();
    assert!(e.contains("not a ShareGPT file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A multi-turn run against `base` (16 shared system tokens, 24 user tokens and 20 answer
/// tokens a turn), its report.
async fn multi_turn(
    base: &str,
    kind: &str,
    conversations: &str,
    extra: &[&str],
) -> fleetgate_bench::Report {
    let mut flags = vec![
        "--base-url",
        base,
        "--endpoint-type",
        kind,
        "--model",
        "qwen32b",
        "--multi-turn-conversations",
        conversations,
        "--multi-turn-turns",
        "3",
        "--multi-turn-user-len",
        "24",
        "--multi-turn-system-len",
        "16",
        "--random-output-len",
        "20",
        "--ignore-eos",
    ];
    flags.extend_from_slice(extra);
    let plan = fleetgate_bench::plan(args(&flags)).await.unwrap();
    assert!(plan.multi_turn.is_some());
    fleetgate_bench::multiturn::run(Arc::new(plan), CancellationToken::new())
        .await
        .unwrap()
}

/// (mean prompt tokens, cached share if the answers said) of each turn of a multi-turn report.
fn turns(report: &fleetgate_bench::Report) -> Vec<(f64, Option<f64>)> {
    report.json["multi_turn"]["per_turn"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["failed"], 0, "{r}");
            (
                r["mean_input_tokens"].as_f64().unwrap(),
                r["cached_tokens_share"].as_f64(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_conversations_carry_their_history_and_hit_the_prefix_cache() {
    for kind in ["openai-chat", "openai-responses", "anthropic-messages"] {
        // A sim of its own per API, so each starts with a cold cache.
        let s = sim(|a| {
            a.kv_cache_tokens = 1_000_000;
            a.enable_prompt_tokens_details = true;
        })
        .await;
        let report = multi_turn(&s.url(), kind, "3", &[]).await;
        assert_eq!(report.exit, 0, "{kind}: {}", report.text);
        assert_eq!(report.json["completed"], 9, "{kind}");
        let t = turns(&report);
        assert_eq!(t.len(), 3, "{kind}: one row per turn");
        // The later turns' TTFT lies within the range of turns 2 and 3's own.
        let later = report.json["multi_turn"]["later_turns"]["median_ttft_ms"]
            .as_f64()
            .unwrap();
        let rows = report.json["multi_turn"]["per_turn"].as_array().unwrap();
        let (lo, hi) = (
            rows[1]["median_ttft_ms"].as_f64().unwrap(),
            rows[2]["median_ttft_ms"].as_f64().unwrap(),
        );
        assert!(
            later > 0.0 && later >= lo.min(hi) - 1e-9 && later <= lo.max(hi) + 1e-9,
            "{kind}: later turns {later} vs turns 2 and 3: {lo}, {hi}"
        );
        assert!(report.text.contains("Later turns (2 to 3)"), "{kind}");
        // Each turn carries the last one's prompt, its 20-token answer and 24 new tokens.
        for w in t.windows(2) {
            assert!(w[1].0 >= w[0].0 + 40.0, "{kind}: {t:?}");
        }
        // The history is found cached: later turns' cached share is higher than the first's,
        // which only the 16-token system prompt can have in common with anything. (The sim's
        // Messages usage does not say what was cached: there only the /metrics rate.)
        if kind != "anthropic-messages" {
            let share = |i: usize| t[i].1.unwrap();
            assert!(share(2) > share(0) && share(2) > 0.4, "{kind}: {t:?}");
        }
        let cache = &report.json["multi_turn"]["prefix_cache"];
        assert_eq!(cache["measured"], true, "{kind}: {cache}");
        let rate = cache["hit_rate"].as_f64().unwrap();
        assert!(rate > 0.0 && rate < 1.0, "{kind}: {cache}");
        assert!(report.text.contains("Prefix cache hit rate (vLLM /metrics"));
        assert!(
            report.json["multi_turn"]["hot"].is_null(),
            "{kind}: no hot conversation"
        );
        assert!(!report.text.contains("Hot conversation"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_through_a_gateway_reads_the_cache_from_the_backends() {
    let s = sim(|a| {
        a.kv_cache_tokens = 1_000_000;
        a.enable_prompt_tokens_details = true;
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let gw_base = format!("http://{}", gw.server.local_addr);
    // The gateway's own /metrics has no vLLM counters: not measured, and said so.
    let report = multi_turn(&gw_base, "openai-chat", "2", &["--header", &auth]).await;
    assert_eq!(report.exit, 0, "{}", report.text);
    assert_eq!(turns(&report).len(), 3);
    let cache = &report.json["multi_turn"]["prefix_cache"];
    assert_eq!(cache["measured"], false, "{cache}");
    assert!(cache["hit_rate"].is_null());
    assert!(report.text.contains("not measured"), "{}", report.text);
    // Named, the backend's counters are read.
    let report = multi_turn(
        &gw_base,
        "openai-chat",
        "2",
        &["--header", &auth, "--cache-metrics-url", &s.url()],
    )
    .await;
    let cache = &report.json["multi_turn"]["prefix_cache"];
    assert_eq!(cache["measured"], true, "{cache}");
    assert!(cache["hit_rate"].as_f64().unwrap() > 0.0, "{cache}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_multi_turn_run_starts_conversations_over_until_the_time_is_up() {
    // 2 conversations of 3 turns, each turn 20 tokens at 5 ms a step (≈ 100 ms), for 1.5 s:
    // more turns than one pass of the conversations sends, each new start a new history.
    let s = sim(|a| {
        a.kv_cache_tokens = 1_000_000;
        a.enable_prompt_tokens_details = true;
        a.decode_step_ms = 5.0;
    })
    .await;
    let report = multi_turn(&s.url(), "openai-chat", "2", &["--duration-seconds", "1.5"]).await;
    assert_eq!(report.exit, 0, "{}", report.text);
    let done = report.json["completed"].as_u64().unwrap();
    assert!(
        done > 6,
        "one pass is 6 turns; a timed run starts over: {done}"
    );
    assert_eq!(s.stats().requests.load(Ordering::SeqCst), done);
    // Every start over is a new conversation: its first turn is as long as the first pass's
    // first turn (the history does not carry over), so turn 1's mean prompt stays turn 1's.
    let t = turns(&report);
    assert_eq!(t.len(), 3);
    assert!(t[1].0 >= t[0].0 + 40.0 && t[2].0 >= t[1].0 + 40.0, "{t:?}");
    let note = report.json["dataset"].as_str().unwrap_or_default();
    assert!(note.contains("starts over as a new one"), "{note}");
    // Without the time, the same flags send one pass.
    let once = multi_turn(&s.url(), "openai-chat", "2", &[]).await;
    assert_eq!(once.json["completed"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_conversation_sends_its_turns_by_lanes_over_one_history() {
    let s = sim(|a| {
        a.kv_cache_tokens = 1_000_000;
        a.enable_prompt_tokens_details = true;
    })
    .await;
    let report = multi_turn(
        &s.url(),
        "openai-chat",
        "4",
        &["--multi-turn-hot-share", "0.5"],
    )
    .await;
    assert_eq!(report.exit, 0, "{}", report.text);
    // L = max(2, round(0.5 / 0.5 × 3)) = 3 lanes: 3 × 3 hot requests and 3 × 3 of the others.
    assert_eq!(s.stats().requests.load(Ordering::SeqCst), 18);
    assert_eq!(report.json["completed"], 18);
    assert_eq!(report.json["num_prompts"], 18);
    let hot = &report.json["multi_turn"]["hot"];
    assert_eq!(hot["lanes"], 3, "{hot}");
    assert_eq!(
        (hot["requests"].as_u64(), hot["all_requests"].as_u64()),
        (Some(9), Some(18))
    );
    assert_eq!(hot["share"].as_f64(), Some(0.5), "{hot}");
    assert_eq!(hot["share_asked"].as_f64(), Some(0.5), "{hot}");
    for k in [
        "median_ttft_ms",
        "p99_ttft_ms",
        "others_median_ttft_ms",
        "others_p99_ttft_ms",
    ] {
        assert!(hot[k].as_f64().unwrap() > 0.0, "{k}: {hot}");
    }
    assert!(
        report
            .text
            .contains("Hot conversation: 3 lanes a turn, 9 of 18 requests (50.0%"),
        "{}",
        report.text
    );
    // Each turn's lanes: a message of its own each, and at the sim the same prompt tokens (the
    // same history behind messages of one size), growing turn by turn with lane 0's answer.
    let plan = fleetgate_bench::plan(args(&[
        "--base-url",
        &s.url(),
        "--model",
        "qwen32b",
        "--multi-turn-conversations",
        "4",
        "--multi-turn-turns",
        "3",
        "--multi-turn-user-len",
        "24",
        "--random-output-len",
        "20",
        "--ignore-eos",
        "--multi-turn-hot-share",
        "0.5",
    ]))
    .await
    .unwrap();
    assert_eq!(plan.num_prompts, 18);
    let mt = plan.multi_turn.clone().unwrap();
    let result =
        fleetgate_bench::multiturn::execute(Arc::new(plan.clone()), CancellationToken::new())
            .await
            .unwrap();
    assert_eq!(result.outcomes.len(), 18);
    let mut last = 0;
    for t in 0..3 {
        let lanes: Vec<_> = result
            .outcomes
            .iter()
            .filter(|o| mt.is_hot(o.prompt) && mt.turn_of(o.prompt) == t)
            .collect();
        assert_eq!(lanes.len(), 3, "turn {t}");
        assert!(lanes.iter().all(|o| o.ok()));
        let tokens: Vec<u64> = lanes.iter().map(|o| o.input_tokens).collect();
        assert!(
            tokens.iter().all(|n| *n == tokens[0]),
            "turn {t}: {tokens:?}"
        );
        assert!(tokens[0] > last, "turn {t}: {tokens:?} after {last}");
        last = tokens[0];
        let texts: std::collections::HashSet<&str> = (0..3)
            .map(|k| plan.prompts[mt.lane_index(0, k, t)].text.as_str())
            .collect();
        assert_eq!(texts.len(), 3, "turn {t}: one message per lane");
    }
}

#[tokio::test]
async fn a_hot_share_out_of_range_or_without_conversations_is_refused() {
    let base = format!("http://{}", closed_port().await);
    let refused = |extra: &[&str]| {
        let mut flags = vec![
            "--base-url".to_owned(),
            base.clone(),
            "--endpoint-type".into(),
            "openai-chat".into(),
            "--model".into(),
            "m".into(),
        ];
        flags.extend(extra.iter().map(|f| (*f).to_owned()));
        args(&flags.iter().map(String::as_str).collect::<Vec<_>>())
    };
    for f in ["0", "1", "1.5", "-0.2", "NaN"] {
        let err = fleetgate_bench::plan(refused(&[
            "--multi-turn-conversations",
            "4",
            &format!("--multi-turn-hot-share={f}"),
        ]))
        .await
        .unwrap_err();
        assert!(
            err.contains("--multi-turn-hot-share") && err.contains("between 0 and 1"),
            "{f}: {err}"
        );
    }
    let err = fleetgate_bench::plan(refused(&["--multi-turn-hot-share", "0.3"]))
        .await
        .unwrap_err();
    assert!(err.contains("--multi-turn-conversations"), "{err}");
    let err = fleetgate_bench::plan(refused(&[
        "--multi-turn-conversations",
        "1",
        "--multi-turn-hot-share",
        "0.3",
    ]))
    .await
    .unwrap_err();
    assert!(err.contains("≥ 2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_repetition_prompts_share_their_prefixes_as_vllm_makes_them() {
    let s = sim(|a| a.zero_delay = true).await;
    let (plan, report) = run(&[
        "--base-url",
        &s.url(),
        "--model",
        "qwen32b",
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "32",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "3",
        "--num-prompts",
        "8",
    ])
    .await;
    assert_eq!(report.exit, 0, "{}", report.text);
    assert_eq!(report.json["completed"], 8);
    // The bodies sent: two prefixes of 32 words, four prompts behind each.
    let mut prefixes = std::collections::HashMap::new();
    for b in &plan.bodies {
        let v: serde_json::Value = serde_json::from_slice(b).unwrap();
        assert_eq!(v["max_tokens"], 3);
        let text = v["messages"][0]["content"].as_str().unwrap();
        let words: Vec<&str> = text.split(' ').collect();
        assert_eq!(words.len(), 40);
        *prefixes.entry(words[..32].join(" ")).or_insert(0) += 1;
    }
    assert_eq!(prefixes.len(), 2, "{prefixes:?}");
    assert!(prefixes.values().all(|n| *n == 4));
}
