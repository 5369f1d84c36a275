//! Line charts drawn as SVG on the server: no script, no asset, colours from the stylesheet
//! (by class; the CSP forbids inline styles, and presentation attributes are not styles).

use std::fmt::Write;

use maud::{Markup, html};

/// One line: a label for the legend, a CSS class for its colour, dashed or not, and one value
/// per bucket (`None`: no data in that bucket, drawn as a gap).
pub struct Line {
    pub label: String,
    pub class: &'static str,
    pub dashed: bool,
    pub values: Vec<Option<f64>>,
}

const W: f64 = 560.0;
const H: f64 = 170.0;
const LEFT: f64 = 52.0;
const RIGHT: f64 = 8.0;
const TOP: f64 = 8.0;
const BOTTOM: f64 = 22.0;

/// A round upper bound for the y axis (1, 2 or 5 times a power of ten).
fn nice_ceiling(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if v <= m * p {
            return m * p;
        }
    }
    10.0 * p
}

fn label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// A chart of `lines` over buckets from `x_labels.0` (left) to `x_labels.2` (right).
pub fn line_chart(
    id: &str,
    title: &str,
    unit: &str,
    x_labels: [&str; 3],
    lines: &[Line],
) -> Markup {
    let max = lines
        .iter()
        .flat_map(|l| l.values.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b));
    let top = nice_ceiling(max);
    let n = lines.iter().map(|l| l.values.len()).max().unwrap_or(0);
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    let x = |i: usize| LEFT + plot_w * (i as f64 + 0.5) / n.max(1) as f64;
    let y = |v: f64| TOP + plot_h * (1.0 - (v / top).clamp(0.0, 1.0));
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
            svg viewBox=(format!("0 0 {W} {H}")) role="img" aria-label=(title) {
                @for k in 0..=4 {
                    @let v = top * f64::from(k) / 4.0;
                    line.grid x1=(LEFT) x2=(W - RIGHT) y1=(format!("{:.1}", y(v))) y2=(format!("{:.1}", y(v))) {}
                    text.axis x=(LEFT - 4.0) y=(format!("{:.1}", y(v) + 3.0)) text-anchor="end" { (label(v)) }
                }
                text.axis x=(LEFT) y=(H - 6.0) text-anchor="start" { (x_labels[0]) }
                text.axis x=(LEFT + plot_w / 2.0) y=(H - 6.0) text-anchor="middle" { (x_labels[1]) }
                text.axis x=(W - RIGHT) y=(H - 6.0) text-anchor="end" { (x_labels[2]) }
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

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(1.2), 2.0);
        assert_eq!(nice_ceiling(3.0), 5.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(120.0), 200.0);
    }

    #[test]
    fn gaps_break_the_line_and_labels_are_escaped() {
        let m = line_chart(
            "c",
            "TTFT <p50>",
            "ms",
            ["-1h", "-30m", "now"],
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
