//! Every command we print works, as a newcomer meets it. Two runs:
//!
//! 1. **The demo's own next steps**: `fleetgate demo` is started as a user starts it (serving
//!    until Ctrl-C), and every command it prints under "Next, in another terminal" is run exactly
//!    as printed — export the key, stream with curl, stream with the OpenAI Python SDK, read the
//!    request back with `usage`, issue a key, revoke the demo's key, and see the 401.
//! 2. **The shell blocks of README.md and docs/*.md**, in order, against real gateways and sims on
//!    free ports. A block that cannot run in a test says so visibly on the line before it
//!    (`_Not run by the docs test: <why>._`); every other block runs. Only ports, paths and keys
//!    are rewritten, by these rules:
//!    - `cargo build --release` and `cargo test` are skipped (this run is both), `pip install …`
//!      is skipped (`.ci/run` installs what the docs install);
//!    - `cargo run --release -- demo` starts the demo in the background, as a second terminal
//!      would have it; its key, key id, port and store then stand for `fg-stress-...`, `<id>`,
//!      `127.0.0.1:8080` and `<demo dir>` in the blocks after it;
//!    - `./target/release/fleetgate` and `fleetgate` run the binary cargo built for this test;
//!    - a command ending in `&` runs in the background on a free port in place of the one
//!      written (8001, 8002, 8003, 8080, 8081), and the next command waits until it listens;
//!    - commands run in a scratch directory holding `config/fleetgate.toml` with those ports and
//!      its store in the scratch directory;
//!    - `<id>` after a `keys create` is the id of the key it printed;
//!    - a debug build's `fleetgate bench --compare` gets `--delta-floor-ms 10`: its hop is
//!      1-3 ms, a release build's a fraction of one, and the verdict must not be a coin toss.
//!
//! A command must exit 0 unless its comment says otherwise: `# exit N`, `# answers <status>
//! <code>` (the output names the code), `# ends with <text>`, `# lists <text>`, `# the same
//! verdict both times` (two `verdict:` lines of `fleetgate bench`, one word). A check that
//! does not hold at once is retried for up to 5 s (a usage line is written a moment after its
//! request), except `answers 401 key_revoked`: the first request after a revoke is refused.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{TempDir, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The marker of a block the test does not run (visible in the rendered page).
const NOT_RUN: &str = "_Not run by the docs test: ";

/// What a command's comment says it does.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    Exit(i32),
    Contains(String),
    /// `verdict: WORD` lines in the standard output: this many, all with the same word.
    SameVerdict(usize),
    EndsWith(String),
}

#[derive(Debug, Clone)]
struct Step {
    /// The command as written (continuations joined).
    text: String,
    /// The command without its comment.
    cmd: String,
    expect: Vec<Expect>,
}

/// Split a shell line at its comment: the first ` #` outside quotes.
fn split_comment(line: &str) -> (&str, Option<&str>) {
    let (mut single, mut double) = (false, false);
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'\'' if !double => single = !single,
            b'"' if !single => double = !double,
            b'#' if !single && !double && (i == 0 || bytes[i - 1] == b' ') => {
                return (line[..i].trim_end(), Some(line[i + 1..].trim()));
            }
            _ => {}
        }
    }
    (line.trim_end(), None)
}

fn expectations(comment: Option<&str>) -> Vec<Expect> {
    let Some(c) = comment else {
        return vec![Expect::Exit(0)];
    };
    let mut out = Vec::new();
    let words: Vec<&str> = c.split_whitespace().collect();
    for (i, w) in words.iter().enumerate() {
        match *w {
            "exit" => {
                if let Some(n) = words
                    .get(i + 1)
                    .and_then(|n| n.trim_end_matches(':').parse().ok())
                {
                    out.push(Expect::Exit(n));
                }
            }
            "answers" if words.get(i + 1).is_some_and(|s| s.parse::<u16>().is_ok()) => {
                if let Some(code) = words.get(i + 2) {
                    let code = code.trim_end_matches([':', ',', ';', '.']);
                    out.push(Expect::Contains(code.to_owned()));
                }
            }
            "lists" => {
                if let Some(what) = words.get(i + 1) {
                    let what = what.trim_end_matches([':', ',', ';', '.']);
                    out.push(Expect::Contains(what.to_owned()));
                }
            }
            _ => {}
        }
    }
    // A bench run twice: "the same verdict both times".
    if c.contains("the same verdict both times") {
        out.push(Expect::SameVerdict(2));
    }
    if let Some(rest) = c.split_once("ends with ").map(|(_, r)| r) {
        let text = rest.split(" (").next().unwrap_or(rest).trim();
        out.push(Expect::EndsWith(text.to_owned()));
    }
    if !out.iter().any(|e| matches!(e, Expect::Exit(_))) {
        out.push(Expect::Exit(0));
    }
    out
}

