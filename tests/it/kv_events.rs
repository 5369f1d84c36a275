//! The engines' KV cache events (`[pools.kv_events]`): the gateway subscribes to each
//! backend's publisher — here the sim's, which publishes its prefix cache's changes in vLLM's
//! wire format — and `/admin/ready` shows what each engine's index holds and how far it is
//! trusted. A late join is filled from the replay endpoint, a restarted engine clears its
//! index, and a hostile publisher (garbage, truncation, a wrong frame count, a sequence going
//! back, a frame declared terabytes long) is counted and survived.

use std::time::Duration;

use crate::common::*;
use fleetgate_gateway::config::KvEventsConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Two consecutive free ports (publisher, replay).
pub(crate) async fn two_ports() -> u16 {
    // Drawn below the kernel's ephemeral range (32768–60999 on Linux): between this check and
    // the publisher's bind, no other test's `127.0.0.1:0` listener and no outgoing connection
    // can be given them (a port from `:0` could, and did).
    use std::hash::{BuildHasher, RandomState};
    let draw = RandomState::new();
    for i in 0..1000u64 {
        let p = 20_000 + u16::try_from(draw.hash_one(i) % 12_000).unwrap();
        let Ok(_a) = tokio::net::TcpListener::bind(("127.0.0.1", p)).await else {
            continue;
        };
        if tokio::net::TcpListener::bind(("127.0.0.1", p + 1))
            .await
            .is_ok()
        {
            return p;
        }
    }
    panic!("no two consecutive free ports")
}

fn kv(port: u16, replay: bool) -> KvEventsConfig {
    KvEventsConfig {
        port: Some(port),
        replay_port: replay.then_some(port + 1),
        data_parallel_size: 1,
        topic: String::new(),
        max_blocks: 4096,
        tokenizer: None,
        chat_template: None,
    }
}

async fn events_sim(port: u16, encoding: &str) -> fleetgate_sim::SimServer {
    let config = json!({
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{port}"), "replay_endpoint": format!("tcp://*:{}", port + 1),
    });
    let encoding = encoding.to_owned();
    sim(move |a| {
        a.kv_cache_tokens = 4096;
        a.kv_events_config = Some(config.to_string());
        a.kv_events_encoding = encoding;
    })
    .await
}

fn chat(turn: &str) -> bytes::Bytes {
    bytes::Bytes::from(
        json!({"model": "qwen32b", "max_tokens": 4, "messages": [
            {"role": "system", "content": "You are a careful assistant. ".repeat(30)},
            {"role": "user", "content": format!("{turn} question, ").repeat(20)},
        ]})
        .to_string(),
    )
}

/// The one backend's `kv_events` in `/admin/ready`.
async fn events_of(gw: &Gateway) -> Value {
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let (s, v) = admin(gw, "GET", "/admin/ready", Some(&viewer), None).await;
    assert_eq!(s, 200, "{v}");
    v["backends"][0]["kv_events"].clone()
}

