//! `fleetgate serve` and `demo` as processes: draining on SIGTERM, reloading on SIGHUP and on a
//! changed file, and the demo's table and next steps.

use super::*;

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
    let child = serve_until_healthy(&cfg.0, port, &[]).await;
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
    send_signal(&child, "TERM");
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

/// A listen backlog above the kernel's cap still starts, and says at start what caps it and how
/// to raise it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_says_when_the_kernel_caps_the_listen_backlog() {
    let sim = sim(|_| {}).await;
    let port = closed_port().await.port();
    let dir = temp_dir("cli");
    let cfg = temp_config(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nlisten_backlog = 2147483647\nshutdown_grace_seconds = 1\n\n[database]\nsqlite_path = \"{}\"\n\n[admin]\nlisten = \"\"\n\n[[pools]]\nmodel = \"qwen32b\"\nbackends = [\"{}\"]\n",
        dir.join("keys.db").display(),
        sim.url()
    ));
    let child = serve_until_healthy(&cfg.0, port, &[("NO_COLOR", "1")]).await;
    let out = stop_and_collect(child, "TERM").await;
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let line = logs
        .lines()
        .find(|l| l.contains("the kernel caps the listen backlog at net.core.somaxconn"))
        .unwrap_or_else(|| panic!("no warning about the cap in:\n{logs}"));
    assert!(line.contains("listen_backlog=2147483647"), "{line}");
    assert!(line.contains("somaxconn="), "{line}");
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
    let child = serve_until_healthy(&cfg.0, port, &[("RUST_LOG", "info")]).await;
    let uri: http::Uri = format!("http://127.0.0.1:{port}/v1/chat/completions")
        .parse()
        .unwrap();
    let (sa, sb) = (a.stats().clone(), b.stats().clone());
    assert!(until_served_by(&uri, &key, &sa.requests, Duration::from_secs(2)).await);

    let hup = || send_signal(&child, "HUP");
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

    let out = stop_and_collect(child, "TERM").await;
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

/// The binary carries jemalloc's settings of `.cargo/config.toml` (the 64 KiB slabs that keep
/// what a burst leaves small), after the background threads of tikv-jemallocator's feature:
/// jemalloc names every source of settings it read when asked to (`confirm_conf`).
#[cfg(feature = "jemalloc")]
#[test]
fn the_binary_carries_its_jemalloc_settings() {
    let (code, _, stderr) = outcome(
        Command::new(BIN)
            .arg("--version")
            .env("_RJEM_MALLOC_CONF", "confirm_conf:true"),
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(r#"--with-malloc-conf): "background_thread:true,slab_sizes:4096-8192:16""#),
        "jemalloc's compiled-in settings, as it reports them: {stderr}"
    );
}
