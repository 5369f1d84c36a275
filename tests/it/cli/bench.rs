//! `fleetgate bench` as a user runs it: the key from the environment, Ctrl-C printing what was
//! measured, every flag of `vllm bench serve`, and the seeds' own command line through a
//! gateway.

use super::*;

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

/// Without `--model` the bench asks the server's `/v1/models`: a refusal shows the server's
/// message whole and names what to check for it: the variable the key was read from (or that
/// it was not set), or the base URL, whose fix the gateway's 404 opens with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_lookup_says_which_variable_it_read_and_shows_the_whole_message() {
    let s = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[s.url()])]).await;
    let base = format!("http://{}", gw.server.local_addr);
    let key = gw.key.clone();
    let run = move |base: String, key_in_default: bool| {
        let mut c = Command::new(BIN);
        c.args(["bench", "--base-url", &base, "--num-prompts", "1"])
            .env_remove("OPENAI_API_KEY")
            // The key where a user following the README put it, not where the bench reads.
            .env("FLEETGATE_API_KEY", &key);
        if key_in_default {
            c.env("OPENAI_API_KEY", &key);
        }
        let out = c.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let b = base.clone();
    let again = run.clone();
    let (code, err) = tokio::task::spawn_blocking(move || again(b, false))
        .await
        .unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("No API key was sent")
            && err.contains("$OPENAI_API_KEY (--api-key-env) is not set"),
        "{err}"
    );
    assert!(
        !err.contains("--model"),
        "no advice about --model for a key: {err}"
    );
    let (code, err) = tokio::task::spawn_blocking(move || run(format!("{base}/api"), true))
        .await
        .unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("answered 404 Not Found: Remove `/api` from the base URL"),
        "{err}"
    );
    assert!(
        err.contains("meant as GET /v1/models") && err.contains("check --base-url"),
        "{err}"
    );
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
    let child = spawn_piped(Command::new(BIN).args([
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
    ]));
    let stats = s.stats().clone();
    // Wait until a few requests have finished.
    assert!(
        eventually(Duration::from_secs(10), || stats
            .completed
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 4)
        .await
    );
    let out = stop_and_collect(child, "INT").await;
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

/// Every flag of `vllm bench serve` 0.33 (tests/fixtures/vllm-bench-serve-flags.tsv, one row per
/// choice where vLLM lists choices), as written and with vLLM's underscore spelling, is taken
/// by `fleetgate bench`: never exit 64 on a valid vLLM command line.
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