/// The commands of a block of lines: `\` continuations joined, blank lines skipped.
fn steps(lines: &[&str]) -> Vec<Step> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in lines {
        let line = line.trim();
        if line.is_empty() && pending.is_empty() {
            continue;
        }
        let (code, comment) = split_comment(line);
        if let Some(cont) = code.strip_suffix('\\') {
            pending.push_str(cont.trim_end());
            pending.push(' ');
            continue;
        }
        pending.push_str(code);
        let cmd = std::mem::take(&mut pending);
        if cmd.trim().is_empty() {
            continue;
        }
        out.push(Step {
            text: match comment {
                Some(c) => format!("{cmd}   # {c}"),
                None => cmd.clone(),
            },
            cmd,
            expect: expectations(comment),
        });
    }
    out
}

/// A shell session: the environment the commands share, what runs in the background, and
/// the values that stand in for the placeholders.
struct Session {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    /// Text → replacement, applied to every command before it runs.
    subst: Vec<(String, String)>,
    /// A port written in the docs → the free port that stands for it.
    ports: BTreeMap<u16, u16>,
    /// What `127.0.0.1:8080` means now: the demo's gateway, then the one `serve` started.
    gateway: Option<String>,
    background: Vec<Child>,
    /// The id of the last key a command printed.
    last_key_id: Option<String>,
    python_sdk: bool,
}
impl Drop for Session {
    fn drop(&mut self) {
        for c in &mut self.background {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
        for c in &mut self.background {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_listening(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what}: nothing listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where `.ci/run` installs the coding agents' npm packages (their binaries).
fn agents_bin() -> PathBuf {
    let dir = match std::env::var_os("FLEETGATE_AGENTS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/fleetgate/agents"),
    };
    dir.join("node_modules/.bin")
}

/// Whether the OpenAI Python SDK is importable; without it the SDK step is skipped loudly,
/// and under `CI=true` it fails (`.ci/run` installs it).
fn python_sdk() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true: the OpenAI Python SDK is missing (python3 -m pip install openai)"
        );
        eprintln!(
            "SKIPPED: the OpenAI Python SDK steps (python3 -m pip install openai to run them)"
        );
    }
    ok
}

