//! The compare verdict judged on made-up runs: equal and shifted latencies, small samples,
//! unmeasured statistics, the hop figures and unequal backends; and `--sla` names checked.

use super::Thresholds;
use super::delta::{Delta, Judgement, compare};
use super::hop::HopCheck;
use super::like_for_like::LikeForLike;
use super::render::render_compare;
use super::sla::parse_sla;
use crate::measure::Outcome;
use crate::summary::{Stats, Summary};

#[test]
fn sla_names_are_checked() {
    let mut measured = vec![99.0];
    let ok = parse_sla(
        "ttft_p99_ms=1500, e2el_p95_ms=60000,itl_p99.9_ms=80,error_rate=0.01",
        &mut measured,
    )
    .unwrap();
    assert_eq!(ok.len(), 4);
    assert_eq!(
        measured,
        [95.0, 99.0, 99.9],
        "what an objective names is measured"
    );
    for (bad, says) in [
        ("ttft_p99=1", "_ms"),
        ("foo_p99_ms=1", "not one of"),
        ("ttft_p900_ms=1", "not a statistic"),
        ("ttft_pfast_ms=1", "not a statistic"),
        ("ttft_p99_ms=fast", "not a number"),
        ("ttft", "name=value"),
    ] {
        let e = parse_sla(bad, &mut vec![95.0, 99.0]).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

/// A compare run: prompt i answered in `base[i]` ms by the first target and `measured[i]` ms
/// by the second, as TTFT, TPOT and ITL (E2EL twice that); with the two summaries measured
/// at `percentiles`.
fn run(base: &[f64], measured: &[f64], percentiles: &[f64]) -> (Vec<Outcome>, Summary, Summary) {
    let one = |target: u8, prompt: usize, v: f64| Outcome {
        target,
        prompt,
        sent_at: std::time::Duration::from_millis(prompt as u64 * 2 + u64::from(target)),
        ttft: Some(std::time::Duration::from_secs_f64(v / 1e3)),
        e2el: Some(std::time::Duration::from_secs_f64(2.0 * v / 1e3)),
        itls_ms: vec![v as f32],
        output_tokens: 2,
        ..Outcome::default()
    };
    let outcomes: Vec<Outcome> = base
        .iter()
        .enumerate()
        .map(|(i, v)| one(0, i, *v))
        .chain(measured.iter().enumerate().map(|(i, v)| one(1, i, *v)))
        .collect();
    let side = |t: u8| {
        let of: Vec<&Outcome> = outcomes.iter().filter(|o| o.target == t).collect();
        Summary::of(&of, 1.0, percentiles, &Vec::new())
    };
    let (a, b) = (side(0), side(1));
    (outcomes, a, b)
}

/// `n` latencies (ms) of a noisy server: a 50 ms floor plus an exponential tail of mean
/// 50 ms, from `seed`.
fn noisy(n: usize, seed: u64) -> Vec<f64> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| 50.0 - 50.0 * (1.0 - r.random::<f64>()).ln())
        .collect()
}

const T: Thresholds = Thresholds {
    mean_pct: 3.0,
    percentile_pct: 5.0,
    floor_ms: 1.0,
};

fn line<'a>(d: &'a [Delta], metric: &str, stat: &str) -> &'a Delta {
    d.iter()
        .find(|x| x.metric == metric && x.stat == stat)
        .unwrap_or_else(|| panic!("no {metric} {stat} line in {d:?}"))
}

fn judge(
    base: &[f64],
    measured: &[f64],
    p: &[f64],
    sel: &[&str],
    t: Thresholds,
) -> (Vec<Delta>, String) {
    let (o, a, b) = run(base, measured, p);
    let sel: Vec<String> = sel.iter().map(|s| (*s).to_owned()).collect();
    let d = compare(&o, &a, &b, &sel, p, t);
    let text = render_compare(
        ["direct", "gateway"],
        &d,
        t,
        &[],
        &HopCheck::of(&o, &a, &b),
        &LikeForLike::of(&o, t),
        &b,
        &[],
    );
    (d, text)
}

