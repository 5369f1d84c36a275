//! Verdicts on a run: `--sla` objectives and what violates them, and the comparison of two
//! targets (the mean and every measured percentile, judged one-sided against a relative
//! tolerance with an absolute floor), beside the hop cost the gateway recorded.

use std::fmt::Write as _;

use super::summary::{METRICS, Stats, Summary, p_word};

/// One `--sla` objective: `ttft_p99_ms=1500` (at most) or `error_rate=0.01`.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub name: String,
    pub limit: f64,
}

/// Parse `ttft_p99_ms=1500,e2el_p95_ms=60000`. A percentile an objective names is measured:
/// it is added to `percentiles` (the `--metric-percentiles`) when missing.
pub fn parse_sla(text: &str, percentiles: &mut Vec<f64>) -> Result<Vec<Objective>, String> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part
            .split_once('=')
            .ok_or_else(|| format!("--sla `{part}`: write name=value, e.g. ttft_p99_ms=1500"))?;
        let limit: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("--sla `{part}`: `{value}` is not a number"))?;
        let name = name.trim().to_owned();
        if name != "error_rate" {
            let rest = name.strip_suffix("_ms").ok_or_else(|| {
                format!("--sla `{name}`: names are <metric>_<stat>_ms (ttft, tpot, itl, e2el × mean, median, pNN) or error_rate")
            })?;
            let (metric, stat) = rest
                .split_once('_')
                .ok_or_else(|| format!("--sla `{name}`: expected e.g. ttft_p99_ms"))?;
            if !METRICS.iter().any(|(k, _, _)| *k == metric) {
                return Err(format!(
                    "--sla `{name}`: `{metric}` is not one of ttft, tpot, itl, e2el"
                ));
            }
            if !matches!(stat, "mean" | "median" | "max") {
                let p = stat
                    .strip_prefix('p')
                    .and_then(|p| p.parse::<f64>().ok())
                    .filter(|p| (0.0..=100.0).contains(p) && p_word(*p) == stat[1..])
                    .ok_or_else(|| {
                        format!(
                            "--sla `{name}`: `{stat}` is not a statistic; use mean, median, max or a percentile such as p95 or p99.9"
                        )
                    })?;
                if !percentiles.iter().any(|q| (q - p).abs() < 1e-9) {
                    percentiles.push(p);
                    percentiles.sort_by(f64::total_cmp);
                }
            }
        }
        out.push(Objective { name, limit });
    }
    Ok(out)
}

/// The objectives `s` violates: (objective, measured).
pub fn violations(s: &Summary, sla: &[Objective]) -> Vec<(Objective, f64)> {
    sla.iter()
        .filter_map(|o| {
            let v = s.value(&o.name)?;
            (v > o.limit).then(|| (o.clone(), v))
        })
        .collect()
}

pub fn render_violations(v: &[(Objective, f64)]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^50}", " SLA violated ");
    let _ = writeln!(o, "{:<24} {:>12} {:>12}", "objective", "limit", "measured");
    for (obj, got) in v {
        let _ = writeln!(o, "{:<24} {:>12.2} {:>12.2}", obj.name, obj.limit, got);
    }
    o
}

/// Tolerances of the compare verdict. One-sided: a line fails only when the measured target is
/// slower than its baseline by more than `pct` % of the baseline's value or `floor_ms`,
/// whichever is larger; being faster is always a pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// For means (`--max-mean-delta-pct`).
    pub mean_pct: f64,
    /// For every percentile (`--max-percentile-delta-pct`, alias `--max-p95-delta-pct`).
    pub percentile_pct: f64,
    /// The absolute floor (`--delta-floor-ms`).
    pub floor_ms: f64,
}

impl Thresholds {
    /// The tolerance in percent for `stat` (`mean` or `pNN`).
    pub fn pct_for(&self, stat: &str) -> f64 {
        if stat == "mean" {
            self.mean_pct
        } else {
            self.percentile_pct
        }
    }

    /// The largest slowdown (ms) allowed a line whose baseline is `baseline_ms`.
    pub fn allowed_ms(&self, pct: f64, baseline_ms: f64) -> f64 {
        (pct / 100.0 * baseline_ms.max(0.0)).max(self.floor_ms)
    }

