//! The documentation stays true to the code: every key the config parser accepts is documented
//! in its section of docs/configuration.md (the keys are read from the parser itself — serde
//! lists a table's fields when it refuses an unknown one — so a new key without documentation
//! fails here), and the messages docs/operations.md quotes are the ones the gateway sends.

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const POOL: &str = "model = 'm'\nbackends = ['http://a:1']\n";

fn read(rel: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{rel}")).unwrap()
}

/// Every `.rs` file under `rel`, concatenated.
fn read_tree(rel: &str) -> String {
    let mut out = String::new();
    let mut dirs = vec![std::path::PathBuf::from(format!("{ROOT}/{rel}"))];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    assert!(out.len() > 10_000, "no sources under {rel}");
    out
}

/// The fields serde expected where it met `zzz_unknown` in `toml`.
fn fields_of(toml: &str) -> Vec<String> {
    let err = fleetgate_gateway::config::Config::parse("t.toml", toml, |_| Some("x".into()))
        .err()
        .unwrap_or_else(|| panic!("no error for:\n{toml}"));
    let msg = err.message;
    assert!(
        msg.contains("unknown field `zzz_unknown`"),
        "{toml}\n→ {msg}"
    );
    let after = &msg[msg.find("expected").unwrap_or(msg.len())..];
    after
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The text of a section of configuration.md: from its heading to the next heading of the same
/// or a higher level.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("configuration.md has no heading `{heading}`"));
    let level = doc[..start].rsplit('\n').next().unwrap_or_default().len()
        + heading.chars().take_while(|c| *c == '#').count();
    let rest = &doc[start + heading.len()..];
    let end = rest
        .match_indices("\n#")
        .find(|(i, _)| {
            let hashes = rest[i + 1..].chars().take_while(|c| *c == '#').count();
            hashes <= level.max(2)
        })
        .map_or(rest.len(), |(i, _)| i);
    &rest[..end]
}

