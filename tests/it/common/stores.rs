//! The shared services: a throwaway PostgreSQL database per test, the Redis the tests share, and
//! a TCP proxy in front of either that a test can pause, slow, cut and start again.

use super::*;

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