impl Session {
    /// `docs`: the docs' own ports and `config/fleetgate.toml` (with them) in the scratch
    /// directory, where the commands run.
    fn new(dir: &Path, docs: bool) -> Self {
        let mut env = BTreeMap::new();
        // `fleetgate` on the PATH is the binary under test.
        let bin_dir = dir.join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        std::os::unix::fs::symlink(BIN, bin_dir.join("fleetgate")).unwrap();
        // The coding agents where `.ci/run` installs them (the demo prints a line for each).
        env.insert(
            "PATH".into(),
            format!(
                "{}:{}:{}",
                bin_dir.display(),
                agents_bin().display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        );
        env.insert(
            "FLEETGATE_SQLITE_PATH".into(),
            dir.join("fleetgate.db").display().to_string(),
        );
        let mut s = Self {
            dir: dir.to_owned(),
            env,
            subst: vec![("./target/release/fleetgate".into(), BIN.into())],
            ports: BTreeMap::new(),
            gateway: None,
            background: Vec::new(),
            last_key_id: None,
            python_sdk: python_sdk(),
        };
        if docs {
            for p in [8001, 8002, 8003, 8080, 8081] {
                s.ports.insert(p, free_port());
            }
            let mut text =
                std::fs::read_to_string(Path::new(ROOT).join("config/fleetgate.toml")).unwrap();
            for (from, to) in &s.ports {
                text = text.replace(&format!("127.0.0.1:{from}"), &format!("127.0.0.1:{to}"));
            }
            std::fs::create_dir_all(dir.join("config")).unwrap();
            std::fs::write(dir.join("config/fleetgate.toml"), text).unwrap();
        }
        s
    }

    fn rewrite(&self, cmd: &str) -> String {
        let mut c = cmd.to_owned();
        for (from, to) in &self.subst {
            c = c.replace(from, to);
        }
        if let Some(g) = &self.gateway {
            c = c.replace("127.0.0.1:8080", g);
        }
        for (from, to) in &self.ports {
            c = c.replace(&format!("127.0.0.1:{from}"), &format!("127.0.0.1:{to}"));
            c = c.replace(&format!("--port {from}"), &format!("--port {to}"));
        }
        if let Some(id) = &self.last_key_id {
            c = c.replace("<id>", id);
        }
        // The docs' comparisons are of a release build, whose hop is a fraction of a
        // millisecond; this test's unoptimised binary adds 1-3 ms on the shared machine, right
        // at the default 1 ms floor, where a verdict is a coin toss. It is judged against a
        // 10 ms floor instead: the docs' claim (the same verdict each time) is what is tested.
        if cfg!(debug_assertions) && c.contains("fleetgate bench") {
            c = c.replace(" --compare ", " --delta-floor-ms 10 --compare ");
        }
        c
    }

    fn shell(&self, cmd: &str) -> Command {
        let mut c = Command::new("bash");
        c.args(["-c", cmd])
            .current_dir(&self.dir)
            .env_clear()
            .envs(&self.env)
            .env(
                "HOME",
                std::env::var("HOME").unwrap_or_else(|_| "/root".into()),
            );
        c
    }

    /// Start the demo in the background and learn its values from what it prints.
    fn start_demo(&mut self, args: &[&str]) -> Vec<String> {
        let mut child = Command::new(BIN)
            .arg("demo")
            .args(args)
            .current_dir(&self.dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        self.background.push(child);
        let mut lines = Vec::new();
        let mut reader = std::io::BufReader::new(stdout);
        loop {
            let mut line = String::new();
            let n = reader.read_line(&mut line).unwrap();
            assert!(n > 0, "the demo ended early:\n{}", lines.join("\n"));
            let line = line.trim_end().to_owned();
            let done = line.contains("answers 401 key_revoked");
            lines.push(line);
            if done {
                break;
            }
        }
        // Keep reading in the background so the demo never blocks on a full pipe.
        std::thread::spawn(move || for _ in reader.lines() {});
        let find = |prefix: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(prefix))
                .map(|r| r.split_whitespace().next().unwrap().to_owned())
                .unwrap_or_else(|| panic!("the demo printed no `{prefix}`:\n{}", lines.join("\n")))
        };
        let gateway = find("Gateway:");
        let key = find("Key:");
        let store = find("Store:");
        // The console's one-time link signs in (a session cookie), once.
        let console = find("Console:");
        let open = || {
            let out = Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-D", "-", &console])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).to_lowercase()
        };
        let first = open();
        assert!(
            first.starts_with("http/1.1 200") && first.contains("set-cookie: fleetgate_console="),
            "the demo's console link: {first}"
        );
        assert!(
            open().starts_with("http/1.1 401"),
            "a second use is refused"
        );
        let addr = gateway
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .to_owned();
        let id = fleetgate_gateway::key::parse(&key)
            .unwrap()
            .public_id
            .to_owned();
        let demo_dir = Path::new(&store).parent().unwrap().display().to_string();
        self.subst.push(("fg-stress-...".into(), key));
        self.gateway = Some(addr);
        self.subst.push(("<demo dir>".into(), demo_dir));
        self.last_key_id = Some(id);
        lines
    }

