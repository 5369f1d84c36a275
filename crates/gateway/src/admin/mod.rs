//! The admin API, on its own listener (default 127.0.0.1:8081): key management guarded by
//! JWTs (role admin for changes, viewer for reading), and `/metrics` in Prometheus text format.
//!
//! Routes: `GET /metrics`, `GET /healthz` (open); `GET /admin/keys[?env=E]`,
//! `POST /admin/keys`, `GET /admin/keys/{id}`, `POST /admin/keys/{id}/revoke`,
//! `POST /admin/keys/{id}/rotate`, `GET /admin/audit[?key=ID&actor=&action=&limit=N]`, `GET /admin/usage`,
//! `GET /admin/ready` (the details the public `/readyz` does not show), `GET /admin/backends`,
//! `POST /admin/backends/drain|undrain` (JWT). `/` and `/console/…`: the console (its own
//! sign-in, see `console`).

pub mod console;
pub mod jwt;
pub mod middleware;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use serde::Deserialize;

use crate::auth::Authenticator;
use crate::key::Environment;
use crate::key::KeyRecord;
use crate::proxy::relay::GatewayBody;
use crate::store::{CreateKey, StoreError};
use fleetgate_protocol::error::error_body;
use jwt::{JwtError, Role, Verifier};
use middleware::Body;

pub(crate) struct AdminState {
    pub(crate) auth: Arc<Authenticator>,
    pub(crate) verifier: Verifier,
    pub(crate) registry: prometheus::Registry,
    pub(crate) fleet: Arc<crate::pool::fleet::Fleet>,
    pub(crate) metrics: Arc<crate::telemetry::metrics::RequestMetrics>,
    /// The limits (whether their Redis answers) and the prefix records shared through it.
    pub(crate) limits: Arc<crate::limits::Limits>,
    pub(crate) prefix_share: Option<Arc<crate::proxy::prefix_share::PrefixShare>>,
    pub(crate) console: crate::admin::console::Console,
    /// The admin listener serves TLS (the console's cookie is then `Secure`).
    pub(crate) tls: bool,
}

static JSON: HeaderValue = HeaderValue::from_static("application/json");

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, JSON.clone());
    r
}

/// An admin API refusal, turned into an OpenAI-format body at the end.
#[derive(Debug)]
struct AdminError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
}

fn error(status: StatusCode, kind: &'static str, code: &'static str, message: &str) -> AdminError {
    AdminError {
        status,
        kind,
        code,
        message: message.to_owned(),
    }
}

impl AdminError {
    fn into_response(self) -> Response<GatewayBody> {
        let mut r = json(
            self.status,
            error_body(&self.message, self.kind, None, Some(self.code)),
        );
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

fn store_error(e: &StoreError) -> AdminError {
    match e {
        StoreError::NotFound(_) => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "key_not_found",
            &e.to_string(),
        ),
        StoreError::AlreadyRevoked(_) => error(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "key_revoked",
            &e.to_string(),
        ),
        StoreError::Invalid(m) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_value",
            m,
        ),
        StoreError::Db(db) => {
            tracing::error!(error = %e, "admin: key store error");
            // The operator needs the cause (a read-only file, a full disk, a lost connection):
            // it is the database's own words, never a key's secret.
            let what = match db {
                sqlx::Error::Database(_) => "The key store (database) refused the change",
                _ => "The key store (database) is unreachable",
            };
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "key_store_unavailable",
                &format!(
                    "{what}: {db}. Nothing was changed, here or on disk; retry when the database accepts writes again."
                ),
            )
        }
        StoreError::NotDurable(_) | StoreError::Migrate(_) | StoreError::Unreachable { .. } => {
            tracing::error!(error = %e, "admin: key store error");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "key_store_unavailable",
                &format!("The key store failed: {e}. Nothing was changed in this gateway; retry."),
            )
        }
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

async fn read_json<T: for<'de> Deserialize<'de>>(body: Body) -> Result<T, AdminError> {
    let bytes = body
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                return error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "request_too_large",
                    &middleware::too_large_message(),
                );
            }
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "body_read_error",
                &format!("cannot read the body: {e}"),
            )
        })?
        .to_bytes();
    let bytes = if bytes.is_empty() {
        Bytes::from_static(b"{}")
    } else {
        bytes
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            &format!("invalid JSON body: {e}"),
        )
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeBody {
    reason: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    #[serde(default)]
    grace_seconds: Option<u64>,
}

/// Who is calling: subject and role from a verified token.
struct Caller {
    subject: String,
    role: Role,
}