#[test]
fn every_config_key_is_documented_in_its_section() {
    let doc = read("docs/configuration.md");
    // (where the parser is asked, which section documents it)
    let cases: Vec<(String, &str)> = vec![
        (
            format!("[server]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[server]`",
        ),
        (
            format!("[server.tls]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "### `[server.tls]`",
        ),
        (
            format!("[database]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[database]`",
        ),
        (
            format!("[auth]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[auth]`",
        ),
        (
            format!("[admin]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[admin]`",
        ),
        (
            format!("[request_log]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[request_log]`",
        ),
        (
            format!("[limits]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[limits]`",
        ),
        (
            format!("[limits.stress]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "### `[limits.stress]`",
        ),
        (
            format!("[limits.redis]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "### `[limits.redis]`",
        ),
        (
            format!("[queue]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[queue]`",
        ),
        (
            format!("[queue.max_wait_seconds]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[queue]`",
        ),
        (
            format!("[tracing]\nzzz_unknown = 1\n[[pools]]\n{POOL}"),
            "## `[tracing]`",
        ),
        (
            format!("[[pools]]\nzzz_unknown = 1\n{POOL}"),
            "## `[[pools]]`",
        ),
        (
            "[[pools]]\nmodel = 'm'\nbackends = [{ zzz_unknown = 1, url = 'http://a:1' }]\n".into(),
            "## `[[pools]]`",
        ),
        (
            format!("[[pools]]\n{POOL}long_prompt = {{ zzz_unknown = 1 }}\n"),
            "## `[[pools]]`",
        ),
    ];
    let mut cases = cases;
    for sub in [
        "retries",
        "ejection",
        "health",
        "load_aware",
        "affinity",
        "warmup",
        "timeouts",
    ] {
        cases.push((
            format!("[[pools]]\n{POOL}[pools.{sub}]\nzzz_unknown = 1\n"),
            Box::leak(format!("### `[pools.{sub}]`").into_boxed_str()),
        ));
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for (toml, heading) in &cases {
        let fields = fields_of(toml);
        assert!(!fields.is_empty(), "no fields listed for {heading}");
        let text = section(&doc, heading);
        for f in fields {
            checked += 1;
            // A key in a table row or inline example, a dotted key (`max_wait_seconds.prod`),
            // or a sub-table with a heading of its own (`[pools.timeouts]`).
            let documented = [
                format!("`{f}`"),
                format!("`{f} "),
                format!("`{f}."),
                format!(".{f}`"),
                format!("{{ {f} ="),
                format!(", {f} ="),
            ]
            .iter()
            .any(|p| text.contains(p.as_str()))
                || doc.contains(&format!(".{f}]`"));
            if !documented {
                missing.push(format!("{f} (in {heading})"));
            }
        }
    }
    assert!(
        checked > 80,
        "only {checked} keys found: is the parser still listing them?"
    );
    assert!(
        missing.is_empty(),
        "config keys the parser accepts but docs/configuration.md does not document in their section: {missing:?}"
    );
}

#[test]
fn the_messages_operations_md_quotes_are_the_gateways() {
    let ops = read("docs/operations.md");
    let mut sources: String = [
        "crates/gateway/src/auth/mod.rs",
        "crates/gateway/src/auth/failure.rs",
        "crates/gateway/src/admin/jwt.rs",
        "crates/gateway/src/queue/mod.rs",
        "crates/gateway/src/limits/mod.rs",
        "crates/gateway/src/limits/refusal.rs",
        "crates/gateway/src/server/reload.rs",
        "crates/gateway/src/pool/cause.rs",
        "crates/gateway/src/pool/health.rs",
        "crates/gateway/src/pool/engine_cache/subscriber.rs",
        "crates/protocol/src/base_url.rs",
    ]
    .iter()
    .map(|p| read(p))
    .collect();
    // Every file of the request path, wherever a step's file is.
    sources.push_str(&read_tree("crates/gateway/src/proxy"));
    // Quoted texts in the troubleshooting table: "..." between double quotes, the variable
    // parts written as "...".
    let table = &ops[ops.find("## Troubleshooting").unwrap()..];
    // The third column: what the client (or the log) receives.
    let received: String = table
        .lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(3))
        .collect::<Vec<_>>()
        .join("\n");
    let mut checked = 0;
    for quoted in received.split('"').skip(1).step_by(2) {
        for piece in quoted.split("...").map(str::trim).filter(|p| p.len() >= 12) {
            // Parts that are the server's own formatting of a value (e.g. `model `...``).
            let piece = piece
                .trim_end_matches(['(', '`', ' '])
                .trim_start_matches([')', '.', ' ', '`']);
            if piece.len() < 12 {
                continue;
            }
            checked += 1;
            assert!(
                sources.contains(piece),
                "docs/operations.md quotes a message the gateway does not send: {piece:?}"
            );
        }
    }
    assert!(checked >= 10, "only {checked} quoted messages checked");
}

/// Nothing the project ships names a directory of the machine it was written on: the vLLM
/// home defaults to the user's cache, fixtures keep a model's directory name only, and the
/// docs and scripts point into the repository.
#[test]
fn no_development_machine_paths_are_shipped() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    for dir in [
        "src",
        "crates",
        "scripts",
        "docs",
        "tests",
        "config",
        "deploy",
        "migrations",
    ] {
        walk(&std::path::Path::new(ROOT).join(dir), &mut files);
    }
    files.push(std::path::Path::new(ROOT).join("README.md"));
    let this = std::path::Path::new(ROOT).join("tests/it/docs.rs");
    // Spelled in pieces, so this test does not find itself.
    let machine = ["/wo", "rk/"].concat();
    let mut found = Vec::new();
    for f in files.iter().filter(|f| **f != this) {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue; // not text
        };
        for (i, line) in text.lines().enumerate() {
            if line.contains(&machine) {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "machine paths:\n{}", found.join("\n"));
}

/// The console's "Now" span is one number in the code, on the page and in docs/console.md.
#[test]
fn the_consoles_now_window_is_the_codes() {
    use fleetgate_gateway::admin::console::{data, pages};
    let secs = data::RATE_WINDOW.as_secs();
    let doc = read("docs/console.md");
    assert!(
        doc.contains(&format!(
            "requests per second and error rate (4xx and 5xx) over the last {secs} seconds"
        )),
        "docs/console.md's Now section names another span than the code's {secs} s"
    );
    assert!(
        !doc.contains("~30 seconds") && !doc.contains("about 30 seconds"),
        "an approximate span"
    );
    let live = |over_seconds: f64, rate: Option<f64>| {
        pages::overview::live(
            &data::LiveFigures {
                rate: [rate; 4],
                error_rate: [None; 4],
                over_seconds,
                requests_total: [0; 4],
                queue: Vec::new(),
            },
            &pages::overview::Fleet { up: 0, total: 0 },
        )
        .into_string()
    };
    let page = live(secs as f64, Some(1.0));
    assert!(
        page.contains(&format!("rates over the last {secs} s")),
        "{page}"
    );
    // Before the first full span, the page names the usual one as the docs do.
    for page in [live(5.0, Some(1.0)), live(0.0, None)] {
        assert!(page.contains(&format!("the last {secs} s")), "{page}");
    }
}

/// docs/bench.md's example settings.json is a file `fleetgate bench` accepts as it stands, with
/// the short / long / tail classes it describes.
#[test]
fn the_example_settings_json_is_valid() {
    let doc = read("docs/bench.md");
    let start = doc
        .find("```json\n{\n  \"endpoint\"")
        .expect("docs/bench.md has an example settings.json");
    let body = &doc[start + "```json\n".len()..];
    let body = &body[..body.find("```").unwrap()];
    let dir = std::env::temp_dir().join(format!("fleetgate-docs-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("settings.json");
    std::fs::write(&path, body).unwrap();
    let s = fleetgate_bench::plan::read_settings(&path);
    let _ = std::fs::remove_dir_all(&dir);
    let s = s.unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<_> = s
        .request_distribution
        .iter()
        .filter_map(|c| c.name.as_deref())
        .collect();
    assert_eq!(names, ["short", "long", "tail"]);
}

/// docs/architecture.md's endpoint table is the endpoint table, rendered row by row (a new row
/// of `TABLE` fails here with the line to add).
#[test]
fn the_architecture_endpoint_table_is_the_table() {
    use fleetgate_protocol::endpoint::{BodyKind, Needs, TABLE};
    fn needs(n: Needs) -> String {
        let mut parts = Vec::new();
        if n.generates {
            parts.push("generates");
        }
        if n.takes_slot {
            parts.push("slot");
        }
        if n.spends_tokens {
            parts.push(if n.reserves_output {
                "tokens"
            } else {
                "tokens (input reserved)"
            });
        }
        if !n.takes_slot && !n.spends_tokens {
            parts.push("request rate only");
        }
        match n.body {
            BodyKind::Json => {}
            BodyKind::None => parts.push("no body"),
            BodyKind::Multipart => parts.push("multipart form"),
        }
        if n.pinned {
            parts.push("pinned");
        }
        if n.stores {
            parts.push("stores");
        }
        if n.engine_priority {
            parts.push("engine priority");
        }
        if n.injects_usage {
            parts.push("usage injected");
        }
        parts.join(", ")
    }
    let expected: Vec<String> = TABLE
        .iter()
        .map(|row| {
            let prompt = row
                .prompt
                .iter()
                .map(|f| format!("`{}`", String::from_utf8_lossy(f).trim_matches('"')))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "| `{} {}` | `{:?}` | {} | {} | {} | {} | `{}` | `{}` |",
                row.method,
                row.path,
                row.endpoint,
                row.family.as_str(),
                row.dialect.as_str(),
                needs(row.needs),
                if prompt.is_empty() {
                    "—".to_owned()
                } else {
                    prompt
                },
                row.name,
                row.operation
            )
        })
        .collect();
    let doc = read("docs/architecture.md");
    let section = &doc[doc.find("### Endpoints and dialects").unwrap()..];
    let documented: Vec<&str> = section
        .lines()
        .skip_while(|l| !l.starts_with("| method and path"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        documented,
        expected,
        "docs/architecture.md's endpoint table, as TABLE gives it:\n{}",
        expected.join("\n")
    );
}
