//! Line charts drawn as SVG on the server: no script, no asset, colours from the stylesheet
//! (by class; the CSP forbids inline styles, and presentation attributes are not styles).
//!
//! Every chart says its window ("per minute, 14:02–14:37 UTC (35 min)"), puts its y ticks on
//! round values (1, 2 or 5 × 10^k) and its time ticks on round times of the UTC clock.

use std::fmt::Write;

use maud::{Markup, html};

use super::data::Window;
use crate::clock::format_wall_ms;

/// One line: a label for the legend, a CSS class for its colour, dashed or not, and one value
/// per bucket (`None`: no data in that bucket, drawn as a gap).
pub(crate) struct Line {
    pub(crate) label: String,
    pub(crate) class: &'static str,
    pub(crate) dashed: bool,
    pub(crate) values: Vec<Option<f64>>,
}

const W: f64 = 560.0;
const H: f64 = 170.0;
const LEFT: f64 = 52.0;
const RIGHT: f64 = 8.0;
const TOP: f64 = 8.0;
const BOTTOM: f64 = 22.0;

const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
const DAY: i64 = 24 * HOUR;

/// The smallest of 1, 2, 5 × 10^k that is at least `v` (> 0).
fn round_step(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= v * (1.0 - 1e-9))
        .unwrap_or(10.0 * p)
}

/// The y axis for values up to `max`: a round step (1, 2 or 5 × 10^k), how many steps reach
/// `max` (2 to 5), and how many decimals the step needs. `whole`: the values are counts, so
/// the step is 1 at least (no tick at 0.2 requests).
pub(crate) fn y_axis(max: f64, whole: bool) -> (f64, u32, usize) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let mut step = round_step(max / 5.0);
    if whole {
        step = step.max(1.0);
    }
    let steps = (max / step - 1e-9).ceil().max(1.0);
    let decimals = (-step.log10() - 1e-9).ceil().max(0.0);
    // Both are small whole numbers here (at most 5 steps, a dozen decimals).
    (step, steps as u32, decimals as usize)
}

/// The time axis's ticks: the instants (epoch ms) of a round step of the UTC clock inside the
/// window, at most 6 of them.
pub(crate) fn time_ticks(from: i64, to: i64) -> Vec<i64> {
    const STEPS: [i64; 14] = [
        MINUTE,
        2 * MINUTE,
        5 * MINUTE,
        10 * MINUTE,
        15 * MINUTE,
        30 * MINUTE,
        HOUR,
        2 * HOUR,
        3 * HOUR,
        6 * HOUR,
        12 * HOUR,
        DAY,
        2 * DAY,
        7 * DAY,
    ];
    let span = (to - from).max(1);
    let step = STEPS.into_iter().find(|s| span / s <= 6).unwrap_or(7 * DAY);
    let first = from.div_euclid(step) * step + if from.rem_euclid(step) == 0 { 0 } else { step };
    (0..)
        .map(|i| first + i * step)
        .take_while(|t| *t <= to)
        .collect()
}

/// A tick's label: `14:30`, or the date (`12-02`) at midnight and for steps of days.
fn tick_label(at: i64, ticks: &[i64]) -> String {
    let s = format_wall_ms(at);
    let daily = ticks.windows(2).next().is_some_and(|w| w[1] - w[0] >= DAY);
    if daily || at.rem_euclid(DAY) == 0 {
        s[5..10].to_owned()
    } else {
        s[11..16].to_owned()
    }
}

/// `35 min`, `1 h 30 min`, `2 d 3 h`, `45 s`.
pub(crate) fn span_text(ms: i64) -> String {
    let s = ms / 1000;
    let (d, h, m) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60);
    let mut parts = Vec::new();
    if d > 0 {
        parts.push(format!("{d} d"));
    }
    if h > 0 {
        parts.push(format!("{h} h"));
    }
    if m > 0 && d == 0 {
        parts.push(format!("{m} min"));
    }
    if parts.is_empty() {
        parts.push(format!("{s} s"));
    }
    parts.join(" ")
}

/// `per 10 s`, `per minute`, `per 5 min`, `per hour`, `per 3 h`, `per day`.
pub(crate) fn per_text(bucket_ms: i64) -> String {
    match bucket_ms {
        MINUTE => "per minute".into(),
        HOUR => "per hour".into(),
        DAY => "per day".into(),
        b if b < MINUTE => format!("per {} s", b / 1000),
        b if b < HOUR => format!("per {} min", b / MINUTE),
        b => format!("per {} h", b / HOUR),
    }
}

/// `14:02–14:37 UTC` (today), `2026-12-01 14:02–14:37 UTC` (another day), or both dates
/// when the window crosses midnight.
pub(crate) fn range_text(from: i64, to: i64, now: i64) -> String {
    let (f, t, n) = (
        format_wall_ms(from),
        format_wall_ms(to),
        format_wall_ms(now),
    );
    let (fd, td) = (&f[..10], &t[..10]);
    let (fh, th) = (&f[11..16], &t[11..16]);
    if fd != td {
        format!("{fd} {fh} – {td} {th} UTC")
    } else if td == &n[..10] {
        format!("{fh}–{th} UTC")
    } else {
        format!("{td} {fh}–{th} UTC")
    }
}

