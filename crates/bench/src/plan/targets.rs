//! Where a run sends: the endpoint and its path, each target's URLs and headers (the
//! `--header`s, then its key), and the model a target serves when none is given.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Uri};
use serde_json::Value;

use crate::args::{BenchArgs, base_of, header_pair, kv};
use crate::spec::{EndpointType, Target};

/// The model: the flag, else the first id of `GET /v1/models`.
pub(super) async fn discover_model(target: &Target) -> Result<String, String> {
    use http_body_util::BodyExt;
    let client = fleetgate_protocol::client::http_client();
    let first = target.base.split(", ").next().unwrap_or_default();
    let uri: Uri = format!("{first}/v1/models")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut req = http::Request::get(uri.clone())
        .body(http_body_util::Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = target.headers.clone();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| format!("GET {uri}: no answer within 10 s"))?
        .map_err(|e| format!("GET {uri}: {e} (is the server running, and is --base-url right?)"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        // The server's own message whole (a gateway's says what to fix), then what to check
        // for this status.
        let text = String::from_utf8_lossy(&body);
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.chars().take(2000).collect());
        let check = match status.as_u16() {
            401 | 403 => format!("it was sent {}", target.key_source),
            404 => "check --base-url: the server's root, http://host:port (with or without /v1)"
                .to_owned(),
            _ => "pass --model to skip this lookup".to_owned(),
        };
        return Err(format!("GET {uri} answered {status}: {message} ({check})"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("GET {uri}: {e}"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("GET {uri}: no model listed; pass --model"))
}

/// The endpoint type, and the API path, which must agree.
pub(super) fn endpoint(args: &BenchArgs) -> Result<(EndpointType, String), String> {
    let kind = args.kind();
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| kind.path().to_owned());
    if !endpoint.starts_with('/') {
        return Err(format!("--endpoint `{endpoint}` must start with /"));
    }
    let fits = match kind {
        EndpointType::OpenaiChat => endpoint.ends_with("/chat/completions"),
        EndpointType::Openai => {
            endpoint.ends_with("/completions") && !endpoint.ends_with("/chat/completions")
        }
        EndpointType::OpenaiResponses => endpoint.ends_with("/responses"),
        EndpointType::AnthropicMessages => endpoint.ends_with("/messages"),
        EndpointType::OpenaiEmbeddings => endpoint.ends_with("/embeddings"),
    };
    if !fits {
        return Err(format!(
            "--endpoint {endpoint} and --endpoint-type {} disagree: chat requests go to /v1/chat/completions, completions to /v1/completions, openai-responses to /v1/responses, anthropic-messages to /v1/messages, openai-embeddings to /v1/embeddings (the \"KeyError: 'choices'\" case)",
            kind.name()
        ));
    }
    Ok((kind, endpoint))
}

/// The servers to send to, each with its URL and headers (the `--header`s, then its key).
pub(super) fn targets(
    args: &BenchArgs,
    endpoint: &str,
    kind: EndpointType,
) -> Result<Vec<Target>, String> {
    let common = common_headers(args)?;
    let default_key = bearer_from(&args.api_key_env)?;
    let mut per_target_key = std::collections::HashMap::new();
    for t in &args.target_key_env {
        let (name, var) = kv(t, "--target-key-env")?;
        let v = bearer_from(&var)?
            .ok_or_else(|| format!("--target-key-env {name}: ${var} is not set"))?;
        per_target_key.insert(name, (var, v));
    }
    let mut targets = Vec::new();
    for (name, urls) in target_urls(args)? {
        let mut bases = Vec::new();
        let mut replicas = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let base = base_of(url)?;
            let uri: Uri = format!("{base}{endpoint}")
                .parse()
                .map_err(|e| format!("`{base}{endpoint}`: {e}"))?;
            bases.push(base);
            replicas.push(uri);
        }
        if replicas.is_empty() {
            return Err(format!("{name}=: no URL given"));
        }
        if let Some(dup) = bases
            .iter()
            .enumerate()
            .find(|(i, b)| bases[..*i].contains(b))
        {
            return Err(format!(
                "{name}: `{}` is listed twice; list each server once",
                dup.1
            ));
        }
        let base = bases.join(", ");
        let uri = replicas[0].clone();
        let mut headers = common.clone();
        let key_source = if headers.contains_key(http::header::AUTHORIZATION) {
            "the key given with --header".to_owned()
        } else if let Some((var, k)) = per_target_key.get(&name) {
            headers.insert(http::header::AUTHORIZATION, k.clone());
            format!("the key read from ${var} (--target-key-env {name}={var})")
        } else if let Some(k) = &default_key {
            headers.insert(http::header::AUTHORIZATION, k.clone());
            format!("the key read from ${} (--api-key-env)", args.api_key_env)
        } else {
            format!(
                "no key: ${} (--api-key-env) is not set; export it, or name the variable that holds the key with --api-key-env",
                args.api_key_env
            )
        };
        // Anthropic's API asks every request to name its version.
        if kind == EndpointType::AnthropicMessages && !headers.contains_key("anthropic-version") {
            headers.insert(
                http::HeaderName::from_static("anthropic-version"),
                http::HeaderValue::from_static("2023-06-01"),
            );
        }
        targets.push(Target {
            name,
            base,
            uri,
            replicas,
            headers,
            key_source,
            dialect: kind.dialect(),
            streamed: kind.streams(),
        });
    }
    if let Some(unknown) = per_target_key
        .keys()
        .find(|k| !targets.iter().any(|t| &t.name == *k))
    {
        return Err(format!(
            "--target-key-env {unknown}: no such --compare target"
        ));
    }
    Ok(targets)
}

/// The `--header`s every target gets.
fn common_headers(args: &BenchArgs) -> Result<HeaderMap, String> {
    let mut common = HeaderMap::new();
    for h in &args.headers {
        let (k, v) = header_pair(h)?;
        if k == http::header::AUTHORIZATION {
            eprintln!(
                "fleetgate bench: warning: a key given with --header is visible to every user of this machine (ps); prefer --api-key-env"
            );
        }
        common.insert(k, v);
    }
    Ok(common)
}

/// `Bearer <key>` from the variable `var`, when it is set (marked sensitive: never logged).
fn bearer_from(var: &str) -> Result<Option<HeaderValue>, String> {
    match std::env::var(var) {
        Ok(k) if !k.trim().is_empty() => {
            let mut v = HeaderValue::try_from(format!("Bearer {}", k.trim()))
                .map_err(|_| format!("${var} holds characters not allowed in a header"))?;
            v.set_sensitive(true);
            Ok(Some(v))
        }
        _ => Ok(None),
    }
}

/// (name, URL) of each target: `--base-url` alone, or the two of `--compare`.
fn target_urls(args: &BenchArgs) -> Result<Vec<(String, String)>, String> {
    if args.compare.is_empty() {
        // Without --base-url, vLLM's --host and --port (127.0.0.1:8000 by default).
        let base = args.base_url.clone().unwrap_or_else(|| {
            let host = args.host.as_deref().unwrap_or("127.0.0.1");
            let host = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]")
            } else {
                host.to_owned()
            };
            let url = format!("http://{host}:{}", args.port.unwrap_or(8000));
            if args.host.is_none() && args.port.is_none() {
                eprintln!(
                    "fleetgate bench: no --base-url: sending to {url} (vLLM's default --host and --port)"
                );
            }
            url
        });
        return Ok(vec![("target".to_owned(), base)]);
    }
    if args.base_url.is_some() && args.config.is_none() {
        return Err(
            "--base-url and --compare exclude each other: --compare names both targets".into(),
        );
    }
    let pairs = args
        .compare
        .iter()
        .map(|c| kv(c, "--compare"))
        .collect::<Result<Vec<_>, _>>()?;
    if pairs[0].0 == pairs[1].0 {
        return Err("--compare: the two targets need different names".into());
    }
    Ok(pairs)
}
