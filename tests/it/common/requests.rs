//! Requests as a client sends them, and answers decoded as an OpenAI client decodes them.

use super::*;

pub fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            http::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

/// POST with `hdrs`; when they carry no credentials and `uri` is a harness gateway, its key is
/// added as `Authorization: Bearer`.
pub async fn post(uri: &Uri, hdrs: &[(&str, &str)], body: impl Into<Bytes>) -> Measured {
    let c: HttpClient = client::http_client();
    let mut h = headers(hdrs);
    if !h.contains_key("authorization")
        && !h.contains_key("x-api-key")
        && !h.contains_key("x-no-auth")
        && let Some(key) = key_for_port(uri.port_u16())
    {
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
        );
    }
    h.remove("x-no-auth");
    client::send(&c, uri, &h, body.into(), true)
        .await
        .expect("request completes")
}

/// GET `uri` with `hdrs` as they are (no key added): the status and the whole body.
pub async fn get_body(uri: &Uri, hdrs: &[(&str, &str)]) -> (u16, Bytes) {
    use http_body_util::BodyExt;
    let mut req = http::Request::get(uri.clone());
    for (k, v) in hdrs {
        req = req.header(*k, *v);
    }
    let req = req.body(http_body_util::Full::new(Bytes::new())).unwrap();
    let resp = client::http_client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// A request builder with the gateway's key already set.
pub fn authed(gw: &Gateway, method: &str, path: &str) -> http::request::Builder {
    http::Request::builder()
        .method(method)
        .uri(gw.url(path))
        .header("authorization", format!("Bearer {}", gw.key))
}

/// A JSON response body (kept by `post`).
pub fn json_body(m: &Measured) -> serde_json::Value {
    serde_json::from_slice(m.body.as_ref().expect("body kept")).unwrap()
}

/// Decode an OpenAI error body as a client would.
pub fn openai_error(m: &Measured) -> serde_json::Value {
    let body = m.body.as_ref().expect("body kept");
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "error body is JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    let err = v["error"].clone();
    assert!(err.is_object(), "OpenAI shape: {v}");
    assert!(err["message"].is_string(), "message: {v}");
    assert!(err["type"].is_string(), "type: {v}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "param/code: {v}"
    );
    err
}

/// Send a request and return as soon as the response head is in (the body unread), so the
/// request stays in flight until the response is dropped or drained.
pub async fn open(
    uri: &Uri,
    key: &str,
    body: impl Into<Bytes>,
) -> http::Response<hyper::body::Incoming> {
    let c: HttpClient = client::http_client();
    let req = http::Request::post(uri.clone())
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body.into()))
        .unwrap();
    c.request(req).await.expect("response head")
}

/// Poll `cond` every 10 ms for at most `limit`.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

/// The text of each token event of a chat or completions stream's parsed `data:` payloads, in
/// order (the opening role chunk is not one).
pub fn token_texts(events: &[serde_json::Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| {
            let c = &e["choices"][0];
            c["text"]
                .as_str()
                .or_else(|| {
                    c["delta"]["content"]
                        .as_str()
                        .filter(|_| c["delta"]["role"].is_null())
                })
                .map(str::to_owned)
        })
        .collect()
}
