//! The admin listener: a JWT secret, a token per role, and its API called as an operator calls it.

use super::*;

/// The admin JWT secret of `admin_cfg()`.
pub const JWT_SECRET: &str = "test-secret-0123456789abcdef0123456789";

/// An admin listener on a free port that accepts HS256 tokens signed with `JWT_SECRET`.
pub fn admin_cfg() -> fleetgate_gateway::config::AdminConfig {
    fleetgate_gateway::config::AdminConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        jwt_key: Some(fleetgate_gateway::config::JwtKey::Secret(
            fleetgate_gateway::secret::Secret::new(JWT_SECRET),
        )),
        ..fleetgate_gateway::config::AdminConfig::default()
    }
}

/// A token for `admin_cfg()` with this role, valid five minutes.
pub fn token(role: fleetgate_gateway::admin::jwt::Role) -> String {
    fleetgate_gateway::admin::jwt::mint(&admin_cfg(), role, "tester", Duration::from_secs(300))
        .unwrap()
}

/// (status, body) of an admin API call.
pub async fn admin(
    gw: &Gateway,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let c = client::http_client();
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", gw.server.admin_addr.unwrap()))
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let resp = c
        .request(req.body(http_body_util::Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// One field of every backend `GET /admin/backends` lists (a viewer's view).
pub async fn admin_backends(gw: &Gateway, field: &str) -> Vec<String> {
    let (s, v) = admin(
        gw,
        "GET",
        "/admin/backends",
        Some(&token(fleetgate_gateway::admin::jwt::Role::Viewer)),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b[field].as_str().unwrap().to_owned())
        .collect()
}

/// The backends' states from `GET /admin/backends`, polled until they are `want` (at most 5 s).
pub async fn backend_states_become(gw: &Gateway, want: &[&str]) -> Vec<String> {
    let mut state = Vec::new();
    for _ in 0..100 {
        state = admin_backends(gw, "state").await;
        if state == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    state
}

/// The admin listener's `/metrics`, as Prometheus scrapes it (the pools' and backends' figures
/// are read then).
pub async fn admin_metrics(gw: &Gateway) -> String {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!("http://{}/metrics", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = client::http_client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}
