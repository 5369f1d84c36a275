//! Planning: a series of runs over request rates (or concurrencies) with a table, an SVG chart of
//! TTFT P99 and throughput against the offered load with the knee marked, and the seed's
//! capacity formula: instances = ceil(target QPS × redundancy / per-instance throughput at the
//! SLA).

use std::fmt::Write as _;
use std::sync::Arc;

use serde_json::{Value, json};

use tokio_util::sync::CancellationToken;

use super::capacity::capacity_json;
use super::engine::execute;
use super::plan::Plan;
use super::report::{EXIT_INTERRUPTED, EXIT_SLA, Report, build_report, capacity_text};
use super::spec::Axis;
use super::summary::Summary;
use super::verdict::sla::{Objective, violations};

/// One point of the sweep.
#[derive(Debug, Clone)]
pub(crate) struct Point {
    pub(crate) x: f64,
    pub(crate) summary: Summary,
    pub(crate) meets_sla: bool,
}

/// The knee: the first point where more offered load stops buying throughput (under 90 % of
/// the offered rate, or under 5 % more than the point before) or TTFT P99 more than doubles
/// against the first point (and grows by 50 ms at least, so step-sized jitter of a fast
/// backend is not a knee). `None` when the series never bends.
pub(crate) fn knee(axis: Axis, points: &[Point]) -> Option<usize> {
    let base_ttft = points.first()?.summary.metrics.get("ttft")?.get("p99")?;
    for (i, p) in points.iter().enumerate().skip(1) {
        let prev = &points[i - 1].summary;
        let thr = p.summary.request_throughput;
        let saturated = match axis {
            Axis::Rate => thr < 0.9 * p.x,
            Axis::Concurrency => thr < 1.05 * prev.request_throughput,
        };
        let ttft = p.summary.metrics.get("ttft").and_then(|s| s.get("p99"));
        let slow = ttft.is_some_and(|t| t > 2.0 * base_ttft && t > base_ttft + 50.0);
        if saturated || slow {
            return Some(i);
        }
    }
    None
}

/// The point of `points` that sustains the most requests per second, and that throughput. On a
/// rate sweep a point's throughput counts at most at the rate it offered: a short run can
/// measure a little more (its last requests finish in a burst), which is no capacity.
fn sustained<'a>(axis: Axis, points: impl Iterator<Item = &'a Point>) -> Option<(f64, f64)> {
    points
        .map(|p| {
            let t = p.summary.request_throughput;
            (p.x, if axis == Axis::Rate { t.min(p.x) } else { t })
        })
        .fold(None, |best: Option<(f64, f64)>, (x, t)| match best {
            Some((_, b)) if b >= t => best,
            _ => Some((x, t)),
        })
}

pub(crate) fn mark_sla(points: &mut [Point], sla: &[Objective]) {
    for p in points {
        p.meets_sla = p.summary.completed > 0 && violations(&p.summary, sla).is_empty();
    }
}

pub(crate) fn table(axis: Axis, points: &[Point], knee: Option<usize>, sla: bool) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^96}", format!(" Sweep over {} ", axis.name()));
    let _ = writeln!(
        o,
        "{:>10} {:>9} {:>7} {:>10} {:>12} {:>12} {:>12} {:>12}  note",
        match axis {
            Axis::Rate => "rate",
            Axis::Concurrency => "conc.",
        },
        "completed",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p99",
        "TPOT p99",
        "E2EL p99",
    );
    let get = |s: &Summary, m: &str| {
        s.metrics
            .get(m)
            .and_then(|x| x.get("p99"))
            .map_or("-".to_owned(), |v| format!("{v:.1}"))
    };
    for (i, p) in points.iter().enumerate() {
        let mut note = Vec::new();
        if Some(i) == knee {
            note.push("knee");
        }
        if sla {
            note.push(if p.meets_sla {
                "meets SLA"
            } else {
                "misses SLA"
            });
        }
        let s = &p.summary;
        let _ = writeln!(
            o,
            "{:>10} {:>9} {:>7} {:>10.2} {:>12.1} {:>12} {:>12} {:>12}  {}",
            p.x,
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            get(s, "ttft"),
            get(s, "tpot"),
            get(s, "e2el"),
            note.join(", ")
        );
    }
    let _ = writeln!(
        o,
        "(latencies in ms; p99 needs 99 in --metric-percentiles, which a sweep adds)"
    );
    o
}