    /// Run one step and check it does what its comment says.
    fn run(&mut self, where_: &str, step: &Step) {
        let cmd = step.cmd.trim();
        eprintln!("{where_}: {}", step.text);
        if cmd.starts_with("cargo build") || cmd == "cargo test" || cmd.starts_with("pip install") {
            return;
        }
        if let Some(rest) = cmd.strip_prefix("cargo run --release -- demo") {
            let args: Vec<&str> = rest.split_whitespace().collect();
            let mut all = vec!["--port", "0", "--requests", "2", "--max-tokens", "4"];
            all.extend(args);
            self.start_demo(&all);
            return;
        }
        if cmd.contains("python3 -c 'from openai") && !self.python_sdk {
            return;
        }
        for (agent, what) in [
            ("codex exec", "Codex CLI (npm @openai/codex)"),
            ("claude -p", "Claude Code (npm @anthropic-ai/claude-code)"),
        ] {
            let bin = agent.split(' ').next().unwrap_or(agent);
            if cmd.contains(agent) && !agents_bin().join(bin).exists() {
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "CI=true: {what} is missing (.ci/run installs it)"
                );
                eprintln!("SKIPPED: `{}`: {what} is not installed", step.text);
                return;
            }
        }
        if let Some(assignments) = cmd.strip_prefix("export ")
            && !cmd.contains("$(")
        {
            for a in self.rewrite(assignments).split_whitespace() {
                let (k, v) = a.split_once('=').unwrap();
                self.env.insert(k.to_owned(), v.to_owned());
            }
            return;
        }
        if let Some(bg) = cmd.strip_suffix('&') {
            let bg = bg.trim();
            let written = match bg.split_once("--port ") {
                Some((_, p)) => p.split_whitespace().next().unwrap().parse::<u16>().unwrap(),
                None if bg.contains(" serve") => 8080,
                None => panic!("{where_}: a background command without a port: {cmd}"),
            };
            let port = *self
                .ports
                .get(&written)
                .unwrap_or_else(|| panic!("{where_}: port {written} is not one the docs use"));
            let child = self
                .shell(&format!("exec {}", self.rewrite(bg)))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            self.background.push(child);
            wait_listening(port, &format!("{where_}: {cmd}"));
            if bg.contains(" serve") {
                // From here on, 127.0.0.1:8080 is this gateway.
                self.gateway = Some(format!("127.0.0.1:{port}"));
            }
            return;
        }
        let mut script = self.rewrite(cmd);
        // `export X=$(…)`: run the command, keep the variable for the next ones.
        let exported = cmd
            .strip_prefix("export ")
            .and_then(|a| a.split_once('='))
            .map(|(k, _)| k.to_owned());
        if let Some(k) = &exported {
            script = format!("{script}; printf '%s' \"${k}\"");
        }
        let started = Instant::now();
        loop {
            let out = self.shell(&script).output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            let code = out.status.code().unwrap_or(-1);
            let failed: Vec<String> = step
                .expect
                .iter()
                .filter_map(|e| match e {
                    Expect::Exit(n) if *n != code => Some(format!("exit {code}, not {n}")),
                    Expect::Contains(t)
                        if !stdout.contains(t.as_str()) && !stderr.contains(t.as_str()) =>
                    {
                        Some(format!("no `{t}` in the output"))
                    }
                    Expect::SameVerdict(n) => {
                        let words: Vec<&str> = stdout
                            .lines()
                            .filter_map(|l| l.strip_prefix("verdict: "))
                            .map(|v| v.split_whitespace().next().unwrap_or(""))
                            .collect();
                        (words.len() != *n || words.iter().any(|w| *w != words[0]))
                            .then(|| format!("verdicts {words:?}, not {n} of one word"))
                    }
                    Expect::EndsWith(t) if !stdout.trim_end().ends_with(t.as_str()) => {
                        Some(format!("the output does not end with `{t}`"))
                    }
                    _ => None,
                })
                .collect();
            if failed.is_empty() {
                assert!(
                    !stderr.contains("panicked"),
                    "{where_}: `{}` panicked:\n{stderr}",
                    step.text
                );
                if let Some(k) = exported {
                    self.env.insert(k, stdout.trim().to_owned());
                }
                if let Some(id) = stdout
                    .split(|c: char| c.is_whitespace() || matches!(c, '=' | '"' | ','))
                    .find_map(|w| {
                        fleetgate_gateway::key::parse(w)
                            .ok()
                            .map(|k| k.public_id.to_owned())
                    })
                {
                    self.last_key_id = Some(id);
                }
                return;
            }
            // A revocation holds as printed: the first request after `keys revoke` is refused,
            // never a later one.
            let at_once = step
                .expect
                .iter()
                .any(|e| matches!(e, Expect::Contains(t) if t == "key_revoked"));
            assert!(
                !at_once && started.elapsed() < Duration::from_secs(5),
                "{where_}: `{}` (run as `{script}`): {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
                step.text,
                failed.join("; ")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Session {
    /// Run every `fleetgate bench` example of `fleetgate bench --help` but `diff` (which needs
    /// result files): each must exit 0. How many ran.
    fn run_bench_help_examples(&mut self) -> usize {
        let out = Command::new(BIN)
            .args(["bench", "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        let examples: Vec<Step> = help
            .split_once("Examples:\n")
            .unwrap()
            .1
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("fleetgate bench ") && !l.starts_with("fleetgate bench diff"))
            .map(|l| Step {
                text: l.to_owned(),
                cmd: l.to_owned(),
                expect: vec![Expect::Exit(0)],
            })
            .collect();
        assert!(examples.len() >= 2, "{help}");
        for step in &examples {
            self.run("fleetgate bench --help", step);
        }
        examples.len()
    }
}

/// The shell blocks of a markdown file: (line of the fence, lines, not-run reason).
fn blocks(text: &str) -> Vec<(usize, Vec<&str>, Option<String>)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim_start();
        if let Some(lang) = fence.strip_prefix("```")
            && matches!(lang.trim(), "sh" | "bash" | "shell" | "console")
        {
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            let before = lines[..start]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .copied()
                .unwrap_or("");
            let not_run = before
                .trim()
                .strip_prefix(NOT_RUN)
                .map(|r| r.trim_end_matches("._").trim().to_owned());
            out.push((start + 1, body, not_run));
        }
        i += 1;
    }
    out
}

fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![Path::new(ROOT).join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn the_demos_next_steps_run_as_printed() {
    let dir = TempDir(temp_dir("docs-demo"));
    let mut s = Session::new(&dir.0, false);
    let printed = s.start_demo(&["--port", "0", "--requests", "2", "--max-tokens", "4"]);
    let from = printed
        .iter()
        .position(|l| l.starts_with("Next, in another terminal"))
        .expect("the demo prints its next steps");
    let lines: Vec<&str> = printed[from + 1..].iter().map(String::as_str).collect();
    let all = steps(&lines);
    assert!(all.len() >= 7, "{all:#?}");
    // Nothing is rewritten here: the lines run exactly as the demo printed them.
    s.subst.clear();
    for step in &all {
        s.run("the demo's next steps", step);
    }
}

#[test]
fn every_shell_block_in_the_docs_runs_or_says_why_not() {
    let dir = TempDir(temp_dir("docs-blocks"));
    let mut s = Session::new(&dir.0, true);
    let mut ran = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(ROOT).unwrap().display().to_string();
        for (line, body, not_run) in blocks(&text) {
            if let Some(why) = not_run {
                assert!(
                    why.len() > 10,
                    "{name}:{line}: say why the block is not run"
                );
                continue;
            }
            for step in steps(&body) {
                s.run(&format!("{name}:{line}"), &step);
                ran += 1;
            }
            // `fleetgate bench --help`'s examples run on the README's sims and gateway, as
            // its help says, right after the README's own comparison.
            if name == "README.md" && body.iter().any(|l| l.contains("--compare")) {
                ran += s.run_bench_help_examples();
            }
        }
    }
    assert!(ran >= 20, "only {ran} commands ran");
}

#[test]
fn the_comment_conventions_parse() {
    let s = steps(&[
        "curl -s x -d '{\"a\":\"# not a comment\"}' \\",
        "  -H y   # answers 401 key_revoked",
        "fleetgate keys rotate <id>   # exit 1: revoked",
        "curl -N z   # ends with data: [DONE] (streamed)",
        "fleetgate keys list   # lists prod: the keys",
        "for i in 1 2; do fleetgate bench; done   # the same verdict both times: PASS",
    ]);
    assert_eq!(s.len(), 5);
    assert_eq!(s[4].expect, [Expect::SameVerdict(2), Expect::Exit(0)]);
    assert!(
        s[0].cmd.contains("# not a comment") && s[0].cmd.ends_with("-H y"),
        "{:?}",
        s[0]
    );
    assert_eq!(
        s[0].expect,
        [Expect::Contains("key_revoked".into()), Expect::Exit(0)]
    );
    assert_eq!(s[1].expect, [Expect::Exit(1)]);
    assert_eq!(
        s[2].expect,
        [Expect::EndsWith("data: [DONE]".into()), Expect::Exit(0)]
    );
    assert_eq!(
        s[3].expect,
        [Expect::Contains("prod".into()), Expect::Exit(0)]
    );
}
