//! A network fuzzer against a running gateway: malformed and hostile HTTP/1.1 requests on raw
//! TCP (broken request lines, odd methods and paths, header floods, oversized and invalid
//! header values, Content-Length/Transfer-Encoding conflicts, truncated and mutated JSON
//! bodies, random bytes). Every request must get either a well-formed HTTP answer other than
//! 500 or a closed connection; no panic anywhere in the gateway; afterwards it still serves.
//!
//! `cargo test --test it wire_fuzz::` sends 300 requests to a gateway it starts. The long run
//! (docs/reliability.md) sets the count, and may aim at a release binary:
//!
//! ```sh
//! FLEETGATE_FUZZ_REQUESTS=500000 FLEETGATE_FUZZ_CONCURRENCY=64 cargo test --release --test it wire_fuzz:: -- --nocapture
//! FLEETGATE_FUZZ_TARGET=127.0.0.1:8080 FLEETGATE_FUZZ_KEY=fg-stress-... \
//!   FLEETGATE_FUZZ_REQUESTS=500000 cargo test --release --test it wire_fuzz:: -- --nocapture
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as RunConfig, RngAlgorithm, TestRng, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

static PANICS: AtomicU64 = AtomicU64::new(0);

fn requests() -> usize {
    std::env::var("FLEETGATE_FUZZ_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// Requests in flight at once (`FLEETGATE_FUZZ_CONCURRENCY`, default 16).
fn concurrency() -> usize {
    std::env::var("FLEETGATE_FUZZ_CONCURRENCY")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(16)
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("POST".to_owned()),
        1 => Just("GET".to_owned()),
        1 => Just("HEAD".to_owned()),
        1 => Just("OPTIONS".to_owned()),
        1 => Just("CONNECT".to_owned()),
        1 => Just("PRI".to_owned()),
        1 => "[A-Z]{1,12}",
        1 => "\\PC{0,6}",
    ]
}

fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => Just("/v1/chat/completions".to_owned()),
        2 => Just("/v1/completions".to_owned()),
        1 => Just("/v1/models".to_owned()),
        1 => Just("/tokenize".to_owned()),
        1 => Just("/readyz".to_owned()),
        1 => Just("/healthz".to_owned()),
        1 => Just("/v1/chat/completions?x=%00%ff".to_owned()),
        1 => Just("/../../etc/passwd".to_owned()),
        1 => Just("*".to_owned()),
        1 => Just("http://evil.example/v1/chat/completions".to_owned()),
        1 => "/[ -~]{0,40}",
        1 => "\\PC{0,20}",
    ]
}

