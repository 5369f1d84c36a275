//! Shared test harness: real sims and a real gateway on 127.0.0.1:0, and a client.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: each test uses some helpers, and a failure here is a test failure"
)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fleetgate_gateway::config::{Config, PoolConfig, ServerConfig};
use fleetgate_gateway::server::Server;
use fleetgate_gateway::telemetry::{Recorder, RequestRecord};
use fleetgate_protocol::client::{self, HttpClient, Measured};
use fleetgate_sim::{SimArgs, SimServer};
use http::{HeaderMap, HeaderValue, Uri};
use tokio::net::TcpListener;

/// A sim on a free port with small, realistic delays unless `f` changes them.
pub async fn sim(f: impl FnOnce(&mut SimArgs)) -> SimServer {
    let mut args = SimArgs {
        decode_step_ms: 2.0,
        decode_ms_per_seq: 0.0,
        prefill_us_per_token: 0.0,
        capture_streams: true,
        ..SimArgs::default()
    };
    f(&mut args);
    fleetgate_sim::start(args).await.expect("sim starts")
}

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

fn key_for_port(port: Option<u16>) -> Option<String> {
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
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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

/// A port nothing listens on.
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

pub fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            http::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

/// POST with `hdrs`; when they carry no credentials and `uri` is a harness gateway, its key is
/// added as `Authorization: Bearer`.
pub async fn post(uri: &Uri, hdrs: &[(&str, &str)], body: impl Into<Bytes>) -> Measured {
    let c: HttpClient = client::http_client();
    let mut h = headers(hdrs);
    if !h.contains_key("authorization")
        && !h.contains_key("x-api-key")
        && !h.contains_key("x-no-auth")
        && let Some(key) = key_for_port(uri.port_u16())
    {
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
        );
    }
    h.remove("x-no-auth");
    client::send(&c, uri, &h, body.into(), true)
        .await
        .expect("request completes")
}

/// A request builder with the gateway's key already set.
pub fn authed(gw: &Gateway, method: &str, path: &str) -> http::request::Builder {
    http::Request::builder()
        .method(method)
        .uri(gw.url(path))
        .header("authorization", format!("Bearer {}", gw.key))
}

/// A JSON response body (kept by `post`).
pub fn json_body(m: &Measured) -> serde_json::Value {
    serde_json::from_slice(m.body.as_ref().expect("body kept")).unwrap()
}

/// Decode an OpenAI error body as a client would.
pub fn openai_error(m: &Measured) -> serde_json::Value {
    let body = m.body.as_ref().expect("body kept");
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "error body is JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    let err = v["error"].clone();
    assert!(err.is_object(), "OpenAI shape: {v}");
    assert!(err["message"].is_string(), "message: {v}");
    assert!(err["type"].is_string(), "type: {v}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "param/code: {v}"
    );
    err
}

/// Poll `cond` every 10 ms for at most `limit`.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

/// A throwaway PostgreSQL database for one test, dropped at the end.
pub struct PgTestDb {
    pub url: String,
    admin_url: String,
    name: String,
}

impl Drop for PgTestDb {
    fn drop(&mut self) {
        let admin = self.admin_url.clone();
        let name = self.name.clone();
        // Dropped inside a runtime: do the cleanup on a thread of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                use sqlx::Connection;
                if let Ok(mut c) = sqlx::PgConnection::connect(&admin).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut c)
                        .await;
                }
            });
        })
        .join();
    }
}