#[test]
fn equal_distributions_are_not_distinguishable() {
    // Two independent draws from one noisy server: the old verdict failed such runs on
    // whichever statistic the noise pushed over 3 %.
    let (d, text) = judge(
        &noisy(200, 1),
        &noisy(200, 2),
        &[50.0, 95.0],
        &["ttft", "e2el"],
        T,
    );
    for x in &d {
        assert_eq!(x.judgement, Judgement::NotDistinguishable, "{x:?}");
        assert!(x.pass);
        let i = x.ci_ms.unwrap();
        assert!(
            i.lo < x.allowed_ms.unwrap() && x.allowed_ms.unwrap() < i.hi,
            "{x:?}"
        );
        assert!(x.prompts_to_decide.unwrap() > 200, "{x:?}");
        // The range's low end is below the estimate at the measured delta.
        assert!(
            x.prompts_to_decide_at_least.unwrap() <= x.prompts_to_decide.unwrap(),
            "{x:?}"
        );
    }
    assert!(
        text.contains("not distinguishable at this sample size (200 prompts run; ≥"),
        "{text}"
    );
    // Deciding always takes more prompts than were run.
    for x in &d {
        assert!(x.prompts_to_decide_at_least.unwrap() > 200, "{x:?}");
    }
    assert!(
        text.contains("verdict: PASS — gateway is not shown slower than allowed; not distinguishable at this sample size: TTFT mean, TTFT p50, TTFT p95, E2EL mean"),
        "{text}"
    );
    assert!(text.contains("prompts per target would decide"), "{text}");
}

#[test]
fn a_real_shift_fails() {
    // The same requests, each 30 ms slower through the second target.
    let base = noisy(200, 3);
    let slow: Vec<f64> = base.iter().map(|v| v + 30.0).collect();
    let (d, text) = judge(&base, &slow, &[50.0, 95.0], &["ttft"], T);
    for x in &d {
        assert_eq!(x.judgement, Judgement::Over, "{x:?}");
        assert!(!x.pass);
        let i = x.ci_ms.unwrap();
        assert!(
            i.lo > x.allowed_ms.unwrap() && i.lo > 25.0 && i.hi < 35.0,
            "{x:?}"
        );
    }
    assert!(
        text.contains("verdict: FAIL — slower than allowed (the whole interval): TTFT mean, TTFT p50, TTFT p95"),
        "{text}"
    );
}

#[test]
fn a_small_sample_does_not_judge_the_tail() {
    // The run: 60 prompts and --metric-percentiles 95,99.
    let base = noisy(60, 4);
    let slow: Vec<f64> = base.iter().map(|v| v + 30.0).collect();
    let (d, text) = judge(&base, &slow, &[95.0, 99.0], &["ttft"], T);
    let p99 = line(&d, "ttft", "p99");
    assert_eq!(p99.judgement, Judgement::NotEnoughSamples);
    assert!(p99.pass, "not judged is not failed");
    assert!(
        text.contains("not enough samples (n=60 for p99; needs 500)"),
        "{text}"
    );
    assert!(
        text.contains("not enough samples (n=60 for p95; needs 100)"),
        "{text}"
    );
    // The mean has enough and is judged: the shift still fails it.
    assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
    assert!(
        text.contains("verdict: FAIL — slower than allowed (the whole interval): TTFT mean"),
        "{text}"
    );
    // Equal samples: nothing shown slower; the unjudged lines are named.
    let (_, text) = judge(&base, &base, &[95.0, 99.0], &["ttft"], T);
    assert!(
        text.contains("verdict: PASS — gateway is within the tolerance on every judged line, interval and all; not judged (not enough samples): TTFT p95, TTFT p99"),
        "{text}"
    );
    // Five prompts: nothing at all can be judged, and the verdict says so.
    let (_, text) = judge(&base[..5], &slow[..5], &[95.0], &["ttft"], T);
    assert!(
        text.contains("PASS — nothing could be judged at this sample size"),
        "{text}"
    );
}

#[test]
fn a_faster_gateway_passes() {
    let base = noisy(200, 5);
    let fast: Vec<f64> = base.iter().map(|v| v * 0.8).collect();
    let (d, text) = judge(&base, &fast, &[50.0, 95.0], &["ttft", "e2el"], T);
    assert_eq!(d.len(), 2 * 3, "mean, P50 and P95 of both metrics");
    for x in &d {
        assert_eq!(x.judgement, Judgement::Within, "{x:?}");
        assert!(x.ci_ms.unwrap().hi < 0.0);
    }
    assert!(text.contains("ok (faster)"), "{text}");
    assert!(
        text.contains("verdict: PASS — gateway is within the tolerance on every judged line"),
        "{text}"
    );
}

