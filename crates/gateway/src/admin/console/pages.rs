//! The console's HTML, as maud templates: every value is escaped by the template engine.

use maud::{DOCTYPE, Markup, html};

use super::chart::{Line, line_chart, range_text, span_text};
use super::data::{Acc, ENVS, LiveFigures, RATE_WINDOW, Series, pct};
use super::session::Session;
use crate::clock::format_wall_ms;
use crate::key::KeyRecord;
use crate::store::AuditEntry;

/// The sections of the navigation bar.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Overview,
    Keys,
    Backends,
    Audit,
}

/// What every page of a signed-in operator carries.
pub struct Frame<'a> {
    pub session: &'a Session,
    pub csrf: &'a str,
}

fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · fleetgate console" }
            link rel="icon" href="/console/assets/icon.svg" type="image/svg+xml";
            link rel="stylesheet" href="/console/assets/console.css";
            script src="/console/assets/console.js" defer {}
        }
    }
}

pub fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// A signed-in page.
pub fn layout(
    f: &Frame<'_>,
    title: &str,
    active: Section,
    notice: Option<&str>,
    body: Markup,
) -> Markup {
    let item = |s: Section, href: &str, label: &str| {
        html! { a href=(href) class=[(s == active).then_some("active")] { (label) } }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                header.top {
                    span.brand { "fleetgate" }
                    nav {
                        (item(Section::Overview, "/console/", "Overview"))
                        (item(Section::Keys, "/console/keys", "Keys"))
                        (item(Section::Backends, "/console/backends", "Backends"))
                        (item(Section::Audit, "/console/audit", "Audit"))
                    }
                    span.who {
                        span #who { (f.session.subject) }
                        " · "
                        span.role #role { (role_name(f.session)) }
                    }
                    form.logout method="post" action="/console/logout" {
                        (csrf_field(f.csrf))
                        button #sign-out type="submit" { "Sign out" }
                    }
                }
                div #banner .banner hidden {}
                main {
                    @if let Some(n) = notice {
                        p.notice #notice { (n) }
                    }
                    (body)
                }
            }
        }
    }
}

fn role_name(s: &Session) -> &'static str {
    if s.is_admin() { "admin" } else { "viewer" }
}

/// A page for someone not signed in (or a refusal), without navigation.
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                header.top { span.brand { "fleetgate" } }
                main.narrow { (body) }
            }
        }
    }
}

pub fn sign_in_help(problem: Option<&str>) -> Markup {
    bare(
        "Sign in",
        html! {
            h1 { "Sign in to the console" }
            @if let Some(p) = problem {
                p.error #error { (p) }
            }
            p { "The console is signed in to with a one-time link. On a machine with the gateway's configuration, run:" }
            pre { code { "fleetgate console-login --ttl 8h              # an admin session\nfleetgate console-login --ttl 8h --role viewer # a read-only session" } }
            p { "and open the link it prints (it works once, within 10 minutes). A gateway configured for RS256/ES256 tokens takes one of your admin API tokens once instead: open "
                code { "/console/login?token=<admin JWT>" } "." }
        },
    )
}

/// The page that sets the session and moves on (a redirect after a cross-site click would
/// leave a `SameSite=Strict` cookie behind; a same-origin refresh carries it).
pub fn signed_in(s: &Session) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta http-equiv="refresh" content="0;url=/console/";
                title { "Signed in · fleetgate console" }
                link rel="icon" href="/console/assets/icon.svg" type="image/svg+xml";
                link rel="stylesheet" href="/console/assets/console.css";
            }
            body {
                main.narrow {
                    p { "Signed in as " strong { (s.subject) } " (" (role_name(s)) "). "
                        a href="/console/" { "Continue to the console" } }
                }
            }
        }
    }
}

pub fn signed_out() -> Markup {
    bare(
        "Signed out",
        html! {
            h1 { "Signed out" }
            p #signed-out { "This session has ended; its cookie is refused from now on." }
        },
    )
}

/// A refusal or failure page inside the console.
pub fn problem(f: &Frame<'_>, active: Section, title: &str, message: &str) -> Markup {
    layout(
        f,
        title,
        active,
        None,
        html! {
            h1 { (title) }
            p.error #error { (message) }
        },
    )
}

/// The unit a latency figure is shown in, the same in its table and its chart.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Unit {
    Ms,
    Us,
}

