//! Clients that try what a key must not do: take over another key's stored response, hold
//! uploads open past their bound, send multipart bodies vLLM reads differently, spoof
//! forwarding headers, reserve less than vLLM may generate, or keep background responses past
//! the pool's slots; a revoked key's refusals are its own in the log.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) const CHAT: &str =
    r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
pub(crate) const CHAT_STREAM: &str =
    r#"{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;

/// The forwarding headers a backend gets, as a reverse proxy sets them: a client's own
/// `X-Forwarded-*`, `Forwarded` and `X-Real-IP` are replaced by the gateway's (the peer's
/// address, the scheme, the Host it was asked for), and the path overrides
/// `X-Original-URL`/`X-Rewrite-URL` never reach a backend. Before, all of them passed as the
/// client sent them and the gateway added none.
#[tokio::test]
async fn forwarding_headers_are_the_gateways_unless_a_trusted_proxy_sent_them() {
    let rec = HeadRecorder::start(&[]).await;
    let claims: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-host", "evil.example"),
        ("x-forwarded-proto", "https"),
        ("forwarded", "for=6.6.6.6;host=evil.example"),
        ("x-real-ip", "6.6.6.6"),
        ("x-original-url", "/admin/keys"),
        ("x-rewrite-url", "/admin/keys"),
    ];
    let stripped = ["forwarded", "x-real-ip", "x-original-url", "x-rewrite-url"];

    // Anyone: replaced.
    let gw = gateway(vec![pool("m", &[rec.url()])]).await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(
        h["x-forwarded-host"],
        gw.server.local_addr.to_string().as_str(),
        "the Host the client asked the gateway for"
    );
    for name in stripped {
        assert!(!h.contains_key(name), "{name} reached the backend: {h:?}");
    }
    assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);

    // A trusted proxy in front: its chain is kept and extended, its host and scheme believed;
    // path overrides still go.
    let gw = gateway_with(vec![pool("m", &[rec.url()])], |c| {
        c.server.trusted_proxies = vec!["127.0.0.0/8".parse().unwrap()];
    })
    .await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    assert_eq!(h["x-forwarded-for"], "6.6.6.6, 127.0.0.1");
    assert_eq!(h["x-forwarded-host"], "evil.example");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert!(h.contains_key("forwarded"));
    assert!(!h.contains_key("x-original-url") && !h.contains_key("x-rewrite-url"));

    // Switched off: the client's go, none are added.
    let gw = gateway_with(vec![pool("m", &[rec.url()])], |c| {
        c.server.forwarded_headers = false;
    })
    .await;
    let m = post(&gw.url("/v1/chat/completions"), claims, CHAT).await;
    assert_eq!(m.status, 200);
    let h = rec.heads().pop().unwrap();
    for name in ["x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"]
        .into_iter()
        .chain(stripped)
    {
        assert!(!h.contains_key(name), "{name}: {h:?}");
    }
}

/// What reached a backend: path, head and body of every request.
#[derive(Clone, Default)]
pub(crate) struct Reached(Arc<Mutex<Vec<(String, http::HeaderMap, bytes::Bytes)>>>);

impl Reached {
    pub(crate) fn to(&self, path: &str) -> Vec<(http::HeaderMap, bytes::Bytes)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| p == path)
            .map(|(_, h, b)| (h.clone(), b.clone()))
            .collect()
    }
}

/// A backend that keeps every request and answers each with `answer(path)`: status, content
/// type, and the body's frames (sent one by one).
pub(crate) async fn recording_backend(
    answer: fn(&str) -> (u16, &'static str, Vec<&'static str>),
) -> (String, Reached, tokio::task::JoinHandle<()>) {
    let reached = Reached::default();
    let keep = reached.clone();
    let (addr, task) = http_backend(move |req: http::Request<hyper::body::Incoming>| {
        let keep = keep.clone();
        async move {
            use http_body_util::BodyExt;
            let path = req.uri().path().to_owned();
            let head = req.headers().clone();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            keep.0.lock().unwrap().push((path.clone(), head, body));
            let (status, ct, frames) = answer(&path);
            let frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::convert::Infallible>> =
                frames
                    .into_iter()
                    .map(|f| {
                        Ok(http_body::Frame::data(bytes::Bytes::from_static(
                            f.as_bytes(),
                        )))
                    })
                    .collect();
            http::Response::builder()
                .status(status)
                .header("content-type", ct)
                .body(http_body_util::StreamBody::new(futures_util::stream::iter(
                    frames,
                )))
                .unwrap()
        }
    })
    .await;
    (format!("http://{addr}"), reached, task)
}