/// An SVG line chart: TTFT P99 (left axis) and request throughput (right axis) against the
/// swept value, the knee marked.
pub(crate) fn svg(axis: Axis, points: &[Point], knee: Option<usize>) -> String {
    let (w, h) = (720.0, 420.0);
    let (l, r, t, b) = (70.0, 70.0, 40.0, 60.0);
    let pw = w - l - r;
    let ph = h - t - b;
    let xs: Vec<f64> = points.iter().map(|p| p.x).collect();
    let ttft: Vec<f64> = points
        .iter()
        .map(|p| {
            p.summary
                .metrics
                .get("ttft")
                .and_then(|s| s.get("p99"))
                .unwrap_or(0.0)
        })
        .collect();
    let thr: Vec<f64> = points
        .iter()
        .map(|p| p.summary.request_throughput)
        .collect();
    let (x0, x1) = (xs[0], xs[xs.len() - 1]);
    let ymax = |v: &[f64]| v.iter().copied().fold(0.0_f64, f64::max).max(1e-9) * 1.1;
    let (tmax, qmax) = (ymax(&ttft), ymax(&thr));
    let px = |x: f64| l + (x - x0) / (x1 - x0).max(1e-9) * pw;
    let py = |v: f64, max: f64| t + ph - v / max * ph;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">TTFT P99 and throughput against {}</text>"#,
        w / 2.0,
        axis.name()
    );
    // Axes and ticks.
    let _ = writeln!(
        o,
        r##"<path d="M{l},{t} V{} H{}" stroke="#333" fill="none"/><path d="M{},{t} V{}" stroke="#333"/>"##,
        t + ph,
        l + pw,
        l + pw,
        t + ph
    );
    for k in 0..=4 {
        let f = f64::from(k) / 4.0;
        let y = t + ph - f * ph;
        let _ = writeln!(
            o,
            r##"<line x1="{l}" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end" fill="#c0392b">{:.0}</text><text x="{}" y="{}" fill="#2471a3">{:.1}</text>"##,
            l + pw,
            l - 6.0,
            y + 4.0,
            f * tmax,
            l + pw + 6.0,
            y + 4.0,
            f * qmax
        );
    }
    for x in &xs {
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            px(*x),
            t + ph + 18.0,
            x
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        l + pw / 2.0,
        h - 18.0,
        axis.name()
    );
    let _ = writeln!(
        o,
        r##"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle" fill="#c0392b">TTFT P99 (ms)</text>"##,
        t + ph / 2.0
    );
    let _ = writeln!(
        o,
        r##"<text transform="translate({},{}) rotate(90)" text-anchor="middle" fill="#2471a3">throughput (req/s)</text>"##,
        w - 14.0,
        t + ph / 2.0
    );
    let line = |vals: &[f64], max: f64, color: &str| {
        let pts: Vec<String> = xs
            .iter()
            .zip(vals)
            .map(|(x, v)| format!("{:.1},{:.1}", px(*x), py(*v, max)))
            .collect();
        let dots: String = xs
            .iter()
            .zip(vals)
            .map(|(x, v)| {
                format!(
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"/>"#,
                    px(*x),
                    py(*v, max)
                )
            })
            .collect();
        format!(
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>{dots}"#,
            pts.join(" ")
        )
    };
    let _ = writeln!(o, "{}", line(&ttft, tmax, "#c0392b"));
    let _ = writeln!(o, "{}", line(&thr, qmax, "#2471a3"));
    if let Some(k) = knee {
        let x = px(xs[k]);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{t}" y2="{}" stroke="#555" stroke-dasharray="5,4"/><text x="{:.1}" y="{}" fill="#555">knee</text>"##,
            t + ph,
            x + 4.0,
            t + 14.0
        );
    }
    let _ = writeln!(o, "</svg>");
    o
}