/// Polls `/admin/ready` until `cond` holds of the backend's `kv_events` (5 s at most).
async fn events_become(gw: &Gateway, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let start = std::time::Instant::now();
    loop {
        let v = events_of(gw).await;
        if cond(&v) {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "never {what}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_index_follows_a_sims_cache_from_a_late_join_through_its_restart() {
    for encoding in ["map", "array"] {
        let port = two_ports().await;
        let backend = events_sim(port, encoding).await;
        // Two prompts before any gateway listens: only the replay has them.
        for turn in ["first", "second"] {
            let m = post(
                &format!("{}/v1/chat/completions", backend.url())
                    .parse()
                    .unwrap(),
                &[],
                chat(turn),
            )
            .await;
            assert_eq!(m.status, 200);
        }
        let mut p = pool("qwen32b", &[backend.url()]);
        p.kv_events = Some(kv(port, true));
        let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
        let v = events_become(&gw, "subscribed", |v| v["state"] == "live").await;
        assert_eq!(v["ranks"][0]["endpoint"], format!("tcp://127.0.0.1:{port}"));
        let m = post(&gw.url("/v1/chat/completions"), &[], chat("third")).await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        let v = events_become(&gw, "indexed", |v| {
            v["ranks"][0]["batches"].as_u64() >= Some(1)
        })
        .await;
        let r = &v["ranks"][0];
        assert_eq!(
            (r["replayed"].as_u64(), r["lost"].as_u64()),
            (Some(2), Some(0)),
            "{encoding}: {v:#}"
        );
        assert_eq!(
            (&v["state"], &r["bad_payloads"], &r["block_size"]),
            (&json!("live"), &json!(0), &json!(16)),
            "{v:#}"
        );
        // The shared system prompt's blocks are stored once; each turn adds its own.
        let blocks = r["blocks"].as_u64().unwrap();
        assert!(blocks >= 14, "{encoding}: {blocks} blocks");
        assert!(r["index_bytes"].as_u64().unwrap() > 0);
        let metrics = admin_metrics(&gw).await;
        let labels = format!("backend=\"{}\",model=\"qwen32b\"", backend.url());
        for line in [
            format!("fleetgate_kv_events_state{{{labels},rank=\"0\"}} 2"),
            format!("fleetgate_kv_events_blocks{{{labels},rank=\"0\"}} {blocks}"),
            format!("fleetgate_kv_events_batches_total{{{labels},outcome=\"replayed\"}} 2"),
            format!("fleetgate_kv_events_batches_total{{{labels},outcome=\"lost\"}} 0"),
        ] {
            assert!(metrics.contains(&line), "no `{line}` in\n{metrics}");
        }

        // The engine dies: the rank goes down and its index is no longer trusted.
        backend.shutdown().await;
        events_become(&gw, "down", |v| v["state"] == "down").await;
        // A new engine on the same ports starts from sequence 0 with an empty cache.
        let again = events_sim(port, encoding).await;
        events_become(&gw, "reconnected", |v| v["state"] == "live").await;
        let m = post(
            &format!("{}/v1/chat/completions", again.url())
                .parse()
                .unwrap(),
            &[],
            chat("x"),
        )
        .await;
        assert_eq!(m.status, 200);
        let v = events_become(&gw, "restarted", |v| v["ranks"][0]["restarts"] == 1).await;
        let fresh = v["ranks"][0]["blocks"].as_u64().unwrap();
        assert!(fresh < blocks, "the old engine's blocks are gone: {v:#}");
        assert_eq!(v["state"], "live");
        again.shutdown().await;
    }
}

/// A ZeroMQ PUB peer that says what the test makes it say, frame by frame.
struct RawPub {
    stream: tokio::net::TcpStream,
}

impl RawPub {
    async fn accept(l: &tokio::net::TcpListener) -> RawPub {
        let (mut stream, _) = l.accept().await.unwrap();
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        stream.write_all(&greeting).await.unwrap();
        let mut theirs = [0u8; 64];
        stream.read_exact(&mut theirs).await.unwrap();
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&3u32.to_be_bytes());
        ready.extend_from_slice(b"PUB");
        let mut s = RawPub { stream };
        s.frame(0x04, &ready).await;
        // Their READY and their subscription: two short frames.
        for _ in 0..2 {
            let mut head = [0u8; 2];
            s.stream.read_exact(&mut head).await.unwrap();
            let mut body = vec![0; usize::from(head[1])];
            s.stream.read_exact(&mut body).await.unwrap();
        }
        s
    }

    async fn frame(&mut self, flags: u8, body: &[u8]) {
        if body.len() > 255 {
            self.stream.write_all(&[flags | 2]).await.unwrap();
            self.stream
                .write_all(&(body.len() as u64).to_be_bytes())
                .await
                .unwrap();
        } else {
            self.stream
                .write_all(&[flags, body.len() as u8])
                .await
                .unwrap();
        }
        self.stream.write_all(body).await.unwrap();
    }

    async fn message(&mut self, frames: &[&[u8]]) {
        for (i, f) in frames.iter().enumerate() {
            self.frame(u8::from(i + 1 < frames.len()), f).await;
        }
    }
}

/// The sim's encoder and the gateway's decoder are written apart (the sim is an independent
/// stand-in for vLLM): what one writes, the other reads, in both encodings.
#[test]
fn the_sims_batches_decode_to_their_events() {
    use fleetgate_protocol::kv_events::{Event, decode};
    use fleetgate_sim::kv_events::{Encoding, Outgoing, encode};
    let tokens: Vec<u32> = (1..=8).collect();
    let events = [
        Outgoing::Stored {
            hashes: &[u64::MAX - 1, 12],
            parent: Some(10),
            token_ids: &tokens,
            block_size: 4,
            lora_name: Some("sql-lora"),
        },
        Outgoing::Removed { hashes: &[12] },
        Outgoing::Cleared,
    ];
    for encoding in [Encoding::Maps, Encoding::Arrays] {
        let batch = decode(&encode(1.5, &events, 2, encoding)).unwrap();
        assert_eq!(
            (batch.ts, batch.data_parallel_rank, batch.unknown),
            (1.5, Some(2), 0)
        );
        let [Event::Stored(st), Event::Removed(rm), Event::Cleared] = &batch.events[..] else {
            panic!("{encoding:?}: {:?}", batch.events)
        };
        assert_eq!(st.hashes.len(), 2);
        assert_ne!(st.hashes[0], st.hashes[1]);
        assert_eq!(
            rm.hashes,
            vec![st.hashes[1]],
            "a removal names the stored block's hash"
        );
        assert!(st.parent.is_some());
        assert_eq!((st.token_ids.clone(), st.block_size), (tokens.clone(), 4));
        assert_eq!(
            (st.lora_name.as_deref(), st.medium.as_deref()),
            (Some("sql-lora"), Some("GPU"))
        );
        // An adapter's blocks carry its name as their extra key, as vLLM's do.
        assert!(
            st.extra_keys.iter().all(Option::is_some),
            "{:?}",
            st.extra_keys
        );
        assert_eq!(st.extra_keys[0], st.extra_keys[1]);
    }
}

fn stored_batch(hash: u64) -> Vec<u8> {
    use fleetgate_sim::kv_events::{Encoding, Outgoing, encode};
    encode(
        1.0,
        &[Outgoing::Stored {
            hashes: &[hash],
            parent: None,
            token_ids: &[hash as u32; 16],
            block_size: 16,
            lora_name: None,
        }],
        0,
        Encoding::Maps,
    )
}

#[tokio::test]
async fn a_hostile_publisher_is_counted_and_survived() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let backend = sim(|_| {}).await;
    let mut p = pool("qwen32b", &[backend.url()]);
    p.kv_events = Some(kv(port, false));
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    let mut publisher = RawPub::accept(&listener).await;
    events_become(&gw, "up", |v| v["state"] == "live").await;

    publisher
        .message(&[b"", &0u64.to_be_bytes(), &stored_batch(1)])
        .await;
    events_become(&gw, "one block", |v| v["ranks"][0]["blocks"] == 1).await;
    // Not msgpack; msgpack cut short; two frames instead of three; an 8-byte sequence that
    // is 7 bytes.
    publisher
        .message(&[b"", &1u64.to_be_bytes(), b"\xc1garbage"])
        .await;
    let whole = stored_batch(2);
    publisher
        .message(&[b"", &2u64.to_be_bytes(), &whole[..whole.len() / 2]])
        .await;
    publisher.message(&[b"", &3u64.to_be_bytes()]).await;
    publisher.message(&[b"", &[0; 7], &stored_batch(3)]).await;
    let v = events_become(&gw, "four bad payloads", |v| {
        v["ranks"][0]["bad_payloads"] == 4
    })
    .await;
    assert_eq!(
        v["state"], "partial",
        "a batch that does not decode may have held a removal: {v:#}"
    );
    assert!(
        v["ranks"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("not 8 bytes"),
        "{v:#}"
    );
    // A sequence going back is a new publisher: the index starts over.
    publisher
        .message(&[b"", &9u64.to_be_bytes(), &stored_batch(4)])
        .await;
    publisher
        .message(&[b"", &0u64.to_be_bytes(), &stored_batch(5)])
        .await;
    let v = events_become(&gw, "restarted", |v| v["ranks"][0]["restarts"] == 1).await;
    assert_eq!(
        (&v["ranks"][0]["blocks"], &v["state"]),
        (&json!(1), &json!("live")),
        "{v:#}"
    );
    // A gap without a replay endpoint: lost, and untrusted until the cache turns over.
    publisher
        .message(&[b"", &5u64.to_be_bytes(), &stored_batch(6)])
        .await;
    // 3..9 were lost before the restart, 1..5 after it.
    let v = events_become(&gw, "a gap", |v| v["ranks"][0]["lost"] == 6 + 4).await;
    assert_eq!(v["state"], "partial");
    // A frame declared a terabyte long ends the connection before anything is allocated.
    publisher.stream.write_all(&[0x02]).await.unwrap();
    publisher
        .stream
        .write_all(&(1u64 << 40).to_be_bytes())
        .await
        .unwrap();
    let v = events_become(&gw, "down", |v| v["state"] == "down").await;
    assert!(
        v["ranks"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("over the"),
        "{v:#}"
    );
    // It reconnects; the gateway serves throughout.
    let _again = RawPub::accept(&listener).await;
    events_become(&gw, "back", |v| v["state"] != "down").await;
    let m = post(&gw.url("/v1/chat/completions"), &[], chat("still here")).await;
    assert_eq!(m.status, 200);
    backend.shutdown().await;
}

/// A model directory the gateway can load (a word-level tokenizer: the requests below are
/// token ids, which need none).
pub(crate) fn tokenizer_dir() -> std::path::PathBuf {
    let dir = temp_dir("kv-tokenizer");
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// Routing by the engines' events: each conversation's second turn goes to the engine that
/// stored its first — whichever one the load sent the first to — and is served from its
/// cache there (the sim reports the cached tokens). By load alone, all six would find their
/// cache with a chance of (1/3)^6.
#[tokio::test]
async fn kv_event_routing_sends_each_turn_where_the_engine_holds_its_prefix() {
    let (gw, sims) = kv_fleet(
        |a| {
            a.kv_cache_tokens = 4096;
            a.enable_prompt_tokens_details = true;
        },
        4,
        (tokenizer_dir(), None),
    )
    .await;
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let blocks = || async {
        let (_, v) = admin(&gw, "GET", "/admin/ready", Some(&viewer), None).await;
        let all = v["backends"].as_array().unwrap();
        assert!(
            all.iter().all(|b| b["kv_events"]["state"] == "live"),
            "{v:#}"
        );
        all.iter()
            .map(|b| b["kv_events"]["ranks"][0]["blocks"].as_u64().unwrap())
            .sum::<u64>()
    };
    let url = gw.url("/v1/completions");
    let first = token_conversations();
    for (i, prompt) in first.iter().enumerate() {
        assert_eq!(cached_of_completion(&url, &[], prompt).await, 0);
        // Wait until its blocks are in an index.
        let want = 10 * (i as u64 + 1);
        let t = std::time::Instant::now();
        while blocks().await < want {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "conversation {i}'s blocks never arrived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    for prompt in &first {
        assert_eq!(
            cached_of_completion(&url, &[], &second_turn(prompt)).await,
            160,
            "the second turn found its first turn's blocks"
        );
    }
    let metrics = admin_metrics(&gw).await;
    assert!(
        metrics.contains("fleetgate_kv_routing_total{model=\"qwen32b\",outcome=\"hit\"} 6"),
        "{metrics}"
    );
    for s in sims {
        s.shutdown().await;
    }
}

/// Six conversations of ten 16-token blocks each, as token ids.
pub(crate) fn token_conversations() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|c| (0..160).map(|t| 1000 + c * 1000 + t).collect())
        .collect()
}

/// A conversation's second turn: its first, then 32 new tokens.
pub(crate) fn second_turn(first: &[u32]) -> Vec<u32> {
    first.iter().copied().chain(50_000..50_032).collect()
}

/// A one-token completion of `prompt` (token ids) at `url`: the cached prompt tokens the
/// backend reported.
pub(crate) async fn cached_of_completion(
    url: &http::Uri,
    headers: &[(&str, &str)],
    prompt: &[u32],
) -> u64 {
    let body = json!({"model": "qwen32b", "prompt": prompt, "max_tokens": 1});
    let m = post(url, headers, bytes::Bytes::from(body.to_string())).await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    json_body(&m)["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// `Some(())` once every backend's events are live.
async fn events_all_live(gw: &Gateway, viewer: &str) -> Option<()> {
    let (_, v) = admin(gw, "GET", "/admin/ready", Some(viewer), None).await;
    v["backends"]
        .as_array()?
        .iter()
        .all(|b| b["kv_events"]["state"] == "live")
        .then_some(())
}

/// A `kv_events` pool over three sims publishing their caches' changes (each sim's arguments
/// set by `args` beside the events), `slack` its load bound, `model` the tokenizer (and
/// template) the gateway cuts prompts with; the gateway returns once every subscriber is live.
async fn kv_fleet(
    args: impl Fn(&mut fleetgate_sim::SimArgs) + Clone + Send + 'static,
    slack: u32,
    model: (std::path::PathBuf, Option<std::path::PathBuf>),
) -> (Gateway, Vec<fleetgate_sim::SimServer>) {
    let mut sims = Vec::new();
    let mut p = pool("qwen32b", &[]);
    for _ in 0..3 {
        let port = two_ports().await;
        let config = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": format!("tcp://*:{port}")});
        let args = args.clone();
        let s = sim(move |a| {
            a.zero_delay = true;
            a.kv_events_config = Some(config.to_string());
            args(a);
        })
        .await;
        p.backends.push(fleetgate_gateway::config::BackendConfig {
            kv_events_port: Some(port),
            ..fleetgate_gateway::config::BackendConfig::new(s.url().parse().unwrap())
        });
        sims.push(s);
    }
    p.affinity = Some(fleetgate_gateway::config::AffinityConfig {
        by: fleetgate_gateway::config::AffinityBy::KvEvents,
        prefix_bytes: 512,
        slack,
        block_bytes: 256,
        max_blocks: 65_536,
        max_age: Duration::from_secs(600),
    });
    p.kv_events = Some(KvEventsConfig {
        tokenizer: Some(model.0),
        chat_template: model.1,
        ..kv(1, false)
    });
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    let start = std::time::Instant::now();
    while events_all_live(&gw, &viewer).await.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the subscribers never connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (gw, sims)
}

/// The request log's (id, predicted cached tokens, cached tokens) once it holds `n` rows (or
/// after 10 s), by id.
pub(crate) async fn rows(gw: &Gateway, n: usize) -> Vec<(String, Option<i64>, Option<i64>)> {
    use sqlx::Row;
    let store = gw.server.auth.store().clone();
    let start = std::time::Instant::now();
    loop {
        let rows = sqlx::query(
            "SELECT request_id, predicted_cached_tokens, cached_tokens FROM request_log ORDER BY request_id",
        )
        .fetch_all(store.pool())
        .await
        .unwrap();
        if rows.len() >= n || start.elapsed() > Duration::from_secs(10) {
            return rows
                .iter()
                .map(|r| {
                    (
                        r.get("request_id"),
                        r.get("predicted_cached_tokens"),
                        r.get("cached_tokens"),
                    )
                })
                .collect();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` answers whose engines served `served` cached tokens in all: each row's prediction is
/// its engine's report, and so are the metric's sums. Returns the metrics text.
pub(crate) async fn predictions_match(gw: &Gateway, n: usize, served: u64) -> String {
    let rows = rows(gw, n).await;
    assert_eq!(rows.len(), n);
    for (id, predicted, reported) in &rows {
        assert!(reported.is_some(), "{id}: the engine's report is recorded");
        assert_eq!(predicted, reported, "{id}: predicted against served");
    }
    let text = admin_metrics(gw).await;
    let m = |kind| {
        metric_value(
            &text,
            "fleetgate_prompt_cache_tokens_total",
            &[("model", "qwen32b"), ("kind", kind)],
        )
    };
    assert_eq!(m("served"), Some(served as f64), "{text}");
    assert_eq!(m("predicted"), Some(served as f64));
    assert_eq!(m("error"), Some(0.0));
    assert!(m("prompt").unwrap() > served as f64);
    text
}

/// Words of the test model's vocabulary, `w{from}` on.
pub(crate) fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("w{}", i % 500))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The cached prompt tokens the engine reported for conversation `c`'s answer at `turn` (at
/// least `min` after the first turn: it found its history), the answer and a next question
/// appended to its `history`.
pub(crate) fn next_turn(
    answer: &Value,
    history: &mut Vec<Value>,
    (c, turn): (usize, usize),
    min: u64,
) -> u64 {
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        turn == 0 || cached >= min,
        "turn {turn} of {c} found its history: {cached} cached"
    );
    history
        .push(json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}));
    history.push(json!({"role": "user", "content": words(300 + c * 40 + turn * 7, 30)}));
    cached
}

/// A model directory both the sims (`--tokenizer`) and the gateway load: a word-level
/// tokenizer over `w0` … `w499` with Qwen's special tokens as single tokens, and Qwen3's chat
/// template. Each side renders the template and tokenizes by its own code.
pub(crate) fn chat_model_dir() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = temp_dir("kv-chat-model");
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for i in 0..500 {
        vocab.insert(format!("w{i}"), json!(i + 1));
    }
    for (i, word) in ["system", "user", "assistant", "think"].iter().enumerate() {
        vocab.insert((*word).into(), json!(600 + i));
    }
    let specials: Vec<Value> = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"id": 700 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    for (i, t) in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        .iter()
        .enumerate()
    {
        vocab.insert((*t).into(), json!(700 + i));
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": specials,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config =
        json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let template = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen3/chat_template.jinja");
    (dir, template)
}

/// `name{labels…}`'s value in a Prometheus text exposition (labels in any order).
pub(crate) fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Chat routed by the engines' events, with the model's own tokens on both sides: the sims
/// cut each prompt with `--tokenizer` and Qwen3's template, the gateway with its own renderer
/// and the same files. Every later turn goes where its history is, and for every request the
/// cached tokens the gateway predicted on the backend it chose are the ones the engine reports
/// serving: in the request log, row by row, and in `fleetgate_prompt_cache_tokens_total`.
#[tokio::test]
async fn the_gateways_prediction_is_what_the_engine_serves_from_its_cache() {
    let (dir, template) = chat_model_dir();
    let model = (dir.clone(), template.clone());
    let (gw, sims) = kv_fleet(
        move |a| {
            a.kv_cache_tokens = 65_536;
            a.enable_prompt_tokens_details = true;
            a.tokenizer = Some(dir.clone());
            a.chat_template = Some(template.clone());
        },
        4,
        (model.0, Some(model.1)),
    )
    .await;
    let viewer = token(fleetgate_gateway::admin::jwt::Role::Viewer);
    // Long enough (over 16 kB) that the gateway cuts it on a blocking thread.
    let system = words(0, 4000);
    let url = gw.url("/v1/chat/completions");
    let mut histories: Vec<Vec<Value>> = (0..4)
        .map(|c| {
            vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": words(200 + c * 40, 40)}),
            ]
        })
        .collect();
    let blocks_indexed = || async {
        let (_, v) = admin(&gw, "GET", "/admin/ready", Some(&viewer), None).await;
        v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["kv_events"]["ranks"][0]["blocks"].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    let mut served = 0;
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let before = blocks_indexed().await;
            let id = format!("kv-chat-{c}-{turn}");
            let body = json!({"model": "qwen32b", "max_tokens": 3, "messages": history});
            let m = post(
                &url,
                &[("x-request-id", id.as_str())],
                bytes::Bytes::from(body.to_string()),
            )
            .await;
            assert_eq!(m.status, 200, "{:?}", m.body);
            served += next_turn(&json_body(&m), history, (c, turn), 160);
            // Its new blocks are in an index before the next request is routed.
            let t = std::time::Instant::now();
            while blocks_indexed().await <= before {
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "{id}'s blocks never arrived"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    // Row by row, the prediction is the truth.
    predictions_match(&gw, 12, served).await;
    for s in sims {
        s.shutdown().await;
    }
}

/// An agent's session header keeps its requests together where no engine holds any of the
/// prompt (here prompts too short for a block): each session's requests all go to one backend,
/// the same whichever of the three headers names it, and sessions spread over the backends.
#[tokio::test]
async fn an_agents_session_keeps_its_requests_on_one_backend() {
    let (dir, template) = chat_model_dir();
    let (gw, sims) = kv_fleet(|a| a.kv_cache_tokens = 4096, 64, (dir, Some(template))).await;
    let url = gw.url("/v1/chat/completions");
    let headers = ["x-claude-code-session-id", "session_id", "x-session-id"];
    let mut n = 0;
    for session in 0..12 {
        for turn in 0..3 {
            let header = headers[(session + turn) % 3];
            let id = format!("s{session:02}-t{turn}");
            let value = format!("session-{session}");
            let body = json!({"model": "qwen32b", "max_tokens": 1, "messages": [{"role": "user", "content": format!("w{turn}")}]});
            let m = post(
                &url,
                &[("x-request-id", id.as_str()), (header, value.as_str())],
                bytes::Bytes::from(body.to_string()),
            )
            .await;
            assert_eq!(m.status, 200);
            n += 1;
        }
    }
    let store = gw.server.auth.store().clone();
    let start = std::time::Instant::now();
    let rows = loop {
        let rows = sqlx::query("SELECT request_id, backend FROM request_log ORDER BY request_id")
            .fetch_all(store.pool())
            .await
            .unwrap();
        if rows.len() >= n || start.elapsed() > Duration::from_secs(10) {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    use sqlx::Row;
    let mut by_session: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for r in &rows {
        let id: String = r.get("request_id");
        let backend: String = r.get("backend");
        by_session
            .entry(id[..3].to_owned())
            .or_default()
            .insert(backend);
    }
    assert_eq!(by_session.len(), 12, "{} rows", rows.len());
    for (session, backends) in &by_session {
        assert_eq!(backends.len(), 1, "{session} went to {backends:?}");
    }
    let used: std::collections::BTreeSet<_> = by_session.values().flatten().collect();
    assert!(used.len() >= 2, "12 sessions on {} backend(s)", used.len());
    for s in sims {
        s.shutdown().await;
    }
}