pub(crate) fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn get_as(gw: &Gateway, path: &str, key: &str) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let c = fleetgate_protocol::client::http_client();
    let req = http::Request::get(gw.url(path))
        .header("authorization", bearer(key))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

/// One key cannot take over another's stored response: a request id the client picks (the
/// `x-request-id` header, the body's `request_id`) is put in its key's namespace before vLLM
/// makes the response's id from it, the gateway's own ids are random, and a pin is never
/// moved to another key. Before: key B sent A's id as its `x-request-id`, read A's response
/// and continued it, and A's own read answered 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cannot_take_over_another_keys_stored_response() {
    let sim = sim(|a| a.responses_store = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (a, a_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let (b, b_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let create = |instructions: &str, store: bool| {
        serde_json::json!({"model": "qwen32b", "input": "hi", "max_output_tokens": 2,
                           "instructions": instructions, "store": store})
        .to_string()
    };
    let made = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&a))],
        create("A's secret instructions", true),
    )
    .await;
    assert_eq!(made.status, 200, "{:?}", made.body);
    let id = json_body(&made)["id"].as_str().unwrap().to_owned();
    assert!(
        id.starts_with(&format!("resp_{}-fg-", a_rec.public_id)),
        "a stored response's id is in its key's namespace: {id}"
    );
    // The gateway's own request ids are a process prefix and 96 random bits, not a counter.
    let rid = made.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(rid.len(), 36, "{rid}");
    let again = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&a))],
        create("x", false),
    )
    .await;
    let rid2 = again.headers["x-request-id"].to_str().unwrap();
    assert_eq!(rid[..12], rid2[..12], "one process, one prefix");
    assert_ne!(
        rid[12..28],
        rid2[12..28],
        "{rid} then {rid2}: not sequential"
    );

    // B replays A's upstream id as its own request id, header and body.
    let upstream_id = id.strip_prefix("resp_").unwrap();
    let mut body: serde_json::Value = serde_json::from_str(&create("B's", false)).unwrap();
    body["request_id"] = upstream_id.into();
    let theirs = post(
        &gw.url("/v1/responses"),
        &[
            ("authorization", &bearer(&b)),
            ("x-request-id", upstream_id),
        ],
        body.to_string(),
    )
    .await;
    assert_eq!(theirs.status, 200, "{:?}", theirs.body);
    let their_id = json_body(&theirs)["id"].as_str().unwrap().to_owned();
    assert_ne!(their_id, id);
    assert!(their_id.starts_with(&format!("resp_{}-", b_rec.public_id)));
    // B cannot read or continue A's response; A still can.
    let (status, _) = get_as(&gw, &format!("/v1/responses/{id}"), &b).await;
    assert_eq!(status, 404);
    let cont = serde_json::json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2,
                                  "previous_response_id": id});
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&b))],
        cont.to_string(),
    )
    .await;
    assert_eq!(m.status, 404);
    assert_eq!(openai_error(&m)["code"], "response_not_found");
    let (status, v) = get_as(&gw, &format!("/v1/responses/{id}"), &a).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["instructions"], "A's secret instructions");

    // The body's `request_id` reaches the backend in the key's namespace too.
    let (url, reached, _task) = recording_backend(|_| {
        (
            200,
            "application/json",
            vec![r#"{"id":"resp_x","object":"response","status":"completed","output":[],"usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2}}"#],
        )
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[url])]).await;
    let (c, c_rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let mut body: serde_json::Value = serde_json::from_str(&create("c", true)).unwrap();
    body["request_id"] = "chosen\\\"id".into();
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&c)), ("x-request-id", "mine")],
        body.to_string(),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    let got = reached.to("/v1/responses");
    let (head, sent) = got.last().unwrap();
    let sent: serde_json::Value = serde_json::from_slice(sent).unwrap();
    assert_eq!(
        sent["request_id"],
        format!("{}-chosen\\\"id", c_rec.public_id),
        "{sent}"
    );
    assert_eq!(head["x-request-id"], format!("{}-mine", c_rec.public_id));
    // The client keeps its own id.
    assert_eq!(m.headers["x-request-id"], "mine");
}

