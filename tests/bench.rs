//! `fleetgate bench` end to end: against the sim with known timing, vLLM's result keys, the
//! comparison through a real gateway, SLA exit codes, ShareGPT sampling, settings.json, and
//! in-stream errors counted as failures.

#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use clap::Parser;
use common::*;
use fleetgate_bench::BenchArgs;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(flags: &[&str]) -> BenchArgs {
    let mut all = vec!["bench", "--no-progress"];
    all.extend_from_slice(flags);
    Cli::try_parse_from(all).unwrap().args
}

async fn run(flags: &[&str]) -> (fleetgate_bench::Plan, fleetgate_bench::Report) {
    let plan = fleetgate_bench::plan(args(flags)).await.unwrap();
    let result = fleetgate_bench::execute(Arc::new(plan.clone()), CancellationToken::new())
        .await
        .unwrap();
    let report = fleetgate_bench::build_report(&plan, &result);
    (plan, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measures_what_the_sim_was_configured_to_produce() {
    // One token every 10 ms, no prefill cost, one request at a time: TTFT ≈ one step,
    // ITL ≈ TPOT ≈ 10 ms, E2EL ≈ TTFT + 19 × 10 ms for 20 tokens.
    let s = sim(|a| {
        a.decode_step_ms = 10.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "12",
        "--random-input-len",
        "50",
        "--random-output-len",
        "20",
        "--max-concurrency",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,95,99",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (12, 0), "{}", report.text);
    assert_eq!(r.total_output, 12 * 20, "output tokens from usage");
    assert_eq!(r.outputs_without_usage, 0);
    let m = |k: &str| r.metrics[k].mean;
    assert!((5.0..30.0).contains(&m("ttft")), "TTFT {}", m("ttft"));
    assert!((8.0..14.0).contains(&m("tpot")), "TPOT {}", m("tpot"));
    assert!((8.0..14.0).contains(&m("itl")), "ITL {}", m("itl"));
    // Like vLLM, the sim opens each stream with a role chunk; by vLLM 0.33's definition it is
    // not a token event: the 20 tokens give 19 ITLs.
    assert_eq!(
        r.metrics["itl"].count,
        12 * 19,
        "one ITL per event after the first"
    );
    // 20 tokens one decode step apart.
    assert!(
        (190.0..260.0).contains(&m("e2el")),
        "E2EL {} for 20 steps of 10 ms",
        m("e2el")
    );
    // One at a time: never two in flight at once, but vLLM's per-second count sees each second's
    // several requests (~210 ms each).
    assert_eq!(r.peak_concurrent_instant, 1);
    assert!(
        (2..=12).contains(&r.max_concurrent_requests),
        "{}",
        r.max_concurrent_requests
    );
    // vLLM's keys and the seed's shape.
    let j = &report.json;
    for k in [
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "peak_concurrent_requests_instant",
        "request_goodput",
        "latencies",
        "backend",
        "label",
        "tokenizer_id",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p95_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "throughput_tokens_per_sec",
        "error_rate",
        "labels",
        "settings",
        "client",
    ] {
        assert!(j.get(k).is_some(), "result JSON lacks `{k}`");
    }
    assert_eq!(j["completed"], 12);
    assert!(j["ttft_ms"]["p95"].as_f64().unwrap() > 0.0);
    assert_eq!(j["labels"]["model"], "qwen32b", "the model from /v1/models");
    assert_eq!(j["itls"].as_array().unwrap().len(), 12);
    assert_eq!(j["max_concurrent_requests"], r.max_concurrent_requests);
    assert_eq!(j["peak_concurrent_requests_instant"], 1);
    assert!(j["request_goodput"].is_null(), "null without --goodput");
    assert_eq!(j["backend"], "openai-chat");
    assert!(j["label"].is_null() && j["tokenizer_id"].is_null());
    // E2EL per request, in seconds like `ttfts`.
    let latencies = j["latencies"].as_array().unwrap();
    assert_eq!(latencies.len(), 12);
    let mean_s = latencies.iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / 12.0;
    assert!((mean_s * 1e3 - m("e2el")).abs() < 1e-6, "{mean_s}");
    // vLLM's labels, to the letter; the instantaneous peak under a label of its own.
    for l in [
        "Successful requests:",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "P95 ITL (ms):",
        "Instantaneous peak concurrency:",
    ] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    assert!(!report.text.contains("Total Token"));
    assert_eq!(report.exit, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_mode_reports_the_gateway_delta_and_its_own_time() {
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let gw_base = format!("http://{}", gw.server.local_addr);
    let direct = format!("direct={}", s.url());
    let via = format!("gateway={gw_base}");
    let (plan, report) = run(&[
        "--compare",
        &direct,
        &via,
        "--header",
        &auth,
        "--model",
        "qwen32b",
        "--num-prompts",
        "150",
        "--random-input-len",
        "20",
        "--random-output-len",
        "4",
        "--max-concurrency",
        "1",
        // Only P99 asked for: the verdict measures P95 too, and says so.
        "--metric-percentiles",
        "99",
        // No absolute floor: the percentages alone judge microseconds.
        "--delta-floor-ms",
        "0",
    ])
    .await;
    assert_eq!(plan.targets.len(), 2);
    assert_eq!(plan.percentiles, [95.0, 99.0]);
    let (d, g) = (&report.summaries[0], &report.summaries[1]);
    assert_eq!((d.completed, g.completed), (150, 150), "{}", report.text);
    assert_eq!((d.failed, g.failed), (0, 0));
    // The same prompts went to both.
    assert_eq!(d.total_input, g.total_input);
    // The gateway reports its own time on every request; the backend does not.
    let own = g
        .gateway_ms
        .as_ref()
        .expect("Server-Timing gw on the gateway");
    assert_eq!(own.count, 150);
    assert!(
        own.mean > 0.0 && own.mean < 5.0,
        "gateway time {} ms",
        own.mean
    );
    assert!(d.gateway_ms.is_none() && d.hop_ms.is_none());
    // Against a zero-delay backend the extra hop shows: a small positive TTFT delta.
    let cmp = &report.json["comparison"];
    let deltas = cmp["deltas"].as_array().unwrap();
    let find = |metric: &str, stat: &str| {
        deltas
            .iter()
            .find(|x| x["metric"] == metric && x["stat"] == stat)
            .unwrap_or_else(|| panic!("no {metric} {stat} line\n{}", report.text))
    };
    let ttft_mean = find("ttft", "mean");
    let delta_ms = ttft_mean["delta_ms"].as_f64().unwrap();
    assert!(
        delta_ms > 0.0 && delta_ms < 5.0,
        "TTFT mean delta {delta_ms} ms\n{}",
        report.text
    );
    // Every selected metric at the mean, the added P95 and the asked P99: nine lines, each
    // judged by the one-sided rule.
    assert_eq!(deltas.len(), 3 * 3, "{}", report.text);
    for stat in ["mean", "p95", "p99"] {
        assert!(find("itl", stat)["pass"].is_boolean());
    }
    // Each line judged by its interval: over only when the whole interval is beyond the allowed
    // delta, within only when the whole interval is inside it; P99 needs 500 prompts.
    for x in deltas {
        let allowed = x["allowed_ms"].as_f64().unwrap();
        let (lo, hi) = (
            x["ci_ms"]["lo"].as_f64().unwrap(),
            x["ci_ms"]["hi"].as_f64().unwrap(),
        );
        assert!(lo <= hi, "{x}");
        let j = x["judgement"].as_str().unwrap();
        match j {
            "over" => assert!(lo > allowed, "{x}"),
            "within" => assert!(hi <= allowed, "{x}"),
            "not_distinguishable" => assert!(lo <= allowed && allowed < hi, "{x}"),
            "not_enough_samples" => assert_eq!(x["stat"], "p99", "{x}"),
            other => panic!("{other}: {x}"),
        }
        assert_eq!(x["pass"], j != "over", "{x}");
        assert_eq!(x["paired_prompts"], 150, "{x}");
    }
    assert!(
        report
            .text
            .contains("not enough samples (n=150 for p99; needs 500)"),
        "{}",
        report.text
    );
    // One backend on both sides: like for like, from the gateway's per-request upstream TTFT.
    assert_eq!(cmp["like_for_like"]["comparable"], true, "{}", report.text);
    assert!(
        report.text.contains(
            "like for like, by timing: the backends behind gateway answered as direct's did"
        ),
        "{}",
        report.text
    );
    assert_eq!(cmp["percentiles_added"], serde_json::json!([95.0]));
    assert!(
        report.text.contains("note: P95 measured for the verdict"),
        "{}",
        report.text
    );
    assert!(
        report.text.contains("rule: a line fails only when"),
        "{}",
        report.text
    );
    assert!(
        report.text.contains("gateway's own time"),
        "{}",
        report.text
    );
    // The hop cost the gateway recorded beside the client-side delta, or that it sent none.
    match &g.hop_ms {
        None => assert!(
            report.text.contains("gateway sent no hop figure"),
            "{}",
            report.text
        ),
        Some(h) => {
            assert!(
                report.text.contains("recorded / client-seen"),
                "{}",
                report.text
            );
            assert_eq!(cmp["hop"]["recorded_median_ms"], h.median);
        }
    }
    assert!(cmp["hop"]["client_ttft_median_delta_ms"].is_number());
    // Microseconds on top of microseconds are many percent: without a floor the verdict says
    // so (exit 3).
    assert_eq!(ttft_mean["judgement"], "over", "{}", report.text);
    assert_eq!(cmp["pass"], false);
    assert!(
        report
            .text
            .contains("verdict: FAIL — slower than allowed (the whole interval): TTFT mean"),
        "{}",
        report.text
    );
    assert_eq!(report.exit, fleetgate_bench::EXIT_COMPARE);
    // Both targets' vLLM keys are kept.
    assert!(report.json["targets"]["direct"]["mean_ttft_ms"].is_number());
    assert!(report.json["targets"]["gateway"]["p99_ttft_ms"].is_number());
}

/// Like for like (issue 31): `direct=` takes the pool's servers, comma-separated, and spreads
/// the direct requests over them as the gateway spreads its own; a gateway whose backends are
/// not the direct side's (here: a pool that stalls 15 ms before each first token) is named in a
/// warning, from its per-request Server-Timing `upstream` beside the direct TTFTs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_spreads_direct_over_the_pool_and_warns_on_unequal_backends() {
    let fast = |a: &mut fleetgate_sim::SimArgs| a.zero_delay = true;
    let (s1, s2) = (sim(fast).await, sim(fast).await);
    let gw = gateway(vec![pool("qwen32b", &[s1.url(), s2.url()])]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let gw_base = format!("http://{}", gw.server.local_addr);
    let flags = |direct: String| {
        vec![
            "--compare".to_owned(),
            direct,
            format!("gateway={gw_base}"),
            "--header".into(),
            auth.clone(),
            "--model".into(),
            "qwen32b".into(),
            "--num-prompts".into(),
            "40".into(),
            "--random-input-len".into(),
            "10".into(),
            "--random-output-len".into(),
            "3".into(),
            "--max-concurrency".into(),
            "2".into(),
        ]
    };
    let run_flags = |f: Vec<String>| async move {
        let f: Vec<&str> = f.iter().map(String::as_str).collect();
        run(&f).await
    };
    // Direct alone: 40 prompts, 20 on each server.
    let seen = |s: &fleetgate_sim::SimServer| s.stats().requests.load(Ordering::SeqCst);
    let (a0, b0) = (seen(&s1), seen(&s2));
    let urls = format!("{}, {}/v1", s1.url(), s2.url());
    let (plan, report) = run(&[
        "--base-url",
        &urls,
        "--model",
        "qwen32b",
        "--num-prompts",
        "40",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
    ])
    .await;
    assert_eq!(plan.targets[0].replicas.len(), 2);
    assert_eq!(report.summaries[0].completed, 40, "{}", report.text);
    assert_eq!((seen(&s1) - a0, seen(&s2) - b0), (20, 20));
    // Both sides over the same two servers: like for like.
    let (_, report) = run_flags(flags(format!("direct={urls}"))).await;
    assert_eq!(report.summaries[0].completed, 40, "{}", report.text);
    let cmp = &report.json["comparison"];
    assert_eq!(cmp["like_for_like"]["comparable"], true, "{}", report.text);

    // Direct to a third server that answers at once; the gateway's pool stalls.
    let slow = sim(|a| a.stall_first_token_ms = 15.0).await;
    let gw = gateway(vec![pool("qwen32b", &[slow.url()])]).await;
    let mut f = flags(format!("direct={}", s1.url()));
    f[2] = format!("gateway=http://{}", gw.server.local_addr);
    f[4] = format!("Authorization: Bearer {}", gw.key);
    let (_, report) = run_flags(f).await;
    let like = &report.json["comparison"]["like_for_like"];
    assert_eq!(like["comparable"], false, "{}", report.text);
    assert!(
        like["gateway_upstream_median_ms"].as_f64().unwrap() >= 14.0,
        "{like}"
    );
    assert!(
        report.text.contains("WARNING: not like for like"),
        "{}",
        report.text
    );
    // Each URL once.
    let e = fleetgate_bench::plan(args(&[
        "--compare",
        &format!("direct={0},{0}", s1.url()),
        "gateway=http://127.0.0.1:9",
        "--model",
        "m",
    ]))
    .await
    .unwrap_err();
    assert!(e.contains("is listed twice"), "{e}");
}

#[tokio::test]
async fn the_verdicts_tolerances_and_labels_come_from_the_flags() {
    let base = [
        "--compare",
        "direct=http://127.0.0.1:9",
        "gateway=http://127.0.0.1:10",
        "--model",
        "m",
        "--num-prompts",
        "2",
    ];
    // Defaults: +3 % (means), +5 % (percentiles), 1 ms floor; P95 joins P99.
    let plan = fleetgate_bench::plan(args(&base)).await.unwrap();
    assert_eq!(
        plan.thresholds,
        fleetgate_bench::verdict::Thresholds {
            mean_pct: 3.0,
            percentile_pct: 5.0,
            floor_ms: 1.0
        }
    );
    assert_eq!(
        (
            plan.percentiles.as_slice(),
            plan.added_percentiles.as_slice()
        ),
        ([95.0, 99.0].as_slice(), [95.0].as_slice())
    );
    // The old flag name still works; asked-for P95 is not "added".
    let mut flags = base.to_vec();
    flags.extend([
        "--max-p95-delta-pct",
        "7",
        "--delta-floor-ms",
        "0.5",
        "--metric-percentiles",
        "50,95",
        "--label",
        "fleetgate-a6000",
        "--label",
        "gpu=a6000",
    ]);
    let plan = fleetgate_bench::plan(args(&flags)).await.unwrap();
    assert_eq!(
        (plan.thresholds.percentile_pct, plan.thresholds.floor_ms),
        (7.0, 0.5)
    );
    assert_eq!(plan.percentiles, [50.0, 95.0]);
    assert!(plan.added_percentiles.is_empty());
    assert_eq!(
        plan.label.as_deref(),
        Some("fleetgate-a6000"),
        "vLLM's --label"
    );
    assert_eq!(plan.labels["gpu"], "a6000");
    // One target: nothing added.
    let plan = fleetgate_bench::plan(args(&["--base-url", "http://127.0.0.1:9", "--model", "m"]))
        .await
        .unwrap();
    assert_eq!(plan.percentiles, [99.0]);
    // Refused before anything is sent.
    for (bad, says) in [
        (
            ["--delta-floor-ms=-1", "--max-mean-delta-pct=3"],
            "--delta-floor-ms",
        ),
        (["--max-mean-delta-pct", "NaN"], "--max-mean-delta-pct"),
        (["--label=a", "--label=b"], "one bare label"),
    ] {
        let mut flags = base.to_vec();
        flags.extend(bad);
        let e = fleetgate_bench::plan(args(&flags)).await.unwrap_err();
        assert!(e.contains(says), "{bad:?}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sla_violations_exit_2_with_a_table() {
    let s = sim(|a| a.zero_delay = true).await;
    let base = s.url();
    let common = [
        "--base-url",
        base.as_str(),
        "--num-prompts",
        "10",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
        "--metric-percentiles",
        "95,99",
    ];
    let mut met = common.to_vec();
    met.extend(["--sla", "ttft_p99_ms=60000,error_rate=0.01"]);
    let (_, report) = run(&met).await;
    assert_eq!(report.exit, 0, "{}", report.text);
    assert!(report.text.contains("every objective met"));
    // Ten requests cost the client some CPU, and it is measured finer than /proc's 10 ms ticks.
    let cpu = report.json["client"]["cpu_us_per_request"]
        .as_f64()
        .unwrap();
    assert!(cpu > 0.0, "{}", report.json["client"]);
    let mut missed = common.to_vec();
    missed.extend([
        "--sla",
        "ttft_p99_ms=0.0001,e2el_mean_ms=0.0001,error_rate=0.5",
    ]);
    let (_, report) = run(&missed).await;
    assert_eq!(report.exit, fleetgate_bench::EXIT_SLA);
    assert!(report.text.contains("SLA violated"));
    // Every objective is listed with its verdict, and a limit is printed as it was written.
    let line = |name: &str| {
        report
            .text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` line:\n{}", report.text))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let ttft = line("ttft_p99_ms");
    assert_eq!((ttft[1].as_str(), ttft[3].as_str()), ("0.0001", "VIOLATED"));
    assert_eq!(line("e2el_mean_ms")[3], "VIOLATED");
    let errors = line("error_rate");
    assert_eq!((errors[1].as_str(), errors[3].as_str()), ("0.5", "met"));
    let violated = report.json["sla"]["violated"].as_array().unwrap();
    assert_eq!(violated.len(), 2);
    // A misspelt objective is refused before anything is sent.
    let mut bad = common.to_vec();
    bad.extend(["--sla", "ttft_q90_ms=5"]);
    let err = fleetgate_bench::plan(args(&bad)).await.unwrap_err();
    assert!(err.contains("not a statistic"), "{err}");
    // A percentile the objective names is measured, though --metric-percentiles omits it (the
    // docs' own example: `--sla ttft_p99_ms=1500,e2el_p95_ms=60000`).
    let mut p90 = common.to_vec();
    p90.extend(["--sla", "ttft_p90_ms=0.0001"]);
    let (_, report) = run(&p90).await;
    assert_eq!(report.exit, fleetgate_bench::EXIT_SLA, "{}", report.text);
    assert!(report.text.contains("P90 TTFT (ms)"), "{}", report.text);
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_stream_errors_and_http_errors_count_as_failures() {
    let s = sim(|a| {
        a.zero_delay = true;
        a.error_after_chunks = Some(2);
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "6",
        "--random-input-len",
        "10",
        "--random-output-len",
        "8",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (0, 6), "{}", report.text);
    assert!(
        r.errors
            .keys()
            .all(|e| e.starts_with("error event in the stream")),
        "{:?}",
        r.errors
    );
    assert!(report.text.contains("Failures by cause"));
    assert_eq!(report.exit, 1, "nothing succeeded");
    // A wrong model name: HTTP 404 with the server's message, per request.
    let s = sim(|a| a.zero_delay = true).await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--model",
        "no-such-model",
        "--num-prompts",
        "2",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!(r.failed, 2);
    assert!(
        r.errors.keys().all(|e| e.starts_with("HTTP 404")),
        "{:?}",
        r.errors
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_json_drives_a_timed_closed_loop_run() {
    let s = sim(|a| a.zero_delay = true).await;
    let dir = temp_dir("bench-settings");
    std::fs::create_dir_all(&dir).unwrap();
    let settings = dir.join("settings.json");
    std::fs::write(
        &settings,
        serde_json::json!({
            "endpoint": format!("{}/v1/chat/completions", s.url().trim_end_matches('/')),
            "api_key_env": "FLEETGATE_BENCH_TEST_UNSET_KEY",
            "model": "qwen32b",
            "concurrency": 4,
            "duration_seconds": 0.5,
            "request_distribution": [
                {"name": "short", "weight": 0.6, "input_tokens": 16, "output_tokens": 4},
                {"name": "long", "weight": 0.4, "input_tokens": 64, "output_tokens": 8}
            ],
            "metrics": {"record_ttft": true, "record_tpot": true, "percentiles": [50, 95, 99]},
            "warmup_requests": 2
        })
        .to_string(),
    )
    .unwrap();
    let out = dir.join("result.json");
    let p = settings.display().to_string();
    let o = out.display().to_string();
    let code = fleetgate_bench::run(
        args(&["--config", &p, "--output", &o]),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(v["completed"].as_u64().unwrap() > 10, "{v}");
    assert_eq!(v["failed"], 0);
    assert_eq!(v["max_concurrency"], 4);
    // The cap holds at every instant; vLLM's per-second count sees more (short requests).
    let instant = v["peak_concurrent_requests_instant"].as_u64().unwrap();
    assert!((1..=4).contains(&instant), "{instant}");
    assert!(v["max_concurrent_requests"].as_u64().unwrap() >= instant);
    for k in ["p50", "p95", "p99"] {
        assert!(v["ttft_ms"][k].is_number(), "ttft_ms.{k}");
        assert!(v["tpot_ms"][k].is_number(), "tpot_ms.{k}");
    }
    assert_eq!(v["error_rate"], 0.0);
    assert!(v["throughput_tokens_per_sec"].as_f64().unwrap() > 0.0);
    assert_eq!(
        v["settings"]["concurrency"], 4,
        "the settings used are archived"
    );
    assert!(
        v["p95_e2el_ms"].is_number(),
        "metrics percentiles from the settings"
    );
    // The breakdown by request class: each class's TTFT, TPOT and E2EL.
    let classes = v["classes"].as_object().expect("classes in the result");
    assert_eq!(classes.len(), 2, "{v}");
    let (short, long) = (&v["classes"]["short"], &v["classes"]["long"]);
    let done = short["completed"].as_u64().unwrap() + long["completed"].as_u64().unwrap();
    assert_eq!(done, v["completed"].as_u64().unwrap());
    for c in [short, long] {
        for k in [
            "mean_ttft_ms",
            "p95_ttft_ms",
            "p99_tpot_ms",
            "median_e2el_ms",
            "p50_e2el_ms",
        ] {
            assert!(c[k].is_number(), "{k} in {c}");
        }
    }
    assert!(
        long["mean_output_tokens"].as_f64().unwrap()
            > short["mean_output_tokens"].as_f64().unwrap(),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bad settings file is a bad command line: exit 64 with the file and the key named, before
/// a request is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_settings_file_exits_64_naming_the_key() {
    let s = sim(|a| a.zero_delay = true).await;
    let dir = TempDir(temp_dir("bench-bad-settings"));
    let endpoint = format!("{}/v1/chat/completions", s.url().trim_end_matches('/'));
    let class = |w: f64, i: u64| serde_json::json!({"name": "a", "weight": w, "input_tokens": i, "output_tokens": 4});
    let cases = [
        ("{\"endpoint\": ".to_owned(), "EOF while parsing"),
        (serde_json::json!({"endpoint": endpoint, "concurency": 4}).to_string(), "unknown field `concurency`"),
        (serde_json::json!({"endpoint": "gateway:8080"}).to_string(), "endpoint: "),
        (serde_json::json!({"endpoint": endpoint, "concurrency": 0}).to_string(), "concurrency: must be ≥ 1"),
        (serde_json::json!({"endpoint": endpoint, "duration_seconds": -1}).to_string(), "duration_seconds: -1"),
        (serde_json::json!({"endpoint": endpoint, "request_distribution": [class(-1.0, 8)]}).to_string(), "request_distribution[0] (a): weight -1"),
        (serde_json::json!({"endpoint": endpoint, "request_distribution": [class(0.0, 8)]}).to_string(), "every weight is 0"),
        (serde_json::json!({"endpoint": endpoint, "request_distribution": [class(1.0, 0)]}).to_string(), "input_tokens and output_tokens must be ≥ 1"),
        (serde_json::json!({"endpoint": endpoint, "request_distribution": [class(1.0, 8), class(1.0, 9)]}).to_string(), "the name \"a\" is used twice"),
        (serde_json::json!({"endpoint": endpoint, "metrics": {"percentiles": [101]}}).to_string(), "metrics.percentiles: 101"),
    ];
    for (i, (text, says)) in cases.iter().enumerate() {
        let path = dir.0.join(format!("settings-{i}.json"));
        std::fs::write(&path, text).unwrap();
        let p = path.display().to_string();
        let e = fleetgate_bench::plan::read_settings(&path).unwrap_err();
        assert!(e.contains(says) && e.contains(&p), "{text}: {e}");
        let code = fleetgate_bench::run(args(&["--config", &p]), CancellationToken::new()).await;
        assert_eq!(code, fleetgate_bench::EXIT_USAGE, "{text}");
    }
    let missing = dir.0.join("nope.json").display().to_string();
    let code = fleetgate_bench::run(args(&["--config", &missing]), CancellationToken::new()).await;
    assert_eq!(code, fleetgate_bench::EXIT_USAGE);
    assert_eq!(
        s.stats().requests.load(Ordering::SeqCst),
        0,
        "nothing was sent"
    );
}

#[test]
fn diff_lines_up_two_results() {
    let a = serde_json::json!({"mean_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "request_throughput": 8.0, "input_lens": [1]});
    let b =
        serde_json::json!({"mean_ttft_ms": 103.0, "p99_ttft_ms": 190.0, "request_throughput": 8.0});
    let t = fleetgate_bench::report::diff(&a, &b).unwrap();
    assert!(t.contains("mean_ttft_ms") && t.contains("+3.00%"), "{t}");
    assert!(t.contains("-5.00%"), "{t}");
    assert!(!t.contains("input_lens"));
    assert!(
        t.starts_with("A: a single-target run\nB: a single-target run\n"),
        "{t}"
    );
    assert!(fleetgate_bench::report::diff(&serde_json::json!({}), &b).is_err());
    // A compare result: the diff says which of its targets it read.
    let compare = serde_json::json!({
        "targets": {"direct": {"mean_ttft_ms": 90.0}, "gateway": {"mean_ttft_ms": 101.0}},
        "comparison": {"baseline": "direct", "measured": "gateway"},
    });
    let t = fleetgate_bench::report::diff(&compare, &a).unwrap();
    assert!(
        t.starts_with("A: target `gateway` of a --compare run (the measured side; `direct` was its baseline)\n"),
        "{t}"
    );
    assert!(t.contains("101.000") && t.contains("-0.99%"), "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_finds_the_knee_draws_it_and_plans_capacity() {
    // Sixteen sequences at a time, ten steps of ~6 ms each: about 200 requests/s at most.
    let s = sim(|a| {
        a.max_num_seqs = 16;
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let dir = temp_dir("bench-sweep");
    std::fs::create_dir_all(&dir).unwrap();
    let chart = dir.join("sweep.svg");
    let out = dir.join("sweep.json");
    let (c, o) = (chart.display().to_string(), out.display().to_string());
    let code = fleetgate_bench::run(
        args(&[
            "--base-url",
            &s.url(),
            "--num-prompts",
            "40",
            "--random-input-len",
            "10",
            "--random-output-len",
            "10",
            // Nearly even gaps: short runs still offer the rate they name.
            "--burstiness",
            "1000",
            "--sweep",
            "rate=20,40,2000",
            "--sweep-chart",
            &c,
            "--sla",
            "ttft_p99_ms=60000",
            "--target-qps",
            "100",
            "--redundancy",
            "1.25",
            "--output",
            &o,
        ]),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let runs = v["sweep"]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert!(runs.iter().all(|r| r["completed"] == 40));
    let thr: Vec<f64> = runs
        .iter()
        .map(|r| r["request_throughput"].as_f64().unwrap())
        .collect();
    // 2000/s offered against ~200/s of capacity: the last point is past the knee.
    assert_eq!(v["sweep"]["knee"], 2000.0, "throughputs {thr:?}");
    let best = runs
        .iter()
        .map(|r| r["request_throughput"].as_f64().unwrap())
        .fold(0.0, f64::max);
    let need = v["capacity"]["instances_needed"].as_u64().unwrap();
    assert_eq!(need, (100.0 * 1.25 / best).ceil() as u64);
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("knee"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mean_itl_equals_mean_tpot_at_eight_output_tokens() {
    // Issue 14's check of vLLM 0.33's definitions: one token per fixed decode step, eight
    // tokens. Counting the opening role chunk as a token made mean ITL 12.5 % lower than mean
    // TPOT here; by the definitions the two are the same gaps averaged two ways (E2EL − TTFT
    // over 7), whatever the machine's load, so the ratio is asserted, not a time.
    let s = sim(|a| {
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "10",
        "--random-input-len",
        "20",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.total_output), (10, 80), "{}", report.text);
    assert_eq!(
        r.metrics["itl"].count,
        10 * 7,
        "seven gaps between eight tokens"
    );
    let (itl, tpot) = (r.metrics["itl"].mean, r.metrics["tpot"].mean);
    assert!(
        (itl - tpot).abs() / tpot < 0.02,
        "mean ITL {itl} ms vs mean TPOT {tpot} ms\n{}",
        report.text
    );
}

/// A body of the frames given, in order (data, then a trailer).
struct Frames(std::collections::VecDeque<hyper::body::Frame<bytes::Bytes>>);

impl hyper::body::Body for Frames {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// A server on 127.0.0.1:0 that answers every request as a gateway will a stream: three tokens,
/// `Server-Timing: gw` in the head and the full `Server-Timing` (with `hop`) as an HTTP/1
/// trailer — which hyper sends only to a request with `TE: trailers` (counted in `te_seen`).
async fn timing_server(
    te_seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = te_seen.clone();
            let svc = hyper::service::service_fn(
                move |req: http::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        if req
                            .headers()
                            .get(http::header::TE)
                            .is_some_and(|v| v == "trailers")
                        {
                            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        let _ = req.into_body().collect().await;
                        let mut frames: std::collections::VecDeque<_> = [
                        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"b"}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"c"}}]}"#,
                        r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
                        "[DONE]",
                    ]
                    .into_iter()
                    .map(|d| hyper::body::Frame::data(bytes::Bytes::from(format!("data: {d}\n\n"))))
                    .collect();
                        let mut trailer = http::HeaderMap::new();
                        trailer.insert(
                            "server-timing",
                            http::HeaderValue::from_static("gw;dur=0.050, hop;dur=0.250"),
                        );
                        frames.push_back(hyper::body::Frame::trailers(trailer));
                        let resp = http::Response::builder()
                            .header(http::header::CONTENT_TYPE, "text/event-stream")
                            .header("server-timing", "gw;dur=0.040")
                            .header(http::header::TRAILER, "server-timing")
                            .body(Frames(frames))
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                },
            );
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hop_cost_is_read_from_the_trailer_of_a_stream() {
    use std::sync::atomic::AtomicUsize;
    let te_seen = std::sync::Arc::new(AtomicUsize::new(0));
    let addr = timing_server(te_seen.clone()).await;
    let client = fleetgate_protocol::client::http_client();
    let uri: http::Uri = format!("http://{addr}/v1/chat/completions")
        .parse()
        .unwrap();
    let body = fleetgate_protocol::client::chat_body("m", "hi", 3, true);
    let target = fleetgate_bench::spec::Target {
        name: "t".into(),
        base: format!("http://{addr}"),
        uri: uri.clone(),
        replicas: vec![uri.clone()],
        headers: http::HeaderMap::new(),
        dialect: fleetgate_protocol::Dialect::Chat,
        streamed: true,
    };
    let o = fleetgate_bench::measure::send(
        &client,
        &target,
        0,
        body.clone(),
        5,
        std::time::Instant::now(),
        std::time::Duration::from_secs(10),
    )
    .await;
    assert!(o.ok(), "{:?}", o.error);
    assert_eq!(o.output_tokens, 3);
    assert_eq!(o.gateway_ms, Some(0.04), "gw from the head");
    assert_eq!(o.hop_ms, Some(0.25), "hop from the trailer");
    assert_eq!(
        te_seen.load(Ordering::SeqCst),
        1,
        "the bench asked for trailers"
    );
    // Without `TE: trailers` the server keeps the trailer back: the bench's header is what
    // lets the hop figure through.
    let req = fleetgate_protocol::client::post(&uri, &http::HeaderMap::new(), body);
    let mut a = fleetgate_protocol::client::open(&client, req, std::time::Instant::now())
        .await
        .unwrap();
    let end = a.read(None, |_, _| {}).await;
    assert_eq!(end, fleetgate_protocol::client::BodyEnd::Complete);
    assert!(a.trailers.is_none(), "{:?}", a.trailers);
    // Through a whole compare run: the report's hop section and the line beside the client's
    // delta.
    let s = sim(|a| a.zero_delay = true).await;
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{addr}");
    let (_, report) = run(&[
        "--compare",
        &direct,
        &via,
        "--model",
        "qwen32b",
        "--num-prompts",
        "10",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
        "--max-concurrency",
        "1",
    ])
    .await;
    let g = &report.summaries[1];
    assert_eq!(g.completed, 10, "{}", report.text);
    assert_eq!(
        te_seen.load(Ordering::SeqCst),
        1 + 10,
        "TE: trailers on every request"
    );
    let hop = g.hop_ms.as_ref().unwrap();
    assert_eq!((hop.count, hop.median), (10, 0.25));
    for l in [
        "Gateway's recorded hop cost (Server-Timing hop)",
        "Median hop cost (ms):                    0.250",
        "the figure to believe: the hop gateway recorded, stamped per request from the kernel's receive time: median 0.250 ms over 10 requests; the client-side TTFT median delta (gateway − direct) is",
    ] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    let j = &report.json;
    assert_eq!(j["targets"]["gateway"]["gateway_hop_ms"]["median"], 0.25);
    assert_eq!(j["targets"]["gateway"]["gateway_hop_ms"]["count"], 10);
    assert!(j["targets"]["direct"].get("gateway_hop_ms").is_none());
    assert_eq!(j["comparison"]["hop"]["recorded_median_ms"], 0.25);
}

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

/// A comparison whose gateway side is refused (a key's rate limit: 429) judges only the prompts
/// both sides answered, says loudly what was refused and why, and fails with the compare's exit
/// code even when an --sla objective fails too (issue 42).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_side_fails_the_comparison_and_says_why() {
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |k| {
        k.requests_per_minute = Some(5)
    })
    .await;
    let auth = format!("Authorization: Bearer {key}");
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{}", gw.server.local_addr);
    let (_, report) = run(&[
        "--compare",
        &direct,
        &via,
        "--header",
        &auth,
        "--model",
        "qwen32b",
        "--num-prompts",
        "40",
        "--random-input-len",
        "20",
        "--random-output-len",
        "4",
        "--sla",
        "ttft_p99_ms=0.000001",
    ])
    .await;
    let (d, g) = (&report.summaries[0], &report.summaries[1]);
    assert_eq!(d.completed, 40, "{}", report.text);
    assert!(g.failed >= 30, "{}", report.text);
    let cmp = &report.json["comparison"];
    assert_eq!(cmp["pass"], false);
    assert_eq!(cmp["failures"][0]["target"], "gateway");
    assert!(
        report.text.contains(&format!(
            "WARNING: gateway failed {} of its 40 requests: {} × HTTP 429 requests_per_minute_exceeded (\"HTTP 429 requests_per_minute_exceeded: Rate limit reached for key",
            g.failed, g.failed
        )),
        "{}",
        report.text
    );
    assert!(
        report
            .text
            .contains("HTTP 429 requests_per_minute_exceeded"),
        "the refusal is named: {}",
        report.text
    );
    let verdict = report
        .text
        .lines()
        .find(|l| l.starts_with("verdict: "))
        .unwrap();
    assert!(
        verdict.starts_with(&format!(
            "verdict: FAIL — gateway failed {} of 40 requests",
            g.failed
        )),
        "{verdict}"
    );
    // Every judged line is over the prompts both answered, never over a refused one.
    for delta in cmp["deltas"].as_array().unwrap() {
        assert_eq!(delta["paired_prompts"], 40 - g.failed, "{delta}");
    }
    // The like-for-like medians are over the same paired prompts too.
    assert_eq!(cmp["like_for_like"]["paired_prompts"], 40 - g.failed);
    assert_eq!(
        report.exit,
        fleetgate_bench::EXIT_COMPARE,
        "3 wins over the SLA's 2"
    );
}