    /// The rule in words, as the verdict's header prints it, for `names` [baseline, measured].
    pub fn rule(&self, names: [&str; 2]) -> String {
        let [base, measured] = names;
        format!(
            "a line fails only when {measured} is slower than {base} by more than max(+{m} % of {base}'s value, +{f} ms) for a mean, max(+{p} %, +{f} ms) for a percentile; faster always passes",
            m = self.mean_pct,
            p = self.percentile_pct,
            f = self.floor_ms
        )
    }
}

/// How a line of the comparison was judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Judgement {
    /// Not slower than its tolerance (or faster).
    Within,
    /// Slower than its tolerance.
    Over,
    /// The statistic has no value on one side or both: the line cannot be judged, and the
    /// verdict cannot pass without it.
    NotMeasured,
}

/// One line of the comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Delta {
    pub metric: String,
    pub stat: String,
    pub baseline_ms: Option<f64>,
    pub measured_ms: Option<f64>,
    /// measured − baseline: positive when the second target is slower.
    pub delta_ms: Option<f64>,
    pub delta_pct: Option<f64>,
    /// The tolerance in percent this line is judged against.
    pub limit_pct: f64,
    /// The largest slowdown allowed, max(limit_pct × baseline, floor).
    pub allowed_ms: Option<f64>,
    pub judgement: Judgement,
    /// Why a line was not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub pass: bool,
}

/// The value of `stat` in `s`, or why there is none.
fn measured(s: &Stats, stat: &str) -> Result<f64, String> {
    if s.count == 0 {
        return Err("no samples".to_owned());
    }
    s.get(stat).ok_or_else(|| {
        format!(
            "{} was not among the measured percentiles",
            stat.to_uppercase()
        )
    })
}

/// Judge `measured` against `baseline` at the mean and every one of `percentiles`, for every
/// selected metric: one line each, none skipped.
pub fn compare(
    baseline: &Summary,
    measured_target: &Summary,
    selected: &[String],
    percentiles: &[f64],
    t: Thresholds,
) -> Vec<Delta> {
    let stats: Vec<String> = std::iter::once("mean".to_owned())
        .chain(percentiles.iter().map(|p| format!("p{}", p_word(*p))))
        .collect();
    let mut out = Vec::new();
    for (key, _, _) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let none = Stats::default();
        let a = baseline.metrics.get(key).unwrap_or(&none);
        let b = measured_target.metrics.get(key).unwrap_or(&none);
        for stat in &stats {
            let limit_pct = t.pct_for(stat);
            let line = match (measured(a, stat), measured(b, stat)) {
                (Ok(x), Ok(y)) => {
                    let allowed = t.allowed_ms(limit_pct, x);
                    let over = y - x > allowed;
                    Delta {
                        metric: (*key).to_owned(),
                        stat: stat.clone(),
                        baseline_ms: Some(x),
                        measured_ms: Some(y),
                        delta_ms: Some(y - x),
                        delta_pct: (x.abs() > 1e-12).then(|| (y - x) / x * 100.0),
                        limit_pct,
                        allowed_ms: Some(allowed),
                        judgement: if over {
                            Judgement::Over
                        } else {
                            Judgement::Within
                        },
                        note: None,
                        pass: !over,
                    }
                }
                (x, y) => {
                    let why = |side: &str, r: &Result<f64, String>| {
                        r.as_ref().err().map(|e| format!("{side}: {e}"))
                    };
                    let note = [why("first", &x), why("second", &y)]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join("; ");
                    Delta {
                        metric: (*key).to_owned(),
                        stat: stat.clone(),
                        baseline_ms: x.ok(),
                        measured_ms: y.ok(),
                        delta_ms: None,
                        delta_pct: None,
                        limit_pct,
                        allowed_ms: None,
                        judgement: Judgement::NotMeasured,
                        note: Some(note),
                        pass: false,
                    }
                }
            };
            out.push(line);
        }
    }
    out
}