/// Open a connection and send the head of a POST declaring `len` bytes of `content_type`
/// body, and `sent` of them; the connection is returned to hold it open.
async fn stalled_upload(
    gw: &Gateway,
    path: &str,
    key: &str,
    content_type: &str,
    len: usize,
    sent: usize,
) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(gw.server.local_addr)
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\ncontent-type: {content_type}\r\ncontent-length: {len}\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(&vec![b'x'; sent]).await.unwrap();
    sock
}

/// The status line and body of the answer on `sock` (read to its end or for 5 s).
async fn answer_on(sock: &mut tokio::net::TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                        break;
                    }
                }
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Bodies still arriving are bounded before they are read: a body holds its declared
/// length, past the key's bound a new one is refused at once with 429, past the gateway's
/// with 503, and one that stops arriving is answered 408 after the idle limit, not the whole
/// body timeout. Before: 80 uploads one byte short of 25 MiB from one key held 1.2 GB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_still_arriving_are_bounded_per_key_and_for_the_gateway() {
    const MIB: usize = 1024 * 1024;
    let sim = sim(|_| {}).await;
    let mut p = pool("asr", &[sim.url()]);
    p.kind = fleetgate_gateway::config::PoolKind::Transcription;
    let gw = gateway_with(vec![p], |c| {
        c.server.max_body_bytes = MIB;
        c.server.max_audio_body_bytes = MIB;
        c.server.max_pending_body_bytes_per_key = 2 * MIB;
        c.server.max_pending_body_bytes = 3 * MIB;
        c.server.body_idle_timeout = Duration::from_millis(1500);
        c.server.body_timeout = Duration::from_secs(30);
    })
    .await;
    let (a, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let (b, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let (c, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Stress, |_| {}).await;
    let audio = "multipart/form-data; boundary=X";
    let path = "/v1/audio/transcriptions";
    // Key A holds its 2 MiB with two uploads one byte short.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(stalled_upload(&gw, path, &a, audio, MIB, MIB - 1).await);
    }
    // Give the gateway the time to read the heads (the refusals below must see them held).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut third = stalled_upload(&gw, path, &a, audio, MIB, 10).await;
    let got = answer_on(&mut third).await;
    assert!(got.starts_with("HTTP/1.1 429"), "{got}");
    assert!(got.contains("key_pending_bodies"), "{got}");
    assert!(got.contains("max_pending_body_bytes_per_key"), "{got}");
    // A JSON body counts the same way.
    let mut json =
        stalled_upload(&gw, "/v1/chat/completions", &a, "application/json", 1000, 5).await;
    let got = answer_on(&mut json).await;
    assert!(got.starts_with("HTTP/1.1 429"), "{got}");
    // Another key still gets in, to the gateway's bound; past it, anyone is refused with 503.
    held.push(stalled_upload(&gw, path, &b, audio, MIB, 10).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut over = stalled_upload(&gw, path, &c, audio, MIB, 10).await;
    let got = answer_on(&mut over).await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("gateway_overloaded"), "{got}");
    assert!(got.contains("retry-after: 1"), "{got}");
    // The held uploads stopped arriving: 408 after the idle limit, well before 30 s.
    let started = std::time::Instant::now();
    let got = answer_on(&mut held[0]).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("body_idle_timeout_seconds"), "{got}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Once they are answered, their bytes are free again: a whole upload of key C is read
    // (and refused only for what it is: no form fields).
    drop(held);
    let mut ok = false;
    for _ in 0..50 {
        let m = post(
            &gw.url(path),
            &[("authorization", &bearer(&c)), ("content-type", audio)],
            vec![b'x'; MIB / 2],
        )
        .await;
        if m.status == 400 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the held bytes were given back");
}

/// A multipart body vLLM would read differently is refused before any backend sees it: a
/// `boundary` named twice (the gateway's parser took the first, Starlette the last, so a key
/// allowed `whisper` had `whisper-secret` run), and a `model` field given twice (it answered
/// 500 `internal_error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_bodies_read_differently_by_vllm_are_refused() {
    let (url, reached, _task) = recording_backend(|_| {
        (
            200,
            "application/json",
            vec![r#"{"text":"hi","usage":{"type":"duration","seconds":1}}"#],
        )
    })
    .await;
    let mut p = pool("whisper", &[url]);
    p.kind = fleetgate_gateway::config::PoolKind::Transcription;
    let gw = gateway(vec![p]).await;
    let part = |boundary: &str, name: &str, value: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        )
    };
    let file = |boundary: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n"
        )
    };
    // Parsed with AAA it names `whisper`; with BBB, `whisper-secret`.
    let body = format!(
        "{}{}--AAA--\r\n{}{}--BBB--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper"),
        file("BBB"),
        part("BBB", "model", "whisper-secret")
    );
    for ct in [
        "multipart/form-data; boundary=AAA; boundary=BBB",
        "multipart/form-data; boundary=\"AAA\"; BOUNDARY=BBB",
        "multipart/form-data; boundary=\"A;A\"; charset=x; boundary=BBB",
    ] {
        let m = post(
            &gw.url("/v1/audio/transcriptions"),
            &[("content-type", ct)],
            body.clone(),
        )
        .await;
        assert_eq!(m.status, 400, "{ct}: {:?}", m.body);
        let e = openai_error(&m);
        assert!(
            e["message"].as_str().unwrap().contains("`boundary`"),
            "{ct}: {e}"
        );
    }
    let twice = format!(
        "{}{}{}--AAA--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper"),
        part("AAA", "model", "whisper-secret")
    );
    let m = post(
        &gw.url("/v1/audio/transcriptions"),
        &[("content-type", "multipart/form-data; boundary=AAA")],
        twice,
    )
    .await;
    assert_eq!(m.status, 400, "{:?}", m.body);
    let e = openai_error(&m);
    assert_eq!(e["param"], "model", "{e}");
    assert!(reached.to("/v1/audio/transcriptions").is_empty());
    // One boundary, one model: forwarded.
    let once = format!(
        "{}{}--AAA--\r\n",
        file("AAA"),
        part("AAA", "model", "whisper")
    );
    let m = post(
        &gw.url("/v1/audio/transcriptions"),
        &[("content-type", "multipart/form-data; boundary=AAA")],
        once,
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
    assert_eq!(reached.to("/v1/audio/transcriptions").len(), 1);
}