/// What a chart says of its window: `per minute, 14:02–14:37 UTC (35 min)`.
pub(crate) fn window_text(w: &Window, now: i64) -> String {
    format!(
        "{}, {} ({})",
        per_text(w.bucket_ms),
        range_text(w.from, w.to, now),
        span_text(w.to - w.from)
    )
}

fn y_label(v: f64, decimals: usize) -> String {
    format!("{v:.decimals$}")
}

/// A chart of `lines` (one value per bucket of `window`), in `unit`; `now` only decides
/// whether the window's text needs a date.
pub(crate) fn line_chart(
    id: &str,
    title: &str,
    unit: &str,
    window: &Window,
    now: i64,
    lines: &[Line],
) -> Markup {
    let max = lines
        .iter()
        .flat_map(|l| l.values.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b));
    let whole = lines
        .iter()
        .flat_map(|l| l.values.iter().flatten())
        .all(|v| v.fract() == 0.0);
    let (step, steps, decimals) = y_axis(max, whole);
    let top = step * f64::from(steps);
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    let span = (window.to - window.from).max(1) as f64;
    let x_at = |t: f64| LEFT + plot_w * ((t - window.from as f64) / span).clamp(0.0, 1.0);
    let x = |i: usize| x_at(window.bucket_middle(i));
    let y = |v: f64| TOP + plot_h * (1.0 - (v / top).clamp(0.0, 1.0));
    let ticks = time_ticks(window.from, window.to);
    let mut paths = Vec::with_capacity(lines.len());
    for l in lines {
        let mut d = String::new();
        let mut pen_down = false;
        let mut lone = Vec::new();
        for (i, v) in l.values.iter().enumerate() {
            match v {
                Some(v) => {
                    let cmd = if pen_down { 'L' } else { 'M' };
                    let _ = write!(d, "{cmd}{:.1},{:.1} ", x(i), y(*v));
                    let next_missing = l.values.get(i + 1).is_none_or(Option::is_none);
                    if !pen_down && next_missing {
                        lone.push((x(i), y(*v)));
                    }
                    pen_down = true;
                }
                None => pen_down = false,
            }
        }
        paths.push((l, d, lone));
    }
    let has_data = max > 0.0 || lines.iter().any(|l| l.values.iter().any(Option::is_some));
    html! {
        figure.chart id=(id) {
            figcaption { (title) " " span.unit { "(" (unit) ")" } }
            p.window { (window_text(window, now)) }
            svg viewBox=(format!("0 0 {W} {H}")) role="img" aria-label=(title) {
                @for k in 0..=steps {
                    @let v = step * f64::from(k);
                    line.grid x1=(LEFT) x2=(W - RIGHT) y1=(format!("{:.1}", y(v))) y2=(format!("{:.1}", y(v))) {}
                    text.axis.y x=(LEFT - 4.0) y=(format!("{:.1}", y(v) + 3.0)) text-anchor="end" { (y_label(v, decimals)) }
                }
                @for t in &ticks {
                    @let tx = x_at(*t as f64);
                    @let anchor = if tx < LEFT + 14.0 { "start" } else if tx > W - RIGHT - 14.0 { "end" } else { "middle" };
                    line.tick x1=(format!("{tx:.1}")) x2=(format!("{tx:.1}")) y1=(TOP + plot_h) y2=(TOP + plot_h + 4.0) {}
                    text.axis.x x=(format!("{tx:.1}")) y=(H - 6.0) text-anchor=(anchor) { (tick_label(*t, &ticks)) }
                }
                @for (l, d, lone) in &paths {
                    @if !d.is_empty() {
                        path class=(format!("series {}", l.class)) d=(d) fill="none"
                            stroke-dasharray=[l.dashed.then_some("5 3")] {}
                    }
                    @for (cx, cy) in lone {
                        circle class=(format!("dot {}", l.class)) cx=(format!("{cx:.1}")) cy=(format!("{cy:.1}")) r="2.5" {}
                    }
                }
                @if !has_data {
                    text.empty x=(LEFT + plot_w / 2.0) y=(TOP + plot_h / 2.0) text-anchor="middle" { "no requests in this window" }
                }
            }
            ul.legend {
                @for l in lines {
                    li {
                        svg.swatch viewBox="0 0 20 8" {
                            line class=(format!("series {}", l.class)) x1="0" x2="20" y1="4" y2="4"
                                stroke-dasharray=[l.dashed.then_some("5 3")] {}
                        }
                        (l.label)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-12-01T14:00:00Z
    const T: i64 = 1_796_133_600_000;

    #[test]
    fn y_ticks_are_round() {
        // (max, step, steps): the ticks are 0, step, …, step × steps.
        for (max, step, steps) in [
            (0.0, 0.2, 5),
            (0.7, 0.2, 4),
            (1.2, 0.5, 3),
            (3.7, 1.0, 4),
            (5.0, 1.0, 5),
            (7.0, 2.0, 4),
            (10.0, 2.0, 5),
            (12.0, 5.0, 3),
            (120.0, 50.0, 3),
            (0.043, 0.01, 5),
        ] {
            let (s, n, _) = y_axis(max, false);
            assert!((s - step).abs() < 1e-12 && n == steps, "{max}: {s} × {n}");
        }
        assert_eq!(y_axis(0.7, false).2, 1);
        assert_eq!(y_axis(0.043, false).2, 2);
        assert_eq!(y_axis(3.7, false).2, 0);
        // Counts: whole steps.
        assert_eq!(y_axis(1.0, true), (1.0, 1, 0));
        assert_eq!(y_axis(3.0, true), (1.0, 3, 0));
        assert_eq!(y_axis(0.0, true), (1.0, 1, 0));
        assert_eq!(y_axis(40.0, true), (10.0, 4, 0));
    }

    #[test]
    fn time_ticks_are_round_times() {
        let m = MINUTE;
        // 14:02–14:37: every 10 minutes.
        let ticks = time_ticks(T + 2 * m + 17_000, T + 37 * m + 17_000);
        assert_eq!(ticks, [T + 10 * m, T + 20 * m, T + 30 * m]);
        let labels: Vec<_> = ticks.iter().map(|t| tick_label(*t, &ticks)).collect();
        assert_eq!(labels, ["14:10", "14:20", "14:30"]);
        // Five minutes: every minute.
        assert_eq!(time_ticks(T + 30_000, T + 5 * m + 30_000).len(), 5);
        // A day: every 6 hours, midnight named by its date.
        let ticks = time_ticks(T, T + DAY);
        assert_eq!(ticks.len(), 4);
        let labels: Vec<_> = ticks.iter().map(|t| tick_label(*t, &ticks)).collect();
        assert_eq!(labels, ["18:00", "12-02", "06:00", "12:00"]);
        // A week: every 2 days, by date.
        let ticks = time_ticks(T, T + 7 * DAY);
        assert!(ticks.iter().all(|t| t % (2 * DAY) == 0), "{ticks:?}");
        assert!(tick_label(ticks[0], &ticks).len() == 5);
    }

    #[test]
    fn the_window_is_said() {
        let w = Window {
            from: T + 2 * MINUTE,
            to: T + 37 * MINUTE,
            bucket_ms: MINUTE,
        };
        assert_eq!(window_text(&w, T), "per minute, 14:02–14:37 UTC (35 min)");
        assert_eq!(
            window_text(&w, T + DAY),
            "per minute, 2026-12-01 14:02–14:37 UTC (35 min)"
        );
        let w = Window {
            from: T,
            to: T + DAY,
            bucket_ms: 30 * MINUTE,
        };
        assert_eq!(
            window_text(&w, T),
            "per 30 min, 2026-12-01 14:00 – 2026-12-02 14:00 UTC (1 d)"
        );
        assert_eq!(per_text(10_000), "per 10 s");
        assert_eq!(per_text(3 * HOUR), "per 3 h");
        assert_eq!(span_text(90 * MINUTE), "1 h 30 min");
        assert_eq!(span_text(7 * DAY), "7 d");
    }

    #[test]
    fn a_chart_draws_round_ticks_and_says_its_window() {
        let w = Window {
            from: T + 2 * MINUTE,
            to: T + 37 * MINUTE,
            bucket_ms: MINUTE,
        };
        let m = line_chart(
            "c",
            "Requests",
            "req/min",
            &w,
            T,
            &[Line {
                label: "prod".into(),
                class: "prod",
                dashed: false,
                values: (0..35).map(|i| Some(f64::from(i % 5) * 0.925)).collect(),
            }],
        )
        .into_string();
        assert!(m.contains("per minute, 14:02–14:37 UTC (35 min)"), "{m}");
        let y_labels: Vec<&str> = m
            .split("text-anchor=\"end\">")
            .skip(1)
            .filter_map(|s| s.split('<').next())
            .collect();
        assert_eq!(y_labels, ["0", "1", "2", "3", "4"], "{m}");
        assert!(m.contains(">14:10<") && m.contains(">14:30<"), "{m}");
    }

    #[test]
    fn gaps_break_the_line_and_labels_are_escaped() {
        let w = Window {
            from: T,
            to: T + 5 * MINUTE,
            bucket_ms: MINUTE,
        };
        let m = line_chart(
            "c",
            "TTFT <p50>",
            "ms",
            &w,
            T,
            &[Line {
                label: "prod <b>".into(),
                class: "prod",
                dashed: false,
                values: vec![Some(1.0), Some(2.0), None, Some(4.0), None],
            }],
        )
        .into_string();
        assert!(m.contains("TTFT &lt;p50&gt;"), "{m}");
        assert!(m.contains("prod &lt;b&gt;"), "{m}");
        // Two runs: M…L… then a lone point drawn as a dot.
        assert_eq!(m.matches("d=\"M").count(), 1, "{m}");
        assert_eq!(m.matches(" M").count(), 1, "{m}");
        assert!(m.contains("<circle"), "{m}");
        assert!(!m.contains("style="), "{m}");
    }
}
