//! The two gateways' configuration (behind TCP forwarders to PostgreSQL and Redis) and their
//! admin API: metrics, the config generation, and whether a gateway has recovered.

use super::*;

/// `scheme://user@` , `host:port`, `/rest` of a service URL.
pub(super) fn split_url(url: &str) -> (String, String, String) {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (user, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    (
        format!("{scheme}://{user}"),
        hostport.to_owned(),
        path.to_owned(),
    )
}

/// The same URL with its host and port replaced by a local forwarder's.
pub(super) fn via_forwarder(url: &str, port: u16) -> String {
    let (head, _, path) = split_url(url);
    format!("{head}127.0.0.1:{port}{path}")
}

pub(super) async fn resolve(url: &str) -> std::net::SocketAddr {
    let (_, hostport, _) = split_url(url);
    tokio::net::lookup_host(hostport.as_str())
        .await
        .unwrap()
        .next()
        .unwrap()
}

pub(super) struct GatewayPlan {
    pub(super) port: u16,
    pub(super) admin_port: u16,
    pub(super) spill: PathBuf,
}

pub(super) struct Shared {
    pub(super) db_url: String,
    pub(super) redis_url: String,
    pub(super) redis_prefix: String,
    pub(super) sim_ports: Vec<u16>,
}

pub(super) fn gateway_config(g: &GatewayPlan, s: &Shared, weight0: u32) -> String {
    let backend = |i: usize| format!("http://127.0.0.1:{}", s.sim_ports[i]);
    format!(
        r#"[server]
listen = "127.0.0.1:{port}"
shutdown_grace_seconds = 5
health_interval_ms = 500
log_format = "json"
request_log_events = false

[database]
url = "{db}"
migrate_on_start = true

[admin]
listen = "127.0.0.1:{admin}"
jwt_secret = "{JWT_SECRET}"

[request_log]
flush_interval_ms = 100
spill_path = "{spill}"

[limits]
shared = "redis"

[limits.redis]
url = "{redis}"
replicas = 2
key_prefix = "{prefix}"

[[pools]]
model = "qwen32b"
backends = [
  {{ url = "{b0}", weight = {weight0} }},
  "{b1}",
  "{b2}",
]
max_in_flight_per_backend = 32

# Shorter than the stall fault, so a stalled backend's streams end with a timeout event.
[pools.timeouts]
idle_ms = 1000

[pools.warmup]
requests = 2
slow_start_seconds = 3
"#,
        port = g.port,
        admin = g.admin_port,
        spill = g.spill.display(),
        db = s.db_url,
        redis = s.redis_url,
        prefix = s.redis_prefix,
        b0 = backend(0),
        b1 = backend(1),
        b2 = backend(2),
    )
}

pub(super) async fn admin_call(
    admin_port: u16,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    use http_body_util::BodyExt;
    let c = client::http_client();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{admin_port}{path}"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", token(Role::Admin)))
        .body(http_body_util::Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// An unlabelled series from a gateway's admin `/metrics`.
pub(super) async fn metric(admin_port: u16, name: &str) -> f64 {
    let (s, text) = admin_call(admin_port, "GET", "/metrics", None).await;
    assert_eq!(s, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

pub(super) async fn config_generation(admin_port: u16) -> f64 {
    metric(admin_port, "fleetgate_config_generation").await
}

/// What a gateway shows once every fault is over: Redis and the key store up, nothing left in
/// the spill file, every backend healthy. `Err` names what is not (yet) so.
pub(super) async fn recovered(admin_port: u16) -> Result<(), String> {
    let mut wrong = Vec::new();
    for (name, want) in [
        ("fleetgate_limits_redis_up", 1.0),
        ("fleetgate_key_store_up", 1.0),
        ("fleetgate_request_log_spilled_rows", 0.0),
    ] {
        let v = metric(admin_port, name).await;
        if v != want {
            wrong.push(format!("{name} {v}"));
        }
    }
    let (s, body) = admin_call(admin_port, "GET", "/admin/backends", None).await;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    for b in v["data"].as_array().unwrap() {
        if b["state"] != "healthy" {
            wrong.push(format!("backend {} {}", b["backend"], b["state"]));
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join(", "))
    }
}

// ----------------------------------------------------------------------------------------------
// Requests and their classification