/// The server used for PostgreSQL tests (`FLEETGATE_TEST_PG`, default the local one).
pub fn pg_admin_url() -> String {
    std::env::var("FLEETGATE_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh database, or `None` (loudly) when PostgreSQL is not reachable — except under
/// `CI=true`, where a missing service is a failure.
pub async fn pg_database(test: &str) -> Option<PgTestDb> {
    use sqlx::Connection;
    let admin_url = pg_admin_url();
    let mut conn = match tokio::time::timeout(
        Duration::from_secs(5),
        sqlx::PgConnection::connect(&admin_url),
    )
    .await
    {
        Ok(Ok(c)) => c,
        other => {
            let why = match other {
                Ok(Err(e)) => e.to_string(),
                _ => "connect timed out".to_owned(),
            };
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: PostgreSQL at {admin_url} is required under CI=true: {why}");
            }
            eprintln!(
                "\n*** SKIPPED {test} on PostgreSQL: {admin_url} not reachable ({why}). Start PostgreSQL or set FLEETGATE_TEST_PG. ***\n"
            );
            return None;
        }
    };
    use std::hash::{BuildHasher, RandomState};
    let n = RandomState::new().hash_one(std::time::SystemTime::now());
    let name = format!("fg_test_{}_{n:x}", std::process::id());
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let base = admin_url
        .rsplit_once('/')
        .map_or(admin_url.as_str(), |(b, _)| b);
    Some(PgTestDb {
        url: format!("{base}/{name}"),
        admin_url: admin_url.clone(),
        name,
    })
}

/// The two stores every key test runs against: SQLite always, PostgreSQL when reachable.
pub async fn stores(
    test: &str,
) -> Vec<(
    fleetgate_gateway::config::DatabaseConfig,
    Box<dyn std::any::Any + Send>,
)> {
    let dir = temp_dir("store");
    let mut out: Vec<(
        fleetgate_gateway::config::DatabaseConfig,
        Box<dyn std::any::Any + Send>,
    )> = vec![(
        fleetgate_gateway::config::DatabaseConfig {
            sqlite_path: dir.join("keys.db"),
            ..Default::default()
        },
        Box::new(TempDir(dir)),
    )];
    if let Some(db) = pg_database(test).await {
        out.push((
            fleetgate_gateway::config::DatabaseConfig {
                url: Some(fleetgate_gateway::secret::Secret::new(db.url.clone())),
                ..Default::default()
            },
            Box::new(db),
        ));
    }
    out
}

/// A TCP proxy the test can cut (listener and connections closed) and start again on the
/// same port (`Cuttable::start(port, upstream)`): a `Faulty` proxy left without faults.
pub type Cuttable = Faulty;

/// What a `Faulty` proxy does to the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Carried as they come.
    None,
    /// Held, both ways, connections open: a server that is paused (SIGSTOP) or wedged.
    Paused,
    /// Each chunk held this long: a slow server or network.
    Slow(Duration),
}

/// A TCP proxy the test can pause, slow down, cut (listener and connections closed) and start
/// again on the same port: every way a shared server (Redis) can fail short of lying.
pub struct Faulty {
    pub port: u16,
    fault: tokio::sync::watch::Sender<Fault>,
    task: tokio::task::JoinHandle<()>,
}