/// What the gateway recorded as its hop cost beside what the client saw it add to TTFT.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HopCheck {
    /// Median `Server-Timing` hop of the second target's successful requests (none: it sent
    /// no hop figure).
    pub recorded_median_ms: Option<f64>,
    /// How many of its requests carried one.
    pub recorded_count: usize,
    /// Second target's TTFT median − first's (none: TTFT not measured on a side).
    pub client_ttft_median_delta_ms: Option<f64>,
    /// recorded / client-seen (none: either is missing, or the client saw no added TTFT).
    pub ratio: Option<f64>,
}

impl HopCheck {
    pub fn of(baseline: &Summary, measured_target: &Summary) -> HopCheck {
        let ttft_median = |s: &Summary| {
            s.metrics
                .get("ttft")
                .filter(|t| t.count > 0)
                .map(|t| t.median)
        };
        let client = ttft_median(baseline)
            .zip(ttft_median(measured_target))
            .map(|(a, b)| b - a);
        let recorded = measured_target.hop_ms.as_ref().map(|h| h.median);
        HopCheck {
            recorded_median_ms: recorded,
            recorded_count: measured_target.hop_ms.as_ref().map_or(0, |h| h.count),
            client_ttft_median_delta_ms: client,
            ratio: recorded
                .zip(client.filter(|c| *c > 0.0))
                .map(|(r, c)| r / c),
        }
    }

    fn render(&self, names: [&str; 2]) -> String {
        let client = match self.client_ttft_median_delta_ms {
            Some(c) => format!(
                "client-side TTFT median delta ({} − {}) {c:+.3} ms",
                names[1], names[0]
            ),
            None => "client-side TTFT median delta: not measured (no TTFT on a side)".to_owned(),
        };
        match self.recorded_median_ms {
            None => format!(
                "hop cost: {} sent no hop figure (no `hop` in its Server-Timing header or trailer); {client}\n",
                names[1]
            ),
            Some(r) => format!(
                "hop cost {} recorded (Server-Timing hop, median of {}): {r:.3} ms; {client}; recorded / client-seen: {}\n",
                names[1],
                self.recorded_count,
                match self.ratio {
                    Some(x) => format!("{x:.2}"),
                    None => "n/a (the client saw no added TTFT)".to_owned(),
                }
            ),
        }
    }
}