impl Unit {
    pub fn label(self) -> &'static str {
        match self {
            Unit::Ms => "ms",
            Unit::Us => "µs",
        }
    }

    /// A value in milliseconds (as the console reads the log), in this unit.
    pub fn of_ms(self, v: f64) -> f64 {
        match self {
            Unit::Ms => v,
            Unit::Us => v * 1000.0,
        }
    }
}

/// A latency figure: its name, its unit and its samples. TTFT is a backend's time (tens to
/// thousands of milliseconds); processing and hop are the gateway's own (tens to hundreds of
/// microseconds): each is read in the unit its values are written in, in tables and charts.
#[derive(Clone, Copy)]
pub struct Latency {
    pub name: &'static str,
    pub unit: Unit,
    pub pick: fn(&Acc) -> &[f64],
}

fn ttft(a: &Acc) -> &[f64] {
    &a.ttft
}

fn processing(a: &Acc) -> &[f64] {
    &a.processing
}

fn hop(a: &Acc) -> &[f64] {
    &a.hop
}

pub const TTFT: Latency = Latency {
    name: "TTFT",
    unit: Unit::Ms,
    pick: ttft,
};
pub const PROCESSING: Latency = Latency {
    name: "processing",
    unit: Unit::Us,
    pick: processing,
};
pub const HOP: Latency = Latency {
    name: "hop",
    unit: Unit::Us,
    pick: hop,
};

impl Latency {
    /// Percentile `p` of `a`'s samples, in this figure's unit.
    fn pct(&self, a: &Acc, p: f64) -> Option<f64> {
        pct((self.pick)(a), p).map(|v| self.unit.of_ms(v))
    }

    /// Percentile `p` for a table cell: a number, the unit being in the column's header.
    fn cell(&self, a: &Acc, p: f64) -> String {
        number(self.pct(a, p))
    }

    /// `TTFT p50 (ms)`
    fn header(&self, p: &str) -> String {
        format!("{} {p} ({})", self.name, self.unit.label())
    }
}

/// A figure in its unit: three significant digits or the whole number.
fn number(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "–".into(), |v| format!("{v:.1} %"))
}

fn env_label(i: usize) -> &'static str {
    match i {
        3 => "no key",
        _ => ENVS[i],
    }
}

// ---------------------------------------------------------------------------------------------
// Overview