impl Faulty {
    pub async fn start(port: u16, upstream: std::net::SocketAddr) -> Self {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_reuseaddr(true).unwrap();
        sock.bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .unwrap();
        let listener = sock.listen(64).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (fault, rx) = tokio::sync::watch::channel(Fault::None);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                let Ok(out) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = out.into_split();
                conns.spawn(pump(ir, ow, rx.clone()));
                conns.spawn(pump(or, iw, rx.clone()));
            }
        });
        Self { port, fault, task }
    }

    pub fn set(&self, f: Fault) {
        self.fault.send_replace(f);
    }

    /// Close the listener and every open connection (aborting the task drops them all).
    pub fn cut(self) -> u16 {
        self.task.abort();
        self.port
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut fault: tokio::sync::watch::Receiver<Fault>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        loop {
            let f = *fault.borrow_and_update();
            match f {
                Fault::None => break,
                Fault::Slow(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Fault::Paused => {
                    if fault.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
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

/// The Redis the tests share (FLEETGATE_TEST_REDIS, default redis://127.0.0.1:6379), or
/// `None` with a loud skip notice; under CI=true a missing Redis fails the test.
pub async fn redis_url(test: &str) -> Option<String> {
    let url = std::env::var("FLEETGATE_TEST_REDIS")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let reachable = async {
        let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
        let mut c = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(3), reachable).await {
        Ok(Ok(_)) => Some(url),
        other => {
            let why = match other {
                Ok(Err(e)) => e,
                _ => "connect timed out".to_owned(),
            };
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: Redis at {url} is required under CI=true: {why}");
            }
            eprintln!(
                "\n*** SKIPPED {test}: Redis at {url} not reachable ({why}). Start Redis or set FLEETGATE_TEST_REDIS. ***\n"
            );
            None
        }
    }
}

/// Send a request and return as soon as the response head is in (the body unread), so the
/// request stays in flight until the response is dropped or drained.
pub async fn open(
    uri: &Uri,
    key: &str,
    body: impl Into<Bytes>,
) -> http::Response<hyper::body::Incoming> {
    let c: HttpClient = client::http_client();
    let req = http::Request::post(uri.clone())
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body.into()))
        .unwrap();
    c.request(req).await.expect("response head")
}

/// The gateway's Prometheus registry in text format, as `GET /metrics` serves it.
pub fn metrics_text(gw: &Gateway) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&gw.server.registry.gather())
        .unwrap()
}

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