/// Run every point of the sweep; the report holds the table, the chart's path and capacity.
pub(super) async fn run(
    plan: Arc<Plan>,
    stop: CancellationToken,
) -> Result<(Report, String), String> {
    let Some((axis, values)) = plan.sweep.clone() else {
        return Err("no sweep".into());
    };
    let mut points = Vec::new();
    let mut runs = Vec::new();
    let mut interrupted = false;
    for (i, x) in values.iter().enumerate() {
        let mut p = (*plan).clone();
        match axis {
            Axis::Rate => p.request_rate = *x,
            Axis::Concurrency => p.max_concurrency = Some(*x as usize),
        }
        if i > 0 {
            p.warmups = 0;
        }
        eprintln!(
            "fleetgate bench: sweep point {} of {}: {} = {x}",
            i + 1,
            values.len(),
            axis.name()
        );
        let result = execute(Arc::new(p.clone()), stop.clone()).await?;
        let r = build_report(&p, &result);
        interrupted |= result.interrupted;
        points.push(Point {
            x: *x,
            summary: r.summaries[0].clone(),
            meets_sla: false,
        });
        let mut j = r.json;
        if let Value::Object(m) = &mut j {
            m.insert("sweep_value".into(), json!(x));
        }
        runs.push(j);
        if result.interrupted {
            break;
        }
    }
    mark_sla(&mut points, &plan.sla);
    let knee = knee(axis, &points);
    let mut text = table(axis, &points, knee, !plan.sla.is_empty());
    let chart = svg(axis, &points, knee);
    let mut exit = 0;
    let best = sustained(axis, points.iter().filter(|p| p.meets_sla));
    if !plan.sla.is_empty() && best.is_none() {
        text.push_str("SLA: no point of the sweep meets it\n");
        exit = EXIT_SLA;
    }
    let mut json = serde_json::Map::new();
    json.insert("model_id".into(), json!(plan.model));
    json.insert("labels".into(), Value::Object(plan.labels.clone()));
    json.insert("settings".into(), plan.settings.clone());
    json.insert(
        "sweep".into(),
        json!({
            "axis": match axis { Axis::Rate => "rate", Axis::Concurrency => "concurrency" },
            "values": values,
            "knee": knee.map(|k| points[k].x),
            "meets_sla": points.iter().map(|p| p.meets_sla).collect::<Vec<_>>(),
            "runs": runs,
        }),
    );
    if let Some((q, red, inst)) = plan.capacity {
        let (point, which) = if plan.sla.is_empty() {
            (
                sustained(axis, points.iter()),
                "the sweep's best throughput; give --sla to plan at an objective",
            )
        } else {
            (best, "the best sweep point meeting the SLA")
        };
        let source = match point {
            Some((x, _)) => format!("{which}: {}={x}", axis.name()),
            None => which.to_owned(),
        };
        let thr = point.map(|(_, t)| t);
        text.push_str(&capacity_text(q, red, inst, thr, &source));
        json.insert("capacity".into(), capacity_json(q, red, thr, inst));
    }
    if interrupted {
        text.push_str("interrupted: the sweep stopped at Ctrl-C\n");
        exit = EXIT_INTERRUPTED;
    }
    json.insert("interrupted".into(), json!(interrupted));
    Ok((
        Report {
            text,
            json: Value::Object(json),
            exit,
            summaries: points.into_iter().map(|p| p.summary).collect(),
        },
        chart,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::Stats;

    fn point(x: f64, thr: f64, ttft_p99: f64) -> Point {
        let mut s = Summary {
            request_throughput: thr,
            completed: 10,
            ..Summary::default()
        };
        s.metrics.insert(
            "ttft",
            Stats {
                percentiles: vec![(99.0, ttft_p99)],
                ..Stats::default()
            },
        );
        Point {
            x,
            summary: s,
            meets_sla: false,
        }
    }

    /// A rate point's capacity is at most what it offered; a concurrency point's is what it
    /// measured; the point is named.
    #[test]
    fn capacity_comes_from_what_a_point_sustained() {
        let pts = [
            point(2.0, 2.0, 100.0),
            point(4.0, 4.6, 110.0),
            point(8.0, 4.3, 180.0),
        ];
        assert_eq!(sustained(Axis::Rate, pts.iter()), Some((8.0, 4.3)));
        assert_eq!(sustained(Axis::Concurrency, pts.iter()), Some((4.0, 4.6)));
        assert_eq!(sustained(Axis::Rate, pts[..0].iter()), None);
    }

    #[test]
    fn the_knee_is_where_throughput_stops_following_the_rate() {
        let pts = [
            point(2.0, 2.0, 100.0),
            point(4.0, 4.0, 110.0),
            point(8.0, 6.5, 180.0),
            point(16.0, 6.6, 900.0),
        ];
        assert_eq!(knee(Axis::Rate, &pts), Some(2));
        let pts = [point(2.0, 2.0, 100.0), point(4.0, 4.0, 250.0)];
        assert_eq!(
            knee(Axis::Rate, &pts),
            Some(1),
            "TTFT P99 more than doubled"
        );
        let pts = [point(2.0, 2.0, 6.0), point(4.0, 4.0, 13.0)];
        assert_eq!(
            knee(Axis::Rate, &pts),
            None,
            "a doubling of a few ms is jitter"
        );
        let pts = [point(2.0, 2.0, 100.0), point(4.0, 3.95, 120.0)];
        assert_eq!(knee(Axis::Rate, &pts), None);
        let svg = svg(
            Axis::Rate,
            &[point(2.0, 2.0, 100.0), point(4.0, 3.0, 300.0)],
            Some(1),
        );
        assert!(
            svg.starts_with("<svg") && svg.contains("knee") && svg.trim_end().ends_with("</svg>")
        );
    }
}
