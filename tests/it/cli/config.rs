//! `fleetgate check-config` and a config's paths: the example accepted, credentials in a
//! backend URL refused unshown, exit 64 naming the field, a store found from any directory.

use super::*;

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

/// `[tracing]` and the `OTEL_*` environment, as `serve` reads them: the environment wins per
/// setting, and a protocol fleetgate does not export is refused (exit 64) naming the variable.
#[test]
fn tracing_is_read_from_the_file_and_the_environment_wins() {
    let cfg = temp_config(
        "[tracing]\nendpoint = \"http://file-collector:4318\"\nsampler = \"always_off\"\n[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:8000\"]\n",
    );
    let check = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(BIN);
        cmd.args(["check-config", "--config"]).arg(&cfg.0);
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("OTEL_")) {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().copied());
        cmd.output().unwrap()
    };
    let out = check(&[]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(
            "tracing: OTLP/HTTP to http://file-collector:4318/v1/traces (sampler AlwaysOff, service fleetgate)"
        ),
        "{stdout}"
    );
    let out = check(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env-collector:4318"),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
        ("OTEL_SERVICE_NAME", "edge"),
    ]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("tracing: OTLP/HTTP to http://env-collector:4318/v1/traces (sampler ParentBasedTraceIdRatio(0.1), service edge)"),
        "{stdout}"
    );
    let out = check(&[("OTEL_SDK_DISABLED", "true")]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("tracing: off\n"));
    let out = check(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL (environment)") && stderr.contains("4318"),
        "{stderr}"
    );
}