/// Wait until `GET url` answers 200 (a process just started); panics after 5 s.
pub async fn wait_for_200(url: &str) {
    let c = client::http_client();
    let uri: Uri = url.parse().unwrap();
    for _ in 0..500 {
        let req = http::Request::get(uri.clone())
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        if matches!(c.request(req).await, Ok(r) if r.status() == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{url} did not answer 200 within 5 s");
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

/// A backend that is not the sim (a load balancer's error page, a server without vLLM's
/// routes): every request is answered by `answer(path)` = (status, content type, body).
/// Returns its address and its task (abort it when done).
pub async fn stub_backend(
    answer: fn(&str) -> (u16, &'static str, &'static [u8]),
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    http_backend(move |req| {
        let (status, content_type, body) = answer(req.uri().path());
        async move {
            http::Response::builder()
                .status(status)
                .header("content-type", content_type)
                .body(http_body_util::Full::new(Bytes::from_static(body)))
                .unwrap()
        }
    })
    .await
}

/// A plain HTTP/1.1 backend on a free port: every request is answered by `answer`. Returns its
/// address and its task (abort it when done).
pub async fn http_backend<F, Fut, B>(answer: F) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = http::Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let answer = answer.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let answer = answer(req);
                    async move { Ok::<_, std::convert::Infallible>(answer.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, server)
}

/// A backend that keeps the head of every request it gets and answers each with a small chat
/// completion whose response head carries `extra` headers as they are.
pub struct HeadRecorder {
    pub addr: SocketAddr,
    pub heads: Arc<Mutex<Vec<HeaderMap>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HeadRecorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HeadRecorder {
    pub async fn start(extra: &'static [(&'static str, &'static str)]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            seen.lock().unwrap().push(req.headers().clone());
                            async move {
                                let mut resp = http::Response::builder()
                                    .status(200)
                                    .header("content-type", "application/json");
                                for (k, v) in extra {
                                    resp = resp.header(*k, *v);
                                }
                                Ok::<_, std::convert::Infallible>(
                                    resp.body(http_body_util::Full::new(Bytes::from_static(
                                        br#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
                                    )))
                                    .unwrap(),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, heads, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The heads received so far.
    pub fn heads(&self) -> Vec<HeaderMap> {
        self.heads.lock().unwrap().clone()
    }
}

/// Whether an outside tool a test needs is here; `None` (loudly) when it is not — except under
/// `CI=true`, where `.ci/run` installs it and its absence is a failure.
pub fn tool_or_skip(test: &str, what: &str, present: bool) -> Option<()> {
    if present {
        return Some(());
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: {what} is required under CI=true (.ci/run installs it)");
    }
    eprintln!("\n*** SKIPPED {test}: {what} is not installed (.ci/run installs it). ***\n");
    None
}

/// A child process stopped when dropped: SIGTERM first (nginx's master then stops its
/// workers; SIGKILL would leave them running), SIGKILL after 2 s.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        for _ in 0..200 {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait (at most 10 s) until something accepts connections on `addr`.
pub async fn listening(addr: SocketAddr) {
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing listens on {addr} after 10 s");
}

/// Debian's nginx as a plain reverse proxy on a free port in front of `upstream` (it cannot
/// bind port 0 and say which: the port is free at this moment), or `None` when nginx is not
/// installed. nginx enforces HTTP/1.1: a request without `Host` gets 400.
pub async fn nginx_in_front(
    test: &str,
    upstream: SocketAddr,
) -> Option<(Child, SocketAddr, TempDir)> {
    let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    tool_or_skip(test, "Debian's nginx", bin.is_some())?;
    let dir = temp_dir("nginx");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let d = dir.display();
    std::fs::write(
        dir.join("nginx.conf"),
        format!(
            "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
             events {{ worker_connections 256; }}\nhttp {{\n access_log off;\n \
             client_body_temp_path {d}/client_body;\n proxy_temp_path {d}/proxy;\n \
             upstream backend {{ server {upstream}; keepalive 16; }}\n \
             server {{\n  listen 127.0.0.1:{port};\n  location / {{\n   proxy_pass http://backend;\n   \
             proxy_http_version 1.1;\n   proxy_set_header Connection \"\";\n   proxy_buffering off;\n  }}\n }}\n}}\n"
        ),
    )
    .unwrap();
    let child = std::process::Command::new(bin.unwrap())
        .arg("-p")
        .arg(format!("{d}/"))
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Child(child);
    listening(addr).await;
    Some((child, addr, TempDir(dir)))
}

// ---------------------------------------------------------------------------------------------
// The coding agents, as `.ci/run` installs them (npm `@openai/codex`, `@anthropic-ai/claude-code`):
// tests/agent_clients.rs runs them through the gateway to the sim, tests/real_vllm.rs to real
// vLLM. They run with their retries off and under a wall-clock limit (Codex waits forever for a
// network it cannot reach; Claude Code retries for minutes by default).

/// Where `.ci/run` installs the agents' npm packages.
pub fn agents_dir() -> std::path::PathBuf {
    match std::env::var_os("FLEETGATE_AGENTS_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/fleetgate/agents"),
    }
}

pub fn agent_bin(name: &str) -> Option<std::path::PathBuf> {
    let p = agents_dir().join("node_modules/.bin").join(name);
    p.exists().then_some(p)
}

pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Run `cmd` with exactly `env` (and PATH), stdin closed, killed after `limit` (a panic then).
pub async fn run_agent(
    cmd: &std::path::Path,
    args: &[&str],
    env: &[(&str, String)],
    cwd: &std::path::Path,
    limit: Duration,
) -> Ran {
    let mut c = std::process::Command::new(cmd);
    c.args(args)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    output_within(c, limit).await
}

/// The output of `c`, or a panic when it runs past `limit` (it is killed first).
pub async fn output_within(mut c: std::process::Command, limit: Duration) -> Ran {
    use std::sync::atomic::{AtomicBool, Ordering};
    let name = format!("{c:?}");
    let (out, timed_out) = tokio::task::spawn_blocking(move || {
        let child = c.spawn().unwrap();
        let pid = child.id();
        let done = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let (d, f) = (done.clone(), fired.clone());
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while start.elapsed() < limit {
                if d.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            f.store(true, Ordering::SeqCst);
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        });
        let out = child.wait_with_output().unwrap();
        done.store(true, Ordering::SeqCst);
        (out, fired.load(Ordering::SeqCst))
    })
    .await
    .unwrap();
    let ran = Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        !timed_out,
        "{name} did not finish within {limit:?}:\nstdout: {}\nstderr: {}",
        ran.stdout, ran.stderr
    );
    ran
}

/// Codex CLI's directories under `dir`: its HOME, its CODEX_HOME with the gateway at
/// `base_url` (ending in `/v1`) as the provider of `model`, as docs/agents.md gives it (retries
/// off), and a work directory to run it in.
pub struct Codex {
    pub home: std::path::PathBuf,
    pub codex_home: std::path::PathBuf,
    pub work: std::path::PathBuf,
}

impl Codex {
    pub fn new(dir: &std::path::Path, base_url: &str, model: &str) -> Codex {
        let codex = Codex {
            home: dir.join("home"),
            codex_home: dir.join("codex"),
            work: dir.join("work"),
        };
        for d in [&codex.home, &codex.codex_home, &codex.work] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(
            codex.codex_home.join("config.toml"),
            format!(
                r#"model = "{model}"
model_provider = "fleetgate"
check_for_update_on_startup = false

[model_providers.fleetgate]
name = "fleetgate"
base_url = "{base_url}"
wire_api = "responses"
env_key = "FLEETGATE_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
metrics_exporter = "none"
"#
            ),
        )
        .unwrap();
        codex
    }

    /// Its environment, with `key` as the provider's key.
    pub fn env(&self, key: &str) -> Vec<(&'static str, String)> {
        vec![
            ("HOME", self.home.display().to_string()),
            ("CODEX_HOME", self.codex_home.display().to_string()),
            ("FLEETGATE_KEY", key.to_owned()),
        ]
    }

    /// `codex exec` on `prompt`: no git repository needed, nothing kept, no sandbox.
    pub fn exec_args(prompt: &str) -> [&str; 8] {
        [
            "exec",
            "--skip-git-repo-check",
            "--ephemeral",
            "--disable",
            "plugins",
            "--sandbox",
            "danger-full-access",
            prompt,
        ]
    }
}

/// Claude Code's environment (`claude -p`): the gateway at `base_url` (without `/v1`), `key` in
/// `var` (`ANTHROPIC_AUTH_TOKEN` or `ANTHROPIC_API_KEY`), `model` for its main and its small
/// model, no telemetry, no updates, no retries.
pub fn claude_env(
    home: &std::path::Path,
    base_url: &str,
    var: &'static str,
    key: &str,
    model: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("HOME", home.display().to_string()),
        ("ANTHROPIC_BASE_URL", base_url.to_owned()),
        (var, key.to_owned()),
        ("ANTHROPIC_MODEL", model.to_owned()),
        ("ANTHROPIC_DEFAULT_HAIKU_MODEL", model.to_owned()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
        ("DISABLE_TELEMETRY", "1".to_owned()),
        ("DISABLE_AUTOUPDATER", "1".to_owned()),
        ("DISABLE_ERROR_REPORTING", "1".to_owned()),
        ("CLAUDE_CODE_MAX_RETRIES", "0".to_owned()),
    ]
}

/// The rows the gateway recorded for `endpoint`, each checked: a clean 200 with its TTFT, hop
/// and usage.
pub fn measured_rows(gw: &Gateway, endpoint: &str) -> usize {
    let rows = gw.records.lock().unwrap().clone();
    let mine: Vec<_> = rows
        .iter()
        .filter(|r| r.endpoint == Some(endpoint))
        .collect();
    for r in &mine {
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.error, None, "{r:?}");
        assert!(r.timeline.upstream_ttft().is_some(), "TTFT recorded: {r:?}");
        assert!(r.timeline.overhead_total().is_some(), "hop recorded: {r:?}");
        assert!(r.timeline.stream().usage.is_some(), "usage recorded: {r:?}");
    }
    mine.len()
}
