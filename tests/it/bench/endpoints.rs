//! Endpoints other than chat: the agents' protocols benchmarked like chat, and embeddings
//! (directly with vLLM's pooling keys, through the gateway, and compared on E2EL only).

use super::*;

/// The agents' protocols are measured like chat: `--endpoint-type openai-responses` and
/// `anthropic-messages` time their own token events (TTFT, ITL, E2EL, usage), directly and
/// through the gateway in one `--compare` run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_protocols_are_benchmarked_like_chat() {
    let s = sim(|a| {
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{}", gw.server.local_addr);
    for kind in ["openai-responses", "anthropic-messages"] {
        let (plan, report) = run(&[
            "--endpoint-type",
            kind,
            "--compare",
            &direct,
            &via,
            "--header",
            &auth,
            "--model",
            "qwen32b",
            "--num-prompts",
            "8",
            "--random-input-len",
            "20",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "1",
            "--percentile-metrics",
            "ttft,itl,e2el",
        ])
        .await;
        assert_eq!(plan.targets.len(), 2);
        for r in &report.summaries {
            assert_eq!((r.completed, r.failed), (8, 0), "{kind}: {}", report.text);
            assert_eq!(r.total_output, 8 * 6, "{kind}: output tokens from usage");
            assert_eq!(r.outputs_without_usage, 0, "{kind}");
            // 6 token events per answer: 5 gaps of one decode step each.
            assert_eq!(r.metrics["itl"].count, 8 * 5, "{kind}: token events only");
            assert!(r.metrics["ttft"].mean > 0.0);
        }
        assert_eq!(report.json["endpoint_type"], kind, "{kind}");
    }
    // An endpoint that disagrees with its type is refused before anything is sent.
    let err = fleetgate_bench::plan(args(&[
        "--base-url",
        &s.url(),
        "--endpoint-type",
        "anthropic-messages",
        "--endpoint",
        "/v1/chat/completions",
    ]))
    .await
    .unwrap_err();
    assert!(err.contains("disagree"), "{err}");
}

/// A `vllm serve --runner pooling` stand-in serving the embedding model `embed`.
async fn embedding_sim() -> fleetgate_sim::SimServer {
    sim(|a| {
        a.runner = fleetgate_sim::Runner::Pooling;
        a.convert = fleetgate_sim::Convert::Embed;
        a.served_model_name = vec!["embed".into()];
    })
    .await
}

/// The lines a generation run prints and an embedding run must not: figures an embedding does
/// not have (no first token, no gaps, no output).
const GENERATION_ONLY: &[&str] = &[
    "TTFT",
    "TPOT",
    "ITL",
    "Time to First Token",
    "Inter-token Latency",
    "Total generated tokens:",
    "Output token throughput",
    "Peak output token throughput",
    "Peak concurrent requests:",
];

/// `--endpoint-type openai-embeddings` against a pooling server: vLLM's request body, E2EL as
/// the whole request, input tokens from usage, and vLLM's pooling keys in the result — no
/// TTFT/TPOT/ITL line or key, even when asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_benchmarked_directly_with_vllms_pooling_keys() {
    let s = embedding_sim().await;
    let (plan, report) = run(&[
        "--endpoint-type",
        "openai-embeddings",
        "--base-url",
        &s.url(),
        "--num-prompts",
        "12",
        "--random-input-len",
        "40",
        "--random-output-len",
        "99",
        "--max-concurrency",
        "2",
        // vLLM's generation metrics, asked for: left out with a note, not printed as zeros.
        "--percentile-metrics",
        "ttft,itl,e2el",
        "--metric-percentiles",
        "50,95",
    ])
    .await;
    assert_eq!(plan.model, "embed", "the model from /v1/models");
    assert_eq!(plan.targets[0].uri.path(), "/v1/embeddings");
    assert_eq!(plan.selected, ["e2el"]);
    // vLLM's body: the prompt as `input`, no stream, no output length.
    let body: serde_json::Value = serde_json::from_slice(&plan.bodies[0]).unwrap();
    assert_eq!(body["model"], "embed");
    assert_eq!(body["input"].as_str(), Some(plan.prompts[0].text.as_str()));
    assert_eq!(body["truncate_prompt_tokens"], -1);
    for k in ["stream", "max_tokens", "stream_options", "messages"] {
        assert!(body.get(k).is_none(), "{k} in {body}");
    }
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (12, 0), "{}", report.text);
    assert_eq!(r.outputs_without_usage, 0, "usage read from every answer");
    assert!(r.total_input > 0 && r.total_output == 0);
    assert_eq!(r.metrics["e2el"].count, 12, "one latency per request");
    assert_eq!(r.metrics["ttft"].count, 0, "no first token");
    assert_eq!(r.metrics["itl"].count, 0);
    assert!(r.metrics["e2el"].mean > 0.0);
    for l in [
        "note: openai-embeddings answers are not streamed: ttft, itl not measured",
        "--random-output-len is not sent",
        "Successful requests:                     12",
        "Total input tokens:",
        "Request throughput (req/s):",
        "Input throughput (inputs/s):",
        "Total token throughput (tok/s):",
        "End-to-end Latency",
        "Mean E2EL (ms):",
        "P95 E2EL (ms):",
    ] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    for l in GENERATION_ONLY {
        assert!(!report.text.contains(l), "{l}\n{}", report.text);
    }
    // vLLM's keys of a pooling run, with its meanings.
    let j = &report.json;
    assert_eq!(j["endpoint_type"], "openai-embeddings");
    assert_eq!(j["backend"], "openai-embeddings");
    for k in [
        "date",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_input_sequences",
        "request_throughput",
        "input_sequence_throughput",
        "total_token_throughput",
        "input_lens",
        "latencies",
        "errors",
        "mean_e2el_ms",
        "median_e2el_ms",
        "std_e2el_ms",
        "p50_e2el_ms",
        "p95_e2el_ms",
        "error_rate",
    ] {
        assert!(j.get(k).is_some(), "result JSON lacks `{k}`");
    }
    for k in [
        "total_output_tokens",
        "output_throughput",
        "output_lens",
        "ttfts",
        "itls",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "request_goodput",
        "mean_ttft_ms",
        "p95_itl_ms",
        "ttft_ms",
        "tpot_ms",
    ] {
        assert!(j.get(k).is_none(), "an embedding run has no `{k}`");
    }
    assert_eq!(j["total_input_tokens"], r.total_input);
    assert_eq!(j["total_input_sequences"], 12);
    assert_eq!(j["settings"]["random_output_len"], serde_json::Value::Null);
    let lat = j["latencies"].as_array().unwrap();
    assert_eq!(lat.len(), 12);
    let mean_s = lat.iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / 12.0;
    assert!((mean_s * 1e3 - r.metrics["e2el"].mean).abs() < 1e-6);
    let throughput = j["total_token_throughput"].as_f64().unwrap();
    let expected = r.total_input as f64 / j["duration"].as_f64().unwrap();
    assert!(
        (throughput - expected).abs() < 1e-6,
        "input tokens per second"
    );
    assert_eq!(report.exit, 0);

    // What an embedding does not have cannot be an objective or the only metric.
    for (flag, value) in [
        ("--sla", "ttft_p99_ms=100"),
        ("--percentile-metrics", "ttft,tpot"),
        ("--sweep", "rate=1,2"),
    ] {
        let err = fleetgate_bench::plan(args(&[
            "--endpoint-type",
            "openai-embeddings",
            "--base-url",
            &s.url(),
            "--model",
            "embed",
            flag,
            value,
        ]))
        .await
        .unwrap_err();
        assert!(err.contains("openai-embeddings"), "{flag} {value}: {err}");
    }
    let err = fleetgate_bench::plan(args(&[
        "--endpoint-type",
        "openai-embeddings",
        "--base-url",
        &s.url(),
        "--model",
        "embed",
        "--goodput",
        "ttft:100",
    ]))
    .await
    .unwrap_err();
    assert!(err.contains("e2el"), "{err}");
    // An embeddings path for a chat type, and a chat path for embeddings, disagree.
    let err = fleetgate_bench::plan(args(&[
        "--endpoint-type",
        "openai-embeddings",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        &s.url(),
        "--model",
        "embed",
    ]))
    .await
    .unwrap_err();
    assert!(err.contains("disagree"), "{err}");
}

