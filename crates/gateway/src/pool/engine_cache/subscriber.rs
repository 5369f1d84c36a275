//! One rank's subscriber: connect, subscribe, apply batches in sequence, fill gaps from the
//! replay endpoint, reconnect with backoff; until cancelled.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::zmtp::{Conn, Kind};
use super::{Link, Rank};
use fleetgate_protocol::kv_events::{self, Batch, MAX_PAYLOAD, REPLAY_END};

/// How long a connect and its handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a replay may take in all (vLLM answers from memory).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Where the subscriber is in the publisher's sequence.
struct Cursor {
    /// The sequence number the next batch should have (`None`: no batch seen yet).
    next: Option<u64>,
}

/// Runs `rank`'s subscriber until `stop`. `pool` and `backend` name it in the log.
pub(crate) async fn run_rank(
    rank: Arc<Rank>,
    topic: Arc<str>,
    pool: Arc<str>,
    backend: Arc<str>,
    stop: CancellationToken,
) {
    let mut cursor = Cursor { next: None };
    let mut backoff = BACKOFF_FIRST;
    loop {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = Conn::connect(&rank.endpoint, Kind::Sub, MAX_PAYLOAD, CONNECT_TIMEOUT) => c,
        };
        let mut conn = match connected {
            Ok(mut c) => match c.subscribe(topic.as_bytes()).await {
                Ok(()) => c,
                Err(e) => {
                    down(&rank, &pool, &backend, &format!("cannot subscribe: {e}"));
                    if pause(&stop, &mut backoff).await {
                        return;
                    }
                    continue;
                }
            },
            Err(e) => {
                down(&rank, &pool, &backend, &format!("cannot connect: {e}"));
                if pause(&stop, &mut backoff).await {
                    return;
                }
                continue;
            }
        };
        backoff = BACKOFF_FIRST;
        rank.set_link(Link::Up);
        rank.detail.store(None);
        tracing::info!(
            model = &*pool,
            backend = &*backend,
            rank = rank.rank,
            endpoint = %rank.endpoint,
            "subscribed to the engine's KV events"
        );
        let ended = loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = conn.recv() => m,
            };
            match msg {
                Ok(frames) => on_message(&rank, &mut cursor, frames, &pool, &backend).await,
                Err(e) => break e,
            }
        };
        down(
            &rank,
            &pool,
            &backend,
            &format!("the connection ended: {ended}"),
        );
        if pause(&stop, &mut backoff).await {
            return;
        }
    }
}

fn down(rank: &Rank, pool: &str, backend: &str, why: &str) {
    // Logged once per outage, not per retry.
    if rank.link() != Link::Down {
        tracing::warn!(
            model = pool,
            backend,
            rank = rank.rank,
            endpoint = %rank.endpoint,
            "KV events unavailable ({why}); until they resume, routing does not trust this engine's index"
        );
    }
    rank.set_link(Link::Down);
    rank.detail
        .store(Some(Arc::new(format!("tcp://{}: {why}", rank.endpoint))));
}

/// Waits out the backoff (doubling it); true when stopped meanwhile.
async fn pause(stop: &CancellationToken, backoff: &mut Duration) -> bool {
    let wait = *backoff;
    *backoff = (*backoff * 2).min(BACKOFF_MAX);
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(wait) => false,
    }
}

/// One live message: `[topic, sequence, payload]`.
async fn on_message(
    rank: &Rank,
    cursor: &mut Cursor,
    frames: Vec<Bytes>,
    pool: &str,
    backend: &str,
) {
    let [_topic, seq, payload] = &frames[..] else {
        rank.bad.fetch_add(1, Ordering::Relaxed);
        note(rank, format!("a message of {} frames, not 3", frames.len()));
        return;
    };
    let Some(seq) = kv_events::sequence(seq) else {
        rank.bad.fetch_add(1, Ordering::Relaxed);
        note(rank, "a sequence frame that is not 8 bytes".to_owned());
        return;
    };
    match cursor.next {
        Some(next) if seq == next => {}
        Some(next) if seq > next => {
            // Batches next..seq were lost on the way.
            fill(rank, next, seq, pool, backend).await;
        }
        Some(_) => {
            // A connection delivers in order, so a sequence going back is a new publisher:
            // the engine restarted, and its cache is empty.
            rank.restarts.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                model = pool,
                backend,
                rank = rank.rank,
                seq,
                "the engine's KV event sequence restarted: its index is cleared"
            );
            if let Ok(mut ix) = rank.index.write() {
                ix.clear();
            }
            if seq > 0 {
                fill(rank, 0, seq, pool, backend).await;
            }
        }
        None if seq > 0 => {
            // Joining a running engine: what it stored before is asked of the replay.
            fill(rank, 0, seq, pool, backend).await;
        }
        None => {}
    }
    cursor.next = Some(seq.saturating_add(1));
    apply(rank, payload);
    rank.applied.fetch_add(1, Ordering::Relaxed);
}

