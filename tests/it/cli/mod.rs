//! The `fleetgate` binary as a user runs it: config checking and its exit code, `serve` with
//! SIGTERM draining, and the demo.

mod bench;
mod config;
mod help;
mod keys;
mod serve;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");

fn temp_config(text: &str) -> tempfile_path::TempPath {
    tempfile_path::write(text)
}

/// A tiny self-cleaning temp file (no extra dependency).
mod tempfile_path {
    use std::path::PathBuf;

    pub struct TempPath(pub PathBuf);

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    pub fn write(text: &str) -> TempPath {
        use std::hash::{BuildHasher, RandomState};
        let n = RandomState::new().hash_one(std::time::SystemTime::now());
        let p = std::env::temp_dir().join(format!("fleetgate-cli-{}-{n}.toml", std::process::id()));
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        TempPath(p)
    }
}

/// A child process killed if the test fails before it is waited for.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, |c| c.id())
    }
    fn take(mut self) -> std::process::Child {
        self.0
            .take()
            .unwrap_or_else(|| panic!("child already taken"))
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawn `cmd` with its output piped, killed if the test fails before it is collected.
fn spawn_piped(cmd: &mut Command) -> KillOnDrop {
    KillOnDrop(Some(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ))
}

/// `fleetgate serve --config cfg` (with `env` set), once its `/healthz` on `port` answers 200.
async fn serve_until_healthy(cfg: &std::path::Path, port: u16, env: &[(&str, &str)]) -> KillOnDrop {
    let child = spawn_piped(
        Command::new(BIN)
            .args(["serve", "--config"])
            .arg(cfg)
            .envs(env.iter().copied()),
    );
    wait_for_200(&format!("http://127.0.0.1:{port}/healthz")).await;
    child
}

/// Send `signal` (`"TERM"`, `"HUP"`, `"INT"`) to the child.
fn send_signal(child: &KillOnDrop, signal: &str) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} failed");
}

/// Send `signal` and wait for the child to exit: its status and output.
async fn stop_and_collect(child: KillOnDrop, signal: &str) -> std::process::Output {
    send_signal(&child, signal);
    tokio::task::spawn_blocking(move || child.take().wait_with_output())
        .await
        .unwrap()
        .unwrap()
}

/// Run the binary; (exit code, stdout, stderr).
fn fleetgate(args: &[&str]) -> (Option<i32>, String, String) {
    outcome(Command::new(BIN).args(args))
}

/// Run `cmd` to its end; (exit code, stdout, stderr).
fn outcome(cmd: &mut Command) -> (Option<i32>, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
