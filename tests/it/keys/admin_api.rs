//! The admin API: without a JWT key it says to configure one, its token checks, tokens not
//! valid yet, and the admin listener's request ids, security headers, gzip and body limit.

use super::*;

/// An admin listener without a key to verify tokens with refuses every call, and says to
/// configure one: telling the user to mint a token would send them to `admin-token`, which
/// fails for the same reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_api_without_a_jwt_key_says_to_configure_one() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = fleetgate_gateway::config::AdminConfig {
            jwt_key: None,
            ..admin_cfg()
        }
    })
    .await;
    for t in [None, Some(token(Role::Admin))] {
        let (s, body) = admin(&gw, "GET", "/admin/keys", t.as_deref(), None).await;
        assert_eq!(s, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_admin_token");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("set admin.jwt_secret"), "{message}");
        assert!(!message.contains("mint"), "{message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_checks_its_tokens() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let create_body = || Some(serde_json::json!({"name": "x", "environment": "stress"}));
    let (s, body) = admin(&gw, "GET", "/admin/keys", None, None).await;
    assert_eq!(s, 401, "{body}");
    assert_eq!(body["error"]["code"], "invalid_admin_token");

    let expired = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &jwt::Claims {
            sub: None,
            role: Role::Admin,
            exp: 1_000_000,
            nbf: None,
            aud: None,
            iss: None,
        },
        &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap();
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&expired), None).await;
    assert_eq!(s, 401);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expired"),
        "{body}"
    );

    let wrong_alg = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS512),
        &jwt::Claims {
            sub: None,
            role: Role::Admin,
            exp: u64::MAX / 4,
            nbf: None,
            aud: None,
            iss: None,
        },
        &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap();
    let (s, body) = admin(&gw, "POST", "/admin/keys", Some(&wrong_alg), create_body()).await;
    assert_eq!(s, 401);
    assert!(
        body["error"]["message"].as_str().unwrap().contains("HS256"),
        "{body}"
    );

    let viewer = token(Role::Viewer);
    let (s, list) = admin(&gw, "GET", "/admin/keys", Some(&viewer), None).await;
    assert_eq!(s, 200);
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    assert!(
        list.to_string()
            .find("secret")
            .is_none_or(|_| !list.to_string().contains(&gw.key))
    );
    let (s, body) = admin(&gw, "POST", "/admin/keys", Some(&viewer), create_body()).await;
    assert_eq!(s, 403, "{body}");
    let id = list["data"][0]["public_id"].as_str().unwrap();
    let (s, _) = admin(
        &gw,
        "POST",
        &format!("/admin/keys/{id}/revoke"),
        Some(&viewer),
        Some(serde_json::json!({"reason": "x"})),
    )
    .await;
    assert_eq!(s, 403, "a viewer cannot revoke");
    assert_eq!(chat(&gw, &gw.key).await.status, 200, "still active");

    let (s, body) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&token(Role::Admin)),
        Some(serde_json::json!({"name": "x"})),
    )
    .await;
    assert_eq!(s, 400, "environment is required: {body}");
    let (s, body) = admin(
        &gw,
        "POST",
        "/admin/keys",
        Some(&token(Role::Admin)),
        Some(serde_json::json!({"name": "x", "environment": "dev"})),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    let (s, _) = admin(&gw, "GET", "/admin/keys/nope", Some(&viewer), None).await;
    assert_eq!(s, 404);

    // Metrics are open on the admin listener and carry the auth counters.
    let c = client::http_client();
    let req = http::Request::get(format!("http://{}/metrics", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let text = String::from_utf8(
        c.request(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    assert!(text.contains("fleetgate_key_store_up 1"), "{text}");
    assert!(text.contains("fleetgate_keys_loaded 1"), "{text}");
    assert!(
        text.contains("fleetgate_auth_failures_total{reason=\"missing\"}"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_tokens_not_valid_yet_are_refused_saying_when_they_become_valid() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Claims as any issuer writes them (the `nbf` claim of RFC 7519).
    let signed = |nbf: u64| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &serde_json::json!({"sub": "early", "role": "admin", "exp": nbf.max(now) + 3600, "nbf": nbf}),
            &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
        )
        .unwrap()
    };
    // An hour early: refused, and the message says when the token becomes valid.
    let nbf = 2_000_000_000;
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(nbf)), None).await;
    assert_eq!(s, 401, "{body}");
    assert_eq!(body["error"]["code"], "invalid_admin_token");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("not valid yet"), "{message}");
    assert!(message.contains("2033-05-18T03:33:20Z"), "{message}");
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now + 3600)), None).await;
    assert_eq!(s, 401, "{body}");
    // Within the same leeway as `exp` (5 s), and in the past: accepted.
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now + 2)), None).await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = admin(&gw, "GET", "/admin/keys", Some(&signed(now - 60)), None).await;
    assert_eq!(s, 200, "{body}");
}