fn authorize(state: &AdminState, req: &Request<Body>) -> Result<Caller, AdminError> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
        });
    let claims = match token {
        // Without a key no token can work: say what to configure, not to mint one.
        _ if !state.verifier.is_configured() => Err(JwtError::NotConfigured),
        None => Err(JwtError::Missing),
        Some(t) => state.verifier.verify(t),
    };
    match claims {
        Ok(c) => Ok(Caller {
            subject: c.sub.unwrap_or_else(|| "admin-token".into()),
            role: c.role,
        }),
        Err(e) => Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_admin_token",
            &e.message(),
        )),
    }
}

fn need_admin(c: &Caller) -> Result<(), AdminError> {
    match c.role {
        Role::Admin => Ok(()),
        Role::Viewer => Err(error(
            StatusCode::FORBIDDEN,
            "permission_error",
            "admin_role_required",
            "This token has role `viewer`, which can only read; changes need role `admin`.",
        )),
    }
}

fn key_json(k: &KeyRecord) -> serde_json::Value {
    serde_json::to_value(k.view()).unwrap_or_default()
}

/// Serve one admin request.
pub(crate) async fn handle(state: Arc<AdminState>, req: Request<Body>) -> Response<GatewayBody> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/metrics") => {
            state.auth.update_gauges();
            state.metrics.update_backends(&state.fleet.current());
            let mut text = String::new();
            let encoder = prometheus::TextEncoder::new();
            if let Err(e) = encoder.encode_utf8(&state.registry.gather(), &mut text) {
                tracing::error!(error = %e, "metrics encoding failed");
            }
            let mut r = Response::new(GatewayBody::full(text));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return r;
        }
        (Method::GET, "/healthz") => return json(StatusCode::OK, r#"{"status":"ok"}"#),
        (_, p) if p == "/" || p == "/console" || p.starts_with("/console/") => {
            return crate::admin::console::handle(&state, req).await;
        }
        _ => {}
    }
    match keys_api(&state, req, &path).await {
        Ok((status, body)) => json(status, body),
        Err(e) => e.into_response(),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    model: String,
    backend: String,
}

/// The JWT-guarded routes.
async fn keys_api(
    state: &AdminState,
    req: Request<Body>,
    path: &str,
) -> Result<(StatusCode, Bytes), AdminError> {
    let method = req.method().clone();
    let caller = authorize(state, &req)?;
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let store = state.auth.store();
    match (method, segments.as_slice()) {
        (Method::GET, ["admin", "keys"]) => list_keys(state, &req).await,
        (Method::POST, ["admin", "keys"]) => create_key(state, req, &caller).await,
        (Method::GET, ["admin", "keys", id]) => match store.get(id).await {
            Ok(Some(k)) => Ok((StatusCode::OK, to_json(&key_json(&k)))),
            Ok(None) => Err(store_error(&StoreError::NotFound((*id).to_owned()))),
            Err(e) => Err(store_error(&e)),
        },
        (Method::POST, ["admin", "keys", id, "revoke"]) => {
            revoke_key(state, req, &caller, id).await
        }
        (Method::POST, ["admin", "keys", id, "rotate"]) => {
            rotate_key(state, req, &caller, id).await
        }
        (Method::GET, ["admin", "usage"]) => usage_report(state, &req).await,
        (Method::GET, ["admin", "ready"]) => Ok((StatusCode::OK, readiness(state))),
        (Method::GET, ["admin", "backends"]) => Ok((
            StatusCode::OK,
            to_json(
                &serde_json::json!({"object": "list", "data": state.fleet.current().backends_json()}),
            ),
        )),
        (Method::POST, ["admin", "backends", action @ ("drain" | "undrain")]) => {
            drain_backend(state, req, &caller, action).await
        }
        (Method::GET, ["admin", "audit"]) => audit_log(state, &req).await,
        _ => Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            "Unknown admin route. Routes: GET/POST /admin/keys, GET /admin/keys/{id}, POST /admin/keys/{id}/revoke, POST /admin/keys/{id}/rotate, GET /admin/audit, GET /admin/usage, GET /admin/ready, GET /admin/backends, POST /admin/backends/drain, POST /admin/backends/undrain, GET /metrics.",
        )),
    }
}

/// `GET /admin/keys[?env=]`
async fn list_keys(
    state: &AdminState,
    req: &Request<Body>,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    let env = match query_param(req.uri().query(), "env").map(str::parse::<Environment>) {
        None => None,
        Some(Ok(e)) => Some(e),
        Some(Err(m)) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_value",
                &m,
            ));
        }
    };
    let keys = store.list(env).await.map_err(|e| store_error(&e))?;
    let data: Vec<_> = keys.iter().map(key_json).collect();
    Ok((
        StatusCode::OK,
        to_json(&serde_json::json!({"object": "list", "data": data})),
    ))
}