/// Through a gateway in front of the pooling server, with the chat key: the same figures, and
/// the gateway's own time from its `Server-Timing` header (an embedding is not streamed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_benchmarked_through_the_gateway() {
    let s = embedding_sim().await;
    let mut p = pool("embed", &[s.url()]);
    p.kind = fleetgate_gateway::config::PoolKind::Embed;
    let gw = gateway(vec![p]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let base = format!("http://{}", gw.server.local_addr);
    let (_, report) = run(&[
        "--endpoint-type",
        "openai-embeddings",
        "--base-url",
        &base,
        "--header",
        &auth,
        "--num-prompts",
        "10",
        "--random-input-len",
        "30",
        "--max-concurrency",
        "1",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (10, 0), "{}", report.text);
    assert_eq!(r.metrics["e2el"].count, 10);
    assert!(r.total_input > 0);
    let g = r
        .gateway_ms
        .as_ref()
        .expect("Server-Timing gw on every answer");
    assert_eq!(g.count, 10);
    assert!(
        report
            .text
            .contains("Gateway's own time (Server-Timing gw)")
    );
    for l in GENERATION_ONLY {
        assert!(!report.text.contains(l), "{l}\n{}", report.text);
    }
    assert_eq!(report.json["completed"], 10);
    assert!(report.json["gateway_time_ms"]["count"] == 10);
    assert_eq!(report.exit, 0);
    // Without the key, every request fails at the gateway (and the run says so).
    let (_, refused) = run(&[
        "--endpoint-type",
        "openai-embeddings",
        "--base-url",
        &base,
        "--model",
        "embed",
        "--api-key-env",
        "FLEETGATE_BENCH_TEST_UNSET_KEY",
        "--num-prompts",
        "2",
    ])
    .await;
    assert_eq!(refused.summaries[0].failed, 2, "{}", refused.text);
    assert!(refused.text.contains("HTTP 401"), "{}", refused.text);
    assert_eq!(refused.exit, 1, "no request succeeded");
}

/// `--compare direct=... gateway=...` of embeddings: the verdict's lines are E2EL's (mean and
/// every percentile), none of TTFT/TPOT/ITL; the hop is set beside the E2EL delta and the
/// gateway's `upstream` beside the direct E2EL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embeddings_comparison_judges_e2el_only() {
    let s = embedding_sim().await;
    let mut p = pool("embed", &[s.url()]);
    p.kind = fleetgate_gateway::config::PoolKind::Embed;
    let gw = gateway(vec![p]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{}", gw.server.local_addr);
    let (plan, report) = run(&[
        "--endpoint-type",
        "openai-embeddings",
        "--compare",
        &direct,
        &via,
        "--header",
        &auth,
        "--model",
        "embed",
        "--num-prompts",
        "12",
        "--random-input-len",
        "30",
        "--max-concurrency",
        "1",
        "--metric-percentiles",
        "50,99",
    ])
    .await;
    assert_eq!(plan.targets.len(), 2);
    for r in &report.summaries {
        assert_eq!((r.completed, r.failed), (12, 0), "{}", report.text);
    }
    let cmp = &report.json["comparison"];
    let lines: Vec<(String, String)> = cmp["deltas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["metric"].as_str().unwrap().to_owned(),
                d["stat"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = ["mean", "p50", "p95", "p99"]
        .iter()
        .map(|s| ("e2el".to_owned(), (*s).to_owned()))
        .collect();
    assert_eq!(lines, want, "E2EL's lines only, P95 added for the verdict");
    assert!(cmp["not_measured"].as_array().unwrap().is_empty());
    // 12 prompts estimate the mean and median, not P95 or P99.
    let judged: Vec<&str> = cmp["deltas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["judgement"].as_str().unwrap())
        .collect();
    assert_eq!(judged[2..], ["not_enough_samples", "not_enough_samples"]);
    assert!(
        judged[..2].iter().all(|j| *j != "not_measured"),
        "{judged:?}"
    );
    for l in ["E2EL mean", "E2EL p50", "E2EL p95", "verdict: "] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    for l in GENERATION_ONLY {
        assert!(!report.text.contains(l), "{l}\n{}", report.text);
    }
    let verdict = report
        .text
        .lines()
        .find(|l| l.starts_with("verdict: "))
        .unwrap();
    assert!(!verdict.contains("not measured"), "{verdict}");
    // The gateway's figures beside the client's E2EL, under keys that say so.
    let hop = &cmp["hop"];
    assert!(hop.get("client_e2el_median_delta_ms").is_some(), "{hop}");
    assert!(hop.get("client_ttft_median_delta_ms").is_none(), "{hop}");
    let like = &cmp["like_for_like"];
    assert!(like["direct_e2el_median_ms"].is_number(), "{like}");
    assert!(like["gateway_upstream_median_ms"].is_number(), "{like}");
    assert!(
        report.text.contains("the client-side E2EL median delta"),
        "{}",
        report.text
    );
    assert!(report.text.contains("ms to answer"), "{}", report.text);
    let targets = &report.json["targets"];
    for t in ["direct", "gateway"] {
        assert!(targets[t]["mean_e2el_ms"].is_number());
        assert!(targets[t].get("mean_ttft_ms").is_none());
        assert_eq!(targets[t]["total_input_sequences"], 12);
    }
    // Pass or fail is the machine's; the exit code follows the verdict.
    let pass = cmp["pass"].as_bool().unwrap();
    assert_eq!(
        report.exit,
        if pass {
            0
        } else {
            fleetgate_bench::EXIT_COMPARE
        }
    );
}
