//! `fleetgate keys` and `console`: the key round trip, store flags anywhere, endpoint families,
//! and sign-in links and admin tokens naming the local user.

use super::*;

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

/// Who a console session and an admin token are minted for when `--sub` is not given: the local
/// user, also in a container where `$USER` is empty (not `operator@cli` for every console
/// action). The secret's absence names how to set it.
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

/// A PostgreSQL store nobody listens at is named as unreachable, with its host and port and
/// the cause, never the URL's password.
#[test]
fn an_unreachable_store_is_named_with_its_host_and_port() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://ops:s3cretpass@127.0.0.1:{port}/fleet");
    let (code, _, err) = outcome(Command::new(BIN).args([
        "keys",
        "revoke",
        "fg-prod-abc",
        "--reason",
        "test",
        "--database-url",
        &url,
    ]));
    assert_ne!(code, Some(0), "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port} is unreachable")) && err.contains("refused"),
        "{err}"
    );
    assert!(!err.contains("s3cretpass"), "{err}");
    assert!(!err.contains("pool timed out"), "{err}");
}
