//! Outside programs: whether a tool is installed, a child stopped when dropped, waiting until
//! something listens, and Debian's nginx in front of a backend.

use super::*;

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

/// Wait until `GET url` answers 200 (a process just started); panics after 20 s. A replica
/// starting on PostgreSQL while the rest of the suite loads both cores took over 5 s once.
pub async fn wait_for_200(url: &str) {
    let c = client::http_client();
    let uri: Uri = url.parse().unwrap();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let req = http::Request::get(uri.clone())
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        if matches!(c.request(req).await, Ok(r) if r.status() == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{url} did not answer 200 within 20 s");
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

pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
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