fn body(model: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let good = (any::<bool>(), 1u32..8, "\\PC{0,30}").prop_map(move |(stream, n, text)| {
        serde_json::to_vec(&serde_json::json!({
            "model": model, "stream": stream, "max_tokens": n,
            "messages": [{"role": "user", "content": text}],
        }))
        .unwrap()
    });
    prop_oneof![
        4 => good.clone(),
        2 => (good, any::<usize>(), any::<u8>(), any::<bool>()).prop_map(|(mut b, at, byte, cut)| {
            let at = at % b.len();
            if cut { b.truncate(at) } else { b[at] = byte }
            b
        }),
        1 => Just(br#"{"model":"qwen32b","stream":true,"stream_options":null,"messages":[]}"#.to_vec()),
        1 => Just(br#"{"model":"qwen32b","stream":true,"stream_options":{"include_usage":false},"stream_options":null}"#.to_vec()),
        1 => Just(br#"{"model":"qwen32b","max_tokens":1e400,"messages":[{"role":"user","content":"x"}]}"#.to_vec()),
        1 => Just(b"[]".to_vec()),
        1 => Just(Vec::new()),
        1 => prop::collection::vec(any::<u8>(), 0..300),
    ]
}

/// Extra header lines, some legal, some hostile.
fn headers() -> impl Strategy<Value = Vec<String>> {
    let one = prop_oneof![
        Just("Transfer-Encoding: chunked".to_owned()),
        Just("Transfer-Encoding: gzip, chunked".to_owned()),
        Just("Transfer-Encoding : chunked".to_owned()),
        Just("Content-Length: 5".to_owned()),
        Just("Content-Length: -1".to_owned()),
        Just("Content-Length: 99999999999999999999".to_owned()),
        Just("Expect: 100-continue".to_owned()),
        Just("Connection: keep-alive, x-secret".to_owned()),
        Just("X-Secret: leak-me".to_owned()),
        Just("Upgrade: h2c".to_owned()),
        Just("Authorization: Bearer".to_owned()),
        Just("Authorization: Basic Zm9vOmJhcg==".to_owned()),
        Just(
            "Authorization: Bearer fg-prod-000000000000-000000000000000000000000000000000000"
                .to_owned()
        ),
        Just("X-Request-Id: \u{7f}".to_owned()),
        Just("Host:".to_owned()),
        Just(" folded: header".to_owned()),
        "[A-Za-z-]{1,20}: [ -~]{0,60}",
        (1usize..20_000).prop_map(|n| format!("X-Big: {}", "a".repeat(n))),
        "\\PC{0,40}",
    ];
    prop::collection::vec(one, 0..6)
}

#[derive(Debug, Clone)]
struct Attempt {
    bytes: Vec<u8>,
    /// What the attempt is, for the report.
    shape: &'static str,
}

fn attempt(key: String) -> impl Strategy<Value = Attempt> {
    let framed = (method(), path(), headers(), body("qwen32b"), any::<u8>()).prop_map(
        move |(m, p, hs, b, framing)| {
            let mut out = format!("{m} {p} HTTP/1.1\r\nHost: gw\r\n");
            if framing % 4 != 0 {
                out.push_str(&format!("Authorization: Bearer {key}\r\n"));
            }
            out.push_str("Content-Type: application/json\r\n");
            for h in &hs {
                out.push_str(h);
                out.push_str("\r\n");
            }
            let chunked = hs.iter().any(|h| h.contains("chunked"));
            let mut bytes;
            if chunked && framing % 3 == 0 {
                out.push_str("\r\n");
                bytes = out.into_bytes();
                bytes.extend_from_slice(format!("{:x}\r\n", b.len()).as_bytes());
                bytes.extend_from_slice(&b);
                bytes.extend_from_slice(b"\r\n0\r\n\r\n");
            } else {
                // A length that is right, short or long.
                let len = match framing % 5 {
                    0 => b.len().saturating_sub(3),
                    1 => b.len() + 3,
                    _ => b.len(),
                };
                if !hs.iter().any(|h| h.starts_with("Content-Length")) {
                    out.push_str(&format!("Content-Length: {len}\r\n"));
                }
                out.push_str("\r\n");
                bytes = out.into_bytes();
                bytes.extend_from_slice(&b);
            }
            Attempt {
                bytes,
                shape: "request",
            }
        },
    );
    prop_oneof![
        8 => framed,
        1 => prop::collection::vec(any::<u8>(), 0..400).prop_map(|bytes| Attempt { bytes, shape: "random bytes" }),
        1 => (1usize..200).prop_map(|n| {
            let mut s = String::from("GET /healthz HTTP/1.1\r\n");
            for i in 0..n { s.push_str(&format!("X-Flood-{i}: {}\r\n", "v".repeat(100))); }
            s.push_str("\r\n");
            Attempt { bytes: s.into_bytes(), shape: "header flood" }
        }),
        1 => Just(Attempt {
            // Smuggling: a second request hidden behind conflicting framing.
            bytes: b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n".to_vec(),
            shape: "CL.TE smuggling",
        }),
        1 => Just(Attempt {
            bytes: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00garbage".to_vec(),
            shape: "h2 preface then garbage",
        }),
    ]
}

/// Send one attempt on its own connection; the status of the first answer (0: closed with
/// no answer).
async fn send(addr: SocketAddr, a: &Attempt) -> Result<u16, String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    // The server may close before reading everything (it refused the head): not an error.
    let _ = s.write_all(&a.bytes).await;
    let _ = s.shutdown().await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got)).await;
    match read {
        Err(_) => return Err("no answer and no close within 20 s".into()),
        Ok(Err(e)) if got.is_empty() => {
            // A reset after an error answer or none at all.
            let _ = e;
            return Ok(0);
        }
        Ok(_) => {}
    }
    if got.is_empty() {
        return Ok(0);
    }
    if a.bytes.starts_with(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") {
        // An HTTP/2 connection: the answer is frames (SETTINGS, GOAWAY), not a status line.
        return Ok(0);
    }
    let head = String::from_utf8_lossy(&got[..got.len().min(200)]).into_owned();
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("not an HTTP answer: {head:?}"))?;
    if got.windows(9).any(|w| w == b"leak-me\r\n") {
        return Err("a hop-by-hop header's value came back".into());
    }
    Ok(status)
}

