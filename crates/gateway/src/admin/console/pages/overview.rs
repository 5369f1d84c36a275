//! The overview page (live figures, the hour's charts) and the backends page.

use maud::{Markup, html};

use super::latency::{HOP, PROCESSING, TTFT, latency_chart};
use super::{Frame, Section, csrf_field, env_label, layout, percent};
use crate::admin::console::chart::{Line, line_chart, range_text, span_text};
use crate::admin::console::data::{Acc, CacheFigures, ENVS, LiveFigures, RATE_WINDOW, Series};

pub(crate) fn overview(f: &Frame<'_>, live: Markup, charts: Markup) -> Markup {
    layout(
        f,
        "Overview",
        Section::Overview,
        None,
        html! {
            h1 { "Overview" }
            section #live data-refresh="/console/live" data-every="5000" { (live) }
            section #charts data-refresh="/console/charts" data-every="15000" { (charts) }
        },
    )
}

pub struct Fleet {
    pub up: usize,
    pub total: usize,
}

/// What the "Now" table says of its span: the real one, and why when it is not yet the
/// usual `RATE_WINDOW`.
fn live_caption(l: &LiveFigures) -> String {
    let usual = RATE_WINDOW.as_secs();
    if l.rate.iter().all(Option::is_none) {
        return format!(
            "Now — rates need two readings of the gateway's own counters: they appear at the next refresh, then settle on the last {usual} s"
        );
    }
    let over = l.over_seconds.round();
    if over + 1.0 < usual as f64 {
        format!(
            "Now — rates over the last {over:.0} s (the console has been reading the gateway's own counters for that long; then over the last {usual} s)"
        )
    } else {
        format!("Now — rates over the last {over:.0} s, from the gateway's own counters")
    }
}

pub fn live(l: &LiveFigures, fleet: &Fleet) -> Markup {
    let queued: i64 = l.queue.iter().map(|(_, d)| d).sum();
    html! {
        div.cards {
            div.card #backends-up {
                div.big { (fleet.up) " / " (fleet.total) }
                div.caption { "backends up" }
            }
            div.card #queue-depth {
                div.big { (queued) }
                div.caption { "queued requests" }
            }
        }
        table.figures #live-table {
            caption { (live_caption(l)) }
            thead { tr { th { "environment" } th.num { "requests/s" } th.num { "error rate" } th.num { "requests since start" } } }
            tbody {
                @for e in 0..4 {
                    @if e < 3 || l.requests_total[e] > 0 {
                        tr data-env=(ENVS[e]) {
                            td { span class=(format!("env {}", ENVS[e])) { (env_label(e)) } }
                            td.num { (l.rate[e].map_or_else(|| "…".to_owned(), |r| format!("{r:.1}"))) }
                            td.num { (percent(l.error_rate[e])) }
                            td.num { (l.requests_total[e]) }
                        }
                    }
                }
            }
        }
        @if l.queue.iter().any(|(_, d)| *d > 0) {
            p.small { "Queued by model: "
                @for (m, d) in &l.queue { @if *d > 0 { code { (m) } " " (d) "  " } } }
        }
    }
}

fn env_groups(s: &Series) -> Vec<(usize, String, &'static str)> {
    (0..4)
        .filter(|&e| e < 3 || s.totals[e].requests > 0)
        .map(|e| (e, env_label(e).to_owned(), ENVS[e]))
        .collect()
}

/// What the overview's table says of its window.
fn hour_caption(s: &Series, now: i64) -> String {
    if s.totals.iter().all(|a| a.requests == 0) {
        return "No request in the last hour, from the request log".into();
    }
    let w = &s.window;
    format!(
        "From the request log, {} ({}): every request of the last hour (the window starts at the first of them, 5 minutes back at least){}",
        range_text(w.from, w.to, now),
        span_text(w.to - w.from),
        if s.cut {
            format!(
                " (its latest {} requests)",
                crate::admin::console::data::ROW_LIMIT
            )
        } else {
            String::new()
        }
    )
}