/// Reservations read a request as vLLM does: `max_completion_tokens: 0` falls back to
/// `max_tokens` (it reserved 1 token), and a completions list of prompts reserves for each
/// (100 prompts of `max_tokens: 1000` reserved about 1 000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_cover_what_vllm_may_generate() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.tokens_per_minute = Some(20_000);
    })
    .await;
    let chat = r#"{"model":"qwen32b","max_completion_tokens":0,"max_tokens":100000,"messages":[{"role":"user","content":"hi"}]}"#;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &bearer(&key))],
        chat,
    )
    .await;
    assert_eq!(m.status, 429, "{:?}", m.body);
    assert_eq!(openai_error(&m)["code"], "request_exceeds_token_budget");
    let prompts = vec!["\"p\""; 100].join(",");
    let completions = format!(r#"{{"model":"qwen32b","max_tokens":1000,"prompt":[{prompts}]}}"#);
    let m = post(
        &gw.url("/v1/completions"),
        &[("authorization", &bearer(&key))],
        completions,
    )
    .await;
    assert_eq!(m.status, 429, "{:?}", m.body);
    assert_eq!(openai_error(&m)["code"], "request_exceeds_token_budget");
    // Within the budget, it is served.
    let m = post(
        &gw.url("/v1/completions"),
        &[("authorization", &bearer(&key))],
        r#"{"model":"qwen32b","max_tokens":8,"prompt":"p"}"#,
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
}

/// A refusal of a key that was identified (revoked here) is that key's in the request log,
/// so `fleetgate usage --by key` shows its refused attempts; an unknown key's stay keyless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_keys_refusals_are_its_own_in_the_log() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, rec) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let revoked = gw
        .server
        .auth
        .store()
        .revoke(&rec.public_id, "incident", "test")
        .await
        .unwrap();
    gw.server.auth.apply(&rec.public_id, Some(revoked));
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("authorization", &bearer(&key)),
            ("x-request-id", "revoked-1"),
        ],
        CHAT,
    )
    .await;
    assert_eq!(m.status, 401);
    assert_eq!(openai_error(&m)["code"], "key_revoked");
    let seen = gw.record_of("revoked-1").await;
    assert_eq!(seen.key_id.as_deref(), Some(&*rec.public_id));
    // A key nobody issued stays "no key".
    let unknown = format!(
        "fg-prod-{}",
        &key["fg-prod-".len()..].replace(|c: char| c.is_ascii_digit(), "7")
    );
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("authorization", &bearer(&unknown)),
            ("x-request-id", "unknown-1"),
        ],
        CHAT,
    )
    .await;
    assert_eq!(m.status, 401);
    assert_eq!(gw.record_of("unknown-1").await.key_id, None);
}

