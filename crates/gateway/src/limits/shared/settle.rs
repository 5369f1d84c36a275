//! Token settlements: what a request used against what it reserved goes back to the key's
//! bucket in Redis in pipelined batches, from a background task (`settle_loop`), never from
//! the request path; shutdown sends what is still queued.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::SharedMetrics;

/// KEYS: key token bucket. ARGV: capacity, delta (> 0 gives back, < 0 takes more).
pub(super) const SETTLE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cap, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'l', 'a')
local level = tonumber(b[1]) or cap
local at = tonumber(b[2]) or now
if now > at then level = math.min(cap, level + (now - at) * cap / 60000000) end
level = math.min(cap, level + delta)
if level >= cap then
  redis.call('DEL', KEYS[1])
  return 0
end
local refill = (cap - level) * 60000000 / cap
redis.call('HSET', KEYS[1], 'l', string.format('%.3f', level), 'a', string.format('%.0f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(refill / 1000) + 1000)
return 0
";

#[derive(Debug)]
pub(super) struct Settle {
    pub(super) key_id: i64,
    pub(super) capacity: u64,
    pub(super) delta: i64,
}

/// Where settlements go: the shared connection while Redis is up.
pub(super) struct Settler {
    pub(super) conn: Arc<ArcSwapOption<ConnectionManager>>,
    pub(super) up: Arc<AtomicBool>,
    pub(super) prefix: Arc<str>,
    pub(super) metrics: Arc<SharedMetrics>,
    pub(super) timeout: Duration,
    pub(super) script: redis::Script,
}

impl Settler {
    /// Send one batch in a pipeline and empty it; `false` when it did not land (counted).
    async fn send(&self, batch: &mut Vec<Settle>) -> bool {
        let sent = self.try_send(batch).await;
        if !sent {
            self.drop_all(batch);
        }
        batch.clear();
        sent
    }

    fn drop_all(&self, batch: &[Settle]) {
        self.metrics.dropped_settlements.inc_by(batch.len() as u64);
    }

    async fn try_send(&self, batch: &[Settle]) -> bool {
        let Some(c) = self
            .conn
            .load_full()
            .filter(|_| self.up.load(Ordering::Acquire))
        else {
            return false;
        };
        let mut c = (*c).clone();
        let prefix = &self.prefix;
        let mut pipe = redis::pipe();
        for s in batch {
            pipe.cmd("EVALSHA")
                .arg(self.script.get_hash())
                .arg(1)
                .arg(format!("{prefix}:k:{}:t", s.key_id))
                .arg(s.capacity)
                .arg(s.delta)
                .ignore();
        }
        let mut result = tokio::time::timeout(self.timeout, pipe.query_async::<()>(&mut c)).await;
        if let Ok(Err(e)) = &result
            && e.kind() == redis::ErrorKind::NoScriptError
        {
            // Redis restarted or flushed its scripts: load it and send the batch again.
            let loaded = self.script.prepare_invoke().load_async(&mut c).await;
            if loaded.is_ok() {
                result = tokio::time::timeout(self.timeout, pipe.query_async::<()>(&mut c)).await;
            }
        }
        matches!(result, Ok(Ok(())))
    }
}

/// Send settlements in pipelined batches until `stop`, then send what is still queued.
pub(super) async fn settle_loop(
    mut rx: mpsc::Receiver<Settle>,
    settler: Settler,
    stop: CancellationToken,
) {
    let mut batch = Vec::with_capacity(256);
    loop {
        let n = tokio::select! {
            _ = stop.cancelled() => break,
            n = rx.recv_many(&mut batch, 256) => n,
        };
        if n == 0 {
            return;
        }
        settler.send(&mut batch).await;
    }
    // Nothing is queued after this (a late settle is counted as dropped), so the drain ends.
    rx.close();
    while rx.recv_many(&mut batch, 256).await > 0 {
        if !settler.send(&mut batch).await {
            // Redis is not taking them: shutdown does not wait a timeout per batch.
            while rx.recv_many(&mut batch, 256).await > 0 {
                settler.drop_all(&batch);
                batch.clear();
            }
        }
    }
}