/// The overview's window: a table over it and its charts, the window following the data
/// (`Window::fitted`) and said on each.
pub(crate) fn charts(s: &Series, now: i64) -> Markup {
    let groups = env_groups(s);
    let count_lines: Vec<Line> = groups
        .iter()
        .map(|(g, name, class)| Line {
            label: name.clone(),
            class,
            dashed: false,
            values: s.values(*g, |a| Some(s.per_minute(a.requests))),
        })
        .collect();
    let error_lines: Vec<Line> = groups
        .iter()
        .map(|(g, name, class)| Line {
            label: name.clone(),
            class,
            dashed: false,
            values: s.values(*g, Acc::error_rate),
        })
        .collect();
    let w = &s.window;
    html! {
        table.figures #hour-table {
            caption { (hour_caption(s, now)) }
            thead { tr {
                th { "environment" } th.num { "requests" } th.num { "error rate" }
                @for f in [TTFT, PROCESSING, HOP] {
                    th.num { (f.header("p50")) } th.num { (f.header("p99")) }
                }
            } }
            tbody {
                @for (g, name, class) in &groups {
                    @let a = &s.totals[*g];
                    tr data-env=(ENVS[*g]) {
                        td { span class=(format!("env {class}")) { (name) } }
                        td.num { (a.requests) }
                        td.num { (percent(a.error_rate())) }
                        @for f in [TTFT, PROCESSING, HOP] {
                            td.num { (f.cell(a, 50.0)) } td.num { (f.cell(a, 99.0)) }
                        }
                    }
                }
            }
        }
        p.small { "TTFT is what clients saw (first token out of the gateway), in milliseconds; processing is the gateway's own work on the request (before the backend and while relaying) and hop is the added time to first token measured from the kernel's receive stamp, both in microseconds. docs/metrics.md defines each." }
        div.grid {
            (line_chart("chart-requests", "Requests per minute", "req/min", w, now, &count_lines))
            (line_chart("chart-errors", "Error rate", "%", w, now, &error_lines))
            (latency_chart("chart-ttft", "Time to first token", s, now, &groups, TTFT))
            (latency_chart("chart-processing", "Gateway processing", s, now, &groups, PROCESSING))
            (latency_chart("chart-hop", "Added time to first token (hop)", s, now, &groups, HOP))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Keys

pub(crate) fn backends(
    f: &Frame<'_>,
    rows: &[serde_json::Value],
    cache: &Result<Vec<CacheFigures>, String>,
) -> Markup {
    let mut models: Vec<&str> = Vec::new();
    for r in rows {
        let m = r["model"].as_str().unwrap_or("");
        if !models.contains(&m) {
            models.push(m);
        }
    }
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "–".to_owned(),
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n
            .as_f64()
            .filter(|f| f.fract() != 0.0)
            .map_or_else(|| n.to_string(), |f| format!("{f:.2}")),
        other => other.to_string(),
    };
    layout(
        f,
        "Backends",
        Section::Backends,
        None,
        html! {
            h1 { "Backends" }
            @for m in &models {
                section.pool {
                    h2 { "Pool " code { (m) } }
                    (cache_line(m, cache))
                    table.list.backends {
                        thead { tr {
                            th { "name" } th { "backend" } th { "labels" } th { "state" } th.num { "in flight" } th.num { "capacity" } th.num { "weight" }
                            th.num { "remote load" } th.num { "KV cache" } th.num { "TTFT (EWMA, ms)" } th { "last error" }
                            @if f.session.is_admin() { th { "" } }
                        } }
                        tbody {
                            @for r in rows.iter().filter(|r| r["model"].as_str() == Some(m)) {
                                @let state = r["state"].as_str().unwrap_or("unknown");
                                @let base = r["backend"].as_str().unwrap_or("");
                                tr data-backend=(base) {
                                    // The name clients' error messages give (`model#N`) and
                                    // the labels a gray canary selects by, as
                                    // `GET /admin/backends` lists them.
                                    td.name { code { (r["name"].as_str().unwrap_or("")) } }
                                    td { code { (base) } }
                                    td.labels {
                                        @for l in r["labels"].as_array().into_iter().flatten().filter_map(|l| l.as_str()) {
                                            span.label { (l) } " "
                                        }
                                    }
                                    td { span class=(format!("state {state}")) { (state) } }
                                    td.num { (text(&r["in_flight"])) }
                                    td.num { (text(&r["capacity"])) }
                                    td.num { (text(&r["weight"])) }
                                    td.num { (text(&r["remote_load"])) }
                                    td.num { (text(&r["kv_cache_usage"])) }
                                    td.num { (text(&r["ewma_ttft_ms"])) }
                                    td { @if let Some(e) = r["last_error"].as_str() { span.error-text { (e) } " " span.small { (r["last_error_at"].as_str().unwrap_or("")) } } }
                                    @if f.session.is_admin() {
                                        td {
                                            @if state != "removed" {
                                                form.inline method="post" action=(if state == "draining" { "/console/backends/undrain" } else { "/console/backends/drain" }) {
                                                    (csrf_field(f.csrf))
                                                    input type="hidden" name="model" value=(m);
                                                    input type="hidden" name="backend" value=(base);
                                                    button type="submit" { @if state == "draining" { "Undrain" } @else { "Drain" } }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            @if models.is_empty() { p.empty { "No pool is configured." } }
        },
    )
}

/// A pool's prefix cache over the last hour: the engines' hit rate, the routing's belief and
/// its error, from the request log.
fn cache_line(model: &str, cache: &Result<Vec<CacheFigures>, String>) -> Markup {
    match cache {
        Err(e) => {
            html! { p.small.error-text { "Prefix cache: cannot read the request log: " (e) } }
        }
        Ok(all) => match all.iter().find(|c| c.model == model) {
            None => html! {
                p.small.cache { "Prefix cache: no answer in the last hour reported its cached prompt tokens (vLLM reports them with " code { "--enable-prompt-tokens-details" } ")." }
            },
            Some(c) => html! {
                table.figures.cache data-model=(model) {
                    caption { "Prefix cache, last hour, from the request log: " (c.answers) " answers whose engine reported its cached prompt tokens" }
                    thead { tr {
                        th.num { "prompt tokens" } th.num { "served from cache (engines)" }
                        th.num { "predicted by routing" } th.num { "prediction error" }
                    } }
                    tbody { tr {
                        td.num { (c.prompt) }
                        td.num.served { (percent(c.served_share())) }
                        td.num.predicted { (percent(c.predicted_share())) }
                        td.num.error { (percent(c.error_share())) }
                    } }
                }
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::console::data::{LogRow, Window};

    /// 2026-12-01T14:00:00Z
    const T: i64 = 1_796_133_600_000;

    fn row(at: i64, ttft_ms: f64, processing_ms: f64, hop_ms: f64) -> LogRow {
        LogRow {
            at,
            env: 2,
            status: 200,
            error: None,
            ttft_ms: Some(ttft_ms),
            processing_ms: Some(processing_ms),
            hop_ms: Some(hop_ms),
            prompt: 1,
            completion: 1,
        }
    }

    /// The text of the first element after `marker`.
    fn after<'a>(html: &'a str, marker: &str) -> &'a str {
        html.split(marker)
            .nth(1)
            .and_then(|s| s.split('>').nth(1))
            .and_then(|s| s.split('<').next())
            .unwrap_or_else(|| panic!("{marker} in {html}"))
    }

    /// The figure `id`'s markup.
    fn figure<'a>(html: &'a str, id: &str) -> &'a str {
        let start = html
            .find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("{id} in {html}"));
        let rest = &html[start..];
        &rest[..rest.find("</figure>").unwrap_or(rest.len())]
    }

    /// The largest y-axis label of a chart.
    fn y_top(chart: &str) -> f64 {
        chart
            .split("class=\"axis y\"")
            .skip(1)
            .filter_map(|s| s.split('>').nth(1)?.split('<').next()?.parse::<f64>().ok())
            .fold(0.0, f64::max)
    }

    #[test]
    fn tables_and_charts_give_each_figure_in_one_unit() {
        let rows: Vec<_> = (0..20)
            .map(|i| row(T + 60_000 * i, 150.0, 0.120, 0.048))
            .collect();
        let w = Window::fitted(Some(T), T + 20 * 60_000);
        let s = Series::new(&rows, false, w, 4, |r| r.env);
        let html = charts(&s, T).into_string();
        // TTFT in ms, processing and hop in µs: the header says so, the cell is a number.
        for header in ["TTFT p50 (ms)", "processing p50 (µs)", "hop p99 (µs)"] {
            assert!(html.contains(&format!(">{header}<")), "{header}: {html}");
        }
        let cells: Vec<&str> = html
            .split("data-env=\"prod\"")
            .nth(1)
            .unwrap_or_default()
            .split("class=\"num\">")
            .skip(1)
            .filter_map(|s| s.split('<').next())
            .collect();
        assert_eq!(
            cells,
            ["20", "0.0 %", "150", "150", "120", "120", "48.0", "48.0"]
        );
        // The charts read in the same units, on the same scale.
        for (id, unit, top) in [
            ("chart-ttft", "ms", 150.0),
            ("chart-processing", "µs", 120.0),
            ("chart-hop", "µs", 48.0),
        ] {
            let c = figure(&html, id);
            assert_eq!(after(c, "class=\"unit\""), format!("({unit})"), "{c}");
            let y = y_top(c);
            assert!(y >= top && y < top * 2.5, "{id}: axis up to {y} for {top}");
        }
    }

    #[test]
    fn the_overview_says_its_window() {
        let rows = [row(T + 2 * 60_000 + 5_000, 1.0, 0.1, 0.1)];
        let to = T + 37 * 60_000 + 5_000;
        let s = Series::new(&rows, false, Window::fitted(Some(rows[0].at), to), 4, |r| {
            r.env
        });
        let html = charts(&s, to).into_string();
        assert!(
            html.contains("From the request log, 14:02–14:37 UTC (35 min)"),
            "{html}"
        );
        assert!(
            html.contains("per minute, 14:02–14:37 UTC (35 min)"),
            "{html}"
        );
    }

    fn live_figures(over_seconds: f64) -> LiveFigures {
        LiveFigures {
            rate: [Some(1.0); 4],
            error_rate: [None; 4],
            over_seconds,
            requests_total: [1; 4],
            queue: Vec::new(),
        }
    }

    #[test]
    fn now_says_over_how_long() {
        let fleet = Fleet { up: 1, total: 1 };
        let usual = live(&live_figures(32.4), &fleet).into_string();
        assert!(usual.contains("rates over the last 32 s"), "{usual}");
        let young = live(&live_figures(7.0), &fleet).into_string();
        assert!(
            young.contains("rates over the last 7 s") && young.contains("then over the last 30 s"),
            "{young}"
        );
        let mut first = live_figures(0.0);
        first.rate = [None; 4];
        let first = live(&first, &fleet).into_string();
        assert!(first.contains("settle on the last 30 s"), "{first}");
    }

    #[test]
    fn each_pool_says_its_hit_rate_and_the_routings_belief() {
        let figures = CacheFigures {
            model: "qwen32b".into(),
            answers: 12,
            prompt: 1000,
            served: 700,
            predicted: 650,
            error: 80,
        };
        let html = cache_line("qwen32b", &Ok(vec![figures])).into_string();
        assert!(html.contains("12 answers"), "{html}");
        for (class, text) in [
            ("served", "70.0 %"),
            ("predicted", "65.0 %"),
            ("error", "8.0 %"),
        ] {
            assert!(
                html.contains(&format!("class=\"num {class}\">{text}<")),
                "{class}: {html}"
            );
        }
        let none = cache_line("other", &Ok(Vec::new())).into_string();
        assert!(none.contains("--enable-prompt-tokens-details"), "{none}");
        let failed = cache_line("qwen32b", &Err("the database is down".into())).into_string();
        assert!(failed.contains("the database is down"), "{failed}");
    }
}
