//! The operators' console: web pages on the admin listener (`/console/`), part of the binary.
//!
//! Server-rendered HTML (maud templates, every value escaped), one small script and one
//! stylesheet embedded in the binary, charts drawn as SVG on the server. It reads the same
//! state as the admin API: keys through the key store (and applies changes to the
//! authenticator exactly as `/admin/keys` does), backends from the fleet, percentiles from the
//! request log, live rates from the in-process metrics.
//!
//! Access: a one-time sign-in link or admin token, then a session cookie (`session.rs`);
//! viewers see everything and change nothing (no buttons, and every POST that changes something checks the role);
//! every POST carries the session's CSRF token and, when the browser sends one, an `Origin`
//! of this host; pages are served with a Content-Security-Policy that allows nothing from
//! elsewhere and no inline script or style.

pub(crate) mod chart;
pub mod data;
pub mod pages;
mod post;
pub mod session;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use maud::Markup;

use crate::admin::AdminState;
use crate::admin::middleware::Body;
use crate::key::Environment;
use crate::proxy::relay::GatewayBody;
use crate::store::StoreError;
use pages::{Frame, Section};
use session::Sessions;

static CSP: HeaderValue = HeaderValue::from_static(
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
);
static HTML: HeaderValue = HeaderValue::from_static("text/html; charset=utf-8");

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");
const ICON: &str = include_str!("assets/icon.svg");

/// Where clients reach the API listener, for the `export OPENAI_BASE_URL=…` line.
#[derive(Debug, Clone)]
pub(crate) struct ApiAddress {
    pub(crate) scheme: &'static str,
    /// `None`: the API listens on every address; the admin request's host name is used.
    pub(crate) host: Option<String>,
    pub(crate) port: u16,
}

/// The console's own state (inside the admin listener's).
#[derive(Debug)]
pub(crate) struct Console {
    pub(crate) sessions: Sessions,
    live: data::Live,
    api: ApiAddress,
}

impl Console {
    pub(crate) fn new(admin: &crate::config::AdminConfig, api: ApiAddress) -> Self {
        Self {
            sessions: Sessions::new(admin),
            live: data::Live::default(),
            api,
        }
    }

    fn base_url(&self, req_host: Option<&str>) -> String {
        let host = match &self.api.host {
            Some(h) => h.clone(),
            None => req_host
                .map(|h| match h.rsplit_once(':') {
                    Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => {
                        name.to_owned()
                    }
                    _ => h.to_owned(),
                })
                .unwrap_or_else(|| "127.0.0.1".into()),
        };
        format!("{}://{}:{}/v1", self.api.scheme, host, self.api.port)
    }
}

/// An HTML page. The admin listener's layers add the other security headers and
/// `Cache-Control: no-store` (`admin::middleware`).
fn page(status: StatusCode, m: Markup) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(m.into_string()));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HTML.clone());
    h.insert(header::CONTENT_SECURITY_POLICY, CSP.clone());
    r
}

fn redirect(to: &str) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(Bytes::new()));
    *r.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(to) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(Bytes::from_static(body.as_bytes())));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Query or form pairs, percent-decoded (the last of a repeated name wins).
fn pairs(s: Option<&[u8]>) -> BTreeMap<String, String> {
    form_urlencoded::parse(s.unwrap_or_default())
        .map(|(k, v)| (k.into_owned(), v.trim().to_owned()))
        .collect()
}

fn query(req: &Request<Body>) -> BTreeMap<String, String> {
    pairs(req.uri().query().map(str::as_bytes))
}

/// The form's pairs; `Err(true)` when the body is over the listener's limit.
async fn read_form(body: Body) -> Result<BTreeMap<String, String>, bool> {
    let bytes = body
        .collect()
        .await
        .map_err(|e| e.is::<http_body_util::LengthLimitError>())?
        .to_bytes();
    Ok(pairs(Some(&bytes)))
}

/// Served over TLS: by this listener, or by a TLS-terminating proxy in front that says so.
fn is_secure(state: &AdminState, req: &Request<Body>) -> bool {
    state.tls
        || req
            .headers()
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

fn host(req: &Request<Body>) -> Option<&str> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(http::uri::Authority::as_str))
}

/// A browser's `Origin` on a POST must be this host, as the request names it (`Host`) or as a
/// reverse proxy in front says the browser did (`X-Forwarded-Host`). Absent: older clients;
/// the CSRF token still has to match.
fn same_origin(req: &Request<Body>) -> bool {
    let Some(origin) = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return true;
    };
    let Some((_, origin_host)) = origin.split_once("://") else {
        return false;
    };
    let forwarded = req
        .headers()
        .get("x-forwarded-host")
        .and_then(|v| v.to_str().ok());
    host(req).is_some_and(|h| h.eq_ignore_ascii_case(origin_host))
        || forwarded.is_some_and(|h| h.trim().eq_ignore_ascii_case(origin_host))
}

