//! The `fleetgate` binary as a user runs it: config checking and its exit code, `serve` with
//! SIGTERM draining, and the demo.

#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a failure here is a test failure"
)]

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");

fn temp_config(text: &str) -> tempfile_path::TempPath {
    tempfile_path::write(text)
}

/// A tiny self-cleaning temp file (no extra dependency).
mod tempfile_path {
    use std::path::PathBuf;

    pub struct TempPath(pub PathBuf);

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    pub fn write(text: &str) -> TempPath {
        use std::hash::{BuildHasher, RandomState};
        let n = RandomState::new().hash_one(std::time::SystemTime::now());
        let p = std::env::temp_dir().join(format!("fleetgate-cli-{}-{n}.toml", std::process::id()));
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        TempPath(p)
    }
}

/// A child process killed if the test fails before it is waited for.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, |c| c.id())
    }
    fn take(mut self) -> std::process::Child {
        self.0
            .take()
            .unwrap_or_else(|| panic!("child already taken"))
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn check_config_accepts_the_example() {
    let out = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/fleetgate.toml"
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("model qwen32b -> http://127.0.0.1:8001/, http://127.0.0.1:8002/\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("model embed -> http://127.0.0.1:8003/ [embed model]"),
        "{stdout}"
    );
}

/// A backend URL with credentials (`http://user:pass@host`) is refused, pointing to
/// `upstream_api_key`, and the message never shows the password: the gateway would have put
/// them in the request line and never sent them as credentials.
#[test]
fn a_backend_url_with_credentials_is_refused_without_showing_them() {
    for backend in [
        "\"http://vllm:s3cret-pw@127.0.0.1:8000\"",
        "{ url = \"https://vllm:s3cret-pw@gpu.example:8443/v1\" }",
    ] {
        let cfg = temp_config(&format!(
            "[[pools]]\nmodel = \"m\"\nbackends = [{backend}]\n"
        ));
        for cmd in ["check-config", "serve"] {
            let out = Command::new(BIN)
                .args([cmd, "--config"])
                .arg(&cfg.0)
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(64), "{cmd}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                stderr.contains("pools[0].backends[0]") && stderr.contains("upstream_api_key"),
                "{cmd}: {stderr}"
            );
            assert!(!stderr.contains("s3cret-pw"), "{cmd}: {stderr}");
            assert!(stderr.contains("***@"), "{cmd}: {stderr}");
        }
    }
}

