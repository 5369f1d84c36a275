//! The Requests page: the last day's requests from the request log, newest first, or the one a
//! request id or a W3C trace id names, so that a client's error report (`x-request-id`) or a
//! trace in the operators' tracing backend leads to the gateway's record of it.

use maud::{Markup, html};

use super::{Frame, Section, layout};
use crate::admin::console::data::{REQUESTS_SHOWN, RequestRow};
use crate::clock::format_wall_ms;

/// The page; `find` is what was searched for (empty: the latest requests).
pub(crate) fn requests(f: &Frame<'_>, rows: &[RequestRow], find: &str) -> Markup {
    let dash = |v: Option<&str>| v.unwrap_or("–").to_owned();
    layout(
        f,
        "Requests",
        Section::Requests,
        None,
        html! {
            h1 { "Requests" }
            form.filters #request-search method="get" action="/console/requests" {
                label { "Request id or trace id " input name="q" value=(find) size="40" placeholder="x-request-id, or the 32 hex digits of a traceparent's trace"; }
                button type="submit" { "Find" }
            }
            @if rows.is_empty() {
                p #no-requests {
                    @if find.is_empty() { "No request in the last 24 hours." }
                    @else { "No request of the last 24 hours has the request id or trace id " code { (find) } "." }
                }
            } @else {
                p.caption {
                    @if find.is_empty() { "The latest " (rows.len()) " requests (at most " (REQUESTS_SHOWN) ") of the last 24 hours, newest first." }
                    @else { (rows.len()) " request(s) with the request id or trace id " code { (find) } "." }
                }
                table #requests {
                    thead { tr {
                        th { "time" } th { "request id" } th { "endpoint" } th { "key" } th { "model" }
                        th { "backend" } th { "status" } th.num { "TTFT (ms)" } th.num { "hop (µs)" } th { "trace id" }
                    } }
                    tbody {
                        @for r in rows {
                            tr {
                                td { (format_wall_ms(r.at)) }
                                td.request-id { (r.request_id) }
                                td { (dash(r.endpoint.as_deref())) }
                                td { @if let Some(k) = &r.key_id { a href={"/console/keys/" (k)} { (k) } } @else { "–" } }
                                td { (dash(r.model.as_deref())) }
                                td { (dash(r.backend.as_deref())) }
                                td { (r.status) @if let Some(e) = &r.error { " " span.error { (e) } } }
                                td.num { @if let Some(t) = r.ttft_ms { (format!("{t:.1}")) } @else { "–" } }
                                td.num { @if let Some(h) = r.hop_us { (h) } @else { "–" } }
                                td.trace-id {
                                    @if let Some(t) = &r.trace_id { a href={"/console/requests?q=" (t)} { (t) } } @else { "–" }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}