/// Serve one request under `/console` (or `/`, which leads there).
pub(crate) async fn handle(state: &AdminState, req: Request<Body>) -> Response<GatewayBody> {
    let path = req.uri().path().to_owned();
    let console = &state.console;
    match (req.method(), path.as_str()) {
        (&Method::GET, "/" | "/console") => return redirect("/console/"),
        (&Method::GET, "/console/assets/console.css") => {
            return asset("text/css; charset=utf-8", CSS);
        }
        (&Method::GET, "/console/assets/console.js") => {
            return asset("text/javascript; charset=utf-8", JS);
        }
        (&Method::GET, "/console/assets/icon.svg") => return asset("image/svg+xml", ICON),
        (&Method::GET, "/console/login") => return sign_in(state, &req).await,
        _ => {}
    }
    let session = session::cookie_value(req.headers()).and_then(|c| console.sessions.session(c));
    let Some(session) = session else {
        return match *req.method() {
            Method::GET if path == "/console/live" || path == "/console/charts" => page(
                StatusCode::UNAUTHORIZED,
                maud::html! { p.error { "Your console session has ended: sign in again." } },
            ),
            _ => page(
                StatusCode::UNAUTHORIZED,
                pages::sign_in_help(Some(
                    "You are not signed in, or your session has ended or was signed out.",
                )),
            ),
        };
    };
    let csrf = console.sessions.csrf_token(&session);
    let frame = Frame {
        session: &session,
        csrf: &csrf,
    };
    if req.method() == Method::POST {
        return post::handle(state, &frame, req, &path).await;
    }
    if req.method() != Method::GET {
        return page(
            StatusCode::METHOD_NOT_ALLOWED,
            pages::problem(
                &frame,
                Section::Overview,
                "Not allowed",
                "The console answers GET and POST only.",
            ),
        );
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segments.as_slice() {
        ["console"] => overview(state, &frame).await,
        ["console", "live"] => page(StatusCode::OK, live(state)),
        ["console", "charts"] => page(StatusCode::OK, charts(state).await),
        ["console", "keys"] => {
            keys_page(
                state,
                &frame,
                &query(&req),
                pages::keys::IssueForm::default(),
                None,
            )
            .await
        }
        ["console", "keys", id] => {
            key_page(state, &frame, id, &query(&req), None, StatusCode::OK).await
        }
        ["console", "backends"] => {
            let hour_ago = crate::clock::wall_ms() - 3_600_000;
            let cache = data::cache_by_pool(state.auth.store(), hour_ago)
                .await
                .map_err(|e| store_message(&e));
            page(
                StatusCode::OK,
                pages::overview::backends(&frame, &state.fleet.current().backends_json(), &cache),
            )
        }
        ["console", "audit"] => audit_page(state, &frame, &query(&req)).await,
        ["console", "requests"] => requests_page(state, &frame, &query(&req)).await,
        _ => page(
            StatusCode::NOT_FOUND,
            pages::problem(
                &frame,
                Section::Overview,
                "Not found",
                "There is no console page here.",
            ),
        ),
    }
}

async fn sign_in(state: &AdminState, req: &Request<Body>) -> Response<GatewayBody> {
    let q = query(req);
    let Some(token) = q.get("token").filter(|t| !t.is_empty()) else {
        return page(StatusCode::OK, pages::sign_in_help(None));
    };
    match state.console.sessions.sign_in(token, &state.verifier) {
        Ok((s, cookie, via)) => {
            let max_age = s.exp.saturating_sub(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            );
            let set = format!(
                "{}={cookie}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age}{}",
                session::COOKIE,
                if is_secure(state, req) {
                    "; Secure"
                } else {
                    ""
                }
            );
            record(
                state,
                &s.subject,
                "console_sign_in",
                None,
                serde_json::json!({"role": if s.is_admin() { "admin" } else { "viewer" }, "via": via}),
            )
            .await;
            let mut r = page(StatusCode::OK, pages::signed_in(&s));
            // The link's token must not travel on in a Referer.
            r.headers_mut().insert(
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            );
            if let Ok(v) = HeaderValue::from_str(&set) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Err(session::LoginError::Used) => page(
            StatusCode::UNAUTHORIZED,
            pages::sign_in_help(Some(
                "This sign-in link has been used already: each link signs in once. Run `fleetgate console-login` for a new one.",
            )),
        ),
        Err(session::LoginError::Invalid(m)) => {
            page(StatusCode::UNAUTHORIZED, pages::sign_in_help(Some(&m)))
        }
    }
}

/// Write an audit entry for a console action that is not a key change; a store outage is
/// logged (the action itself has happened).
async fn record(
    state: &AdminState,
    actor: &str,
    action: &str,
    key: Option<&str>,
    detail: serde_json::Value,
) {
    if let Err(e) = state
        .auth
        .store()
        .audit_event(actor, action, key, detail)
        .await
    {
        tracing::warn!(error = %e, action, "console: cannot write the audit entry");
    }
}

/// What the admin API would answer for a store error: the same status and message.
fn store_message(e: &StoreError) -> String {
    super::store_error(e).message
}

/// A key change the store refused: the key's page again, with the reason and the admin API's
/// status for it.
async fn key_refused(
    state: &AdminState,
    f: &Frame<'_>,
    id: &str,
    e: &StoreError,
) -> Response<GatewayBody> {
    let e = super::store_error(e);
    key_page(state, f, id, &BTreeMap::new(), Some(&e.message), e.status).await
}

async fn overview(state: &AdminState, f: &Frame<'_>) -> Response<GatewayBody> {
    page(
        StatusCode::OK,
        pages::overview::overview(f, live(state), charts(state).await),
    )
}

fn live(state: &AdminState) -> Markup {
    let figures = state.console.live.read(&state.registry);
    let pools = state.fleet.current();
    let backends: Vec<_> = pools.iter().flat_map(|p| p.backends.iter()).collect();
    let fleet = pages::overview::Fleet {
        up: backends
            .iter()
            .filter(|b| b.reachability() == crate::pool::Reachability::Up)
            .count(),
        total: backends.len(),
    };
    pages::overview::live(&figures, &fleet)
}

/// The overview's window: the last hour's requests, drawn from the first of them to now.
async fn charts(state: &AdminState) -> Markup {
    let now = crate::clock::wall_ms();
    let to = now + 1;
    let from = to - 3_600_000;
    match data::read_rows(state.auth.store(), from, to, None).await {
        Ok((rows, cut)) => {
            // Newest first: the last row is the oldest.
            let window = data::Window::fitted(rows.last().map(|r| r.at), to);
            let s = data::Series::new(&rows, cut, window, 4, |r| r.env);
            pages::overview::charts(&s, now)
        }
        Err(e) => maud::html! { p.error { "Cannot read the request log: " (store_message(&e)) } },
    }
}

async fn keys_page(
    state: &AdminState,
    f: &Frame<'_>,
    q: &BTreeMap<String, String>,
    form: pages::keys::IssueForm,
    error: Option<(StatusCode, String)>,
) -> Response<GatewayBody> {
    let filter = pages::keys::KeyFilter {
        env: q.get("env").cloned().unwrap_or_default(),
        status: q.get("status").cloned().unwrap_or_default(),
        q: q.get("q").cloned().unwrap_or_default(),
    };
    let env = match filter.env.as_str() {
        "" => None,
        e => match e.parse::<Environment>() {
            Ok(e) => Some(e),
            Err(m) => {
                return page(
                    StatusCode::BAD_REQUEST,
                    pages::problem(f, Section::Keys, "Keys", &m),
                );
            }
        },
    };
    let now = crate::clock::wall_ms();
    let keys = match state.auth.store().list(env).await {
        Ok(k) => k,
        Err(e) => {
            return page(
                StatusCode::SERVICE_UNAVAILABLE,
                pages::problem(f, Section::Keys, "Keys", &store_message(&e)),
            );
        }
    };
    let needle = filter.q.to_lowercase();
    let keys: Vec<_> = keys
        .into_iter()
        .filter(|k| filter.status.is_empty() || k.status(now) == filter.status)
        .filter(|k| {
            needle.is_empty()
                || k.name.to_lowercase().contains(&needle)
                || k.public_id.to_lowercase().contains(&needle)
        })
        .collect();
    let (status, message) = match error {
        Some((s, m)) => (s, Some(m)),
        None => (StatusCode::OK, None),
    };
    page(
        status,
        pages::keys::keys(f, &keys, &filter, &form, message.as_deref(), now),
    )
}

async fn key_page(
    state: &AdminState,
    f: &Frame<'_>,
    id: &str,
    q: &BTreeMap<String, String>,
    error: Option<&str>,
    status: StatusCode,
) -> Response<GatewayBody> {
    let store = state.auth.store();
    let record = match store.get(id).await {
        Ok(Some(k)) => k,
        Ok(None) => {
            return page(
                StatusCode::NOT_FOUND,
                pages::problem(
                    f,
                    Section::Keys,
                    "No such key",
                    &format!("There is no key {id}."),
                ),
            );
        }
        Err(e) => {
            return page(
                StatusCode::SERVICE_UNAVAILABLE,
                pages::problem(f, Section::Keys, "Key", &store_message(&e)),
            );
        }
    };
    let (usage, usage_error) = match key_usage(store, id, q).await {
        Ok(u) => (Some(u), None),
        Err(e) => (
            None,
            Some(format!(
                "Cannot read the request log: {}",
                store_message(&e)
            )),
        ),
    };
    let audit = store
        .audit_log(Some(id), 200)
        .await
        .map_err(|e| format!("Cannot read the audit trail: {}", store_message(&e)));
    let notice = match q.get("done").map(String::as_str) {
        Some("revoked") => Some("Key revoked: clients using it now get 401 key_revoked."),
        _ => None,
    };
    page(
        status,
        pages::keys::key_page(
            f,
            &record,
            pages::keys::KeyPage {
                usage: usage.as_ref().map(|u| pages::keys::KeyUsage {
                    since: u.since,
                    series: &u.series,
                    last: u.last,
                    ends_at_last: u.ends_at_last,
                    now: u.now,
                }),
                usage_error: usage_error.as_deref(),
                audit: audit.as_deref().map_err(String::as_str),
                notice,
                error,
                now: crate::clock::wall_ms(),
            },
        ),
    )
}

/// A key's usage over the window its page asked for.
struct KeyUsage {
    since: &'static str,
    series: data::Series,
    last: Option<i64>,
    ends_at_last: bool,
    now: i64,
}

/// The window of a key's page: `since=1h|24h|7d` up to now, or by default (`latest`) the 24
/// hours up to its last request — up to now when that was within the last few minutes, so a
/// key whose traffic was yesterday opens on yesterday, not on an empty last hour. Either way
/// the chart starts at the first request in that span (`Window::fitted`).
async fn key_usage(
    store: &crate::store::KeyStore,
    id: &str,
    q: &BTreeMap<String, String>,
) -> Result<KeyUsage, StoreError> {
    let asked = q.get("since").map(String::as_str);
    let since = pages::keys::KEY_WINDOWS
        .iter()
        .map(|(v, _)| *v)
        .find(|v| Some(*v) == asked)
        .unwrap_or("latest");
    let now = crate::clock::wall_ms();
    let last = data::last_request_at(store, id).await?;
    let (to, reach) = if since == "latest" {
        let to = match last {
            Some(l) if now - l > data::MIN_SPAN_MS => l + 1,
            _ => now + 1,
        };
        (to, Duration::from_secs(86_400))
    } else {
        (
            now + 1,
            crate::clock::parse_duration(since).unwrap_or(Duration::from_secs(86_400)),
        )
    };
    let from = to - i64::try_from(reach.as_millis()).unwrap_or(86_400_000);
    let (rows, cut) = data::read_rows(store, from, to, Some(id)).await?;
    let window = data::Window::fitted(rows.last().map(|r| r.at), to);
    Ok(KeyUsage {
        since,
        series: data::Series::new(&rows, cut, window, 1, |_| 0),
        last,
        ends_at_last: to <= now,
        now,
    })
}

async fn requests_page(
    state: &AdminState,
    f: &Frame<'_>,
    q: &BTreeMap<String, String>,
) -> Response<GatewayBody> {
    let find = q.get("q").map(|s| s.trim()).unwrap_or_default();
    let rows = data::find_requests(
        state.auth.store(),
        crate::clock::wall_ms(),
        Some(find).filter(|s| !s.is_empty()),
    )
    .await;
    match rows {
        Ok(rows) => page(StatusCode::OK, pages::requests::requests(f, &rows, find)),
        Err(e) => page(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::problem(f, Section::Requests, "Requests", &store_message(&e)),
        ),
    }
}

async fn audit_page(
    state: &AdminState,
    f: &Frame<'_>,
    q: &BTreeMap<String, String>,
) -> Response<GatewayBody> {
    let filter = pages::keys::AuditFilter {
        key: q.get("key").cloned().unwrap_or_default(),
        actor: q.get("actor").cloned().unwrap_or_default(),
        action: q.get("action").cloned().unwrap_or_default(),
        limit: q
            .get("limit")
            .and_then(|l| l.parse().ok())
            .unwrap_or(200)
            .clamp(1, 10_000),
    };
    let search = crate::store::AuditSearch {
        key: Some(filter.key.as_str()).filter(|s| !s.is_empty()),
        actor: Some(filter.actor.as_str()).filter(|s| !s.is_empty()),
        action: Some(filter.action.as_str()).filter(|s| !s.is_empty()),
        limit: filter.limit,
    };
    match state.auth.store().audit_search(&search).await {
        Ok(entries) => page(StatusCode::OK, pages::keys::audit(f, &entries, &filter)),
        Err(e) => page(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::problem(f, Section::Audit, "Audit", &store_message(&e)),
        ),
    }
}