/// Decodes and applies one payload; false when it does not decode.
fn apply(rank: &Rank, payload: &[u8]) -> bool {
    match kv_events::decode(payload) {
        Ok(batch) => {
            apply_batch(rank, &batch);
            rank.last_batch_ms
                .store(crate::clock::mono_ms().max(1), Ordering::Relaxed);
            true
        }
        Err(e) => {
            rank.bad.fetch_add(1, Ordering::Relaxed);
            // Its events are lost: the index may now miss a removal.
            if let Ok(mut ix) = rank.index.write() {
                ix.lose_trust();
            }
            note(rank, format!("a payload that does not decode: {e}"));
            false
        }
    }
}

fn apply_batch(rank: &Rank, batch: &Batch) {
    if let Ok(mut ix) = rank.index.write() {
        for e in &batch.events {
            ix.apply(e);
        }
    }
}

fn note(rank: &Rank, what: String) {
    rank.detail.store(Some(Arc::new(what)));
}

/// Batches `from..to` were missed: ask the replay endpoint for them. Whatever it cannot give
/// (no endpoint, no answer, no longer buffered) leaves the index untrusted.
async fn fill(rank: &Rank, from: u64, to: u64, pool: &str, backend: &str) {
    // Only this task replays for the rank: what the replay applied before failing is not lost.
    let replayed_before = rank.replayed.load(Ordering::Relaxed);
    let got = match &rank.replay {
        Some(addr) => tokio::time::timeout(REPLAY_TIMEOUT, replay(rank, addr, from, to))
            .await
            .unwrap_or_else(|_| Err(format!("no full answer within {REPLAY_TIMEOUT:?}"))),
        None => Err("the pool names no replay_port".to_owned()),
    };
    match got {
        Ok(()) => {}
        Err(why) => {
            let replayed = rank.replayed.load(Ordering::Relaxed) - replayed_before;
            rank.lost
                .fetch_add((to - from).saturating_sub(replayed), Ordering::Relaxed);
            if let Ok(mut ix) = rank.index.write() {
                ix.lose_trust();
            }
            let what = if from == 0 && rank.applied.load(Ordering::Relaxed) == 0 {
                format!("joined at sequence {to}; the history before it was not replayed ({why})")
            } else {
                format!("lost batches {from}..{to}, not replayed ({why})")
            };
            tracing::warn!(
                model = pool,
                backend,
                rank = rank.rank,
                "KV events: {what}; only blocks stored from now on count until the cache turns over"
            );
            note(rank, what);
        }
    }
}

/// Applies the replayed batches `from..to` in order; `Err` when they are not all there.
async fn replay(rank: &Rank, addr: &str, from: u64, to: u64) -> Result<(), String> {
    let mut conn = Conn::connect(addr, Kind::Dealer, MAX_PAYLOAD, CONNECT_TIMEOUT)
        .await
        .map_err(|e| format!("cannot reach tcp://{addr}: {e}"))?;
    conn.send(&[b"", &from.to_be_bytes()])
        .await
        .map_err(|e| format!("tcp://{addr}: {e}"))?;
    let mut next = from;
    loop {
        let frames = conn
            .recv()
            .await
            .map_err(|e| format!("tcp://{addr}: {e}"))?;
        // `["", topic, seq, payload]` from vLLM 0.32 (the end marker's topic empty), `["",
        // seq, payload]` from earlier versions: the sequence and the payload are the last two.
        let (Some([seq, payload]), 3 | 4) = (frames.last_chunk::<2>(), frames.len()) else {
            return Err(format!(
                "a replay message of {} frames, not 3 or 4",
                frames.len()
            ));
        };
        let seq = kv_events::sequence(seq).ok_or("a replay sequence that is not 8 bytes")?;
        if seq == REPLAY_END {
            return if next >= to {
                Ok(())
            } else {
                Err(format!("the replay ended at sequence {next}"))
            };
        }
        if seq < next || seq >= to {
            // Already applied, or arrived live after the gap: skipped.
            continue;
        }
        if seq > next {
            return Err(format!(
                "the replay starts at sequence {seq}, no longer holding {next}"
            ));
        }
        if !apply(rank, payload) {
            return Err(format!("replayed batch {seq} does not decode"));
        }
        rank.replayed.fetch_add(1, Ordering::Relaxed);
        next = seq + 1;
    }
}
