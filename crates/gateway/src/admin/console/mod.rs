//! The operators' console: web pages on the admin listener (`/console/`), part of the binary.
//!
//! Server-rendered HTML (maud templates, every value escaped), one small script and one
//! stylesheet embedded in the binary, charts drawn as SVG on the server. It reads the same
//! state as the admin API: keys through the key store (and applies changes to the
//! authenticator exactly as `/admin/keys` does), backends from the fleet, percentiles from the
//! request log, live rates from the in-process metrics.
//!
//! Access: a one-time sign-in link or admin token, then a session cookie (`session.rs`);
//! viewers see everything and change nothing (no buttons, and every POST checks the role);
//! every POST carries the session's CSRF token and, when the browser sends one, an `Origin`
//! of this host; pages are served with a Content-Security-Policy that allows nothing from
//! elsewhere and no inline script or style.

pub mod chart;
pub mod data;
pub mod pages;
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
use crate::store::{CreateKey, StoreError};
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
pub struct ApiAddress {
    pub scheme: &'static str,
    /// `None`: the API listens on every address; the admin request's host name is used.
    pub host: Option<String>,
    pub port: u16,
}

/// The console's own state (inside the admin listener's).
#[derive(Debug)]
pub struct Console {
    pub sessions: Sessions,
    live: data::Live,
    api: ApiAddress,
}

impl Console {
    pub fn new(admin: &crate::config::AdminConfig, api: ApiAddress) -> Self {
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
pub async fn handle(state: &AdminState, req: Request<Body>) -> Response<GatewayBody> {
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
        return post(state, &frame, req, &path).await;
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
                pages::IssueForm::default(),
                None,
            )
            .await
        }
        ["console", "keys", id] => {
            key_page(state, &frame, id, &query(&req), None, StatusCode::OK).await
        }
        ["console", "backends"] => page(
            StatusCode::OK,
            pages::backends(&frame, &state.fleet.current().backends_json()),
        ),
        ["console", "audit"] => audit_page(state, &frame, &query(&req)).await,
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
        pages::overview(f, live(state), charts(state).await),
    )
}

fn live(state: &AdminState) -> Markup {
    let figures = state.console.live.read(&state.registry);
    let pools = state.fleet.current();
    let backends: Vec<_> = pools.iter().flat_map(|p| p.backends.iter()).collect();
    let fleet = pages::Fleet {
        up: backends
            .iter()
            .filter(|b| b.reachability() == crate::pool::Reachability::Up)
            .count(),
        total: backends.len(),
    };
    pages::live(&figures, &fleet)
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
            pages::charts(&s, now)
        }
        Err(e) => maud::html! { p.error { "Cannot read the request log: " (store_message(&e)) } },
    }
}