/// One raw request to the admin listener: (status, headers, body as sent on the wire).
async fn admin_raw(
    gw: &Gateway,
    req: http::request::Builder,
    body: Bytes,
) -> (u16, http::HeaderMap, Bytes) {
    let path = req.uri_ref().unwrap().to_string();
    let req = req
        .uri(format!("http://{}{path}", gw.server.admin_addr.unwrap()))
        .body(http_body_util::Full::new(body))
        .unwrap();
    let resp = client::http_client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (
        status,
        headers,
        resp.into_body().collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_gives_request_ids_security_headers_gzip_and_one_body_limit() {
    use std::io::Read;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin = admin_cfg()
    })
    .await;
    let bearer = format!("Bearer {}", token(Role::Admin));

    // A request id: made when the caller brings none, the caller's kept when it does.
    let get = || http::Request::builder().method("GET").uri("/admin/keys");
    let (s, h, _) = admin_raw(&gw, get().header("authorization", &bearer), Bytes::new()).await;
    assert_eq!(s, 200);
    let made = h["x-request-id"].to_str().unwrap();
    assert!(made.starts_with("fg-") && made.len() > 10, "{made}");
    let (_, h, _) = admin_raw(
        &gw,
        get()
            .header("authorization", &bearer)
            .header("x-request-id", "ops-42"),
        Bytes::new(),
    )
    .await;
    assert_eq!(h["x-request-id"], "ops-42");

    // Security headers on the JSON API and on a refusal, not only on the console's pages.
    let (s, h, _) = admin_raw(&gw, get(), Bytes::new()).await;
    assert_eq!(s, 401);
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["referrer-policy"], "same-origin");
    // An asset keeps its own caching.
    let (s, h, _) = admin_raw(
        &gw,
        http::Request::builder().uri("/console/assets/console.css"),
        Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["cache-control"], "no-cache");

    // gzip for a client that asks for it (a Prometheus scrape), plain text otherwise.
    let metrics = || http::Request::builder().uri("/metrics");
    let (s, h, plain) = admin_raw(&gw, metrics(), Bytes::new()).await;
    assert_eq!(s, 200);
    assert!(h.get("content-encoding").is_none(), "{h:?}");
    let (s, h, zipped) = admin_raw(
        &gw,
        metrics().header("accept-encoding", "gzip"),
        Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["content-encoding"], "gzip");
    assert!(
        zipped.len() * 3 < plain.len(),
        "{} against {}",
        zipped.len(),
        plain.len()
    );
    let mut text = String::new();
    flate2::read::GzDecoder::new(&zipped[..])
        .read_to_string(&mut text)
        .unwrap();
    assert!(text.contains("# TYPE fleetgate_"), "{text:.200}");

    // One body limit, answered in OpenAI's format: a Content-Length over it before the body
    // is read, and a chunked body that grows past it.
    let count = async || {
        let (_, keys) = admin(&gw, "GET", "/admin/keys", Some(&token(Role::Admin)), None).await;
        keys["data"].as_array().unwrap().len()
    };
    let keys_before = count().await;
    let big = Bytes::from(vec![b' '; 70 * 1024]);
    let post = || {
        http::Request::builder()
            .method("POST")
            .uri("/admin/keys")
            .header("authorization", &bearer)
            .header("content-type", "application/json")
    };
    let (s, h, body) = admin_raw(&gw, post(), big.clone()).await;
    assert_eq!(s, 413, "{body:?}");
    assert_eq!(h["content-type"], "application/json");
    let e: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(e["error"]["code"], "request_too_large", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("65536"),
        "{e}"
    );
    // Chunked, over raw HTTP/1.1: no length to refuse up front.
    let mut conn = tokio::net::TcpStream::connect(gw.server.admin_addr.unwrap())
        .await
        .unwrap();
    let mut wire = format!(
        "POST /admin/keys HTTP/1.1\r\nhost: admin\r\nauthorization: {bearer}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    .into_bytes();
    for chunk in big.chunks(8 * 1024) {
        wire.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    // The gateway may answer and close before the whole body is written.
    let _ = conn.write_all(&wire).await;
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains(r#""code":"request_too_large""#), "{answer}");
    // Nothing was created.
    assert_eq!(count().await, keys_before);
}
