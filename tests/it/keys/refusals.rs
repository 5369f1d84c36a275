//! Refused keys: every 401/403 with its own message and no backend call, the brute-force
//! slowdown (a throttled address, an unknown id and a wrong secret answered alike, bounded
//! waiting refusals), and `/v1/models` showing only what a key may use.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_has_its_own_message_and_never_reaches_a_backend() {
    let sim = sim(|_| {}).await;
    let mut prod_only = pool("prod-model", &[sim.url()]);
    prod_only.environments = Some(vec![Environment::Prod]);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()]), prod_only], |c| {
        c.auth.failures_per_minute = 1000;
    })
    .await;
    let store = gw.server.auth.store().clone();
    let (revoked, r) = store
        .create(&create(Environment::Stress, "r"), "t")
        .await
        .unwrap();
    store
        .revoke(&r.public_id, "rotated out by ops", "t")
        .await
        .unwrap();
    let (expired, _) = store
        .create(
            &CreateKey {
                expires_in_seconds: Some(1),
                ..create(Environment::Stress, "e")
            },
            "t",
        )
        .await
        .unwrap();
    let (limited, _) = store
        .create(
            &CreateKey {
                allowed_models: Some(vec!["other".into()]),
                ..create(Environment::Prod, "m")
            },
            "t",
        )
        .await
        .unwrap();
    let mut mistyped = gw.key.clone();
    mistyped.pop();
    mistyped.push(if gw.key.ends_with('A') { 'B' } else { 'A' });
    let unknown = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // Let the expiry pass and the snapshot pick the changes up.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    gw.server.auth.replace_all(store.load_all().await.unwrap());

    let chat_for = |model: &str| chat_body(model, "hi", 3, true);
    // (case, headers, body, status, code)
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, Bytes, u16, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            "no credentials",
            vec![("x-no-auth", "1".into())],
            chat_for("qwen32b"),
            401,
            "missing_api_key",
        ),
        (
            "no space",
            vec![("authorization", format!("Bearer{}", gw.key))],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "quoted",
            vec![("authorization", format!("Bearer \"{}\"", gw.key))],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "basic",
            vec![("authorization", "Basic dXNlcjpwYXNz".into())],
            chat_for("qwen32b"),
            401,
            "invalid_authorization_header",
        ),
        (
            "oauth",
            vec![(
                "authorization",
                "Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln".into(),
            )],
            chat_for("qwen32b"),
            401,
            "oauth_not_supported",
        ),
        (
            "openai key",
            vec![("authorization", "Bearer sk-proj-abc123".into())],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "anthropic key",
            vec![("x-api-key", "sk-ant-api03-abcDEF123".into())],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "claude account's oauth token",
            vec![("authorization", "Bearer sk-ant-oat01-abcDEF123".into())],
            chat_for("qwen32b"),
            401,
            "oauth_not_supported",
        ),
        (
            "mistyped",
            vec![("authorization", format!("Bearer {mistyped}"))],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "truncated",
            vec![(
                "authorization",
                format!("Bearer {}", &gw.key[..gw.key.len() - 3]),
            )],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "unknown",
            vec![("authorization", format!("Bearer {unknown}"))],
            chat_for("qwen32b"),
            401,
            "invalid_api_key",
        ),
        (
            "revoked",
            vec![("authorization", format!("Bearer {revoked}"))],
            chat_for("qwen32b"),
            401,
            "key_revoked",
        ),
        (
            "expired",
            vec![("authorization", format!("Bearer {expired}"))],
            chat_for("qwen32b"),
            401,
            "key_expired",
        ),
        (
            "model not allowed",
            vec![("authorization", format!("Bearer {limited}"))],
            chat_for("qwen32b"),
            403,
            "model_not_allowed",
        ),
        (
            "environment not allowed",
            vec![],
            chat_for("prod-model"),
            403,
            "environment_not_allowed",
        ),
    ];
    let mut messages = std::collections::HashSet::new();
    for (name, hdrs, body, status, code) in cases {
        let hdrs: Vec<(&str, &str)> = hdrs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let m = post(&gw.url("/v1/chat/completions"), &hdrs, body).await;
        assert_eq!(m.status, status, "{name}: {:?}", m.body);
        let err = openai_error(&m);
        assert_eq!(err["code"], code, "{name}: {err}");
        assert!(
            !err["message"].as_str().unwrap().contains(&gw.key),
            "{name}: key echoed"
        );
        if status == 401 {
            assert!(m.headers.contains_key("www-authenticate"), "{name}");
        }
        // The SDKs (and Codex and Claude Code through them) stop retrying on it.
        assert_eq!(
            m.headers.get("x-should-retry").map(|v| v.as_bytes()),
            Some(&b"false"[..]),
            "{name}"
        );
        let message = err["message"].as_str().unwrap();
        match name {
            "openai key" => assert!(
                message.contains("OpenAI") && message.contains("OPENAI_API_KEY"),
                "{message}"
            ),
            "anthropic key" => assert!(
                message.contains("Anthropic API key") && message.contains("ANTHROPIC_API_KEY"),
                "{message}"
            ),
            "claude account's oauth token" => assert!(
                message.contains("Claude account") && message.contains("ANTHROPIC_AUTH_TOKEN"),
                "{message}"
            ),
            _ => {}
        }
        messages.insert(message.to_owned());
    }
    // mistyped and truncated share the checksum message; every other cause has its own.
    assert_eq!(messages.len(), 14);
    assert_eq!(
        sim.stats().requests.load(Ordering::SeqCst),
        0,
        "a refused request reached a backend"
    );
    assert_eq!(gw.server.auth.failure_count("revoked"), 1);
    assert_eq!(gw.server.auth.failure_count("environment_not_allowed"), 1);
}

