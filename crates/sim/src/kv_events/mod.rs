//! vLLM's KV cache events from the simulated prefix cache: `--kv-events-config` takes vLLM's
//! own JSON (`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
//! "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000}`),
//! and the sim publishes what its cache stores and evicts as vLLM does: a PUB socket (bound
//! when the endpoint has `*`, else connecting), three frames per batch (topic, a big-endian u64
//! sequence from 0, the msgpack batch), and a ROUTER replay endpoint answering a start
//! sequence with the batches it still buffers, then sequence -1 with an empty payload.
//!
//! The token ids in `BlockStored` are the sim's own tokens (its character-level pieces, folded
//! to 32 bits), so a consumer can chain blocks over them as over a real model's.

mod encode;
#[cfg(test)]
mod tests;

pub use encode::{Encoding, Outgoing, encode};

use std::collections::VecDeque;
use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's `--kv-events-config`, the fields the sim reads (any other is refused, as vLLM's
/// own config class refuses it).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmConfig {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default = "null_publisher")]
    publisher: String,
    #[serde(default = "default_endpoint")]
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default = "default_buffer_steps")]
    buffer_steps: usize,
    #[serde(default)]
    hwm: Option<u64>,
    #[serde(default)]
    max_queue_size: Option<u64>,
    #[serde(default)]
    topic: String,
}

fn null_publisher() -> String {
    "null".into()
}

fn default_endpoint() -> String {
    "tcp://*:5557".into()
}

fn default_buffer_steps() -> usize {
    10_000
}

/// What the sim publishes, checked.
#[derive(Debug, Clone)]
pub(crate) struct KvEventsSettings {
    endpoint: String,
    /// vLLM's rule: bind when the endpoint has a wildcard, else connect.
    bind: bool,
    replay_endpoint: Option<String>,
    buffer_steps: usize,
    topic: String,
    pub(crate) encoding: Encoding,
}

/// `None` when the JSON turns events off (`enable_kv_cache_events` false or publisher
/// `"null"`), as vLLM does.
pub(crate) fn parse(json: &str, encoding: Encoding) -> Result<Option<KvEventsSettings>, String> {
    let c: VllmConfig = serde_json::from_str(json)
        .map_err(|e| format!("--kv-events-config is not vLLM's KV events config: {e}"))?;
    let _ = (c.hwm, c.max_queue_size);
    if !c.enable_kv_cache_events || c.publisher == "null" {
        return Ok(None);
    }
    if c.publisher != "zmq" {
        return Err(format!(
            "--kv-events-config: publisher {:?} is not one the sim has (\"zmq\" or \"null\")",
            c.publisher
        ));
    }
    let tcp = |e: &str| -> Result<String, String> {
        e.strip_prefix("tcp://")
            .map(|rest| format!("tcp://{}", rest.replacen('*', "0.0.0.0", 1)))
            .ok_or_else(|| {
                format!("--kv-events-config: the sim publishes over tcp:// only, not {e}")
            })
    };
    Ok(Some(KvEventsSettings {
        endpoint: tcp(&c.endpoint)?,
        bind: c.endpoint.contains('*') || c.endpoint.contains("::"),
        // vLLM binds the replay endpoint whatever it says.
        replay_endpoint: c.replay_endpoint.as_deref().map(tcp).transpose()?,
        buffer_steps: c.buffer_steps.max(1),
        topic: c.topic,
        encoding,
    }))
}

/// A change of the prefix cache, in the order it happened.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        /// The LoRA adapter of the request whose prefill computed the blocks.
        adapter: Option<std::sync::Arc<crate::lora::LoraAdapter>>,
    },
    Removed(Vec<u64>),
}

/// Sends the cache's changes to the publishing task, one batch per call.
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    tx: mpsc::UnboundedSender<Vec<Change>>,
}

impl Publisher {
    pub(crate) fn publish(&self, batch: Vec<Change>) {
        if !batch.is_empty() {
            // Only fails while shutting down.
            let _ = self.tx.send(batch);
        }
    }
}

fn zmq_err(e: zeromq::ZmqError) -> io::Error {
    io::Error::other(e.to_string())
}

/// Binds (or connects) the sockets and spawns the task that publishes until `cancel`.
pub(crate) async fn start(
    s: KvEventsSettings,
    block_size: u32,
    cancel: CancellationToken,
) -> io::Result<(Publisher, JoinHandle<()>)> {
    let mut publisher = zeromq::PubSocket::new();
    if s.bind {
        publisher.bind(&s.endpoint).await.map_err(zmq_err)?;
    } else {
        publisher.connect(&s.endpoint).await.map_err(zmq_err)?;
    }
    let mut router = match &s.replay_endpoint {
        Some(e) => {
            let mut r = zeromq::RouterSocket::new();
            r.bind(e).await.map_err(zmq_err)?;
            Some(r)
        }
        None => None,
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Change>>();
    let topic = Bytes::from(s.topic.clone().into_bytes());
    let task = tokio::spawn(async move {
        let mut seq = 0u64;
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                batch = rx.recv() => {
                    let Some(batch) = batch else { return };
                    let payload = Bytes::from(encode_batch(&batch, block_size, s.encoding));
                    let mut msg = ZmqMessage::from(topic.clone());
                    msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                    msg.push_back(payload.clone());
                    if let Err(e) = publisher.send(msg).await {
                        tracing::warn!(error = %e, "KV events: publishing failed");
                    }
                    if buffer.len() == s.buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                    seq += 1;
                }
                req = async { match router.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => {
                    let Some(r) = router.as_mut() else { continue };
                    let Ok(req) = req else { continue };
                    replay(r, req, &topic, &buffer).await;
                }
            }
        }
    });
    Ok((Publisher { tx }, task))
}

/// Answers one replay request `[identity, "", start]` as vLLM 0.32 does.
async fn replay(
    router: &mut zeromq::RouterSocket,
    req: ZmqMessage,
    topic: &Bytes,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let frames = req.into_vec();
    let [id, _, start] = &frames[..] else {
        tracing::warn!(
            frames = frames.len(),
            "KV events: an invalid replay request"
        );
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
        return;
    };
    // As vLLM 0.32: `[identity, "", topic, seq, payload]`, and the end marker with an empty
    // topic and payload.
    let reply = |topic: &Bytes, seq: u64, payload: Bytes| {
        let mut m = ZmqMessage::from(id.clone());
        m.push_back(Bytes::new());
        m.push_back(topic.clone());
        m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        m.push_back(payload);
        m
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if router
            .send(reply(topic, *seq, payload.clone()))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = router
        .send(reply(&Bytes::new(), u64::MAX, Bytes::new()))
        .await;
}

fn encode_batch(batch: &[Change], block_size: u32, encoding: Encoding) -> Vec<u8> {
    let events: Vec<Outgoing<'_>> = batch
        .iter()
        .map(|c| match c {
            Change::Stored {
                hashes,
                parent,
                tokens,
                adapter,
            } => Outgoing::Stored {
                hashes,
                parent: *parent,
                token_ids: tokens,
                block_size,
                lora_name: adapter.as_deref().map(|a| a.name.as_str()),
            },
            Change::Removed(hashes) => Outgoing::Removed { hashes },
        })
        .collect();
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    encode(ts, &events, 0, encoding)
}

/// The 32-bit token id an event carries for one of the sim's 64-bit token ids.
pub(crate) fn event_token(id: u64) -> u32 {
    (id as u32) ^ ((id >> 32) as u32)
}