pub fn overview(f: &Frame<'_>, live: Markup, charts: Markup) -> Markup {
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

/// p50 (solid) and p99 (dashed) lines of `figure` per group that has samples, in its unit.
fn pair_lines(s: &Series, groups: &[(usize, String, &'static str)], figure: Latency) -> Vec<Line> {
    let mut out = Vec::new();
    for (g, name, class) in groups {
        if (figure.pick)(&s.totals[*g]).is_empty() {
            continue;
        }
        out.push(Line {
            label: format!("{name} p50"),
            class,
            dashed: false,
            values: s.values(*g, |a| figure.pct(a, 50.0)),
        });
        out.push(Line {
            label: format!("{name} p99"),
            class,
            dashed: true,
            values: s.values(*g, |a| figure.pct(a, 99.0)),
        });
    }
    out
}

/// A chart of `figure`'s p50 and p99 over the window.
fn latency_chart(
    id: &str,
    title: &str,
    s: &Series,
    now: i64,
    groups: &[(usize, String, &'static str)],
    figure: Latency,
) -> Markup {
    line_chart(
        id,
        &format!("{title}, p50 and p99 (dashed)"),
        figure.unit.label(),
        &s.window,
        now,
        &pair_lines(s, groups, figure),
    )
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
            format!(" (its latest {} requests)", super::data::ROW_LIMIT)
        } else {
            String::new()
        }
    )
}

/// The overview's window: a table over it and its charts, the window following the data
/// (`Window::fitted`) and said on each.
pub fn charts(s: &Series, now: i64) -> Markup {
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

/// The issue form's values (kept when the form comes back with an error).
/// A key's endpoint families as the console shows them.
fn families(f: Option<fleetgate_protocol::endpoint::Families>) -> String {
    f.map_or_else(|| "all".to_owned(), |f| f.names().join(", "))
}

#[derive(Default)]
pub struct IssueForm {
    pub environment: String,
    pub name: String,
    pub models: String,
    pub endpoints: String,
    pub rpm: String,
    pub tpm: String,
    pub streams: String,
    pub expires: String,
    pub metadata: String,
}

pub struct KeyFilter {
    pub env: String,
    pub status: String,
    pub q: String,
}

fn status_class(s: &str) -> &'static str {
    match s {
        "active" => "status active",
        "revoked" => "status revoked",
        _ => "status expired",
    }
}

fn limit(v: Option<i64>) -> String {
    v.map_or_else(|| "–".into(), |v| v.to_string())
}

fn select(name: &str, id: &str, options: &[(&str, &str)], chosen: &str) -> Markup {
    html! {
        select name=(name) id=(id) {
            @for (value, label) in options {
                option value=(value) selected[*value == chosen] { (label) }
            }
        }
    }
}

pub fn keys(
    f: &Frame<'_>,
    keys: &[KeyRecord],
    filter: &KeyFilter,
    form: &IssueForm,
    error: Option<&str>,
    now: i64,
) -> Markup {
    let envs = [
        ("", "all"),
        ("stress", "stress"),
        ("gray", "gray"),
        ("prod", "prod"),
    ];
    layout(
        f,
        "Keys",
        Section::Keys,
        None,
        html! {
            h1 { "Keys" }
            form.filters #key-filter method="get" action="/console/keys" {
                label { "Environment " (select("env", "filter-env", &envs, &filter.env)) }
                label { "Status " (select("status", "filter-status", &[("", "all"), ("active", "active"), ("revoked", "revoked"), ("expired", "expired")], &filter.status)) }
                label { "Search " input #filter-q type="search" name="q" value=(filter.q) placeholder="name or id"; }
                button type="submit" { "Filter" }
            }
            table.list #keys {
                thead { tr { th { "name" } th { "id" } th { "environment" } th { "status" } th { "models" } th { "endpoints" } th.num { "req/min" } th.num { "tokens/min" } th.num { "streams" } th { "created" } th { "expires" } } }
                tbody {
                    @for k in keys {
                        @let status = k.status(now);
                        tr data-key=(k.public_id) {
                            td.name { a href=(format!("/console/keys/{}", k.public_id)) { (k.name) } }
                            td { code { (k.public_id) } }
                            td { span class=(format!("env {}", k.environment.as_str())) { (k.environment.as_str()) } }
                            td { span class=(status_class(status)) { (status) } }
                            td { (k.allowed_models.as_ref().map_or_else(|| "all".to_owned(), |m| m.join(", "))) }
                            td { (families(k.allowed_endpoints)) }
                            td.num { (limit(k.requests_per_minute)) }
                            td.num { (limit(k.tokens_per_minute)) }
                            td.num { (limit(k.max_concurrent_streams)) }
                            td { (format_wall_ms(k.created_at)) }
                            td { (k.expires_at.map_or_else(|| "never".to_owned(), format_wall_ms)) }
                        }
                    }
                    @if keys.is_empty() {
                        tr { td colspan="10" .empty { "No key matches." } }
                    }
                }
            }
            @if f.session.is_admin() {
                (issue_form(f, form, error))
            }
        },
    )
}

fn issue_form(f: &Frame<'_>, v: &IssueForm, error: Option<&str>) -> Markup {
    let envs = [("prod", "prod"), ("gray", "gray"), ("stress", "stress")];
    html! {
        section #issue {
            h2 { "Issue a key" }
            @if let Some(e) = error {
                p.error #error { (e) }
            }
            form.stack #issue-form method="post" action="/console/keys" {
                (csrf_field(f.csrf))
                label { "Environment " (select("environment", "issue-environment", &envs, if v.environment.is_empty() { "prod" } else { &v.environment })) }
                label { "Name " input #issue-name name="name" required value=(v.name) placeholder="e.g. team-search-prod"; }
                label { "Models " input #issue-models name="models" value=(v.models) placeholder="all, or a comma-separated list"; }
                label { "Endpoints " input #issue-endpoints name="endpoints" value=(v.endpoints) placeholder="all, or e.g. chat, embeddings, rerank"; }
                label { "Requests per minute " input #issue-rpm name="requests_per_minute" inputmode="numeric" value=(v.rpm) placeholder="the environment's default"; }
                label { "Tokens per minute " input #issue-tpm name="tokens_per_minute" inputmode="numeric" value=(v.tpm) placeholder="the environment's default"; }
                label { "Concurrent streams " input #issue-streams name="max_concurrent_streams" inputmode="numeric" value=(v.streams) placeholder="the environment's default"; }
                label { "Expires in " input #issue-expires name="expires_in" value=(v.expires) placeholder="never, or e.g. 30d, 12h"; }
                label { "Metadata (JSON object) " textarea #issue-metadata name="metadata" rows="2" placeholder="{\"owner\": \"search team\"}" { (v.metadata) } }
                button #issue-submit type="submit" { "Issue key" }
            }
        }
    }
}

/// The one page that shows a full key.
pub fn key_shown(
    f: &Frame<'_>,
    title: &str,
    record: &KeyRecord,
    full: &str,
    base_url: &str,
    note: &str,
) -> Markup {
    let export = format!("export OPENAI_API_KEY={full} OPENAI_BASE_URL={base_url}");
    layout(
        f,
        title,
        Section::Keys,
        None,
        html! {
            h1 { (title) }
            p.warning { "This is the only time the full key is shown. " (note) }
            div.secret {
                code #new-key { (full) }
                button.copy type="button" data-copy="new-key" { "Copy key" }
            }
            p { "For a client using the OpenAI SDK:" }
            div.secret {
                code #export-line { (export) }
                button.copy type="button" data-copy="export-line" { "Copy" }
            }
            p { a #key-page href=(format!("/console/keys/{}", record.public_id)) { "Key " (record.public_id) " (" (record.name) ")" } }
        },
    )
}

/// The windows a key's page offers: `latest` (its latest traffic, the default) or a span up
/// to now.
pub const KEY_WINDOWS: [(&str, &str); 4] = [
    ("latest", "its latest traffic"),
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("7d", "last 7 days"),
];

pub struct KeyUsage<'a> {
    /// One of `KEY_WINDOWS`.
    pub since: &'a str,
    pub series: &'a Series,
    /// The key's last request in the log, whenever it was.
    pub last: Option<i64>,
    /// The window ends at `last`, not now (`latest`, when that was a while ago).
    pub ends_at_last: bool,
    pub now: i64,
}

/// What a key's page shows beside the key itself.
pub struct KeyPage<'a> {
    pub usage: Option<KeyUsage<'a>>,
    pub usage_error: Option<&'a str>,
    /// The key's audit trail, or why it could not be read.
    pub audit: Result<&'a [AuditEntry], &'a str>,
    pub notice: Option<&'a str>,
    pub error: Option<&'a str>,
    pub now: i64,
}

pub fn key_page(f: &Frame<'_>, k: &KeyRecord, p: KeyPage<'_>) -> Markup {
    let KeyPage {
        usage,
        usage_error,
        audit,
        notice,
        error,
        now,
    } = p;
    let status = k.status(now);
    let metadata = serde_json::to_string_pretty(&k.metadata).unwrap_or_default();
    layout(
        f,
        &format!("Key {}", k.name),
        Section::Keys,
        notice,
        html! {
            h1 { "Key " span #key-name { (k.name) } }
            @if let Some(e) = error { p.error #error { (e) } }
            table.details #key-details {
                tr { th { "id" } td { code { (k.public_id) } } }
                tr { th { "environment" } td { span class=(format!("env {}", k.environment.as_str())) { (k.environment.as_str()) } } }
                tr { th { "status" } td { span #key-status class=(status_class(status)) { (status) } } }
                tr { th { "created" } td { (format_wall_ms(k.created_at)) " by " (k.created_by) } }
                tr { th { "expires" } td { (k.expires_at.map_or_else(|| "never".to_owned(), format_wall_ms)) } }
                @if let Some(at) = k.revoked_at {
                    tr { th { "revoked" } td { (format_wall_ms(at)) " by " (k.revoked_by.as_deref().unwrap_or("?")) ": " (k.revoke_reason.as_deref().unwrap_or("")) } }
                }
                @if let Some((_, until)) = k.previous {
                    tr { th { "previous secret" } td { "accepted until " (format_wall_ms(until)) } }
                }
                tr { th { "models" } td { (k.allowed_models.as_ref().map_or_else(|| "all".to_owned(), |m| m.join(", "))) } }
                tr { th { "endpoints" } td #key-endpoints { (families(k.allowed_endpoints)) } }
                tr { th { "limits" } td { (limit(k.requests_per_minute)) " req/min · " (limit(k.tokens_per_minute)) " tokens/min · " (limit(k.max_concurrent_streams)) " streams" } }
                tr { th { "metadata" } td { pre #key-metadata { (metadata) } } }
            }
            @if f.session.is_admin() && status != "revoked" {
                div.actions {
                    form.stack #revoke-form method="post" action=(format!("/console/keys/{}/revoke", k.public_id)) {
                        h2 { "Revoke" }
                        (csrf_field(f.csrf))
                        label { "Reason " input #revoke-reason name="reason" required placeholder="e.g. leaked in a log"; }
                        label.check { input #revoke-confirm type="checkbox" name="confirm" value="yes" required; " Clients using this key get 401 key_revoked at once" }
                        button.danger #revoke type="submit" { "Revoke key" }
                    }
                    form.stack #rotate-form method="post" action=(format!("/console/keys/{}/rotate", k.public_id)) {
                        h2 { "Rotate" }
                        (csrf_field(f.csrf))
                        label { "Old secret keeps working for " input #rotate-grace name="grace" value="10m"; }
                        button #rotate type="submit" { "Rotate secret" }
                    }
                }
            }
            h2 { "Usage" }
            form.filters #usage-window method="get" action=(format!("/console/keys/{}", k.public_id)) {
                label { "Window " (select("since", "usage-since", &KEY_WINDOWS, usage.as_ref().map_or("latest", |u| u.since))) }
                button type="submit" { "Show" }
            }
            @if let Some(e) = usage_error { p.error { (e) } }
            @if let Some(u) = usage { (key_usage(&u, &k.public_id, k.environment.as_str())) }
            h2 { "Audit trail" }
            @match audit {
                Ok(entries) => (audit_table(entries, false)),
                Err(e) => p.error { (e) },
            }
        },
    )
}

/// `3 h ago`
fn ago(ms: i64) -> String {
    if ms < 60_000 {
        "just now".into()
    } else {
        format!("{} ago", span_text(ms))
    }
}

/// Which window a key's page shows, and why.
fn key_window_note(u: &KeyUsage<'_>, id: &str) -> Markup {
    let w = &u.series.window;
    let requests = u.series.totals[0].requests;
    let last = u
        .last
        .map(|l| format!("{} ({})", format_wall_ms(l), ago(u.now.saturating_sub(l))));
    let span = KEY_WINDOWS
        .iter()
        .find(|(v, _)| *v == u.since)
        .map_or("window", |(_, label)| label);
    html! {
        p.small #usage-note {
            @match (u.since, last) {
                (_, None) => { "No request with this key is in the request log." }
                ("latest", Some(last)) if u.ends_at_last => {
                    "Its latest traffic: the window ends at its last request, " (last)
                    ", and starts at its first request of the 24 hours before that."
                }
                ("latest", Some(_)) => {
                    "Its latest traffic, up to now: from its first request of the last 24 hours."
                }
                (_, Some(last)) if requests == 0 => {
                    "No request in the " (span) "; its last request was at " (last) ". "
                    a href=(format!("/console/keys/{id}?since=latest")) { "Show its latest traffic" }
                }
                (_, Some(_)) => { "From its first request of the " (span) " up to now." }
            }
            " " (range_text(w.from, w.to, u.now)) " (" (span_text(w.to - w.from)) ")."
        }
    }
}

fn key_usage(u: &KeyUsage<'_>, id: &str, class: &'static str) -> Markup {
    let s = u.series;
    let t = &s.totals[0];
    let groups = [(0usize, "this key".to_owned(), class)];
    let requests = [
        Line {
            label: "requests".into(),
            class,
            dashed: false,
            values: s.values(0, |a| Some(a.requests as f64)),
        },
        Line {
            label: "errors".into(),
            class: "error",
            dashed: false,
            values: s.values(0, |a| Some(a.errors as f64)),
        },
    ];
    let per = super::chart::per_text(s.window.bucket_ms);
    html! {
        (key_window_note(u, id))
        div.cards #key-usage {
            div.card { div.big #usage-requests { (t.requests) } div.caption { "requests" } }
            div.card { div.big #usage-errors { (t.errors) } div.caption { "errors" } }
            div.card { div.big { (t.prompt) } div.caption { "prompt tokens" } }
            div.card { div.big { (t.completion) } div.caption { "completion tokens" } }
        }
        @if s.cut { p.small { "Summarised from the latest " (super::data::ROW_LIMIT) " requests of the window." } }
        table.figures #key-percentiles {
            thead { tr { th { "" } th { "unit" } th.num { "p50" } th.num { "p95" } th.num { "p99" } } }
            tbody {
                @for (name, f) in [("client TTFT", TTFT), ("gateway processing", PROCESSING), ("hop (added TTFT)", HOP)] {
                    tr data-figure=(f.name) {
                        td { (name) } td.unit { (f.unit.label()) }
                        td.num { (f.cell(t, 50.0)) } td.num { (f.cell(t, 95.0)) } td.num { (f.cell(t, 99.0)) }
                    }
                }
            }
        }
        @if !t.causes.is_empty() {
            table.list #key-errors {
                thead { tr { th { "errors by cause" } th.num { "count" } } }
                tbody { @for (c, n) in &t.causes { tr { td { code { (c) } } td.num { (n) } } } }
            }
        }
        div.grid {
            (line_chart("key-chart-requests", "Requests and errors", &format!("requests {per}"), &s.window, u.now, &requests))
            (latency_chart("key-chart-ttft", "Time to first token", s, u.now, &groups, TTFT))
            (latency_chart("key-chart-processing", "Gateway processing", s, u.now, &groups, PROCESSING))
            (latency_chart("key-chart-hop", "Added time to first token (hop)", s, u.now, &groups, HOP))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Audit

pub struct AuditFilter {
    pub key: String,
    pub actor: String,
    pub action: String,
    pub limit: i64,
}

pub fn audit_table(entries: &[AuditEntry], with_key: bool) -> Markup {
    html! {
        table.list.audit {
            thead { tr { th { "when" } th { "who" } th { "action" } @if with_key { th { "key" } } th { "detail" } } }
            tbody {
                @for e in entries {
                    tr data-action=(e.action) {
                        td { (format_wall_ms(e.at)) }
                        td { (e.actor) }
                        td { span.action { (e.action) } }
                        @if with_key {
                            td { @if let Some(k) = &e.key_public_id { a href=(format!("/console/keys/{k}")) { code { (k) } } } }
                        }
                        td { code.detail { (e.detail_for_people().to_string()) } }
                    }
                }
                @if entries.is_empty() {
                    tr { td colspan="5" .empty { "Nothing recorded." } }
                }
            }
        }
    }
}

pub fn audit(f: &Frame<'_>, entries: &[AuditEntry], filter: &AuditFilter) -> Markup {
    layout(
        f,
        "Audit",
        Section::Audit,
        None,
        html! {
            h1 { "Audit" }
            form.filters #audit-filter method="get" action="/console/audit" {
                label { "Key " input name="key" value=(filter.key) placeholder="key id"; }
                label { "Who " input name="actor" value=(filter.actor); }
                label { "Action " input name="action" value=(filter.action) placeholder="create, revoke, rotate, drain, …"; }
                label { "Show " input name="limit" value=(filter.limit) size="5"; }
                button type="submit" { "Filter" }
            }
            div #audit { (audit_table(entries, true)) }
        },
    )
}

// ---------------------------------------------------------------------------------------------
// Backends

pub fn backends(f: &Frame<'_>, rows: &[serde_json::Value]) -> Markup {
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
                    table.list.backends {
                        thead { tr {
                            th { "backend" } th { "state" } th.num { "in flight" } th.num { "capacity" } th.num { "weight" }
                            th.num { "remote load" } th.num { "KV cache" } th.num { "TTFT (EWMA, ms)" } th { "last error" }
                            @if f.session.is_admin() { th { "" } }
                        } }
                        tbody {
                            @for r in rows.iter().filter(|r| r["model"].as_str() == Some(m)) {
                                @let state = r["state"].as_str().unwrap_or("unknown");
                                @let base = r["backend"].as_str().unwrap_or("");
                                tr data-backend=(base) {
                                    td { code { (base) } }
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

#[cfg(test)]
mod tests {
    use super::super::data::{LogRow, Window};
    use super::*;

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
}