/// One HTTP/1.1 keep-alive connection from a chosen loopback address, written and read by
/// hand so the test sees exactly what the server does with the connection.
struct RawConn {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

/// A response read off a `RawConn`.
struct RawAnswer {
    status: u16,
    /// Header names lower-cased.
    headers: Vec<(String, String)>,
    body: serde_json::Value,
    took: Duration,
}

impl RawAnswer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl RawConn {
    /// Connect to the gateway from `from` (any 127.x.y.z address reaches the loopback
    /// listener, so tests can act as several client addresses).
    async fn connect(gw: &Gateway, from: [u8; 4]) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
        let stream = socket.connect(gw.server.local_addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// `GET /v1/models` with `key`, and its whole answer.
    async fn models(&mut self, key: &str) -> RawAnswer {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t = Instant::now();
        let req = format!(
            "GET /v1/models HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n\r\n"
        );
        self.stream.write_all(req.as_bytes()).await.unwrap();
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed before an answer");
            self.buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(self.buf[..head_end].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let len: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map_or(0, |(_, v)| v.parse().unwrap());
        while self.buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed inside the body");
            self.buf.extend_from_slice(&chunk[..n]);
        }
        let body = serde_json::from_slice(&self.buf[head_end..head_end + len]).unwrap();
        self.buf.drain(..head_end + len);
        RawAnswer {
            status,
            headers,
            body,
            took: t.elapsed(),
        }
    }

    /// Whether the server closes the connection (end of stream) within `limit`.
    async fn closed_by_server(&mut self, limit: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut chunk = [0u8; 64];
        matches!(
            tokio::time::timeout(limit, self.stream.read(&mut chunk)).await,
            Ok(Ok(0) | Err(_))
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_address_is_refused_unchecked_after_a_delay_and_its_connection_closed() {
    let sim = sim(|_| {}).await;
    let throttle_delay = Duration::from_millis(400);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 3;
        c.auth.throttle_delay = throttle_delay;
    })
    .await;
    let bad = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // One keep-alive connection guessing: the allowance is answered 401 and the connection
    // stays open.
    let mut conn = RawConn::connect(&gw, [127, 0, 0, 1]).await;
    for i in 0..3 {
        let a = conn.models(&bad).await;
        assert_eq!(a.status, 401, "guess {i}: {}", a.body);
        assert_eq!(a.header("connection"), None, "guess {i}");
    }
    // Past it: refused after the throttle delay, and the server closes the connection.
    let a = conn.models(&bad).await;
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["error"]["code"], "too_many_auth_failures");
    assert!(a.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(a.header("connection"), Some("close"));
    assert!(a.took >= throttle_delay, "answered after {:?}", a.took);
    assert!(
        conn.closed_by_server(Duration::from_secs(5)).await,
        "the server kept the throttled connection open"
    );
    // The correct key from the throttled address is refused too: while throttled, no key is
    // checked at all.
    let mut again = RawConn::connect(&gw, [127, 0, 0, 1]).await;
    let a = again.models(&gw.key).await;
    assert_eq!(
        a.status, 429,
        "a throttled address had its key checked: {}",
        a.body
    );
    assert_eq!(a.header("connection"), Some("close"));
    assert!(again.closed_by_server(Duration::from_secs(5)).await);
    // Other addresses are served as before.
    let mut other = RawConn::connect(&gw, [127, 0, 0, 2]).await;
    let a = other.models(&gw.key).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(other.models(&gw.key).await.status, 200, "kept alive");
    assert!(gw.server.auth.failure_count("too_many_failures") >= 2);
    // The unknown-key lookups that reached the store stayed within the budget.
    assert!(gw.server.auth.db_lookups() <= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_id_and_a_wrong_secret_are_answered_alike_no_sooner_than_the_floor() {
    let sim = sim(|_| {}).await;
    let floor = Duration::from_millis(300);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 1000;
        c.auth.failure_delay = floor;
        c.auth.throttle_delay = floor;
    })
    .await;
    let known = fleetgate_gateway::key::parse(&gw.key)
        .unwrap()
        .public_id
        .to_owned();
    let wrong_secret = fleetgate_gateway::key::generate(Environment::Stress, Some(&known)).full;
    let wrong_env = fleetgate_gateway::key::generate(Environment::Prod, Some(&known)).full;
    let unknown = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    // The unknown id twice: once looked up in the store, once from the negative cache.
    let mut bodies = Vec::new();
    for (what, key) in [
        ("unknown id (store lookup)", &unknown),
        ("known id, wrong secret", &wrong_secret),
        ("unknown id (negative cache)", &unknown),
        ("known id, wrong environment", &wrong_env),
    ] {
        let t = Instant::now();
        let m = chat(&gw, key).await;
        let took = t.elapsed();
        assert_eq!(m.status, 401, "{what}");
        assert!(
            took >= floor,
            "{what} answered after {took:?}, before the floor"
        );
        let err = openai_error(&m);
        assert_eq!(err["code"], "invalid_api_key", "{what}");
        bodies.push(err["message"].clone());
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "{bodies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_waiting_out_their_delay_are_bounded() {
    let sim = sim(|_| {}).await;
    let delay = Duration::from_secs(3);
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.auth.failures_per_minute = 1000;
        c.auth.failure_delay = delay;
        c.auth.throttle_delay = delay;
        c.auth.max_delayed_answers = 1;
    })
    .await;
    let bad = fleetgate_gateway::key::generate(Environment::Stress, None).full;
    let waiting = |gw: &Gateway| {
        gw.server.auth.update_gauges();
        metrics_text(gw).contains("fleetgate_auth_delayed_answers 1")
    };
    let url = gw.url("/v1/chat/completions");
    let first_key = bad.clone();
    let started = Instant::now();
    let first = tokio::spawn(async move {
        post(
            &url,
            &[("authorization", &format!("Bearer {first_key}"))],
            chat_body("qwen32b", "hi", 3, false),
        )
        .await
    });
    assert!(eventually(Duration::from_secs(5), || waiting(&gw)).await);
    // The one slot is taken: the next refusal is answered without waiting, and counted.
    let second = chat(&gw, &bad).await;
    assert_eq!(second.status, 401);
    assert!(
        !first.is_finished(),
        "the second refusal waited for the first's delay"
    );
    assert!(metrics_text(&gw).contains("fleetgate_auth_delays_skipped_total 1"));
    let first = first.await.unwrap();
    assert_eq!(first.status, 401);
    assert!(started.elapsed() >= delay);
    gw.server.auth.update_gauges();
    assert!(metrics_text(&gw).contains("fleetgate_auth_delayed_answers 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_list_shows_only_what_the_key_may_use() {
    let sim = sim(|_| {}).await;
    let mut prod_only = pool("prod-model", &[sim.url()]);
    prod_only.environments = Some(vec![Environment::Prod]);
    let gw = gateway(vec![pool("qwen32b", &[sim.url()]), prod_only]).await;
    let c = client::http_client();
    let req = authed(&gw, "GET", "/v1/models")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(
        &c.request(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes(),
    )
    .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["qwen32b"],
        "a stress key does not see the prod-only pool"
    );
}
