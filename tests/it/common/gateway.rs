//! A real gateway on 127.0.0.1:0 with its own SQLite store, a stress key issued on it, and every
//! record it writes kept for the test.

use super::*;

/// What the gateway recorded, one snapshot per finished request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub request_id: String,
    pub endpoint: Option<&'static str>,
    pub status: u16,
    pub error: Option<&'static str>,
    pub stream: bool,
    pub model: Option<String>,
    pub backend: Option<String>,
    pub retries: u8,
    /// The public id of the key the request is counted under (a refused key's included).
    pub key_id: Option<String>,
    pub timeline: fleetgate_gateway::telemetry::Timeline,
}

pub struct Gateway {
    pub server: Server,
    pub records: Arc<Mutex<Vec<Seen>>>,
    /// A stress key issued on this gateway's store; `post` sends it unless told otherwise.
    pub key: String,
    pub db_dir: TempDir,
}

/// A directory removed when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Default key of the gateway listening on a port (so `post` can add it).
static KEYS: Mutex<Vec<(u16, String)>> = Mutex::new(Vec::new());

pub(crate) fn key_for_port(port: Option<u16>) -> Option<String> {
    let port = port?;
    KEYS.lock()
        .unwrap()
        .iter()
        .rev()
        .find(|(p, _)| *p == port)
        .map(|(_, k)| k.clone())
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    use std::hash::{BuildHasher, RandomState};
    let n = RandomState::new().hash_one(std::time::SystemTime::now());
    let dir = std::env::temp_dir().join(format!("fleetgate-{tag}-{}-{n:x}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Gateway {
    pub fn url(&self, path: &str) -> Uri {
        format!("{}{}", self.server.base_url(), path)
            .parse()
            .unwrap()
    }

    /// Wait (bounded) until the record of `request_id` is in.
    pub async fn record_of(&self, request_id: &str) -> Seen {
        for _ in 0..500 {
            if let Some(s) = self
                .records
                .lock()
                .unwrap()
                .iter()
                .find(|s| s.request_id == request_id)
            {
                return s.clone();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no record for {request_id}");
    }
}

pub fn pool(model: &str, backends: &[String]) -> PoolConfig {
    PoolConfig::new(model, backends.iter().map(|b| b.parse().unwrap()).collect())
}

pub async fn gateway(pools: Vec<PoolConfig>) -> Gateway {
    gateway_with(pools, |_| {}).await
}

pub async fn gateway_with(pools: Vec<PoolConfig>, f: impl FnOnce(&mut Config)) -> Gateway {
    let db_dir = temp_dir("gw");
    let mut config = Config::with_pools(pools);
    config.server = ServerConfig {
        health_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(10),
        ..ServerConfig::default()
    };
    config.database.sqlite_path = db_dir.join("keys.db");
    config.request_log.spill_path = db_dir.join("request-log.spill");
    config.request_log.flush_interval = Duration::from_millis(20);
    config.admin.listen = Some("127.0.0.1:0".parse().unwrap());
    f(&mut config);
    // Bound as `serve` binds, with the configured accept queue.
    let listener = fleetgate_gateway::server::listen(
        "127.0.0.1:0".parse().unwrap(),
        config.server.listen_backlog,
    )
    .unwrap();
    let records = Arc::new(Mutex::new(Vec::new()));
    let sink = records.clone();
    let recorder = Recorder::new(false).with_observer(move |r: &RequestRecord| {
        sink.lock().unwrap().push(Seen {
            request_id: r.request_id.to_str().unwrap().to_owned(),
            endpoint: r.endpoint.map(|e| e.as_str()),
            status: r.status,
            error: r.error.map(|e| e.as_str()),
            stream: r.stream,
            model: r.model.as_deref().map(str::to_owned),
            backend: r.backend.as_deref().map(str::to_owned),
            retries: r.retries,
            key_id: r.key.as_ref().map(|k| k.public_id.to_string()),
            timeline: r.timeline.clone(),
        });
    });
    let server = Server::start_on(listener, &config, recorder).await.unwrap();
    let (key, record) = server
        .auth
        .store()
        .create(
            &fleetgate_gateway::store::CreateKey {
                name: "test".into(),
                environment: Some(fleetgate_gateway::key::Environment::Stress),
                ..Default::default()
            },
            "test",
        )
        .await
        .unwrap();
    server.auth.apply(&record.public_id, Some(record.clone()));
    KEYS.lock()
        .unwrap()
        .push((server.local_addr.port(), key.clone()));
    Gateway {
        server,
        records,
        key,
        db_dir: TempDir(db_dir),
    }
}

/// The public id of a key (`fg-<env>-<public id>-<secret>`): what the gateway puts before
/// the request id a backend gets on `/v1/responses`.
pub fn public_id(key: &str) -> &str {
    key.split('-').nth(2).expect("a fleetgate key")
}

/// The request id a backend gets on `/v1/responses` for the client's `id`, sent with `key`.
pub fn upstream_responses_id(key: &str, id: &str) -> String {
    format!("{}-{id}", public_id(key))
}

/// Issue a key of `env` on this gateway's store, with `f` setting its limits; it is in the
/// gateway's snapshot when this returns. Returns the secret and the record.
pub async fn issue_key(
    gw: &Gateway,
    env: fleetgate_gateway::key::Environment,
    f: impl FnOnce(&mut fleetgate_gateway::store::CreateKey),
) -> (String, fleetgate_gateway::key::KeyRecord) {
    let mut req = fleetgate_gateway::store::CreateKey {
        name: format!("{env} test key"),
        environment: Some(env),
        ..Default::default()
    };
    f(&mut req);
    let (secret, record) = gw.server.auth.store().create(&req, "test").await.unwrap();
    gw.server
        .auth
        .apply(&record.public_id, Some(record.clone()));
    (secret, record)
}

/// The gateway's Prometheus registry in text format, as `GET /metrics` serves it.
/// Every backend of `model`'s pool reads healthy, within 5 s.
pub async fn all_backends_healthy(gw: &Gateway, model: &str) -> bool {
    let pools = gw.server.pools();
    let backends = &pools.get(model).unwrap().backends;
    eventually(Duration::from_secs(5), || {
        backends.iter().all(|b| b.state().as_str() == "healthy")
    })
    .await
}

pub fn metrics_text(gw: &Gateway) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&gw.server.registry.gather())
        .unwrap()
}