/// `POST /admin/keys`
async fn create_key(
    state: &AdminState,
    req: Request<Body>,
    caller: &Caller,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    need_admin(caller)?;
    let body: CreateKey = read_json(req.into_body()).await?;
    let (full, record) = store
        .create(&body, &caller.subject)
        .await
        .map_err(|e| store_error(&e))?;
    state.auth.apply(&record.public_id, Some(record.clone()));
    Ok((
        StatusCode::CREATED,
        to_json(&serde_json::json!({
            "key": full,
            // What the CLI calls `<id>` (`keys revoke <id>`, the console's key pages).
            "id": &*record.public_id,
            "note": "This is the only time the full key is shown: store it in a secret manager or an environment variable.",
            "record": key_json(&record),
        })),
    ))
}

/// `POST /admin/keys/{id}/revoke`
async fn revoke_key(
    state: &AdminState,
    req: Request<Body>,
    caller: &Caller,
    id: &str,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    need_admin(caller)?;
    let id = id.to_owned();
    let body: RevokeBody = read_json(req.into_body()).await?;
    let reason = body.reason.unwrap_or_default();
    let record = store
        .revoke(&id, &reason, &caller.subject)
        .await
        .map_err(|e| store_error(&e))?;
    state.auth.apply(&id, Some(record.clone()));
    Ok((StatusCode::OK, to_json(&key_json(&record))))
}

/// `POST /admin/keys/{id}/rotate`
async fn rotate_key(
    state: &AdminState,
    req: Request<Body>,
    caller: &Caller,
    id: &str,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    need_admin(caller)?;
    let id = id.to_owned();
    let body: RotateBody = read_json(req.into_body()).await?;
    let grace = Duration::from_secs(body.grace_seconds.unwrap_or(600));
    let (full, record) = store
        .rotate(&id, grace, &caller.subject)
        .await
        .map_err(|e| store_error(&e))?;
    state.auth.apply(&id, Some(record.clone()));
    Ok((
        StatusCode::OK,
        to_json(&serde_json::json!({
            "key": full,
            "id": &*record.public_id,
            "note": "The old secret keeps working until previous_secret_valid_until.",
            "record": key_json(&record),
        })),
    ))
}

/// `GET /admin/usage[?by=&month=|since=&env=]`
async fn usage_report(
    state: &AdminState,
    req: &Request<Body>,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    use crate::telemetry::usage::{GroupBy, UsageQuery, month_window, usage};
    let query = req.uri().query();
    let bad = |m: String| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_value",
            &m,
        )
    };
    let by = match query_param(query, "by") {
        Some(b) => b.parse::<GroupBy>().map_err(bad)?,
        None => GroupBy::Key,
    };
    let (from, to) = match query_param(query, "month") {
        Some(m) => month_window(m).map_err(|e| bad(e.to_string()))?,
        None => {
            let since = crate::clock::parse_duration(query_param(query, "since").unwrap_or("1h"))
                .map_err(|e| bad(e.to_string()))?;
            let now = crate::clock::wall_ms();
            (
                now - i64::try_from(since.as_millis()).unwrap_or(i64::MAX),
                now + 1,
            )
        }
    };
    let environment = match query_param(query, "env") {
        Some(e) => Some(e.parse::<Environment>().map_err(bad)?.as_str().to_owned()),
        None => None,
    };
    let rows = usage(
        store,
        &UsageQuery {
            from,
            to,
            environment,
            by,
        },
    )
    .await
    .map_err(|e| store_error(&e))?;
    Ok((
        StatusCode::OK,
        to_json(&serde_json::json!({"object": "list", "from": from, "to": to, "data": rows})),
    ))
}

/// `GET /admin/ready`: what the public `/readyz` decides by and does not show — every
/// backend with its state and last error, and the key store's.
fn readiness(state: &AdminState) -> Bytes {
    let pools = state.fleet.current();
    let ready = pools.any_reachable();
    let auth = &state.auth;
    let store_up = auth.store_health() == crate::auth::StoreHealth::Up;
    to_json(&serde_json::json!({
        "ready": ready,
        "detail": if ready { "at least one backend is reachable" } else { "no backend is reachable yet" },
        "backends": pools.backends_json(),
        "pools": pools.iter().map(|p| serde_json::json!({
            "model": &*p.model,
            "backends": p.backends.len(),
            "reachable": p.backends.iter().filter(|b| b.reachability() == crate::pool::Reachability::Up).count(),
        })).collect::<Vec<_>>(),
        "key_store": {
            "state": if store_up { "up" } else { "degraded" },
            "detail": if store_up {
                "keys are current".to_owned()
            } else {
                format!("the key store is unreachable: authenticating from the last snapshot ({} keys, {:.0} s old)", auth.key_count(), auth.snapshot_age().as_secs_f64())
            },
            "keys": auth.key_count(),
            "snapshot_age_seconds": auth.snapshot_age().as_secs_f64(),
        },
        "redis": redis_readiness(state),
    }))
}