/// Background responses count against the pool's slots for as long as their backend works on
/// them: 12 background POSTs on a pool of 2 slots never run more than 2 at once at the
/// backend (before: all 12 ran together, and the key's cap and the queue were bypassed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_stay_within_the_pools_slots() {
    let sim = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 20.0;
    })
    .await;
    let mut p = pool("qwen32b", &[sim.url()]);
    p.max_in_flight_per_backend = 2;
    let gw = gateway_with(vec![p], |c| {
        c.queue.max_wait = [Duration::from_millis(300); 3];
    })
    .await;
    let stats = sim.stats().clone();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watching = {
        let (stats, peak) = (stats.clone(), peak.clone());
        tokio::spawn(async move {
            loop {
                let now = stats.running.load(std::sync::atomic::Ordering::SeqCst);
                peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let body = r#"{"model":"qwen32b","input":"hi","max_output_tokens":40,"background":true}"#;
    let posts: Vec<_> = (0..12)
        .map(|_| {
            let url = gw.url("/v1/responses");
            tokio::spawn(async move { post(&url, &[], body).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for p in posts {
        statuses.push(p.await.unwrap());
    }
    let accepted = statuses.iter().filter(|s| **s == 200).count();
    assert!((2..12).contains(&accepted), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    // Let the accepted ones finish (40 tokens × 20 ms).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    watching.abort();
    let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= 2, "{peak} ran at once at the backend");
    assert!(peak >= 1);
}

/// A streamed background response whose client leaves early goes on at the backend: its key's
/// stream stays taken until the backend is done, then comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_background_response_left_early_keeps_its_slot_until_done() {
    use http_body_util::BodyExt;
    let sim = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 20.0;
    })
    .await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.max_concurrent_streams = Some(1);
    })
    .await;
    let body = r#"{"model":"qwen32b","input":"hi","max_output_tokens":60,"background":true,"stream":true}"#;
    let c = fleetgate_protocol::client::http_client();
    let req = http::Request::post(gw.url("/v1/responses"))
        .header("authorization", bearer(&key))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            body.as_bytes(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    // Read until the response's id has come (`response.created`), then leave.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("response.created") {
        let frame = stream.frame().await.unwrap().unwrap();
        seen.extend_from_slice(&frame.into_data().unwrap_or_default());
    }
    drop(stream);
    drop(c);
    let small = r#"{"model":"qwen32b","input":"hi","max_output_tokens":2}"#;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer(&key))],
        small,
    )
    .await;
    assert_eq!(
        m.status, 429,
        "the background work still holds the key's stream"
    );
    // 60 tokens at 20 ms: done within a few seconds, and the stream comes back.
    let mut status = 0;
    for _ in 0..100 {
        status = post(
            &gw.url("/v1/responses"),
            &[("authorization", &bearer(&key))],
            small,
        )
        .await
        .status;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200);
}