#[test]
fn bad_config_exits_64_naming_the_field() {
    let cfg = temp_config("[[pools]]\nmodel = \"m\"\nbackends = [\"10.0.0.1:8000\"]\n");
    for cmd in ["check-config", "serve"] {
        let out = Command::new(BIN)
            .args([cmd, "--config"])
            .arg(&cfg.0)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{cmd}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("pools[0].backends[0]") && stderr.contains("scheme"),
            "{cmd}: {stderr}"
        );
    }
    let out = Command::new(BIN)
        .args(["check-config", "--config", "/nonexistent/fleetgate.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_drains_a_stream_on_sigterm() {
    let sim = sim(|a| a.decode_step_ms = 10.0).await;
    let port = closed_port().await.port();
    let dir = temp_dir("cli");
    let db = dir.join("keys.db");
    let cfg = temp_config(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace_seconds = 10\nlog_format = \"json\"\n\n[database]\nsqlite_path = \"{}\"\n\n[admin]\nlisten = \"\"\n\n[[pools]]\nmodel = \"qwen32b\"\nbackends = [\"{}\"]\n",
        db.display(),
        sim.url()
    ));
    // Issue a key with the CLI, as an operator would.
    let out = Command::new(BIN)
        .args(["keys", "--config"])
        .arg(&cfg.0)
        .args([
            "create",
            "--env",
            "prod",
            "--name",
            "sigterm test",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let key = created["key"].as_str().unwrap().to_owned();
    assert!(key.starts_with("fg-prod-"));
    let child = KillOnDrop(Some(
        Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&cfg.0)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    wait_for_200(&format!("http://127.0.0.1:{port}/healthz")).await;
    let uri: http::Uri = format!("http://127.0.0.1:{port}/v1/chat/completions")
        .parse()
        .unwrap();
    let auth = format!("Bearer {key}");
    let stream = tokio::spawn(async move {
        post(
            &uri,
            &[("x-request-id", "sigterm-1"), ("authorization", &auth)],
            fleetgate_protocol::client::chat_body("qwen32b", "hi", 50, true),
        )
        .await
    });
    let stats = sim.stats().clone();
    assert!(
        eventually(Duration::from_secs(5), || stats
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1)
        .await
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let m = stream.await.unwrap();
    assert_eq!(m.status, 200);
    assert!(m.metrics.done, "stream cut by SIGTERM");
    assert_eq!(
        m.metrics.usage.map(|u| u.completion_tokens),
        None,
        "usage was not asked for"
    );
    assert_eq!(m.metrics.content_events, 50);
    let out = tokio::task::spawn_blocking(move || child.take().wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "exit status {:?}", out.status);
    // JSON logs: one request event with the Timeline fields.
    let logs = String::from_utf8_lossy(&out.stdout);
    let event = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["request_id"] == "sigterm-1")
        .unwrap_or_else(|| panic!("no request event in:\n{logs}"));
    assert_eq!(event["status"], 200);
    assert_eq!(event["content_events"], 50);
    // The gateway asked for usage upstream (the client did not) and hid it from the client.
    assert_eq!(event["usage_source"], "backend");
    assert_eq!(event["completion_tokens"], 50);
    assert!(
        event["client_ttft_ms"].as_f64().unwrap() >= event["upstream_ttft_ms"].as_f64().unwrap()
    );
    assert!(event["overhead_pre_us"].as_f64().unwrap() >= 0.0);
    assert_eq!(event["environment"], "prod");
    assert_eq!(event["key_id"], created["record"]["public_id"]);
    assert!(!logs.contains(&key), "the key must never appear in logs");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_prints_the_table_and_how_to_try_it() {
    let mut child = Command::new(BIN)
        .args([
            "demo",
            "--port",
            "0",
            "--requests",
            "4",
            "--max-tokens",
            "8",
            "--no-wait",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdin.take().map(|mut s| s.write_all(b"")));
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("median TTFT difference"), "{stdout}");
    assert!(stdout.matches(" ms ").count() >= 4, "{stdout}");
    assert!(
        stdout.contains("OPENAI_BASE_URL=http://127.0.0.1:") && stdout.contains("curl -sN "),
        "{stdout}"
    );
    assert!(!stdout.contains("failed"), "{stdout}");
}

/// The operator's key round trip with the CLI alone, on an embedded store.
#[test]
fn keys_cli_round_trip() {
    let dir = temp_dir("keys-cli");
    let db = dir.join("keys.db");
    // `--actor` is taken by the commands that change a key, and only by them.
    let run = |args: &[&str]| {
        let changes = matches!(args.first(), Some(&("create" | "revoke" | "rotate")));
        outcome(
            Command::new(BIN)
                .arg("keys")
                .arg("--sqlite")
                .arg(&db)
                .args(args)
                .args(if changes {
                    &["--actor", "ops@test"][..]
                } else {
                    &[]
                }),
        )
    };
    let (code, out, err) = run(&[
        "create",
        "--env",
        "stress",
        "--name",
        "nightly load",
        "--models",
        "qwen32b",
        "--expires",
        "7d",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("shown only this once") && out.contains("export FLEETGATE_API_KEY=fg-stress-"),
        "{out}"
    );
    let key = out
        .split_whitespace()
        .find(|w| w.starts_with("fg-stress-"))
        .unwrap()
        .to_owned();
    let id = fleetgate_gateway::key::parse(&key)
        .unwrap()
        .public_id
        .to_owned();

    let (code, out, _) = run(&["list", "--env", "stress"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&id) && out.contains("active") && out.contains("nightly load"),
        "{out}"
    );
    assert!(!out.contains(&key), "a listing never shows the key");

    let (code, _, err) = run(&["revoke", &id, "--reason", "test over"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run(&["revoke", &id, "--reason", "again"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("already revoked"), "{err}");
    let (_, out, _) = run(&["show", &id, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "revoked");
    assert_eq!(v["revoke_reason"], "test over");
    assert_eq!(v["revoked_by"], "ops@test");

    let (code, _, err) = run(&["rotate", &id]);
    assert_ne!(code, Some(0), "a revoked key cannot be rotated");
    assert!(err.contains("revoked"), "{err}");
    let (_, out, _) = run(&["audit", &id, "--json"]);
    let audit: serde_json::Value = serde_json::from_str(&out).unwrap();
    let actions: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["revoke", "create"]);
    // For people, the trail's instants are ISO 8601 (the JSON keeps the stored number).
    let expires = audit[1]["detail"]["expires_at"].as_i64().unwrap();
    let (_, text, _) = run(&["audit", &id]);
    assert!(text.contains("\"expires_at\":\"20"), "{text}");
    assert!(!text.contains(&expires.to_string()), "{text}");
    let (code, _, err) = run(&["create", "--env", "dev", "--name", "x"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("stress, gray or prod"), "{err}");
    // `-q` on rotate: the new key alone, for `export X=$(fleetgate keys rotate ID -q)`.
    let (_, out, _) = run(&["create", "--env", "gray", "--name", "rotated", "-q"]);
    let first = out.trim().to_owned();
    let rid = fleetgate_gateway::key::parse(&first)
        .unwrap()
        .public_id
        .to_owned();
    let (code, out, err) = run(&["rotate", &rid, "--grace", "1m", "-q"]);
    assert_eq!(code, Some(0), "{err}");
    let second = out.trim();
    assert_eq!(
        fleetgate_gateway::key::parse(second).unwrap().public_id,
        rid,
        "one line, the new key: {out:?}"
    );
    assert_ne!(second, first);
    // A read-only command takes no --actor (it records nothing).
    let (code, _, err) = run(&["list", "--actor", "x"]);
    assert_eq!(code, Some(64), "{err}");
    // Store flags go anywhere, also before the subcommand (`fleetgate --sqlite DB keys list`).
    let joined = format!("--sqlite={}", db.display());
    for (before, after) in [
        (vec!["--sqlite", db.to_str().unwrap()], vec!["keys", "list"]),
        (
            vec![],
            vec!["keys", "list", "--sqlite", db.to_str().unwrap()],
        ),
        (vec![joined.as_str()], vec!["keys", "list"]),
        (
            vec!["--sqlite", db.to_str().unwrap()],
            vec!["usage", "--by", "endpoint"],
        ),
    ] {
        let (code, out, err) = outcome(Command::new(BIN).args(&before).args(&after));
        assert_eq!(code, Some(0), "{before:?} {after:?}: {err}");
        assert!(
            out.contains(&rid) || after[0] == "usage",
            "{before:?} {after:?}: {out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Until `served` counts a new request: send one every 50 ms for up to `limit`.
async fn until_served_by(
    uri: &http::Uri,
    key: &str,
    served: &std::sync::atomic::AtomicU64,
    limit: Duration,
) -> bool {
    let auth = format!("Bearer {key}");
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        let before = served.load(std::sync::atomic::Ordering::SeqCst);
        let m = post(
            uri,
            &[("authorization", &auth)],
            fleetgate_protocol::client::chat_body("qwen32b", "hi", 2, true),
        )
        .await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        if served.load(std::sync::atomic::Ordering::SeqCst) > before {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reloads_pools_on_sighup_and_when_the_file_changes() {
    let a = sim(|s| s.zero_delay = true).await;
    let b = sim(|s| s.zero_delay = true).await;
    let port = closed_port().await.port();
    let dir = temp_dir("cli-reload");
    let db = dir.join("keys.db");
    let config_with = |backend: &str, extra: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nwatch_config = true\n\n[database]\nsqlite_path = \"{}\"\n\n[admin]\nlisten = \"\"\n\n[[pools]]\nmodel = \"qwen32b\"\nbackends = [\"{backend}\"]\n{extra}",
            db.display()
        )
    };
    let cfg = temp_config(&config_with(&a.url(), ""));
    let out = Command::new(BIN)
        .args(["keys", "--config"])
        .arg(&cfg.0)
        .args(["create", "--env", "prod", "--name", "reload", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let key = created["key"].as_str().unwrap().to_owned();
    let child = KillOnDrop(Some(
        Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&cfg.0)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let uri: http::Uri = format!("http://127.0.0.1:{port}/v1/chat/completions")
        .parse()
        .unwrap();
    wait_for_200(&format!("http://127.0.0.1:{port}/healthz")).await;
    let (sa, sb) = (a.stats().clone(), b.stats().clone());
    assert!(until_served_by(&uri, &key, &sa.requests, Duration::from_secs(2)).await);

    let hup = || {
        let status = Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    // SIGHUP: the pool moves to b. (The watcher would see the change as well; the signal
    // applies it first.)
    std::fs::write(&cfg.0, config_with(&b.url(), "")).unwrap();
    hup();
    assert!(
        until_served_by(&uri, &key, &sb.requests, Duration::from_secs(5)).await,
        "SIGHUP did not move the pool to b"
    );
    let on_a = sa.requests.load(std::sync::atomic::Ordering::SeqCst);

    // An invalid file is refused; the gateway keeps serving b.
    std::fs::write(
        &cfg.0,
        config_with(&b.url(), "max_in_flight_per_backend = \"many\"\n"),
    )
    .unwrap();
    hup();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(until_served_by(&uri, &key, &sb.requests, Duration::from_secs(1)).await);
    assert_eq!(sa.requests.load(std::sync::atomic::Ordering::SeqCst), on_a);

    // The watcher: a changed file is applied without a signal (ConfigMap updates).
    std::fs::write(&cfg.0, config_with(&a.url(), "")).unwrap();
    assert!(
        until_served_by(&uri, &key, &sa.requests, Duration::from_secs(10)).await,
        "the watcher did not apply the changed file"
    );

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.take().wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success());
    let logs = String::from_utf8_lossy(&out.stdout);
    let reloaded_by = |trigger: &str| {
        logs.lines()
            .any(|l| l.contains("config reloaded") && l.contains(trigger))
    };
    assert!(reloaded_by("SIGHUP"), "{logs}");
    assert!(reloaded_by("the config file changed"), "{logs}");
    assert!(
        logs.contains("reload refused: the config file is invalid"),
        "{logs}"
    );
    assert!(logs.contains("max_in_flight_per_backend"), "{logs}");
    // The shutdown says it drained once (not once per listener and worker thread).
    assert_eq!(logs.matches("drained").count(), 1, "{logs}");
    assert_eq!(
        logs.matches("stopped accepting; draining").count(),
        1,
        "{logs}"
    );
    // Durations in the request events are rounded: milliseconds to the microsecond,
    // microseconds to the tenth (no `39.675000000000004`).
    let mut durations = 0;
    for line in logs.lines().filter(|l| l.contains("fleetgate::request")) {
        for field in line.split_whitespace() {
            let Some((name, value)) = field.split_once('=') else {
                continue;
            };
            let places = match name {
                n if n.ends_with("_ms") => 3,
                n if n.ends_with("_us") => 1,
                _ => continue,
            };
            durations += 1;
            let decimals = value.split_once('.').map_or(0, |(_, d)| d.len());
            assert!(decimals <= places, "{field} in {line}");
        }
    }
    assert!(durations >= 20, "request events with durations: {logs}");
    // Written to a pipe, as to a file: no ANSI colour codes.
    assert!(
        !logs.contains('\u{1b}'),
        "colour codes in a log that is not a terminal: {logs}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_reads_the_key_from_the_environment() {
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let base = format!("http://{}", gw.server.local_addr);
    let bench = move |env: Option<&str>| {
        let mut c = Command::new(BIN);
        c.args([
            "bench",
            "--base-url",
            &base,
            "--api-key-env",
            "FLEETGATE_TEST_BENCH_KEY",
            "--model",
            "qwen32b",
            "--num-prompts",
            "5",
            "--random-input-len",
            "8",
            "--random-output-len",
            "3",
        ])
        .env_remove("FLEETGATE_TEST_BENCH_KEY");
        if let Some(k) = env {
            c.env("FLEETGATE_TEST_BENCH_KEY", k);
        }
        c.output().unwrap()
    };
    let key = gw.key.clone();
    let out = tokio::task::spawn_blocking(move || bench(Some(&key)))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Serving Benchmark Result"), "{stdout}");
    assert!(
        stdout.contains("Successful requests:                     5"),
        "{stdout}"
    );
    // Without the key every request is refused, and the report says why.
    let base2 = format!("http://{}", gw.server.local_addr);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args([
                "bench",
                "--base-url",
                &base2,
                "--api-key-env",
                "FLEETGATE_TEST_BENCH_KEY",
                "--model",
                "qwen32b",
                "--num-prompts",
                "2",
                "--random-input-len",
                "8",
                "--random-output-len",
                "3",
            ])
            .env_remove("FLEETGATE_TEST_BENCH_KEY")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("HTTP 401"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_ctrl_c_prints_what_was_measured() {
    // Two at a time, 100 tokens 10 ms apart: 40 prompts would take about 20 s.
    let s = sim(|a| {
        a.decode_step_ms = 10.0;
        a.decode_ms_per_seq = 0.0;
    })
    .await;
    let base = s.url();
    let child = KillOnDrop(Some(
        Command::new(BIN)
            .args([
                "bench",
                "--base-url",
                &base,
                "--model",
                "qwen32b",
                "--num-prompts",
                "40",
                "--random-input-len",
                "8",
                "--random-output-len",
                "100",
                "--max-concurrency",
                "2",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let stats = s.stats().clone();
    // Wait until a few requests have finished.
    assert!(
        eventually(Duration::from_secs(10), || stats
            .completed
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 4)
        .await
    );
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.take().wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}");
    assert!(stdout.contains("Serving Benchmark Result"), "{stdout}");
    assert!(stdout.contains("interrupted"), "{stdout}");
    let done: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Successful requests:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!((4..40).contains(&done), "{stdout}");
}

/// Run the binary; (exit code, stdout, stderr).
fn fleetgate(args: &[&str]) -> (Option<i32>, String, String) {
    outcome(Command::new(BIN).args(args))
}

/// Run `cmd` to its end; (exit code, stdout, stderr).
fn outcome(cmd: &mut Command) -> (Option<i32>, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A relative `sqlite_path` (and spill path) in a config file is relative to the file, from
/// whatever directory a command runs; a store that does not exist is created only by `migrate`
/// (and `serve`, the demo), or by `keys create` saying where, and never by a read.
#[test]
fn a_config_files_store_is_the_same_from_any_directory() {
    let conf_dir = TempDir(temp_dir("cli-conf"));
    let elsewhere = TempDir(temp_dir("cli-cwd"));
    let cfg = conf_dir.0.join("fleetgate.toml");
    std::fs::write(
        &cfg,
        "[database]\nsqlite_path = \"keys.db\"\n\n[request_log]\nspill_path = \"spill/rl.spill\"\n\n[admin]\nlisten = \"\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let run_in = |dir: &std::path::Path, args: &[&str]| {
        outcome(Command::new(BIN).current_dir(dir).args(args))
    };
    let store = conf_dir.0.join("keys.db");
    let (code, out, _) = run_in(&elsewhere.0, &["check-config", "--config", cfg]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&format!("store sqlite file {}", store.display())),
        "{out}"
    );
    // A read of a store that does not exist: refused, naming the path, nothing created.
    for read in [
        vec!["keys", "list", "--config", cfg],
        vec!["usage", "--config", cfg, "--since", "1h"],
    ] {
        let (code, _, err) = run_in(&elsewhere.0, &read);
        assert_eq!(code, Some(1), "{read:?}: {err}");
        assert!(
            err.contains(&format!("no key store at {}", store.display()))
                && err.contains("nothing was created")
                && err.contains("relative to that file's directory"),
            "{err}"
        );
        assert!(!store.exists(), "{read:?} created the store");
    }
    // `keys create` from another directory: the store beside the config, said on stderr.
    let (code, key, err) = run_in(
        &elsewhere.0,
        &[
            "keys", "create", "--config", cfg, "--env", "prod", "--name", "x", "-q",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(key.starts_with("fg-prod-"), "{key}");
    assert!(
        err.contains(&format!("no key store at {}", store.display()))
            && err.contains("creating a new one"),
        "{err}"
    );
    assert!(store.exists());
    assert!(
        std::fs::read_dir(&elsewhere.0).unwrap().next().is_none(),
        "nothing in the working directory"
    );
    // From a third directory, the same store: the key is listed, and nothing is said.
    let (code, out, err) = run_in(&conf_dir.0.join(".."), &["keys", "list", "--config", cfg]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(" x") || out.contains("x\n"), "{out}");
    assert!(!err.contains("creating"), "{err}");
    // --sqlite is relative to the working directory, and refused when missing.
    let (code, _, err) = run_in(&elsewhere.0, &["keys", "list", "--sqlite", "none.db"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(&format!(
            "no key store at {} (named by --sqlite)",
            elsewhere.0.join("none.db").display()
        )),
        "{err}"
    );
    assert!(!elsewhere.0.join("none.db").exists());
    // `migrate` creates one.
    let (code, out, err) = run_in(&elsewhere.0, &["migrate", "--sqlite", "new.db"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("schema is current"), "{out}");
    assert!(elsewhere.0.join("new.db").exists());
}

/// The store flags go anywhere on the command line (the demo prints `keys create --sqlite DB
/// …`), `-q` prints the key alone for scripts, and `keys list` lines its columns up for every
/// environment.
#[test]
fn store_flags_go_anywhere_and_the_key_table_lines_up() {
    let dir = TempDir(temp_dir("cli-flags"));
    let db = dir.0.join("keys.db");
    let db = db.to_str().unwrap();
    let (code, out, err) = fleetgate(&[
        "keys", "create", "--sqlite", db, "--env", "prod", "--name", "after",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("fg-prod-"), "{out}");
    let (code, _, err) = fleetgate(&[
        "keys", "--sqlite", db, "create", "--env", "gray", "--name", "before",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let (code, key, err) = fleetgate(&[
        "keys", "create", "--env", "stress", "--name", "last", "-q", "--sqlite", db,
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        key.starts_with("fg-stress-") && key.trim_end().lines().count() == 1,
        "-q prints the key alone: {key}"
    );
    let id = fleetgate_gateway::key::parse(key.trim())
        .unwrap()
        .public_id
        .to_owned();
    let (code, _, err) = fleetgate(&[
        "keys",
        "revoke",
        &id,
        "--sqlite",
        db,
        "--reason",
        "demo over",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = fleetgate(&["keys", "list", "--sqlite", db]);
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    for column in ["STATUS", "CREATED", "NAME"] {
        let at = lines[0].find(column).unwrap();
        for l in &lines[1..] {
            assert!(
                l.as_bytes()[at - 2..at] == *b"  " && l.as_bytes()[at] != b' ',
                "column {column} is not lined up:\n{out}"
            );
        }
    }
    // The config flag too, after the subcommand.
    let (code, _, err) = fleetgate(&["keys", "list", "--config", "/nonexistent/fleetgate.toml"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("/nonexistent/fleetgate.toml"), "{err}");
}

/// Every command that prints survives a reader that stopped reading: no panic, no backtrace,
/// status 0 (the work was done; only its output went unread). The reading end of the pipe is
/// closed before the command writes, so every write finds it closed.
#[test]
fn printing_commands_survive_a_closed_pipe() {
    let dir = TempDir(temp_dir("cli-pipe"));
    let db = dir.0.join("keys.db");
    let db = db.to_str().unwrap();
    let (code, key, err) = fleetgate(&[
        "keys", "create", "--sqlite", db, "--env", "prod", "--name", "x", "-q",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let id = fleetgate_gateway::key::parse(key.trim())
        .unwrap()
        .public_id
        .to_owned();
    let config = temp_config(
        "[admin]\njwt_secret = \"pipe-test-secret-0123456789abcdef\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n",
    );
    let config = config.0.to_str().unwrap().to_owned();
    let commands: Vec<Vec<&str>> = vec![
        vec![
            "keys", "create", "--sqlite", db, "--env", "gray", "--name", "y",
        ],
        vec![
            "keys", "create", "--sqlite", db, "--env", "gray", "--name", "y", "--json",
        ],
        vec!["keys", "list", "--sqlite", db],
        vec!["keys", "list", "--sqlite", db, "--json"],
        vec!["keys", "show", &id, "--sqlite", db],
        vec!["keys", "audit", "--sqlite", db],
        vec!["keys", "rotate", &id, "--sqlite", db],
        vec!["usage", "--sqlite", db, "--since", "1h"],
        vec!["usage", "--sqlite", db, "--since", "1h", "--json"],
        vec!["check-config", "--config", &config],
        vec!["admin-token", "--config", &config],
        vec!["console-login", "--config", &config],
        vec![
            "demo",
            "--port",
            "0",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--no-wait",
        ],
        vec!["--help"],
        vec!["keys", "create", "--help"],
        vec!["--version"],
    ];
    for args in commands {
        let mut child = Command::new(BIN)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before the first write
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
}

/// Every command's `--help` ends with examples; `fleetgate --help` has the exit codes; a bad
/// command line exits 64 (never 2, which is bench's "SLA violated").
#[test]
fn every_command_has_help_with_examples_and_usage_errors_exit_64() {
    let (code, out, _) = fleetgate(&["--help"]);
    assert_eq!(code, Some(0));
    for line in [
        "Exit codes:",
        "64   bad command line",
        "2    bench: an --sla",
    ] {
        assert!(out.contains(line), "{out}");
    }
    // Each command's line says all it means (the demo's once read "... direct vs via").
    assert!(
        out.contains("demo           Two simulated backends behind the gateway, in one process: TTFT direct vs through it\n"),
        "{out}"
    );
    // Every option of `keys create` is described, the required ones first of all.
    let (_, create, _) = fleetgate(&["keys", "create", "--help"]);
    for (option, says) in [
        ("--env <ENV>", "stress, gray or prod"),
        ("--name <NAME>", "A name for people"),
    ] {
        let line = create
            .lines()
            .find(|l| l.trim_start().starts_with(option))
            .unwrap_or_else(|| panic!("no {option} in:\n{create}"));
        assert!(line.contains(says), "{line}\n{create}");
    }
    // A config file that is not there is named, and nothing else (no stray `-` field).
    let (code, _, err) = fleetgate(&["check-config", "--config", "/nonexistent/fleetgate.toml"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("/nonexistent/fleetgate.toml: cannot read the file: No such file"),
        "{err}"
    );
    for cmd in [
        &["serve"][..],
        &["sim"],
        &["demo"],
        &["keys"],
        &["keys", "create"],
        &["keys", "list"],
        &["keys", "show"],
        &["keys", "revoke"],
        &["keys", "rotate"],
        &["keys", "audit"],
        &["usage"],
        &["migrate"],
        &["admin-token"],
        &["console-login"],
        &["bench"],
        &["probe"],
        &["check-config"],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let (code, out, err) = fleetgate(&args);
        assert_eq!(code, Some(0), "{cmd:?}: {err}");
        let examples = out
            .split_once("Examples:\n")
            .unwrap_or_else(|| panic!("{cmd:?} --help has no examples:\n{out}"))
            .1;
        assert!(
            examples
                .lines()
                .next()
                .is_some_and(|l| l.trim_start().starts_with("fleetgate ")),
            "{cmd:?}: {examples}"
        );
    }
    let (code, _, err) = fleetgate(&["keys", "create", "--env", "prod", "--bogus"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("--bogus"), "{err}");
    let (code, _, _) = fleetgate(&["no-such-command"]);
    assert_eq!(code, Some(64));
}

/// `keys create --endpoints` bounds the key's endpoint families: `keys show` prints them, and
/// a family that does not exist is refused with the list of families, creating nothing.
#[test]
fn keys_create_takes_endpoint_families() {
    let dir = TempDir(temp_dir("cli-endpoints"));
    let db = dir.0.join("keys.db");
    let db = db.to_str().unwrap();
    let (code, key, err) = fleetgate(&[
        "keys",
        "create",
        "--sqlite",
        db,
        "--env",
        "prod",
        "--name",
        "indexer",
        "--endpoints",
        "embeddings,rerank",
        "-q",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let id = fleetgate_gateway::key::parse(key.trim())
        .unwrap()
        .public_id
        .to_owned();
    let (code, shown, err) = fleetgate(&["keys", "show", &id, "--sqlite", db]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        shown.contains("endpoints:    embeddings, rerank"),
        "{shown}"
    );
    let (code, _, err) = fleetgate(&[
        "keys",
        "create",
        "--sqlite",
        db,
        "--env",
        "prod",
        "--name",
        "typo",
        "--endpoints",
        "chat,embedding",
    ]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("`embedding`") && err.contains("chat, completions, responses"),
        "{err}"
    );
    let (_, listed, _) = fleetgate(&["keys", "list", "--sqlite", db]);
    assert!(!listed.contains("typo"), "nothing was created: {listed}");
}

/// Every flag of `vllm bench serve` 0.33 (tests/fixtures/vllm-bench-serve-flags.tsv, one row per
/// choice where vLLM lists choices), as written and with vLLM's underscore spelling, is taken
/// by `fleetgate bench`: never exit 64 on a valid vLLM command line (issue 42).
#[test]
fn bench_takes_every_vllm_bench_serve_flag() {
    let table = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/vllm-bench-serve-flags.tsv"
    ))
    .unwrap();
    let mut checked = 0;
    for row in table.lines().filter(|l| !l.starts_with('#')) {
        let cells: Vec<&str> = row.split('\t').collect();
        let (flag, value) = (cells[0], cells.get(2).copied().unwrap_or(""));
        let underscored = format!("--{}", flag[2..].replace('-', "_"));
        for spelling in [flag, underscored.as_str()] {
            let mut args = vec!["bench", spelling];
            args.extend(value.split(' ').filter(|v| !v.is_empty()));
            // --help ends the parse: what comes before it was understood.
            args.push("--help");
            let (code, out, err) = fleetgate(&args);
            assert_eq!(code, Some(0), "fleetgate {}: {err}", args.join(" "));
            assert!(out.contains("Usage"), "{out}");
            checked += 1;
        }
    }
    assert!(checked > 250, "{checked} rows");
    // And `vllm serve`'s tool and reasoning parsers on the sim, as the README starts it.
    let (code, _, err) = fleetgate(&[
        "sim",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
        "--help",
    ]);
    assert_eq!(code, Some(0), "{err}");
}

/// The seeds' own `vllm bench serve` line (SEEDS.md; ShareGPT replaced by a small file of the
/// same format) runs through the gateway as written; vLLM's `--host`/`--port` reach it too; a
/// flag that would change the measurement and is not implemented stops the run before anything
/// is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seeds_vllm_bench_serve_line_runs_through_the_gateway() {
    use std::sync::atomic::Ordering;
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let dir = TempDir(temp_dir("bench-seed-line"));
    let dataset = dir.0.join("ShareGPT_V3_unfiltered_cleaned_split.json");
    let conversations: Vec<serde_json::Value> = (0..24)
        .map(|i| {
            serde_json::json!({"id": format!("c{i}"), "conversations": [
                {"from": "human", "value": format!("Question {i}: explain how a reverse proxy keeps a stream flowing to its client.")},
                {"from": "gpt", "value": "It relays every chunk the moment it arrives, never holding one back to fill a buffer."}
            ]})
        })
        .collect();
    std::fs::write(&dataset, serde_json::Value::from(conversations).to_string()).unwrap();
    let base = format!("http://{}", gw.server.local_addr);
    let auth = format!("Authorization: Bearer {}", gw.key);
    let dataset = dataset.display().to_string();
    let line = [
        "bench",
        "--backend",
        "vllm",
        "--base_url",
        &base,
        "--model",
        "qwen32b",
        "--tokenizer",
        "/mnt/data/models/DeepSeek-R1-Distill-Qwen-32B",
        "--endpoint-type",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--header",
        &auth,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        &dataset,
        "--sharegpt-output-len",
        "1024",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "95,99",
        "--num-prompts",
        "16",
        "--request-rate",
        "8",
    ]
    .map(str::to_owned);
    let run = |args: Vec<String>| async move {
        tokio::task::spawn_blocking(move || {
            outcome(Command::new(BIN).args(&args).env_remove("OPENAI_API_KEY"))
        })
        .await
        .unwrap()
    };
    let (code, out, err) = run(line.to_vec()).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("Successful requests:                     16"),
        "{out}"
    );
    for metric in ["TTFT", "TPOT", "ITL", "E2EL"] {
        for p in ["P95", "P99"] {
            assert!(
                out.contains(&format!("{p} {metric} (ms):")),
                "{p} {metric}:\n{out}"
            );
        }
    }
    assert!(
        err.contains(
            "--backend vllm is ignored: --endpoint-type openai-chat gives the request format"
        ),
        "{err}"
    );
    assert!(
        err.contains("--tokenizer /mnt/data/models/DeepSeek-R1-Distill-Qwen-32B: no such file"),
        "{err}"
    );
    assert_eq!(s.stats().requests.load(Ordering::SeqCst), 16);

    // vLLM's --host/--port instead of --base_url, with flags that change nothing here.
    let mut by_port: Vec<String> = line
        .iter()
        .filter(|a| !a.starts_with("http"))
        .cloned()
        .collect();
    by_port.retain(|a| a != "--base_url");
    by_port.extend(
        [
            "--host",
            "127.0.0.1",
            "--port",
            &gw.server.local_addr.port().to_string(),
            "--trust-remote-code",
            "--save-detailed",
            "--disable-tqdm",
            "--num-prompts",
            "4",
        ]
        .map(str::to_owned),
    );
    let (code, out, err) = run(by_port.clone()).await;
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("Successful requests:                     4"),
        "{out}"
    );
    assert!(
        err.contains("warning: --trust-remote-code is ignored: "),
        "{err}"
    );
    assert!(
        err.contains("warning: --save-detailed is ignored: "),
        "{err}"
    );
    assert_eq!(s.stats().requests.load(Ordering::SeqCst), 20);

    // A ramp-up would change what is measured: refused, nothing sent, exit 1 (not 64).
    let mut ramp = by_port;
    ramp.extend(
        [
            "--ramp-up-strategy",
            "linear",
            "--ramp-up-start-rps",
            "1",
            "--ramp-up-end-rps",
            "8",
        ]
        .map(str::to_owned),
    );
    let (code, _, err) = run(ramp).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--ramp-up-strategy: a ramp of the request rate")
            && err.contains("nothing was sent"),
        "{err}"
    );
    assert_eq!(s.stats().requests.load(Ordering::SeqCst), 20);
}

/// Who a console session and an admin token are minted for when `--sub` is not given: the local
/// user, also in a container where `$USER` is empty (issue 42: every console action was
/// recorded as `operator@cli`). The secret's absence names how to set it.
#[test]
fn console_login_and_admin_token_name_the_local_user() {
    let no_secret = temp_config(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[admin]\nlisten = \"127.0.0.1:9\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n",
    );
    let (code, _, err) = outcome(
        Command::new(BIN)
            .args(["admin-token", "--config"])
            .arg(&no_secret.0),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("set admin.jwt_secret") && err.contains("FLEETGATE_ADMIN_JWT_SECRET"),
        "{err}"
    );
    let cfg = temp_config(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[admin]\nlisten = \"127.0.0.1:9\"\njwt_secret = \"{}\"\n\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:9\"]\n",
        "s".repeat(40)
    ));
    let (code, out, err) = outcome(
        Command::new(BIN)
            .args(["console-login", "--config"])
            .arg(&cfg.0)
            .env("USER", "")
            .env_remove("LOGNAME"),
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("/console/login?token="), "{out}");
    let who = err
        .split("signs in once, as ")
        .nth(1)
        .and_then(|r| r.split(" (").next())
        .unwrap_or_else(|| panic!("{err}"));
    assert!(!who.is_empty() && !who.contains("operator"), "{err}");
    // The same user names the admin token's subject, with `@cli`.
    let (code, token, err) = outcome(
        Command::new(BIN)
            .args(["admin-token", "--config"])
            .arg(&cfg.0)
            .env("USER", "")
            .env_remove("LOGNAME"),
    );
    assert_eq!(code, Some(0), "{err}");
    let payload = token.trim().split('.').nth(1).unwrap();
    use base64::Engine;
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(claims["sub"], format!("{who}@cli"), "{claims}");
}