/// What the replicas share through Redis, and what each falls back to while it is away
/// (`null` without `limits.shared = "redis"`: nothing is shared).
fn redis_readiness(state: &AdminState) -> serde_json::Value {
    let Some(shared) = state.limits.shared() else {
        return serde_json::Value::Null;
    };
    let limits_up = shared.is_up();
    let prefix_up = state.prefix_share.as_ref().is_none_or(|p| p.is_up());
    let up = limits_up && prefix_up;
    serde_json::json!({
        "state": if up { "up" } else { "degraded" },
        "limits": if limits_up { "shared" } else { "local" },
        "prefix_index": if prefix_up { "shared" } else { "local" },
        "detail": if up {
            "limits, stored-response pins and longest-prefix records are shared with the other replicas".to_owned()
        } else {
            format!(
                "Redis does not answer {}: {}",
                match (limits_up, prefix_up) {
                    (false, false) => "the limits nor the prefix records",
                    (false, true) => "the limits",
                    _ => "the prefix records",
                },
                [
                    (!limits_up).then_some("each limit is enforced per replica at limit / replicas, stored-response pins stay local"),
                    (!prefix_up).then_some("longest-prefix routing uses this replica's own index"),
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; ")
            )
        },
    })
}

/// Drain or undrain a backend (the admin API and the console), recorded in the audit trail.
/// Returns the backend's base URL, state and in-flight count, or why there is no such backend.
pub(crate) async fn set_drain(
    state: &AdminState,
    actor: &str,
    model: &str,
    backend: &str,
    drain: bool,
) -> Result<(String, &'static str, u32), String> {
    let pools = state.fleet.current();
    let Some(b) = pools.find_backend(model, backend) else {
        return Err(format!(
            "No backend {backend} in the pool of `{model}`; GET /admin/backends lists them."
        ));
    };
    b.set_draining(drain);
    tracing::info!(backend = %b.base, by = %actor, drain, "backend drain changed");
    let action = if drain { "drain" } else { "undrain" };
    if let Err(e) = state
        .auth
        .store()
        .audit_event(
            actor,
            action,
            None,
            serde_json::json!({"model": model, "backend": &*b.base}),
        )
        .await
    {
        tracing::warn!(error = %e, action, "cannot write the audit entry");
    }
    Ok((
        b.base.to_string(),
        b.state().as_str(),
        b.in_flight.load(std::sync::atomic::Ordering::Relaxed),
    ))
}

/// `POST /admin/backends/drain` and `/undrain`
async fn drain_backend(
    state: &AdminState,
    req: Request<Body>,
    caller: &Caller,
    action: &str,
) -> Result<(StatusCode, Bytes), AdminError> {
    need_admin(caller)?;
    let body: DrainBody = read_json(req.into_body()).await?;
    let (base, backend_state, in_flight) = set_drain(
        state,
        &caller.subject,
        &body.model,
        &body.backend,
        action == "drain",
    )
    .await
    .map_err(|m| {
        error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "backend_not_found",
            &m,
        )
    })?;
    Ok((
        StatusCode::OK,
        to_json(&serde_json::json!({
            "backend": base,
            "state": backend_state,
            "in_flight": in_flight,
        })),
    ))
}

/// `GET /admin/audit[?key=&actor=&action=&limit=]`
async fn audit_log(
    state: &AdminState,
    req: &Request<Body>,
) -> Result<(StatusCode, Bytes), AdminError> {
    let store = state.auth.store();
    let key = query_param(req.uri().query(), "key");
    let limit = query_param(req.uri().query(), "limit")
        .and_then(|l| l.parse::<i64>().ok())
        .unwrap_or(100)
        .clamp(1, 10_000);
    let entries = store
        .audit_search(&crate::store::AuditSearch {
            key,
            actor: query_param(req.uri().query(), "actor"),
            action: query_param(req.uri().query(), "action"),
            limit,
        })
        .await
        .map_err(|e| store_error(&e))?;
    Ok((
        StatusCode::OK,
        to_json(&serde_json::json!({"object": "list", "data": entries})),
    ))
}
