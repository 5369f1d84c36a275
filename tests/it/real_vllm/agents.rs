//! The agents' protocols byte for byte, and Codex CLI and Claude Code through the gateway to
//! real vLLM (against the agents' server, `start --agents`).

use super::*;

/// Every id and time stamp of a body made neutral (`"id"`, `"item_id"`, `"created"`,
/// `"created_at"` values): the agents' protocols carry several per answer, which differ between
/// any two requests. Everything else must be byte for byte the same.
fn neutral_all(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    loop {
        let next = [
            "\"id\":\"",
            "\"item_id\":\"",
            "\"created\":",
            "\"created_at\":",
        ]
        .iter()
        .filter_map(|k| rest.find(k).map(|at| (at, *k)))
        .min();
        let Some((at, key)) = next else {
            out.push_str(rest);
            return out;
        };
        let start = at + key.len();
        out.push_str(&rest[..start]);
        let end = if key.ends_with('"') {
            out.push_str("ID");
            start + rest[start..].find('"').unwrap()
        } else {
            out.push('0');
            start
                + rest[start..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(rest.len() - start)
        };
        rest = &rest[end..];
    }
}

/// A stream of the agents' protocols with the deltas vLLM happened to merge told apart from
/// their text: vLLM hands a slow reader several tokens in one delta (its output collector
/// coalesces them), so how many deltas carry a text differs between any two reads of one
/// generation. Each run of consecutive deltas becomes its joined text; every other event stays
/// as it came, ids, stamps and sequence numbers made neutral.
fn deltas_joined(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut text = String::new();
    for block in body.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let data = block
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        let delta = match v["type"].as_str() {
            Some("response.output_text.delta") => v["delta"].as_str(),
            Some("content_block_delta") => v["delta"]["text"].as_str(),
            _ => None,
        };
        if let Some(d) = delta {
            text.push_str(d);
            continue;
        }
        if !text.is_empty() {
            out.push(format!("deltas: {}", std::mem::take(&mut text)));
        }
        let mut neutral = neutral_all(block);
        while let Some(at) = neutral.find("\"sequence_number\":") {
            let start = at + 18;
            let end = start
                + neutral[start..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(neutral.len() - start);
            neutral.replace_range(at..end, "\"seq\":0");
        }
        out.push(neutral);
    }
    out
}

/// The agents' protocols through the gateway as vLLM answers them directly: whole answers byte
/// for byte (ids and time stamps aside), streams event for event (vLLM's own merging of deltas
/// aside, `deltas_joined`), with the usage the gateway recorded equal to vLLM's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_protocols_are_relayed_byte_for_byte() {
    let Some(r) = real("the_agents_protocols_are_relayed_byte_for_byte").await else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let gw = gateway_to(&r, &r.model, &r.key, false).await;
    let responses = |stream: bool| {
        serde_json::json!({"model": r.model, "input": "Tell me about the sea",
            "max_output_tokens": 10, "temperature": 0, "stream": stream})
    };
    let messages = |stream: bool| {
        serde_json::json!({"model": r.model, "max_tokens": 10, "temperature": 0,
            "stream": stream, "system": "be brief",
            "messages": [{"role": "user", "content": "Tell me about the sea"}]})
    };
    for (path, body, endpoint) in [
        ("/v1/responses", responses(true), "responses"),
        ("/v1/responses", responses(false), "responses"),
        ("/v1/messages?beta=true", messages(true), "messages"),
        ("/v1/messages", messages(false), "messages"),
    ] {
        let d = direct(&r, path, &body).await;
        let rid = format!("agents-{endpoint}-{}", body["stream"]);
        let g = post(
            &gw.url(path),
            &[("x-request-id", &rid)],
            Bytes::from(body.to_string()),
        )
        .await;
        assert_eq!(
            (d.status, g.status),
            (200, 200),
            "{path} {body}: {}",
            text(&g)
        );
        assert_eq!(
            g.headers.get("content-type"),
            d.headers.get("content-type"),
            "{path}"
        );
        if body["stream"] == true {
            assert_eq!(
                deltas_joined(&text(&g)),
                deltas_joined(&text(&d)),
                "{path} {body}"
            );
        } else {
            assert_eq!(
                neutral_all(&text(&g)),
                neutral_all(&text(&d)),
                "{path} {body}"
            );
        }
        let rec = gw.record_of(&rid).await;
        assert_eq!(rec.endpoint, Some(endpoint));
        assert_eq!(rec.error, None, "{path}: a clean end");
        let usage = rec.timeline.stream().usage.expect("usage recorded");
        assert_eq!(usage.completion_tokens, 10, "{path}");
        assert!(usage.prompt_tokens > 0, "{path}");
        assert!(rec.timeline.upstream_ttft().is_some(), "{path}");
    }
    // vLLM's own errors reach an Anthropic client in Anthropic's shape.
    let g = through(
        &gw,
        "/v1/messages",
        &serde_json::json!({"model": r.model, "max_tokens": 100000,
            "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(g.status, 400, "{}", text(&g));
    let v: serde_json::Value = serde_json::from_str(&text(&g)).unwrap();
    assert_eq!(v["type"], "error", "{v}");
}

/// Whether the server runs in agents mode (`scripts/real-vllm.sh start --agents`), which the
/// coding agents need: their prompts need its 32k context, Claude Code's tools its
/// `--enable-auto-tool-choice`, and their requests, which set no output limit, its model that
/// ends its answers after a few words. Skipped loudly otherwise.
fn agents_mode(r: &Real, test: &str) -> bool {
    if r.max_model_len < 32768 {
        eprintln!(
            "\n*** SKIPPED {test} against real vLLM: the server is not in agents mode \
             (max_model_len {}; `scripts/real-vllm.sh stop`, then `start --agents`). ***\n",
            r.max_model_len
        );
        return false;
    }
    // A model built before its answers ended by themselves (the build writes calibration.json
    // beside one that does) would run every answer toward the 32k context: minutes here.
    let dir = std::path::Path::new(&r.root);
    assert!(
        !dir.join("config.json").exists() || dir.join("calibration.json").exists(),
        "{test}: {} predates the agents' model that ends its answers by itself: \
         `scripts/real-vllm.sh stop`, `model --agents` (rebuilds it), `start --agents`",
        r.root
    );
    true
}

/// An agent's run, bounded. Directly against the server (by hand, 2026-12-02: each agent's
/// provider or base URL the server itself) Codex finished in 0.6–1.2 s and Claude Code in
/// 1.9–2.4 s; through the gateway 0.7–3.1 s and 1.9–3.3 s.
const AGENT_LIMIT: Duration = Duration::from_secs(120);

/// A gateway in front of the server, and a prod key for an agent.
async fn agents_gateway(r: &Real) -> (Gateway, String) {
    let gw = gateway_to(r, &r.model, &r.key, false).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    (gw, key)
}

/// The gateway's request-log rows of `endpoint`, described: at least one, each a 200 with its
/// TTFT, hop and usage that relayed the answer to its end. Codex hangs up the moment it reads
/// `response.completed`, often before the gateway has read vLLM's end of body (0.3 ms later):
/// the answer was whole, and the row says so (no `client_disconnected`; tests/it/agent_protocols.rs
/// `a_client_leaving_after_the_terminal_event_got_its_answer`).
async fn agent_rows(gw: &Gateway, endpoint: &str) -> String {
    let rows = || -> Vec<Seen> {
        let rows = gw.records.lock().unwrap().clone();
        rows.into_iter()
            .filter(|r| r.endpoint == Some(endpoint))
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(5), || !rows().is_empty()).await,
        "the request log holds the agent's {endpoint} request: {:?}",
        gw.records.lock().unwrap()
    );
    rows()
        .iter()
        .map(|r| {
            let stream = r.timeline.stream();
            assert_eq!(r.status, 200, "{r:?}");
            assert!(
                r.error.is_none() && (!r.stream || stream.done),
                "a clean end: {r:?}"
            );
            let ttft = r.timeline.upstream_ttft().expect("TTFT recorded");
            assert!(r.timeline.overhead_total().is_some(), "hop recorded: {r:?}");
            let usage = stream.usage.expect("usage recorded");
            format!(
                "{endpoint} stream={} TTFT {ttft:?}, {} prompt + {} answer tokens",
                r.stream, usage.prompt_tokens, usage.completion_tokens,
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Codex CLI (`codex exec`, its provider the gateway with `wire_api = "responses"`) completes a
/// prompt through the gateway to real vLLM in agents mode, as against the sim in
/// tests/it/agent_clis_and_sdks.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_completes_a_prompt_through_the_gateway() {
    const TEST: &str = "codex_cli_completes_a_prompt_through_the_gateway";
    let Some(r) = real(TEST).await else {
        return;
    };
    if !agents_mode(&r, TEST) {
        return;
    }
    let Some(codex) = agent_bin("codex") else {
        tool_or_skip(TEST, "Codex CLI (npm @openai/codex)", false);
        return;
    };
    let _turn = SERIAL.lock().await;
    let (gw, key) = agents_gateway(&r).await;
    let dir = temp_dir("real-vllm-codex");
    let c = Codex::new(
        &dir,
        &format!("http://{}/v1", gw.server.local_addr),
        &r.model,
    );
    let started = std::time::Instant::now();
    let ran = run_agent(
        &codex,
        &Codex::exec_args("say hi"),
        &c.env(&key),
        &c.work,
        AGENT_LIMIT,
    )
    .await;
    let took = started.elapsed();
    assert!(
        ran.ok,
        "codex failed after {took:?}:\nstdout: {}\nstderr: {}",
        ran.stdout, ran.stderr
    );
    assert!(
        !ran.stdout.trim().is_empty(),
        "codex printed the answer: {}",
        ran.stderr
    );
    let rows = agent_rows(&gw, "responses").await;
    eprintln!(
        "Codex CLI through the gateway to real vLLM: {took:?}; {rows}; answer {:?}",
        ran.stdout.trim()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Claude Code (`claude -p`, `ANTHROPIC_BASE_URL` the gateway, the key as
/// `ANTHROPIC_AUTH_TOKEN`) completes a prompt through the gateway to real vLLM in agents mode
/// `/v1/messages` with its tools and no `tool_choice`, as against the sim in
/// tests/it/agent_clis_and_sdks.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_completes_a_prompt_through_the_gateway() {
    const TEST: &str = "claude_code_completes_a_prompt_through_the_gateway";
    let Some(r) = real(TEST).await else {
        return;
    };
    if !agents_mode(&r, TEST) {
        return;
    }
    let Some(claude) = agent_bin("claude") else {
        tool_or_skip(TEST, "Claude Code (npm @anthropic-ai/claude-code)", false);
        return;
    };
    let _turn = SERIAL.lock().await;
    let (gw, key) = agents_gateway(&r).await;
    let dir = temp_dir("real-vllm-claude");
    let (home, work) = (dir.join("home"), dir.join("work"));
    for d in [&home, &work] {
        std::fs::create_dir_all(d).unwrap();
    }
    let env = claude_env(
        &home,
        &format!("http://{}", gw.server.local_addr),
        "ANTHROPIC_AUTH_TOKEN",
        &key,
        &r.model,
    );
    let started = std::time::Instant::now();
    let ran = run_agent(
        &claude,
        &["-p", "say hi", "--no-session-persistence"],
        &env,
        &work,
        AGENT_LIMIT,
    )
    .await;
    let took = started.elapsed();
    assert!(
        ran.ok,
        "claude failed after {took:?}:\nstdout: {}\nstderr: {}",
        ran.stdout, ran.stderr
    );
    assert!(
        !ran.stdout.trim().is_empty(),
        "claude printed the answer: {}",
        ran.stderr
    );
    let rows = agent_rows(&gw, "messages").await;
    eprintln!(
        "Claude Code through the gateway to real vLLM: {took:?}; {rows}; answer {:?}",
        ran.stdout.trim()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
