//! The steady mixed load and the classification of each request's outcome.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Class {
    /// 200 with a JSON body, or a stream that ended with `[DONE]` and no error event.
    Completed,
    /// A non-2xx status with an OpenAI error body, or a stream with an error event then `[DONE]`.
    ClearError,
    /// The connection was refused: no gateway received it.
    NotReceived,
    /// Anything else: a cut stream, a 500, a body that is not JSON, a hang.
    Failure,
}

#[derive(Debug)]
pub(super) struct Outcome {
    pub(super) id: String,
    pub(super) gateway: usize,
    pub(super) stream: bool,
    pub(super) class: Class,
    /// The response head's status, when one arrived.
    pub(super) status: Option<u16>,
    /// The error code (of the body or the stream's error event), or what went wrong.
    pub(super) detail: String,
}

pub(super) struct Load {
    pub(super) client: HttpClient,
    pub(super) tag: String,
    pub(super) ports: [u16; 2],
    pub(super) keys: [String; 2],
    /// Gateway B takes requests until it is about to get its SIGTERM.
    pub(super) b_open: AtomicBool,
}

/// The `n`th request of the soak: which gateway, key, endpoint and shape. Mixed so every
/// combination comes up: gateway alternates, streaming by pairs, one in five a completion.
pub(super) fn request_for(
    load: &Load,
    n: u64,
) -> (usize, http::Uri, HeaderMap, Bytes, bool, String) {
    let gateway = if load.b_open.load(Ordering::SeqCst) {
        (n % 2) as usize
    } else {
        0
    };
    let stream = (n / 2).is_multiple_of(2);
    let max_tokens = 8 + (n * 37) % 120;
    let prompt = "soak ".repeat(1 + (n % 40) as usize);
    let (path, body) = if n % 5 == 4 {
        (
            "/v1/completions",
            serde_json::json!({"model": "qwen32b", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}),
        )
    } else {
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "qwen32b", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream}),
        )
    };
    let id = format!("{}-{n}", load.tag);
    let key = &load.keys[((n / 3) % 2) as usize];
    let mut h = HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
    );
    h.insert("x-request-id", HeaderValue::from_str(&id).unwrap());
    let uri = format!("http://127.0.0.1:{}{path}", load.ports[gateway])
        .parse()
        .unwrap();
    (gateway, uri, h, Bytes::from(body.to_string()), stream, id)
}

/// The start of a body, for a failure's description.
pub(super) fn snippet(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
}

/// The `code` of an OpenAI error body, or `None` when the body is not one.
pub(super) fn openai_error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let e = v.get("error")?;
    if !(e["message"].is_string()
        && e["type"].is_string()
        && e.get("code").is_some()
        && e.get("param").is_some())
    {
        return None;
    }
    Some(e["code"].as_str().unwrap_or("null").to_owned())
}

pub(super) async fn one_request(
    client: HttpClient,
    gateway: usize,
    uri: http::Uri,
    headers: HeaderMap,
    body: Bytes,
    stream: bool,
    id: String,
) -> Outcome {
    let outcome = |class, status, detail: String| Outcome {
        id: id.clone(),
        gateway,
        stream,
        class,
        status,
        detail,
    };
    let deadline = tokio::time::Instant::now() + REQUEST_BOUND;
    let req = client::post(&uri, &headers, body);
    let mut answer =
        match tokio::time::timeout_at(deadline, client::open(&client, req, Instant::now())).await {
            Err(_) => return outcome(Class::Failure, None, "no response head (hang)".into()),
            Ok(Err(e)) if e.is_connect() => {
                return outcome(Class::NotReceived, None, format!("connect: {e}"));
            }
            Ok(Err(e)) => {
                return outcome(
                    Class::Failure,
                    None,
                    format!("transport error before the head: {e:?}"),
                );
            }
            Ok(Ok(a)) => a,
        };
    let status = answer.status.as_u16();
    let mut scanner = SseScanner::new();
    let mut metrics = StreamMetrics::default();
    let mut error_code: Option<String> = None;
    let mut kept = BytesMut::new();
    let end = answer
        .read(Some(deadline), |data, at| {
            scanner.feed(data, |l| {
                if l.kind == DataKind::Error && error_code.is_none() {
                    error_code = Some(
                        openai_error_code(l.payload).unwrap_or_else(|| "malformed".to_owned()),
                    );
                }
                metrics.on_data(l.kind, l.usage, at);
            });
            kept.extend_from_slice(data);
        })
        .await;
    scanner.finish(|l| metrics.on_data(l.kind, l.usage, Duration::ZERO));
    let s = Some(status);
    if answer
        .headers
        .get("x-request-id")
        .map(HeaderValue::as_bytes)
        != Some(id.as_bytes())
    {
        return outcome(Class::Failure, s, "x-request-id not echoed".into());
    }
    match end {
        BodyEnd::Complete => {}
        BodyEnd::Deadline => return outcome(Class::Failure, s, "body hang".into()),
        BodyEnd::Cut(e) => return outcome(Class::Failure, s, format!("body cut: {e}")),
    }
    if status == 500 {
        return outcome(Class::Failure, s, format!("500: {}", snippet(&kept)));
    }
    if !(200..300).contains(&status) {
        return match openai_error_code(&kept) {
            Some(code) => outcome(Class::ClearError, s, code),
            None => outcome(
                Class::Failure,
                s,
                format!("error body not OpenAI JSON: {}", snippet(&kept)),
            ),
        };
    }
    if stream {
        if !metrics.done {
            return outcome(Class::Failure, s, "stream ended without [DONE]".into());
        }
        if let Some(code) = error_code {
            return outcome(Class::ClearError, s, format!("stream: {code}"));
        }
        if metrics.content_events == 0 {
            return outcome(Class::Failure, s, "stream without content".into());
        }
        return outcome(Class::Completed, s, String::new());
    }
    match serde_json::from_slice::<serde_json::Value>(&kept) {
        Ok(v) if v["choices"].is_array() => outcome(Class::Completed, s, String::new()),
        _ => outcome(
            Class::Failure,
            s,
            format!("200 body not a completion: {}", snippet(&kept)),
        ),
    }
}

// ----------------------------------------------------------------------------------------------
// Faults