async fn keys_page(
    state: &AdminState,
    f: &Frame<'_>,
    q: &BTreeMap<String, String>,
    form: pages::IssueForm,
    error: Option<(StatusCode, String)>,
) -> Response<GatewayBody> {
    let filter = pages::KeyFilter {
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
        pages::keys(f, &keys, &filter, &form, message.as_deref(), now),
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
        pages::key_page(
            f,
            &record,
            pages::KeyPage {
                usage: usage.as_ref().map(|u| pages::KeyUsage {
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
    let since = pages::KEY_WINDOWS
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

async fn audit_page(
    state: &AdminState,
    f: &Frame<'_>,
    q: &BTreeMap<String, String>,
) -> Response<GatewayBody> {
    let filter = pages::AuditFilter {
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
        Ok(entries) => page(StatusCode::OK, pages::audit(f, &entries, &filter)),
        Err(e) => page(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::problem(f, Section::Audit, "Audit", &store_message(&e)),
        ),
    }
}

/// Every POST: signed in (checked by the caller), CSRF token, same origin, role admin.
async fn post(
    state: &AdminState,
    f: &Frame<'_>,
    req: Request<Body>,
    path: &str,
) -> Response<GatewayBody> {
    if !same_origin(&req) {
        return page(
            StatusCode::FORBIDDEN,
            pages::problem(
                f,
                Section::Overview,
                "Refused",
                "This form was sent from another site; nothing was changed.",
            ),
        );
    }
    let api_host = host(&req).map(str::to_owned);
    let form = match read_form(req.into_body()).await {
        Ok(form) => form,
        Err(too_large) => {
            let (status, why) = if too_large {
                (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    crate::admin::middleware::too_large_message(),
                )
            } else {
                (
                    StatusCode::BAD_REQUEST,
                    "The form could not be read: the connection ended before it did.".to_owned(),
                )
            };
            return page(
                status,
                pages::problem(
                    f,
                    Section::Overview,
                    "Refused",
                    &format!("{why} Nothing was changed."),
                ),
            );
        }
    };
    let csrf_ok = form
        .get("csrf")
        .is_some_and(|t| state.console.sessions.csrf_ok(f.session, t));
    if !csrf_ok {
        return page(
            StatusCode::FORBIDDEN,
            pages::problem(
                f,
                Section::Overview,
                "Refused",
                "This form's CSRF token is missing or belongs to another session; nothing was changed. Reload the page and try again.",
            ),
        );
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    if segments.as_slice() == ["console", "logout"] {
        state.console.sessions.sign_out(f.session);
        record(
            state,
            &f.session.subject,
            "console_sign_out",
            None,
            serde_json::json!({}),
        )
        .await;
        let mut r = page(StatusCode::OK, pages::signed_out());
        r.headers_mut().insert(
            header::SET_COOKIE,
            HeaderValue::from_static(
                "fleetgate_console=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0",
            ),
        );
        return r;
    }
    if !f.session.is_admin() {
        return page(
            StatusCode::FORBIDDEN,
            pages::problem(
                f,
                Section::Overview,
                "Not allowed",
                "This session has role viewer: it can look at everything and change nothing. Sign in with an admin link to make changes.",
            ),
        );
    }
    match segments.as_slice() {
        ["console", "keys"] => issue(state, f, &form, api_host.as_deref()).await,
        ["console", "keys", id, "revoke"] => revoke(state, f, id, &form).await,
        ["console", "keys", id, "rotate"] => rotate(state, f, id, &form, api_host.as_deref()).await,
        ["console", "backends", action @ ("drain" | "undrain")] => {
            drain(state, f, action, &form).await
        }
        _ => page(
            StatusCode::NOT_FOUND,
            pages::problem(
                f,
                Section::Overview,
                "Not found",
                "There is no console action here.",
            ),
        ),
    }
}

fn optional_number(
    form: &BTreeMap<String, String>,
    field: &str,
    what: &str,
) -> Result<Option<i64>, String> {
    match form.get(field).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(v) => match v.parse::<i64>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!(
                "{what}: `{v}` is not a whole number above 0 (leave it empty for the environment's default)."
            )),
        },
    }
}

/// The issue form's fields as the store's `CreateKey` (the admin API's body).
fn create_key(form: &BTreeMap<String, String>) -> Result<CreateKey, String> {
    let field = |k: &str| form.get(k).cloned().unwrap_or_default();
    let environment = field("environment")
        .parse::<Environment>()
        .map_err(|m| format!("Environment: {m}"))?;
    let models = field("models");
    let allowed_models = match models.trim() {
        "" | "all" | "*" => None,
        list => Some(
            list.split([',', ' '])
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>(),
        ),
    };
    let allowed_endpoints = match field("endpoints").trim() {
        "" | "all" | "*" => None,
        list => {
            let names: Vec<String> = list
                .split([',', ' '])
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned)
                .collect();
            fleetgate_protocol::endpoint::Families::parse(&names)
                .map_err(|e| format!("Endpoints: {e}."))?;
            Some(names)
        }
    };
    let expires_in_seconds = match field("expires_in").as_str() {
        "" | "never" => None,
        text => {
            let d = crate::clock::parse_duration(text)
                .map_err(|e| format!("Expires in: {e} (e.g. 30d, 12h, or empty for never)."))?;
            Some(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        }
    };
    let metadata = match field("metadata").as_str() {
        "" => None,
        text => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v @ serde_json::Value::Object(_)) => Some(v),
            Ok(_) => {
                return Err(
                    "Metadata: must be a JSON object, e.g. {\"owner\": \"search team\"}.".into(),
                );
            }
            Err(e) => return Err(format!("Metadata: not valid JSON ({e}).")),
        },
    };
    Ok(CreateKey {
        name: field("name"),
        environment: Some(environment),
        allowed_models,
        allowed_endpoints,
        requests_per_minute: optional_number(form, "requests_per_minute", "Requests per minute")?,
        tokens_per_minute: optional_number(form, "tokens_per_minute", "Tokens per minute")?,
        max_concurrent_streams: optional_number(
            form,
            "max_concurrent_streams",
            "Concurrent streams",
        )?,
        expires_in_seconds,
        metadata,
    })
}

async fn issue(
    state: &AdminState,
    f: &Frame<'_>,
    form: &BTreeMap<String, String>,
    host: Option<&str>,
) -> Response<GatewayBody> {
    let field = |k: &str| form.get(k).cloned().unwrap_or_default();
    let values = pages::IssueForm {
        environment: field("environment"),
        name: field("name"),
        models: field("models"),
        endpoints: field("endpoints"),
        rpm: field("requests_per_minute"),
        tpm: field("tokens_per_minute"),
        streams: field("max_concurrent_streams"),
        expires: field("expires_in"),
        metadata: field("metadata"),
    };
    let body = match create_key(form) {
        Ok(b) => b,
        Err(m) => {
            return keys_page(
                state,
                f,
                &BTreeMap::new(),
                values,
                Some((StatusCode::BAD_REQUEST, m)),
            )
            .await;
        }
    };
    match state.auth.store().create(&body, &f.session.subject).await {
        Ok((full, record)) => {
            state.auth.apply(&record.public_id, Some(record.clone()));
            page(
                StatusCode::CREATED,
                pages::key_shown(
                    f,
                    "Key issued",
                    &record,
                    &full,
                    &state.console.base_url(host),
                    "Store it in a secret manager or an environment variable now; the gateway keeps only its hash.",
                ),
            )
        }
        Err(e) => {
            let e = super::store_error(&e);
            keys_page(
                state,
                f,
                &BTreeMap::new(),
                values,
                Some((e.status, e.message)),
            )
            .await
        }
    }
}

async fn revoke(
    state: &AdminState,
    f: &Frame<'_>,
    id: &str,
    form: &BTreeMap<String, String>,
) -> Response<GatewayBody> {
    let reason = form.get("reason").cloned().unwrap_or_default();
    let refusal = if form.get("confirm").map(String::as_str) != Some("yes") {
        Some("Tick the confirmation to revoke: nothing was changed.")
    } else if reason.is_empty() {
        Some("Give a reason to revoke (it goes into the audit trail): nothing was changed.")
    } else {
        None
    };
    if let Some(m) = refusal {
        return key_page(
            state,
            f,
            id,
            &BTreeMap::new(),
            Some(m),
            StatusCode::BAD_REQUEST,
        )
        .await;
    }
    match state
        .auth
        .store()
        .revoke(id, &reason, &f.session.subject)
        .await
    {
        Ok(record) => {
            state.auth.apply(id, Some(record));
            redirect(&format!("/console/keys/{id}?done=revoked"))
        }
        Err(e) => key_refused(state, f, id, &e).await,
    }
}

async fn rotate(
    state: &AdminState,
    f: &Frame<'_>,
    id: &str,
    form: &BTreeMap<String, String>,
    host: Option<&str>,
) -> Response<GatewayBody> {
    let grace = match form.get("grace").map(String::as_str) {
        None | Some("") => Duration::from_secs(600),
        Some(text) => match crate::clock::parse_duration(text) {
            Ok(d) => d,
            Err(e) => {
                let m = format!("Grace: {e} (e.g. 10m, 1h, 0s); nothing was changed.");
                return key_page(
                    state,
                    f,
                    id,
                    &BTreeMap::new(),
                    Some(&m),
                    StatusCode::BAD_REQUEST,
                )
                .await;
            }
        },
    };
    match state
        .auth
        .store()
        .rotate(id, grace, &f.session.subject)
        .await
    {
        Ok((full, record)) => {
            state.auth.apply(id, Some(record.clone()));
            let note = match record.previous {
                Some((_, until)) => format!(
                    "The old secret keeps working until {}.",
                    crate::clock::format_wall_ms(until)
                ),
                None => "The old secret no longer works.".to_owned(),
            };
            page(
                StatusCode::OK,
                pages::key_shown(
                    f,
                    "Key rotated",
                    &record,
                    &full,
                    &state.console.base_url(host),
                    &note,
                ),
            )
        }
        Err(e) => key_refused(state, f, id, &e).await,
    }
}

async fn drain(
    state: &AdminState,
    f: &Frame<'_>,
    action: &str,
    form: &BTreeMap<String, String>,
) -> Response<GatewayBody> {
    let model = form.get("model").cloned().unwrap_or_default();
    let backend = form.get("backend").cloned().unwrap_or_default();
    match crate::admin::set_drain(
        state,
        &f.session.subject,
        &model,
        &backend,
        action == "drain",
    )
    .await
    {
        Ok(_) => redirect("/console/backends"),
        Err(m) => page(
            StatusCode::NOT_FOUND,
            pages::problem(f, Section::Backends, "Backends", &m),
        ),
    }
}
