//! Every command's help with examples, usage errors exiting 64, and printing commands
//! surviving a closed pipe.

use super::*;

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
