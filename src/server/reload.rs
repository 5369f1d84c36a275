//! Reloading `[[pools]]` from the config file without a restart: on SIGHUP, and — with
//! `server.watch_config` — when the file's content changes (a Kubernetes ConfigMap update).

use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;

use super::Server;

/// How often the watcher reads the file.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// Reload on SIGHUP (and file changes when watching) until `stop`. `running` is the config
/// the server started with.
pub async fn run(server: &Server, path: PathBuf, mut running: Config, stop: CancellationToken) {
    #[cfg(unix)]
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reload by signal is off");
            None
        }
    };
    let watch = running.server.watch_config;
    let mut last = std::fs::read(&path).ok();
    loop {
        #[cfg(unix)]
        let signalled = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let signalled = std::future::pending::<()>();
        let why = tokio::select! {
            _ = stop.cancelled() => return,
            () = signalled => "SIGHUP",
            () = tokio::time::sleep(WATCH_INTERVAL), if watch => {
                let now = std::fs::read(&path).ok();
                if now.is_none() || now == last {
                    continue;
                }
                last = now;
                "the config file changed"
            }
        };
        if why == "SIGHUP" {
            last = std::fs::read(&path).ok();
        }
        if let Some(next) = reload_once(server, &path, &running, why) {
            running = next;
        }
    }
}

/// Read, check and apply the file once. Returns the new config when it was applied.
pub fn reload_once(
    server: &Server,
    path: &std::path::Path,
    running: &Config,
    why: &str,
) -> Option<Config> {
    let next = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            server.fleet.count_failed();
            tracing::error!(trigger = why, error = %e, "reload refused: the config file is invalid; still serving the previous pools");
            return None;
        }
    };
    let restart = running.restart_needed_for(&next);
    if !restart.is_empty() {
        tracing::warn!(
            trigger = why,
            sections = %restart.join(", "),
            "these sections changed and take effect only after a restart; a reload applies [[pools]]"
        );
    }
    match server.reload(&next) {
        Ok(summary) if summary.is_empty() => {
            tracing::info!(
                trigger = why,
                generation = summary.generation,
                "config reloaded: backends unchanged (weights, labels and settings applied)"
            );
            Some(next)
        }
        Ok(summary) => {
            tracing::info!(trigger = why, %summary, "config reloaded");
            Some(next)
        }
        Err(e) => {
            tracing::error!(trigger = why, error = %e, "reload failed; still serving the previous pools");
            None
        }
    }
}
