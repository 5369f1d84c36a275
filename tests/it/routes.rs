//! The allow-list is the contract (docs/security.md, "Routes: the allow-list"): every route of
//! vLLM 0.32's API server, sent to a gateway in front of a backend that records what reaches
//! it — with a valid key, a wrong one and none, and the path tricks that fool a prefix match.
//! Nothing outside the forwarded rows ever reaches the backend, and nothing at all without a
//! valid key.

use std::sync::{Arc, Mutex};

use crate::common::*;
use bytes::Bytes;
use http_body_util::BodyExt;

/// What the backend received: (method, path with query, the request id the client sent).
type Received = Arc<Mutex<Vec<(String, String, String)>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Forwarded,
    Gateway,
    /// Answered by the gateway without a key (the probes).
    Open,
    Never,
}

/// The table of docs/security.md: (method, path, action).
fn table() -> Vec<(String, String, Action)> {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/security.md")).unwrap();
    let rows: Vec<(String, String, Action)> = doc
        .lines()
        .filter(|l| l.starts_with("| GET ") || l.starts_with("| POST "))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let action = match cells[3] {
                "forwarded with a key" => Action::Forwarded,
                "answered by the gateway" => Action::Gateway,
                "answered by the gateway, open" => Action::Open,
                "never forwarded" => Action::Never,
                other => panic!("docs/security.md: unknown action `{other}` in {l}"),
            };
            (cells[1].to_owned(), cells[2].to_owned(), action)
        })
        .collect();
    assert!(rows.len() > 70, "the table was read: {} rows", rows.len());
    rows
}

/// The rows docs/security.md says are forwarded are the endpoint table's, no more, no fewer.
#[test]
fn the_forwarded_rows_are_the_endpoint_table() {
    let mut documented: Vec<(String, String)> = table()
        .into_iter()
        .filter(|(_, _, action)| *action == Action::Forwarded)
        .map(|(method, path, _)| (method, path.replace("{response_id}", "{id}")))
        .collect();
    let mut forwarded: Vec<(String, String)> = fleetgate_protocol::endpoint::TABLE
        .iter()
        .map(|row| (row.method.to_string(), row.path.to_owned()))
        .collect();
    documented.sort();
    forwarded.sort();
    assert_eq!(
        documented, forwarded,
        "docs/security.md's forwarded rows against crates/protocol/src/endpoint.rs's TABLE"
    );
}

/// The body a row is sent with: a valid request for the forwarded ones.
fn body_for(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => {
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#
        }
        "/v1/completions" => r#"{"model":"m","max_tokens":1,"prompt":"hi"}"#,
        "/v1/responses" => r#"{"model":"m","max_output_tokens":1,"input":"hi"}"#,
        "/v1/messages" => {
            r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#
        }
        "/v1/messages/count_tokens" => {
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
        }
        "/tokenize" => r#"{"model":"m","prompt":"hi"}"#,
        "/detokenize" => r#"{"model":"m","tokens":[1,2]}"#,
        "/v1/embeddings" | "/classify" | "/pooling" => r#"{"model":"m","input":"hi"}"#,
        "/v2/embed" => r#"{"model":"m","texts":["hi"]}"#,
        "/rerank" | "/v1/rerank" | "/v2/rerank" => {
            r#"{"model":"m","query":"hi","documents":["a","b"]}"#
        }
        "/score" | "/v1/score" => r#"{"model":"m","queries":"hi","documents":["a"]}"#,
        "/v1/audio/transcriptions" | "/v1/audio/translations" => concat!(
            "--fgroutes\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n",
            "--fgroutes\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n",
            "Content-Type: audio/wav\r\n\r\nRIFF\r\n--fgroutes--\r\n"
        ),
        "/v1/chat/completions/batch" => {
            r#"{"model":"m","max_tokens":1,"messages":[[{"role":"user","content":"hi"}]]}"#
        }
        _ => {
            r#"{"model":"m","input":"hi","prompt":"hi","messages":[{"role":"user","content":"hi"}]}"#
        }
    }
}

/// A backend that records every request and answers each with a small JSON body (200 on
/// `/health`, so the gateway keeps it in its pool).
async fn recording_backend() -> (std::net::SocketAddr, Received, tokio::task::JoinHandle<()>) {
    let seen: Received = Arc::default();
    let log = seen.clone();
    let (addr, task) = http_backend(move |req: http::Request<hyper::body::Incoming>| {
        let id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(String::new, ToString::to_string);
        log.lock()
            .unwrap()
            .push((req.method().to_string(), target, id));
        async move {
            http::Response::builder()
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from_static(
                    br#"{"id":"x","object":"chat.completion","model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
                )))
                .unwrap()
        }
    })
    .await;
    (addr, seen, task)
}

