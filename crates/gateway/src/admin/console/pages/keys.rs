//! The keys pages: the list and its filters, the issue form, a new key shown once, one key's
//! page with its usage, and the audit trail.

use maud::{Markup, html};

use super::latency::{HOP, PROCESSING, TTFT, latency_chart};
use super::{Frame, Section, csrf_field, layout};
use crate::admin::console::chart::{Line, line_chart, range_text, span_text};
use crate::admin::console::data::Series;
use crate::clock::format_wall_ms;
use crate::key::KeyRecord;
use crate::store::AuditEntry;

/// The issue form's values (kept when the form comes back with an error).
/// A key's endpoint families as the console shows them.
fn families(f: Option<fleetgate_protocol::endpoint::Families>) -> String {
    f.map_or_else(|| "all".to_owned(), |f| f.names().join(", "))
}

#[derive(Default)]
pub(crate) struct IssueForm {
    pub(crate) environment: String,
    pub(crate) name: String,
    pub(crate) models: String,
    pub(crate) endpoints: String,
    pub(crate) rpm: String,
    pub(crate) tpm: String,
    pub(crate) streams: String,
    pub(crate) expires: String,
    pub(crate) metadata: String,
}

pub(crate) struct KeyFilter {
    pub(crate) env: String,
    pub(crate) status: String,
    pub(crate) q: String,
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

pub(crate) fn keys(
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
pub(crate) fn key_shown(
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
pub(crate) const KEY_WINDOWS: [(&str, &str); 4] = [
    ("latest", "its latest traffic"),
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("7d", "last 7 days"),
];

pub(crate) struct KeyUsage<'a> {
    /// One of `KEY_WINDOWS`.
    pub(crate) since: &'a str,
    pub(crate) series: &'a Series,
    /// The key's last request in the log, whenever it was.
    pub(crate) last: Option<i64>,
    /// The window ends at `last`, not now (`latest`, when that was a while ago).
    pub(crate) ends_at_last: bool,
    pub(crate) now: i64,
}

/// What a key's page shows beside the key itself.
pub(crate) struct KeyPage<'a> {
    pub(crate) usage: Option<KeyUsage<'a>>,
    pub(crate) usage_error: Option<&'a str>,
    /// The key's audit trail, or why it could not be read.
    pub(crate) audit: Result<&'a [AuditEntry], &'a str>,
    pub(crate) notice: Option<&'a str>,
    pub(crate) error: Option<&'a str>,
    pub(crate) now: i64,
}

pub(crate) fn key_page(f: &Frame<'_>, k: &KeyRecord, p: KeyPage<'_>) -> Markup {
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
    let per = crate::admin::console::chart::per_text(s.window.bucket_ms);
    html! {
        (key_window_note(u, id))
        div.cards #key-usage {
            div.card { div.big #usage-requests { (t.requests) } div.caption { "requests" } }
            div.card { div.big #usage-errors { (t.errors) } div.caption { "errors" } }
            div.card { div.big { (t.prompt) } div.caption { "prompt tokens" } }
            div.card { div.big { (t.completion) } div.caption { "completion tokens" } }
        }
        @if s.cut { p.small { "Summarised from the latest " (crate::admin::console::data::ROW_LIMIT) " requests of the window." } }
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

pub(crate) struct AuditFilter {
    pub(crate) key: String,
    pub(crate) actor: String,
    pub(crate) action: String,
    pub(crate) limit: i64,
}

pub(crate) fn audit_table(entries: &[AuditEntry], with_key: bool) -> Markup {
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

pub(crate) fn audit(f: &Frame<'_>, entries: &[AuditEntry], filter: &AuditFilter) -> Markup {
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
