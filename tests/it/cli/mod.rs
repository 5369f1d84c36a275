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