/// Send `method target` with `auth` (an Authorization value, or none) and the request id `id`;
/// the status.
async fn send(gw: &Gateway, method: &str, target: &str, auth: Option<&str>, id: &str) -> u16 {
    let c = fleetgate_protocol::client::http_client();
    let uri: http::Uri = format!("http://{}{target}", gw.server.local_addr)
        .parse()
        .unwrap_or_else(|e| panic!("{target}: {e}"));
    let path = target.split('?').next().unwrap_or(target);
    let audio = path.starts_with("/v1/audio/");
    let content_type = if audio {
        "multipart/form-data; boundary=fgroutes"
    } else {
        "application/json"
    };
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("x-request-id", id)
        .header("content-type", content_type);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let body = if method == "GET" {
        Bytes::new()
    } else {
        Bytes::from_static(body_for(path).as_bytes())
    };
    let resp = c
        .request(req.body(http_body_util::Full::new(body)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("{method} {target}: {e}"));
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_outside_the_allow_list_reaches_a_backend() {
    let (addr, seen, _task) = recording_backend().await;
    let gw = gateway_with(vec![pool("m", &[format!("http://{addr}")])], |c| {
        // Hundreds of refusals from one address, on purpose: no throttling, no delay.
        c.auth.failures_per_minute = 100_000;
        c.auth.failure_delay = std::time::Duration::ZERO;
        c.auth.throttle_delay = std::time::Duration::ZERO;
    })
    .await;
    let key = format!("Bearer {}", gw.key);
    let wrong = "Bearer fg-stress-0000000000000000-0000000000000000000000000000000000000000";
    let rows = table();
    // The path tricks: none is a forwarded route, whatever a prefix match would think.
    let tricks: Vec<(String, String)> = [
        ("POST", "//v1/chat/completions"),
        ("POST", "/v1/../pause"),
        ("POST", "/v1/chat/completions/../../pause"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/chat%2Fcompletions"),
        ("POST", "/v1/chat/completions%00"),
        ("POST", "/V1/chat/completions"),
        ("POST", "/v1//chat/completions"),
        ("POST", "/./v1/chat/completions"),
        ("GET", "/v1/responses/..%2F..%2Fpause"),
        ("GET", "/v1/responses/a/../../../pause"),
        ("POST", "/v1/responses/x/cancel/../../../../pause"),
        ("GET", "/v1/chat/completions"),
        ("DELETE", "/v1/chat/completions"),
        ("PUT", "/tokenize"),
        ("POST", "/v1/models"),
        ("POST", "/pause?next=/v1/chat/completions"),
        ("POST", "/invocations?x=/v1/chat/completions"),
        ("POST", "//v1/embeddings"),
        ("POST", "/v1/embeddings/"),
        ("GET", "/v1/embeddings"),
        ("POST", "/v2/embed/../../pause"),
        ("POST", "/rerank/"),
        ("POST", "/v1%2Frerank"),
        ("POST", "/v1/chat/completions/batch/"),
        ("POST", "/score/../invocations"),
        ("POST", "/v1/audio/transcriptions/"),
        ("POST", "/v1/audio//translations"),
        ("GET", "/v1/audio/transcriptions"),
    ]
    .iter()
    .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
    .collect();

    let mut n = 0;
    // (request id, method, target, what it may do)
    let mut sent: Vec<(String, String, String, Action, bool)> = Vec::new();
    let cases = rows
        .iter()
        .map(|(m, p, a)| (m.clone(), p.replace("{response_id}", "resp_0123abcd"), *a))
        .chain(
            tricks
                .iter()
                .map(|(m, p)| (m.clone(), p.clone(), Action::Never)),
        );
    for (method, target, action) in cases {
        for (auth, valid) in [
            (Some(key.as_str()), true),
            (Some(wrong), false),
            (None, false),
        ] {
            n += 1;
            let id = format!("rt-{n}");
            let status = send(&gw, &method, &target, auth, &id).await;
            match (action, valid) {
                (Action::Open, _) => assert_eq!(status, 200, "{method} {target} (open)"),
                (_, false) => assert_eq!(status, 401, "{method} {target} without a valid key"),
                (Action::Never, true) => assert!(
                    status == 404 || status == 405,
                    "{method} {target} with a key: {status}"
                ),
                (Action::Gateway, true) => assert_eq!(status, 200, "{method} {target}"),
                (Action::Forwarded, true) => assert!(
                    status != 401 && status != 404 || target.starts_with("/v1/responses/"),
                    "{method} {target} with a key: {status}"
                ),
            }
            sent.push((id, method.clone(), target.clone(), action, valid));
        }
    }

    // What reached the backend, by the ids the client sent.
    let seen = seen.lock().unwrap().clone();
    let mut forwarded = 0;
    for (id, method, target, action, valid) in &sent {
        // (`POST /v1/responses` reaches it with the id in the key's namespace.)
        let owned = upstream_responses_id(&gw.key, id);
        let arrived: Vec<_> = seen
            .iter()
            .filter(|(_, _, i)| i == id || *i == owned)
            .collect();
        if !valid || *action != Action::Forwarded {
            assert!(
                arrived.is_empty(),
                "{method} {target} ({id}, valid key: {valid}) reached the backend: {arrived:?}"
            );
            continue;
        }
        // A forwarded route reaches the backend on its own path, and only there.
        for (m, t, _) in &arrived {
            assert_eq!((m, t), (method, target), "{id}");
        }
        forwarded += arrived.len();
    }
    assert!(
        forwarded >= 19,
        "the forwarded rows reached the backend: {forwarded}"
    );
    // Whatever else the backend saw is the gateway's own (health probes, warm-up), never a
    // client's route outside the table.
    let ids: std::collections::HashSet<&str> = sent.iter().map(|s| s.0.as_str()).collect();
    let namespace = format!("{}-", public_id(&gw.key));
    for (m, t, id) in &seen {
        if !ids.contains(id.as_str().strip_prefix(&namespace).unwrap_or(id)) {
            assert!(
                matches!(
                    (m.as_str(), t.as_str()),
                    ("GET", "/health" | "/v1/models" | "/metrics")
                        | ("POST", "/v1/chat/completions" | "/v1/completions")
                ),
                "the backend received {m} {t} (request id {id:?}) from no client request"
            );
        }
    }
}
