//! The clients people point at the gateway for agent traffic, run for real against the gateway
//! in front of `fleetgate sim`: the OpenAI Python SDK's Responses API, the Anthropic
//! Python SDK (typed errors included), Codex CLI (npm `@openai/codex`, `codex exec` with a
//! custom provider) and Claude Code (npm `@anthropic-ai/claude-code`, `claude -p`, with
//! `ANTHROPIC_AUTH_TOKEN` and with `ANTHROPIC_API_KEY`). `.ci/run` installs them; a missing
//! one skips loudly, and fails under `CI=true`.
//!
//! The agents run with their retries off and under a wall-clock limit (Codex waits forever
//! for a network it cannot reach; Claude Code retries for minutes by default), set up by the
//! helpers tests/it/real_vllm/ shares (tests/it/common/agents.rs: `Codex`, `claude_env`, `run_agent`).

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;
use fleetgate_gateway::key::Environment;

fn python_has(module: &str) -> bool {
    std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success())
}

/// A gateway in front of a sim that takes Claude Code's tools (`--enable-auto-tool-choice`),
/// and a prod key with room for an agent's ~20k-token prompts.
async fn setup() -> (fleetgate_sim::SimServer, Gateway, String) {
    let sim = sim(|a| {
        a.enable_auto_tool_choice = true;
        a.responses_store = true;
        // A model ends its answer long before an agent's limit (Claude Code asks 32000).
        a.output_tokens = Some(12);
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    (sim, gw, key)
}

/// `claude -p "say hi"` with exactly `env`, in `work`: it completes and prints an answer.
async fn claude_says_hi(
    claude: &std::path::Path,
    env: &[(&'static str, String)],
    work: &std::path::Path,
    what: &str,
) {
    let r = run_agent(
        claude,
        &["-p", "say hi", "--no-session-persistence"],
        env,
        work,
        Duration::from_secs(90),
    )
    .await;
    assert!(
        r.ok,
        "claude ({what}) failed:\nstdout: {}\nstderr: {}",
        r.stdout, r.stderr
    );
    assert!(!r.stdout.trim().is_empty(), "claude printed the answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_completes_a_prompt_through_the_gateway() {
    let Some(codex) = agent_bin("codex") else {
        tool_or_skip("codex_cli", "Codex CLI (npm @openai/codex)", false);
        return;
    };
    let (_sim, gw, key) = setup().await;
    let dir = temp_dir("codex");
    // The provider as docs/agents.md gives it.
    let c = Codex::new(
        &dir,
        &format!("http://{}/v1", gw.server.local_addr),
        "qwen32b",
    );
    let env = c.env(&key);
    let args = Codex::exec_args("say hi");
    let r = run_agent(&codex, &args, &env, &c.work, Duration::from_secs(90)).await;
    assert!(
        r.ok,
        "codex failed:\nstdout: {}\nstderr: {}",
        r.stdout, r.stderr
    );
    assert!(
        !r.stdout.trim().is_empty(),
        "codex printed the answer: {}",
        r.stderr
    );
    assert!(
        eventually(Duration::from_secs(5), || measured_rows(&gw, "responses")
            >= 1)
        .await,
        "the request log holds Codex's request with TTFT and hop"
    );
    // A revoked key: Codex says so and fails (no retries), without hanging.
    let env = c.env("fg-prod-00000000-revokedrevokedrevoked");
    let r = run_agent(&codex, &args, &env, &c.work, Duration::from_secs(90)).await;
    assert!(!r.ok);
    assert!(r.stderr.contains("401"), "{}", r.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_completes_a_prompt_through_the_gateway() {
    let Some(claude) = agent_bin("claude") else {
        tool_or_skip(
            "claude_code",
            "Claude Code (npm @anthropic-ai/claude-code)",
            false,
        );
        return;
    };
    let (_sim, gw, key) = setup().await;
    let dir = temp_dir("claude");
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let base = format!("http://{}", gw.server.local_addr);
    // Once with the key as a bearer token, once as an API key (`x-api-key`).
    for (i, var) in ["ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY"]
        .into_iter()
        .enumerate()
    {
        let home = dir.join(format!("home{i}"));
        std::fs::create_dir_all(&home).unwrap();
        let env = claude_env(&home, &base, var, &key, "qwen32b");
        claude_says_hi(&claude, &env, &work, var).await;
        assert!(
            eventually(Duration::from_secs(5), || measured_rows(&gw, "messages")
                > i)
            .await,
            "the request log holds Claude Code's request ({var}) with TTFT and hop"
        );
    }
    // A revoked key, with Claude Code's own retries as it ships them (it retries a 401 for
    // minutes unless told not to): the refusal's `x-should-retry: false` stops it at once,
    // and it prints the gateway's reason.
    let (revoked, rec) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let store = gw.server.auth.store();
    store
        .revoke(&rec.public_id, "left the team", "test")
        .await
        .unwrap();
    gw.server
        .auth
        .apply(&rec.public_id, store.get(&rec.public_id).await.unwrap());
    for (i, var) in ["ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY"]
        .into_iter()
        .enumerate()
    {
        let home = dir.join(format!("revoked{i}"));
        std::fs::create_dir_all(&home).unwrap();
        let env: Vec<_> = claude_env(&home, &base, var, &revoked, "qwen32b")
            .into_iter()
            .filter(|(k, _)| *k != "CLAUDE_CODE_MAX_RETRIES")
            .collect();
        let started = std::time::Instant::now();
        let r = run_agent(
            &claude,
            &["-p", "say hi", "--no-session-persistence"],
            &env,
            &work,
            Duration::from_secs(120),
        )
        .await;
        let took = started.elapsed();
        assert!(!r.ok, "{var}: a revoked key succeeded: {}", r.stdout);
        let said = format!("{}{}", r.stdout, r.stderr);
        assert!(
            said.contains("revoked"),
            "{var}: the reason is shown: {said}"
        );
        assert!(
            took < Duration::from_secs(5),
            "{var}: Claude Code gave up after {took:?}, not at once: {said}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The chat sims of README.md's "Try it with separate processes", started as separate
/// processes with exactly the README's flags (only the port is a free one), killed on drop.
struct ReadmeSims(Vec<std::process::Child>, Vec<String>);

impl Drop for ReadmeSims {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn readme_sims() -> ReadmeSims {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("## Try it with separate processes")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let mut sims = ReadmeSims(Vec::new(), Vec::new());
    for line in section.lines().filter(|l| {
        l.starts_with("./target/release/fleetgate sim ") && !l.contains("--runner pooling")
    }) {
        let command = line
            .split(" #")
            .next()
            .unwrap()
            .trim()
            .trim_end_matches('&');
        let mut args: Vec<String> = command
            .split_whitespace()
            .skip(1)
            .map(str::to_owned)
            .collect();
        let at = args.iter().position(|a| a == "--port").unwrap() + 1;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        args[at] = port.to_string();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_fleetgate"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        sims.0.push(child);
        let url = format!("http://127.0.0.1:{port}");
        wait_for_200(&format!("{url}/health")).await;
        sims.1.push(url);
    }
    assert_eq!(
        sims.1.len(),
        2,
        "the README starts two chat sims:\n{section}"
    );
    sims
}

/// Codex CLI and Claude Code complete against the README's own sims, started as the README
/// starts them (with the sims' defaults Claude Code would get vLLM's 400 "auto" tool choice
/// refusal, and with tools alone would run to its 32 000 tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_agents_complete_against_the_readmes_sims() {
    let (Some(claude), Some(codex)) = (agent_bin("claude"), agent_bin("codex")) else {
        tool_or_skip(
            "readme_sims",
            "Claude Code and Codex CLI (npm @anthropic-ai/claude-code, @openai/codex)",
            false,
        );
        return;
    };
    let sims = readme_sims().await;
    let gw = gateway(vec![pool("qwen32b", &sims.1)]).await;
    let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let dir = temp_dir("readme-agents");
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let base = format!("http://{}", gw.server.local_addr);
    let env = claude_env(&home, &base, "ANTHROPIC_AUTH_TOKEN", &key, "qwen32b");
    claude_says_hi(&claude, &env, &work, "the README's sims").await;
    let c = Codex::new(&dir.join("codex"), &format!("{base}/v1"), "qwen32b");
    let r = run_agent(
        &codex,
        &Codex::exec_args("say hi"),
        &c.env(&key),
        &c.work,
        Duration::from_secs(90),
    )
    .await;
    assert!(
        r.ok,
        "codex failed:\nstdout: {}\nstderr: {}",
        r.stdout, r.stderr
    );
    assert!(
        eventually(Duration::from_secs(5), || measured_rows(&gw, "messages")
            >= 1
            && measured_rows(&gw, "responses") >= 1)
        .await,
        "the request log holds both agents' requests"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The OpenAI Python SDK's Responses API, and the Anthropic Python SDK with its typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdks_speak_both_protocols_through_the_gateway() {
    let ok = python_has("openai") && python_has("anthropic");
    if tool_or_skip("python_sdks", "the openai and anthropic Python SDKs", ok).is_none() {
        return;
    }
    let (_sim, gw, key) = setup().await;
    let (revoked, rec) = issue_key(&gw, Environment::Prod, |_| {}).await;
    let revoked_rec = gw
        .server
        .auth
        .store()
        .revoke(&rec.public_id, "test", "test")
        .await
        .unwrap();
    gw.server.auth.apply(&rec.public_id, Some(revoked_rec));
    let (limited, _) = issue_key(&gw, Environment::Prod, |k| k.requests_per_minute = Some(1)).await;
    let (narrow, _) = issue_key(&gw, Environment::Prod, |k| {
        k.allowed_models = Some(vec!["other".into()]);
    })
    .await;
    let script = r#"
import sys, openai, anthropic
base, key, revoked, limited, narrow = sys.argv[1:6]
oa = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
r = oa.responses.create(model="qwen32b", input="hello", max_output_tokens=5)
assert r.status in ("completed", "incomplete") and r.output_text, r
assert r.usage.output_tokens == 5, r.usage
events = [e.type for e in oa.responses.create(model="qwen32b", input="hello", max_output_tokens=4, stream=True)]
assert events[0] == "response.created" and events[-1] == "response.completed", events
assert events.count("response.output_text.delta") == 4, events
again = oa.responses.retrieve(r.id)
assert again.id == r.id, again
follow = oa.responses.create(model="qwen32b", input="more", max_output_tokens=3, previous_response_id=r.id)
assert follow.output_text, follow
try:
    oa.responses.cancel(r.id)
    raise SystemExit("a finished response was cancelled")
except openai.BadRequestError as e:
    assert "synchronous" in str(e), e
try:
    oa.responses.retrieve("resp_unknown0000")
    raise SystemExit("an unknown id was found")
except openai.NotFoundError as e:
    assert e.code == "response_not_found", e

an = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
m = an.messages.create(model="qwen32b", max_tokens=6, messages=[{"role": "user", "content": "hi"}])
assert m.type == "message" and m.usage.output_tokens == 6 and m.content[0].text, m
with an.messages.stream(model="qwen32b", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text and final.usage.output_tokens == 5, (text, final.usage)
n = an.messages.count_tokens(model="qwen32b", messages=[{"role": "user", "content": "hello there"}])
assert n.input_tokens > 0, n
def raises(cls, k, model="qwen32b"):
    c = anthropic.Anthropic(base_url=base, api_key=k, max_retries=0)
    try:
        c.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    except cls as e:
        return e
    raise SystemExit(f"expected {cls.__name__}")
e = raises(anthropic.AuthenticationError, revoked)
assert "revoked" in e.message, e.message
c = anthropic.Anthropic(base_url=base, api_key=limited, max_retries=0)
c.messages.create(model="qwen32b", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
e = raises(anthropic.RateLimitError, limited)
assert e.response.headers.get("retry-after"), e.response.headers
e = raises(anthropic.PermissionDeniedError, narrow)
assert "qwen32b" in e.message, e.message
e = raises(anthropic.NotFoundError, key, model="nope")
print("ok")
"#;
    let mut c = std::process::Command::new("python3");
    c.args([
        "-c",
        script,
        &format!("http://{}", gw.server.local_addr),
        &key,
        &revoked,
        &limited,
        &narrow,
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let r = output_within(c, Duration::from_secs(60)).await;
    assert!(r.ok, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    assert_eq!(r.stdout.trim(), "ok");
}
