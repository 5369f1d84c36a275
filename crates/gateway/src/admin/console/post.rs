//! The console's changes: every POST of a signed-in session is checked here (same origin, CSRF
//! token; role admin for every change but signing out), then issues, revokes or rotates a key,
//! or drains or undrains a backend, through the same store
//! and authenticator as the admin API, and records it in the audit trail.

use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderValue, Request, Response, StatusCode, header};

use super::pages::{self, Frame, Section};
use super::{
    host, key_page, key_refused, keys_page, page, read_form, record, redirect, same_origin,
};
use crate::admin::AdminState;
use crate::admin::middleware::Body;
use crate::key::Environment;
use crate::proxy::relay::GatewayBody;
use crate::store::CreateKey;

/// Every POST: signed in (checked by the caller), CSRF token, same origin, role admin.
pub(super) async fn handle(
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
    let values = pages::keys::IssueForm {
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
                pages::keys::key_shown(
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
            let e = crate::admin::store_error(&e);
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
                pages::keys::key_shown(
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
