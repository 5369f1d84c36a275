//! The coding agents, as `.ci/run` installs them (npm `@openai/codex`,
//! `@anthropic-ai/claude-code`), run through the gateway with their retries off and under a
//! wall-clock limit (Codex waits forever for a network it cannot reach; Claude Code retries for
//! minutes by default).

use super::*;

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