/// The comparison as text: the rule, one line per judged statistic, the gateway's own figures
/// beside the client's, and the verdict.
pub fn render_compare(
    names: [&str; 2],
    deltas: &[Delta],
    t: Thresholds,
    added_percentiles: &[f64],
    baseline: &Summary,
    measured_target: &Summary,
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^96}", format!(" {} vs {} ", names[1], names[0]));
    let _ = writeln!(o, "rule: {}", t.rule(names));
    if !added_percentiles.is_empty() {
        let _ = writeln!(
            o,
            "note: {} measured for the verdict (the seed's criterion), though not in --metric-percentiles",
            added_percentiles
                .iter()
                .map(|p| format!("P{}", p_word(*p)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        o,
        "{:<12} {:>14} {:>14} {:>12} {:>9} {:>12}  verdict",
        "metric", names[0], names[1], "delta (ms)", "delta", "allowed (ms)"
    );
    let num = |v: Option<f64>, w: usize, sign: bool| match v {
        Some(x) if sign => format!("{x:>+w$.3}"),
        Some(x) => format!("{x:>w$.3}"),
        None => format!("{:>w$}", "-"),
    };
    for d in deltas {
        let verdict = match d.judgement {
            Judgement::Within if d.delta_ms.is_some_and(|x| x < 0.0) => "ok (faster)".to_owned(),
            Judgement::Within => "ok".to_owned(),
            Judgement::Over => "SLOWER than allowed".to_owned(),
            Judgement::NotMeasured => {
                format!("not measured ({})", d.note.as_deref().unwrap_or("no value"))
            }
        };
        let pct = d
            .delta_pct
            .map_or_else(|| format!("{:>9}", "-"), |p| format!("{p:>+8.2}%"));
        let _ = writeln!(
            o,
            "{:<12} {} {} {} {} {}  {}",
            format!("{} {}", d.metric.to_uppercase(), d.stat),
            num(d.baseline_ms, 14, false),
            num(d.measured_ms, 14, false),
            num(d.delta_ms, 12, true),
            pct,
            num(d.allowed_ms, 12, false),
            verdict
        );
    }
    o.push_str(&HopCheck::of(baseline, measured_target).render(names));
    if let Some(g) = &measured_target.gateway_ms {
        let _ = writeln!(
            o,
            "{}'s own time (its Server-Timing gw): mean {:.3} ms, median {:.3} ms, max {:.3} ms",
            names[1], g.mean, g.median, g.max,
        );
    }
    let list = |j: Judgement| {
        deltas
            .iter()
            .filter(|d| d.judgement == j)
            .map(|d| format!("{} {}", d.metric.to_uppercase(), d.stat))
            .collect::<Vec<_>>()
    };
    let (over, unmeasured) = (list(Judgement::Over), list(Judgement::NotMeasured));
    let mut why = Vec::new();
    if !over.is_empty() {
        why.push(format!("slower than allowed: {}", over.join(", ")));
    }
    if !unmeasured.is_empty() {
        why.push(format!(
            "not measured, so not shown within tolerance: {}",
            unmeasured.join(", ")
        ));
    }
    let _ = writeln!(
        o,
        "verdict: {}",
        if why.is_empty() {
            format!("PASS — {} is nowhere slower than the tolerance", names[1])
        } else {
            format!("FAIL — {}", why.join("; "))
        }
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A summary whose every metric has `values` (ms), measured at `percentiles`.
    fn summary(values: &[f64], percentiles: &[f64]) -> Summary {
        let mut s = Summary::default();
        for (k, _, _) in METRICS {
            s.metrics.insert(k, Stats::of(values.to_vec(), percentiles));
        }
        s
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

    #[test]
    fn a_faster_gateway_passes() {
        // 10 % faster everywhere: the old two-sided rule failed this ("OVER 5%").
        let base = summary(&[100.0, 200.0, 300.0, 400.0], &[95.0, 99.0]);
        let fast = summary(&[90.0, 180.0, 270.0, 360.0], &[95.0, 99.0]);
        let d = compare(
            &base,
            &fast,
            &["ttft".into(), "e2el".into()],
            &[95.0, 99.0],
            T,
        );
        assert_eq!(d.len(), 2 * 3, "mean, P95 and P99 of both metrics");
        for x in &d {
            assert!(x.delta_ms.unwrap() < 0.0);
            assert_eq!(x.judgement, Judgement::Within, "{x:?}");
            assert!(x.pass);
        }
        let text = render_compare(["direct", "gateway"], &d, T, &[], &base, &fast);
        assert!(text.contains("ok (faster)"), "{text}");
        assert!(text.contains("verdict: PASS"), "{text}");
    }

    #[test]
    fn slower_fails_past_the_larger_of_percent_and_floor() {
        let p = [95.0];
        let sel = ["ttft".to_owned()];
        // 1000 ms baseline: 3 % = 30 ms is the larger; +29 passes, +31 fails (mean).
        let base = summary(&[1000.0], &p);
        let d = compare(&base, &summary(&[1029.0], &p), &sel, &p, T);
        assert!(line(&d, "ttft", "mean").pass);
        assert_eq!(line(&d, "ttft", "mean").allowed_ms, Some(30.0));
        let d = compare(&base, &summary(&[1031.0], &p), &sel, &p, T);
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
        // P95 has its own tolerance: 5 % of 1000 ms.
        assert!(line(&d, "ttft", "p95").pass, "+31 ms is within 50 ms");
        // 2 ms baseline: the 1 ms floor is the larger; +0.9 ms (45 %) passes, +1.1 ms fails.
        let base = summary(&[2.0], &p);
        let d = compare(&base, &summary(&[2.9], &p), &sel, &p, T);
        assert!(d.iter().all(|x| x.pass), "{d:?}");
        let d = compare(&base, &summary(&[3.1], &p), &sel, &p, T);
        assert!(d.iter().all(|x| !x.pass), "{d:?}");
        // Without a floor the percentages alone decide.
        let no_floor = Thresholds { floor_ms: 0.0, ..T };
        let d = compare(&base, &summary(&[2.5], &p), &sel, &p, no_floor);
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
        let text = render_compare(["direct", "gateway"], &d, no_floor, &[], &base, &base);
        assert!(
            text.contains("verdict: FAIL — slower than allowed: TTFT mean, TTFT p95"),
            "{text}"
        );
    }

    #[test]
    fn every_percentile_is_judged_and_an_unmeasured_one_is_named() {
        // P99 is judged like P95 (it was "reported" only); P50 too when asked for.
        let p = [50.0, 95.0, 99.0];
        let base = summary(&[10.0, 20.0, 30.0, 40.0, 1000.0], &p);
        let slow_tail = summary(&[10.0, 20.0, 30.0, 40.0, 1500.0], &p);
        let d = compare(&base, &slow_tail, &["e2el".into()], &p, T);
        assert_eq!(
            d.iter().map(|x| x.stat.as_str()).collect::<Vec<_>>(),
            ["mean", "p50", "p95", "p99"]
        );
        assert!(line(&d, "e2el", "p50").pass);
        assert_eq!(line(&d, "e2el", "p99").judgement, Judgement::Over);
        // A percentile the summaries were not measured at is a line, "not measured".
        let d = compare(&base, &slow_tail, &["e2el".into()], &[90.0], T);
        let l = line(&d, "e2el", "p90");
        assert_eq!(l.judgement, Judgement::NotMeasured);
        assert!(!l.pass);
        assert!(
            l.note.as_deref().unwrap().contains("P90 was not among"),
            "{l:?}"
        );
        // A metric without samples on one side (TPOT of one-token answers): named, not passed.
        let mut no_tpot = summary(&[10.0], &[95.0]);
        no_tpot
            .metrics
            .insert("tpot", Stats::of(Vec::new(), &[95.0]));
        let d = compare(
            &summary(&[10.0], &[95.0]),
            &no_tpot,
            &["ttft".into(), "tpot".into()],
            &[95.0],
            T,
        );
        assert!(line(&d, "ttft", "mean").pass);
        let l = line(&d, "tpot", "p95");
        assert_eq!(l.judgement, Judgement::NotMeasured);
        assert_eq!(l.note.as_deref(), Some("second: no samples"));
        let text = render_compare(["direct", "gateway"], &d, T, &[], &no_tpot, &no_tpot);
        assert!(text.contains("not measured (second: no samples)"), "{text}");
        assert!(
            text.contains(
                "FAIL — not measured, so not shown within tolerance: TPOT mean, TPOT p95"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_hop_line_sets_the_recorded_cost_beside_the_client_delta() {
        let base = summary(&[10.0, 10.0, 10.0], &[99.0]);
        let mut gw = summary(&[10.25, 10.25, 10.25], &[99.0]);
        let d = compare(&base, &gw, &["ttft".into()], &[99.0], T);
        // No hop figure yet: said so, not left out.
        let text = render_compare(["direct", "gateway"], &d, T, &[95.0], &base, &gw);
        assert!(text.contains("gateway sent no hop figure"), "{text}");
        assert!(
            text.contains("TTFT median delta (gateway − direct) +0.250 ms"),
            "{text}"
        );
        assert!(
            text.contains("note: P95 measured for the verdict"),
            "{text}"
        );
        assert!(text.contains("rule: a line fails only when gateway is slower than direct by more than max(+3 % of direct's value, +1 ms) for a mean, max(+5 %, +1 ms) for a percentile; faster always passes"), "{text}");
        gw.hop_ms = Some(Stats::of(vec![0.2, 0.21, 0.3], &[99.0]));
        let h = HopCheck::of(&base, &gw);
        assert_eq!(h.recorded_median_ms, Some(0.21));
        assert_eq!(h.recorded_count, 3);
        assert!((h.ratio.unwrap() - 0.84).abs() < 1e-9, "{h:?}");
        let text = render_compare(["direct", "gateway"], &d, T, &[], &base, &gw);
        assert!(
            text.contains("median of 3): 0.210 ms; client-side TTFT median delta (gateway − direct) +0.250 ms; recorded / client-seen: 0.84"),
            "{text}"
        );
        // A faster gateway has no added TTFT to set the hop against.
        let mut fast = base.clone();
        fast.hop_ms = gw.hop_ms.clone();
        let h = HopCheck::of(&gw, &fast);
        assert_eq!((h.recorded_median_ms, h.ratio), (Some(0.21), None));
        assert!(
            h.render(["direct", "gateway"])
                .contains("n/a (the client saw no added TTFT)")
        );
    }
}