/// The gateway's runtime threads are named, so the panic hook counts the gateway's panics
/// alone: the hook is the whole process's, and the other tests of this binary run beside this
/// one.
const GATEWAY_THREADS: &str = "wire-fuzz-gateway";

#[test]
fn fuzz_the_gateway_on_the_wire() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some(GATEWAY_THREADS) {
            PANICS.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(GATEWAY_THREADS)
        .enable_all()
        .build()
        .unwrap()
        .block_on(fuzz_on_the_wire());
}

async fn fuzz_on_the_wire() {
    let target = std::env::var("FLEETGATE_FUZZ_TARGET").ok();
    let (_sim, gw, addr, key) = match &target {
        Some(t) => (
            None,
            None,
            t.parse::<SocketAddr>()
                .expect("FLEETGATE_FUZZ_TARGET is host:port"),
            std::env::var("FLEETGATE_FUZZ_KEY").expect("FLEETGATE_FUZZ_KEY with the target"),
        ),
        None => {
            let sim = sim(|a| a.decode_step_ms = 0.0).await;
            let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
                c.server.header_timeout = Duration::from_secs(2);
                c.server.max_body_bytes = 64 * 1024;
                // Every attempt comes from 127.0.0.1: with the default allowance the address
                // is throttled after 30 refusals and the rest of the run would only meet the
                // throttle (tested on its own in tests/it/keys/refusals.rs), not the parsers.
                c.auth.failures_per_minute = 1_000_000;
            })
            .await;
            let addr = gw.server.local_addr;
            let key = gw.key.clone();
            (Some(sim), Some(gw), addr, key)
        }
    };
    let n = requests();
    let seed = if std::env::var_os("FLEETGATE_FUZZ_REQUESTS").is_some() {
        rand_seed()
    } else {
        [7u8; 32]
    };
    let mut runner = TestRunner::new_with_rng(
        RunConfig::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    );
    let strategy = attempt(key.clone());
    let started = Instant::now();
    let statuses = Arc::new(std::sync::Mutex::new(BTreeMap::<u16, u64>::new()));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let concurrency = concurrency();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0usize;
    // A sliding window: a slow answer (a delayed refusal, a body that never comes) holds one
    // place, not a whole batch.
    while sent < n || !tasks.is_empty() {
        while sent < n && tasks.len() < concurrency {
            let a = strategy.new_tree(&mut runner).unwrap().current();
            sent += 1;
            let statuses = statuses.clone();
            let failures = failures.clone();
            tasks.spawn(async move {
                match send(addr, &a).await {
                    Ok(status) => {
                        *statuses.lock().unwrap().entry(status).or_default() += 1;
                        if status == 500 {
                            failures.lock().unwrap().push(format!(
                                "500 for a {}: {:?}",
                                a.shape,
                                String::from_utf8_lossy(&a.bytes[..a.bytes.len().min(300)])
                            ));
                        }
                    }
                    Err(e) => failures.lock().unwrap().push(format!(
                        "{e} ({}: {:?})",
                        a.shape,
                        String::from_utf8_lossy(&a.bytes[..a.bytes.len().min(300)])
                    )),
                }
            });
        }
        tasks.join_next().await;
    }
    eprintln!(
        "netfuzz: {n} requests in {:.1} s; answers by status (0 = closed without one): {:?}",
        started.elapsed().as_secs_f64(),
        statuses.lock().unwrap()
    );
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failures: {:#?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "the gateway panicked");
    // It still serves.
    let m = client_post(addr, &key).await;
    assert_eq!(m, 200);
    drop(gw);
}

fn rand_seed() -> [u8; 32] {
    use std::hash::{BuildHasher, RandomState};
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&RandomState::new().hash_one(i).to_le_bytes());
    }
    eprintln!("netfuzz seed: {seed:?}");
    seed
}

async fn client_post(addr: SocketAddr, key: &str) -> u16 {
    let body = fleetgate_protocol::client::chat_body("qwen32b", "still there?", 4, true);
    let c = fleetgate_protocol::client::http_client();
    let mut h = http::HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        format!("Bearer {key}").parse().unwrap(),
    );
    let uri: http::Uri = format!("http://{addr}/v1/chat/completions")
        .parse()
        .unwrap();
    fleetgate_protocol::client::send(&c, &uri, &h, body, false)
        .await
        .unwrap()
        .status
}
