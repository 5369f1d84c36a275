//! Keeps the key snapshot current: PostgreSQL LISTEN/NOTIFY applies each change at once;
//! SQLite's change counter is polled every 250 ms; a full resync runs on an interval and after
//! every reconnect. While the store is unreachable the gateway keeps authenticating from its
//! last snapshot, reports itself degraded, and recovers on its own.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use super::{Authenticator, StoreHealth};
use crate::config::DbKind;
use crate::store::KEYS_CHANNEL;

/// A cheap single-row read of a local file; short so revocations land well within 1 s.
pub(crate) const SQLITE_POLL: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(15);

/// How long after a change is committed every gateway on a store of `kind` has applied it:
/// three SQLite polls (a poll, the reload after it, and room for a busy machine), or the
/// milliseconds a PostgreSQL NOTIFY takes (p99 8.7 ms measured; docs/benchmarks.md). `keys
/// revoke` waits this long before it says every gateway refuses the key.
pub fn propagation(kind: DbKind) -> Duration {
    match kind {
        DbKind::Sqlite => SQLITE_POLL * 3,
        DbKind::Postgres => Duration::from_millis(100),
    }
}

/// Run until `stop` is cancelled.
pub(crate) async fn run(auth: Arc<Authenticator>, stop: CancellationToken) {
    match auth.store().kind() {
        DbKind::Postgres => postgres_loop(auth, stop).await,
        DbKind::Sqlite => sqlite_loop(auth, stop).await,
    }
}

/// Reload everything; returns whether it worked.
pub(crate) async fn resync(auth: &Authenticator) -> bool {
    // A key applied while the store is read (a notification, an admin call) may be newer than
    // the read: the read is then done again, twice at most, before it is applied regardless.
    let mut attempt = 1;
    loop {
        let before = auth.current();
        match tokio::time::timeout(Duration::from_secs(10), auth.store().load_all()).await {
            Ok(Ok(keys)) => {
                let n = keys.len();
                let applied = if attempt < 3 {
                    auth.replace_all_since(&before, keys)
                } else {
                    auth.replace_all(keys);
                    true
                };
                if !applied {
                    attempt += 1;
                    continue;
                }
                auth.set_store_health(StoreHealth::Up);
                tracing::debug!(keys = n, "key snapshot reloaded");
                return true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "key resync failed");
                auth.set_store_health(StoreHealth::Down);
                return false;
            }
            Err(_) => {
                tracing::warn!("key resync timed out");
                auth.set_store_health(StoreHealth::Down);
                return false;
            }
        }
    }
}

async fn postgres_loop(auth: Arc<Authenticator>, stop: CancellationToken) {
    let url = auth.store().config().connect_url();
    let mut backoff = Duration::from_millis(250);
    loop {
        // (Re)connect the listener, then resync: changes made while we were away are in it.
        let listener = async {
            let mut l = PgListener::connect(&url).await?;
            l.listen(KEYS_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            _ = stop.cancelled() => return,
            r = tokio::time::timeout(Duration::from_secs(10), listener) => match r {
                Ok(Ok(l)) => l,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot LISTEN for key changes");
                    auth.set_store_health(StoreHealth::Down);
                    if sleep_or_stop(&stop, backoff).await { return; }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
                Err(_) => {
                    auth.set_store_health(StoreHealth::Down);
                    if sleep_or_stop(&stop, backoff).await { return; }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        if !resync(&auth).await {
            if sleep_or_stop(&stop, backoff).await {
                return;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            continue;
        }
        backoff = Duration::from_millis(250);
        let mut tick = tokio::time::interval(auth.config().resync_interval);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {
                    auth.prune();
                    if !resync(&auth).await { break; }
                }
                n = listener.try_recv() => match n {
                    Ok(Some(note)) => {
                        let id = note.payload().to_owned();
                        match auth.store().get(&id).await {
                            Ok(record) => auth.apply(&id, record),
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot load a changed key");
                                auth.set_store_health(StoreHealth::Down);
                                break;
                            }
                        }
                    }
                    Ok(None) => {
                        tracing::warn!("key notification connection lost; reconnecting");
                        auth.set_store_health(StoreHealth::Down);
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "key notification connection failed");
                        auth.set_store_health(StoreHealth::Down);
                        break;
                    }
                },
            }
        }
        if sleep_or_stop(&stop, backoff).await {
            return;
        }
    }
}

async fn sqlite_loop(auth: Arc<Authenticator>, stop: CancellationToken) {
    let mut seen = auth.store().change_seq().await.ok();
    let mut poll = tokio::time::interval(SQLITE_POLL);
    let mut full = tokio::time::interval(auth.config().resync_interval);
    full.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = full.tick() => {
                auth.prune();
                resync(&auth).await;
            }
            _ = poll.tick() => {
                match auth.store().change_seq().await {
                    Ok(seq) if Some(seq) != seen => {
                        if resync(&auth).await {
                            seen = Some(seq);
                        }
                    }
                    Ok(_) => auth.set_store_health(StoreHealth::Up),
                    Err(e) => {
                        tracing::warn!(error = %e, "key change poll failed");
                        auth.set_store_health(StoreHealth::Down);
                    }
                }
            }
        }
    }
}

/// Sleep, or return true when asked to stop.
async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}
