//! Reloading `[[pools]]` from the config file without a restart: on SIGHUP, and — with
//! `server.watch_config` — when the file's content changes (a Kubernetes ConfigMap update).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;

use super::Server;

/// How often the watcher reads the file.
pub(crate) const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// What started a reload: logged as its `trigger`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReloadTrigger {
    Signal,
    FileChanged,
}

impl ReloadTrigger {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ReloadTrigger::Signal => "SIGHUP",
            ReloadTrigger::FileChanged => "the config file changed",
        }
    }
}

/// The file's bytes, or `None` when it cannot be read (a ConfigMap mid-update); read off the
/// event loop.
async fn read_file(path: &Path) -> Option<Vec<u8>> {
    tokio::fs::read(path).await.ok()
}

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
    let mut last = read_file(&path).await;
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
        let trigger = tokio::select! {
            _ = stop.cancelled() => return,
            () = signalled => ReloadTrigger::Signal,
            () = tokio::time::sleep(WATCH_INTERVAL), if watch => ReloadTrigger::FileChanged,
        };
        match trigger {
            // What the signal applies is the watcher's new baseline, so it is not applied
            // a second time as a change.
            ReloadTrigger::Signal => last = read_file(&path).await,
            ReloadTrigger::FileChanged => {
                let now = read_file(&path).await;
                if now.is_none() || now == last {
                    continue;
                }
                last = now;
            }
        }
        if let Some(next) = reload_once(server, &path, &running, trigger).await {
            running = next;
        }
    }
}

/// Read, check and apply the file once. Returns the new config when it was applied.
pub(crate) async fn reload_once(
    server: &Server,
    path: &Path,
    running: &Config,
    trigger: ReloadTrigger,
) -> Option<Config> {
    let why = trigger.as_str();
    // Loading reads the file (and any key or CA file it names): not on the event loop.
    let owned = path.to_path_buf();
    let loaded = match tokio::task::spawn_blocking(move || Config::load(&owned)).await {
        Ok(loaded) => loaded,
        Err(e) => {
            server.fleet.count_failed();
            tracing::error!(trigger = why, error = %e, "reload failed; still serving the previous pools");
            return None;
        }
    };
    let next = match loaded {
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
