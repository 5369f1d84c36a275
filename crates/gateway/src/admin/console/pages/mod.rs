//! The console's HTML, as maud templates: every value is escaped by the template engine.

use maud::{DOCTYPE, Markup, html};

use super::data::ENVS;
use super::session::Session;

pub(crate) mod keys;
pub(crate) mod latency;
pub mod overview;
pub mod requests;

/// The sections of the navigation bar.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    Overview,
    Keys,
    Backends,
    Requests,
    Audit,
}

/// What every page of a signed-in operator carries.
pub(crate) struct Frame<'a> {
    pub(crate) session: &'a Session,
    pub(crate) csrf: &'a str,
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

pub(crate) fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// A signed-in page.
pub(crate) fn layout(
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
                        (item(Section::Requests, "/console/requests", "Requests"))
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
pub(crate) fn bare(title: &str, body: Markup) -> Markup {
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

pub(crate) fn sign_in_help(problem: Option<&str>) -> Markup {
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
pub(crate) fn signed_in(s: &Session) -> Markup {
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

pub(crate) fn signed_out() -> Markup {
    bare(
        "Signed out",
        html! {
            h1 { "Signed out" }
            p #signed-out { "This session has ended; its cookie is refused from now on." }
        },
    )
}

/// A refusal or failure page inside the console.
pub(crate) fn problem(f: &Frame<'_>, active: Section, title: &str, message: &str) -> Markup {
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