#[test]
fn slower_fails_past_the_larger_of_percent_and_floor() {
    let p = [95.0];
    let sel = ["ttft"];
    // 1000 ms baseline: 3 % = 30 ms is the larger; +29 passes, +31 fails (mean).
    let base = vec![1000.0; 120];
    let shifted = |by: f64| base.iter().map(|v| v + by).collect::<Vec<_>>();
    let (d, _) = judge(&base, &shifted(29.0), &p, &sel, T);
    assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Within);
    assert_eq!(line(&d, "ttft", "mean").allowed_ms, Some(30.0));
    let (d, _) = judge(&base, &shifted(31.0), &p, &sel, T);
    assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
    // P95 has its own tolerance: 5 % of 1000 ms.
    assert!(line(&d, "ttft", "p95").pass, "+31 ms is within 50 ms");
    // 2 ms baseline: the 1 ms floor is the larger; +0.9 ms (45 %) passes, +1.1 ms fails.
    let base = vec![2.0; 120];
    let (d, _) = judge(&base, &vec![2.9; 120], &p, &sel, T);
    assert!(d.iter().all(|x| x.judgement == Judgement::Within), "{d:?}");
    let (d, _) = judge(&base, &vec![3.1; 120], &p, &sel, T);
    assert!(d.iter().all(|x| !x.pass), "{d:?}");
    // Without a floor the percentages alone decide.
    let no_floor = Thresholds { floor_ms: 0.0, ..T };
    let (d, text) = judge(&base, &vec![2.5; 120], &p, &sel, no_floor);
    assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
    assert!(
        text.contains(
            "verdict: FAIL — slower than allowed (the whole interval): TTFT mean, TTFT p95"
        ),
        "{text}"
    );
}

#[test]
fn every_percentile_is_judged_and_an_unmeasured_one_is_named() {
    let p = [50.0, 95.0];
    let base = noisy(150, 6);
    // P50 and P95 are both lines; a statistic the summaries lack is "not measured".
    let (o, a, b) = run(&base, &base, &p);
    let d = compare(&o, &a, &b, &["e2el".into()], &[90.0], T);
    let l = line(&d, "e2el", "p90");
    assert_eq!(l.judgement, Judgement::NotMeasured);
    assert!(!l.pass);
    assert!(
        l.note.as_deref().unwrap().contains("P90 was not among"),
        "{l:?}"
    );
    let d = compare(&o, &a, &b, &["e2el".into()], &p, T);
    assert_eq!(
        d.iter().map(|x| x.stat.as_str()).collect::<Vec<_>>(),
        ["mean", "p50", "p95"]
    );
    // A metric without samples on one side (TPOT of one-token answers): named, not passed.
    let mut one_token = o.clone();
    for x in one_token.iter_mut().filter(|x| x.target == 1) {
        x.output_tokens = 1;
    }
    let of = |t: u8| {
        let v: Vec<&Outcome> = one_token.iter().filter(|o| o.target == t).collect();
        Summary::of(&v, 1.0, &p, &Vec::new())
    };
    let (a, b) = (of(0), of(1));
    let d = compare(&one_token, &a, &b, &["ttft".into(), "tpot".into()], &p, T);
    assert!(line(&d, "ttft", "mean").pass);
    let l = line(&d, "tpot", "p95");
    assert_eq!(l.judgement, Judgement::NotMeasured);
    assert_eq!(l.note.as_deref(), Some("second: no samples"));
    let text = render_compare(
        ["direct", "gateway"],
        &d,
        T,
        &[],
        &HopCheck::of(&one_token, &a, &b),
        &LikeForLike::of(&one_token, T),
        &b,
        &[],
    );
    assert!(text.contains("not measured (second: no samples)"), "{text}");
    assert!(
        text.contains(
            "FAIL — not measured, so not shown within tolerance: TPOT mean, TPOT p50, TPOT p95"
        ),
        "{text}"
    );
}

