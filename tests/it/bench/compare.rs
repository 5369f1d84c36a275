//! `--compare`: the gateway's delta and its own time, direct requests spread over the pool,
//! the verdict's tolerances and labels from the flags, a refused side failing the comparison,
//! and `diff` lining up two results.

use super::*;

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

/// Like for like: `direct=` takes the pool's servers, comma-separated, and spreads
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

/// `--request-rate` is each target's, as `vllm bench serve` run against each means it: a
/// comparison at 40 req/s sends 40 per second to each side (80 on the one schedule), and each
/// side's report says 40.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_rate_is_each_targets() {
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let auth = format!("Authorization: Bearer {}", gw.key);
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{}", gw.server.local_addr);
    let (plan, report) = run(&[
        "--compare",
        &direct,
        &via,
        "--header",
        &auth,
        "--model",
        "qwen32b",
        "--num-prompts",
        "40",
        "--request-rate",
        "40",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--seed",
        "3",
    ])
    .await;
    assert_eq!(plan.request_rate, 40.0);
    assert_eq!(
        report
            .text
            .matches("Request rate configured (RPS):")
            .count(),
        2,
        "{}",
        report.text
    );
    for line in report
        .text
        .lines()
        .filter(|l| l.starts_with("Request rate configured"))
    {
        assert!(line.trim_end().ends_with("40.00"), "{line}");
    }
    assert_eq!(report.json["request_rate"], 40.0);
    let (d, g) = (&report.summaries[0], &report.summaries[1]);
    assert_eq!((d.completed, g.completed), (40, 40));
}

#[test]
fn diff_lines_up_two_results() {
    let a = serde_json::json!({"mean_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "request_throughput": 8.0, "input_lens": [1]});
    let b =
        serde_json::json!({"mean_ttft_ms": 103.0, "p99_ttft_ms": 190.0, "request_throughput": 8.0});
    let t = fleetgate_bench::report::diff(&a, &b, ["a.json", "b.json"]).unwrap();
    assert!(t.contains("mean_ttft_ms") && t.contains("+3.00%"), "{t}");
    assert!(t.contains("-5.00%"), "{t}");
    assert!(!t.contains("input_lens"));
    assert!(
        t.starts_with("A: a.json: a single-target run\nB: b.json: a single-target run\n"),
        "{t}"
    );
    // Files that say what run they hold are told apart by it.
    let described = |rate: f64| {
        serde_json::json!({"mean_ttft_ms": 100.0, "label": "nightly", "model_id": "qwen32b",
                           "num_prompts": 500, "request_rate": rate, "date": 1_796_533_200})
    };
    let t = fleetgate_bench::report::diff(&described(10.0), &described(20.0), ["x", "y"]).unwrap();
    assert!(
        t.starts_with("A: x: a single-target run (label `nightly`, model `qwen32b`, 500 prompts at 10.0 req/s, 2026-12-06T05:00:00Z)\nB: y: a single-target run (label `nightly`, model `qwen32b`, 500 prompts at 20.0 req/s,"),
        "{t}"
    );
    assert!(fleetgate_bench::report::diff(&serde_json::json!({}), &b, ["a", "b"]).is_err());
    // A compare result: the diff says which of its targets it read.
    let compare = serde_json::json!({
        "targets": {"direct": {"mean_ttft_ms": 90.0}, "gateway": {"mean_ttft_ms": 101.0}},
        "comparison": {"baseline": "direct", "measured": "gateway"},
    });
    let t = fleetgate_bench::report::diff(&compare, &a, ["c.json", "a.json"]).unwrap();
    assert!(
        t.starts_with("A: c.json: target `gateway` of a --compare run (the measured side; `direct` was its baseline)\n"),
        "{t}"
    );
    assert!(t.contains("101.000") && t.contains("-0.99%"), "{t}");
}

/// A comparison whose gateway side is refused (a key's rate limit: 429) judges only the prompts
/// both sides answered, says loudly what was refused and why, and fails with the compare's exit
/// code even when an --sla objective fails too.
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