#[test]
fn unequal_backends_are_named() {
    let base = noisy(120, 8);
    let (mut o, _, _) = run(&base, &base, &[50.0]);
    let t = LikeForLike::of(&o, T);
    assert_eq!(t.comparable, None);
    assert!(
        t.render(["direct", "gateway"])
            .contains("gateway sent no Server-Timing upstream figure")
    );
    // The gateway's backends answer as direct's did (to a few µs): like for like.
    let ttft = |o: &Outcome| o.ttft.unwrap().as_secs_f64() * 1e3;
    for x in o.iter_mut().filter(|x| x.target == 1) {
        x.upstream_ms = Some(ttft(x) - 0.005);
    }
    let t = LikeForLike::of(&o, T);
    assert_eq!(t.comparable, Some(true), "{t:?}");
    assert!(t.render(["direct", "gateway"]).starts_with(
        "like for like, by timing: the backends behind gateway answered as direct's did"
    ));
    // Behind the gateway, a pool twice as fast as the one direct server: warned.
    for x in o.iter_mut().filter(|x| x.target == 1) {
        x.upstream_ms = Some(ttft(x) / 2.0);
    }
    let t = LikeForLike::of(&o, T);
    assert_eq!(t.comparable, Some(false), "{t:?}");
    let text = t.render(["direct", "gateway"]);
    assert!(text.starts_with("WARNING: not like for like"), "{text}");
    assert!(
        text.contains("direct=http://host1:8000,http://host2:8000"),
        "{text}"
    );
    // Too few prompts to tell.
    let (o, _, _) = run(&base[..5], &base[..5], &[50.0]);
    let mut o = o;
    for x in o.iter_mut() {
        x.upstream_ms = Some(1.0);
    }
    assert!(
        LikeForLike::of(&o, T)
            .render(["direct", "gateway"])
            .contains("5 paired prompts; the check needs 10")
    );
}

#[test]
fn the_summary_line_names_the_recorded_hop_beside_the_client_delta() {
    let base: Vec<f64> = noisy(120, 7);
    let gw_v: Vec<f64> = base.iter().map(|v| v + 0.25).collect();
    let (o, a, mut b) = run(&base, &gw_v, &[99.0]);
    let hop = HopCheck::of(&o, &a, &b);
    let d = compare(&o, &a, &b, &["ttft".into()], &[99.0], T);
    // No hop figure: said so, not left out.
    let text = render_compare(
        ["direct", "gateway"],
        &d,
        T,
        &[95.0],
        &hop,
        &LikeForLike::of(&o, T),
        &b,
        &[],
    );
    assert!(text.contains("gateway sent no hop figure"), "{text}");
    assert!(
        text.contains("the client-side TTFT median delta (gateway − direct) is +0.250 ms, 95 % interval [+0.250, +0.250] ms"),
        "{text}"
    );
    assert!(
        text.contains("note: P95 measured for the verdict"),
        "{text}"
    );
    assert!(text.contains("rule: a line fails only when gateway is slower than direct by more than max(+3 % of direct's value, +1 ms) for a mean, max(+5 %, +1 ms) for a percentile; faster always passes"), "{text}");
    b.hop_ms = Some(Stats::of(vec![0.2, 0.21, 0.3], &[99.0]));
    let h = HopCheck::of(&o, &a, &b);
    assert_eq!(h.recorded_median_ms, Some(0.21));
    assert_eq!(h.recorded_p99_ms, None, "three hops do not make a P99");
    assert_eq!(h.recorded_count, 3);
    assert!((h.ratio.unwrap() - 0.84).abs() < 1e-6, "{h:?}");
    let text = render_compare(
        ["direct", "gateway"],
        &d,
        T,
        &[],
        &h,
        &LikeForLike::of(&o, T),
        &b,
        &[],
    );
    assert!(
        text.contains("the figure to believe: the hop gateway recorded, stamped per request from the kernel's receive time: median 0.210 ms over 3 requests; the client-side TTFT median delta (gateway − direct) is +0.250 ms, 95 % interval [+0.250, +0.250] ms; recorded / client-seen: 0.84"),
        "{text}"
    );
    // A faster gateway has no added TTFT to set the hop against.
    let (o, a, mut fast) = run(&gw_v, &base, &[99.0]);
    fast.hop_ms = b.hop_ms.clone();
    let h = HopCheck::of(&o, &a, &fast);
    assert_eq!((h.recorded_median_ms, h.ratio), (Some(0.21), None));
    assert!(
        h.render(["direct", "gateway"])
            .contains("n/a (the client saw no added TTFT)")
    );
}
