//! The simulator against real vLLM: every request recorded from vLLM 0.32 in
//! tests/fixtures/vllm-0.32.0/ (scripts/vllm-capture.py, docs/testing.md) is sent to
//! `fleetgate sim` configured like the captured server (model `tiny`, max-model-len 1024, an API
//! key), and the answers must agree on what the gateway and its clients act on:
//!
//! - the status code of every case;
//! - for an error, its shape: vLLM's bare `{"error":"Unauthorized"}` as is, otherwise the
//!   OpenAI error's `type`, `param` and `code` (the message may differ in numbers: the sim's
//!   tokenizer counts differently);
//! - `/v1/models`: the card's keys; `/health`: an empty 200 without a key; `/version`;
//! - `/metrics`: the families the gateway reads (load-aware balancing) with vLLM's label names.
//!
//! - a stream's chunks by kind (the role chunk, content, the finish chunk, the usage chunk):
//!   their keys, their choice's keys and their delta's keys;
//! - a whole answer's keys, at every depth.
//!
//! When vLLM changes, re-recording the captures is the one step that updates this target.

use std::collections::BTreeSet;
use std::path::Path;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;

const CAPTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/vllm-0.32.0");
const KEY: &str = "conformance-key";

/// The captured request, rebuilt: long texts expanded, the key as the capture says.
fn request(case: &Value, base: &str) -> http::Request<http_body_util::Full<Bytes>> {
    let rq = &case["request"];
    let mut body = rq["body"].clone();
    if let Some(long) = rq["long_text"].as_array() {
        for l in long {
            let text = l["repeat"]
                .as_str()
                .unwrap()
                .repeat(l["count"].as_u64().unwrap() as usize);
            let mut at = &mut body;
            for part in l["path"].as_str().unwrap().split('.') {
                at = match part.parse::<usize>() {
                    Ok(i) => &mut at[i],
                    Err(_) => &mut at[part],
                };
            }
            *at = Value::String(text);
        }
    }
    let bytes = match &body {
        Value::Null => Bytes::new(),
        Value::String(raw) => Bytes::from(raw.clone()),
        other => Bytes::from(serde_json::to_vec(other).unwrap()),
    };
    let mut req = http::Request::builder()
        .method(rq["method"].as_str().unwrap())
        .uri(format!("{base}{}", rq["path"].as_str().unwrap()));
    match rq["auth"].as_str().unwrap_or("") {
        "the server's API key" => req = req.header("authorization", format!("Bearer {KEY}")),
        a if a.starts_with("Bearer ") => req = req.header("authorization", a),
        a if a.starts_with("the server's API key as x-api-key") => {
            req = req.header("x-api-key", KEY)
        }
        a if a.starts_with("x-api-key: ") => {
            let key = a["x-api-key: ".len()..].split(',').next().unwrap();
            req = req.header("x-api-key", key);
        }
        _ => {}
    }
    if !bytes.is_empty() {
        req = req.header("content-type", "application/json");
    }
    if let Some(h) = rq["headers"].as_object() {
        for (k, v) in h {
            req = req.header(k.as_str(), v.as_str().unwrap());
        }
    }
    req.body(http_body_util::Full::new(bytes)).unwrap()
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// A stream's `data:` payloads as JSON (`[DONE]` as a string).
fn events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|p| serde_json::from_str(p).unwrap_or_else(|_| Value::String(p.to_owned())))
        .collect()
}

/// Chunk kind → (keys, the first choice's keys, its delta's keys), the first of each kind.
fn chunk_kinds(
    events: &[Value],
) -> std::collections::BTreeMap<&'static str, [BTreeSet<String>; 3]> {
    let mut out = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e.is_object()) {
        let choice = &e["choices"][0];
        let kind = if e["choices"].as_array().is_some_and(Vec::is_empty) {
            "usage"
        } else if choice["delta"].get("role").is_some() {
            "role"
        } else if !choice["finish_reason"].is_null() {
            "finish"
        } else {
            "content"
        };
        out.entry(kind)
            .or_insert_with(|| [keys(e), keys(choice), keys(&choice["delta"])]);
    }
    out
}

/// Every key path of a JSON value (the first element standing for an array's).
fn paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(o) => {
            for (k, x) in o {
                let p = format!("{prefix}{k}");
                out.insert(p.clone());
                paths(x, &format!("{p}."), out);
            }
        }
        Value::Array(a) if !a.is_empty() => paths(&a[0], &format!("{prefix}0."), out),
        _ => {}
    }
}

/// Metric family → its label names, from Prometheus text (sample lines only).
fn families(text: &str) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let mut out = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, rest) = line.split_at(line.find(['{', ' ']).unwrap_or(line.len()));
        let labels = out.entry(name.to_owned()).or_default();
        if let Some(inner) = rest.strip_prefix('{').and_then(|r| r.split_once('}')) {
            for pair in inner.0.split(',').filter(|p| !p.is_empty()) {
                labels.insert(pair.split('=').next().unwrap().to_owned());
            }
        }
    }
    out
}

/// Captures of what the model itself decided, which a simulator that always generates
/// `max_tokens` tokens of its own text does not reproduce: a matched stop sequence and an end
/// of sequence forced with `logit_bias`.
const NOT_SIMULATED: &[&str] = &[
    "messages_stop_sequences",
    "responses_eos",
    "responses_stream_eos",
    // The sim's generative runner serves speech-to-text, as vLLM does for a speech model
    // (Whisper, Voxtral); the captured text-only model has no such route (404).
    "generate_transcriptions",
];

/// A body's structure: keys at every depth, array lengths, numbers as 0 and strings as "",
/// except base64 vectors, kept as their length (the vector's size).
fn skeleton(v: &Value, key: &str) -> Value {
    match v {
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (k.clone(), skeleton(x, k))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| skeleton(x, key)).collect()),
        Value::Number(_) => Value::from(0),
        Value::String(s) if matches!(key, "embedding" | "data" | "base64") => Value::from(s.len()),
        Value::String(_) => Value::from(""),
        other => other.clone(),
    }
}

/// `{"event","data"}` of each captured or received event.
fn named_events(list: &[Value]) -> Vec<(String, Value)> {
    list.iter()
        .map(|e| (e["event"].as_str().unwrap().to_owned(), e["data"].clone()))
        .collect()
}

/// An SSE body's events as `{"event","data"}`.
fn sse_named(body: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(body);
    text.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|block| {
            let mut name = Value::Null;
            let mut data = Value::Null;
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Value::String(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or(Value::Null);
                }
            }
            serde_json::json!({"event": name, "data": data})
        })
        .collect()
}

/// How an answer differs from vLLM's captured one: the status, an error's shape, and by kind
/// of answer the keys (model cards, chunks, events, bodies) or the exact text.
fn compare(name: &str, want: &Value, status: u16, body: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut differ = |what: String| out.push(what);
    if u64::from(status) != want["status"].as_u64().unwrap() {
        differ(format!(
            "status {status}, vLLM {} ({})",
            want["status"],
            String::from_utf8_lossy(body)
        ));
        return out;
    }
    let got: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let vb = &want["body"];
    match &vb["error"] {
        Value::String(_) if got != *vb => differ(format!("error body {got}, vLLM {vb}")),
        Value::Object(e) => {
            // (Anthropic's shape has no `param` or `code`, and a `type` beside `error`.)
            if got.get("type") != vb.get("type") {
                differ(format!("error shape {got}, vLLM {vb}"));
            }
            for field in ["type", "param", "code"] {
                let want = e.get(field).unwrap_or(&Value::Null);
                if got["error"][field] != *want {
                    differ(format!(
                        "error {field} {}, vLLM {want}",
                        got["error"][field]
                    ));
                }
            }
        }
        _ => {}
    }
    match name {
        "models" => {
            let (a, b) = (&got["data"][0], &vb["data"][0]);
            if keys(a) != keys(b) || a["max_model_len"] != b["max_model_len"] {
                differ(format!("model card {a}, vLLM {b}"));
            }
        }
        "version" | "health" | "health_wrong_key" => {
            let want_body = match vb {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let got_body = String::from_utf8_lossy(body);
            let same = match vb {
                Value::String(_) => got_body == want_body,
                other => got == *other,
            };
            if !same {
                differ(format!("body {got_body:?}, vLLM {want_body:?}"));
            }
        }
        // The agents' protocols: the same events in the same order (repeated deltas
        // counted once), each with vLLM's keys.
        _ if vb.is_array() && vb[0].get("event").is_some() => {
            let theirs = named_events(vb.as_array().unwrap());
            let ours = named_events(&sse_named(body));
            let order = |e: &[(String, Value)]| {
                let mut names: Vec<String> = e.iter().map(|(n, _)| n.clone()).collect();
                names.dedup();
                names
            };
            if order(&ours) != order(&theirs) {
                differ(format!(
                    "events {:?}, vLLM {:?}",
                    order(&ours),
                    order(&theirs)
                ));
            }
            for (name, data) in &theirs {
                if let Some((_, mine)) = ours.iter().find(|(n, _)| n == name) {
                    let (mut a, mut b) = (BTreeSet::new(), BTreeSet::new());
                    paths(mine, "", &mut a);
                    paths(data, "", &mut b);
                    if a != b {
                        differ(format!(
                            "{name}: sim only {:?}, vLLM only {:?}",
                            a.difference(&b).collect::<Vec<_>>(),
                            b.difference(&a).collect::<Vec<_>>()
                        ));
                    }
                }
            }
        }
        _ if vb.is_array() => {
            let (ours, theirs) = (
                chunk_kinds(&events(body)),
                chunk_kinds(vb.as_array().unwrap()),
            );
            for (kind, want_keys) in &theirs {
                match ours.get(kind) {
                    Some(got_keys) if got_keys == want_keys => {}
                    other => differ(format!("{kind} chunk: keys {other:?}, vLLM {want_keys:?}")),
                }
            }
        }
        // The pooling API: the same structure, down to the vectors' lengths, the number of
        // results and classes.
        _ if status == 200
            && vb.get("choices").is_none()
            && (vb.get("usage").is_some() || vb.get("embeddings").is_some()) =>
        {
            let (ours, theirs) = (skeleton(&got, ""), skeleton(vb, ""));
            if ours != theirs {
                differ(format!("body structure {ours}, vLLM {theirs}"));
            }
            if let Some(results) = got["results"].as_array() {
                let scores: Vec<f64> = results
                    .iter()
                    .map(|r| r["relevance_score"].as_f64().unwrap())
                    .collect();
                if scores.windows(2).any(|w| w[0] < w[1]) {
                    differ(format!("rerank results not best first: {scores:?}"));
                }
            }
        }
        _ if status == 200
            && (vb.get("choices").is_some()
                || vb.get("object").is_some_and(|o| o == "response")
                || vb.get("type").is_some_and(|t| t == "message")
                || vb.get("input_tokens").is_some()) =>
        {
            let (mut ours, mut theirs) = (BTreeSet::new(), BTreeSet::new());
            paths(&got, "", &mut ours);
            paths(vb, "", &mut theirs);
            let choices = |v: &Value| v["choices"].as_array().map(Vec::len);
            if choices(&got) != choices(vb) {
                differ(format!(
                    "{:?} choices, vLLM {:?}",
                    choices(&got),
                    choices(vb)
                ));
            }
            // A streamed chat batch: one JSON body, one token a conversation.
            if name == "batch_chat_stream"
                && got["usage"]["completion_tokens"] != vb["usage"]["completion_tokens"]
            {
                differ(format!("usage {}, vLLM {}", got["usage"], vb["usage"]));
            }
            if ours != theirs {
                differ(format!(
                    "body keys: sim only {:?}, vLLM only {:?}",
                    ours.difference(&theirs).collect::<Vec<_>>(),
                    theirs.difference(&ours).collect::<Vec<_>>()
                ));
            }
        }
        "metrics" | "pooling_metrics" => {
            let ours = families(&String::from_utf8_lossy(body));
            let theirs = families(vb["raw"].as_str().unwrap());
            let raw = String::from_utf8_lossy(body);
            let theirs_raw = vb["raw"].as_str().unwrap();
            // What the gateway reads for load-aware balancing (crates/gateway/src/pool/health.rs), and
            // what dashboards and autoscalers built for vLLM read.
            for family in [
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_waiting_by_reason",
                "vllm:num_preemptions_total",
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total",
                "vllm:request_success_total",
                "vllm:time_to_first_token_seconds_bucket",
                "vllm:inter_token_latency_seconds_bucket",
                "vllm:e2e_request_latency_seconds_bucket",
                "vllm:request_queue_time_seconds_bucket",
                "vllm:request_prompt_tokens_bucket",
            ] {
                if ours.get(family) != theirs.get(family) {
                    differ(format!(
                        "{family}: labels {:?}, vLLM {:?}",
                        ours.get(family),
                        theirs.get(family)
                    ));
                }
            }
            // Nothing vLLM 0.32 does not export (`vllm:gpu_cache_usage_perc` is gone), with
            // its type and labels.
            for (sample, labels) in &ours {
                if theirs.get(sample) != Some(labels) {
                    differ(format!(
                        "{sample}: labels {labels:?}, vLLM {:?}",
                        theirs.get(sample)
                    ));
                }
            }
            let types = |text: &str| -> BTreeSet<String> {
                text.lines()
                    .filter_map(|l| l.strip_prefix("# TYPE "))
                    .map(str::to_owned)
                    .collect()
            };
            let their_types = types(theirs_raw);
            for t in types(&raw).difference(&their_types) {
                differ(format!("# TYPE {t}: not vLLM's"));
            }
            // Values as Python prints floats (`0.0`, not `0`).
            for line in raw.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
                let value = line.rsplit(' ').next().unwrap_or("");
                if !(value.contains(['.', 'e', 'E']) || value.ends_with("Inf")) {
                    differ(format!("{line}: vLLM prints a float"));
                }
            }
        }
        _ => {}
    }
    out
}

/// The captures of `groups` (the manifest's `group`: how the server was started), each sent
/// once to `sim` in file order, and how the sim's answers differ from vLLM's.
async fn replay(sim: &fleetgate_sim::SimServer, groups: &[&str]) -> (usize, Vec<String>) {
    let base = sim.url();
    let client = fleetgate_protocol::client::http_client();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(Path::new(CAPTURES).join("manifest.json")).unwrap())
            .unwrap();
    let wanted: BTreeSet<String> = manifest["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| groups.contains(&c["group"].as_str().unwrap_or("base")))
        .map(|c| c["file"].as_str().unwrap().to_owned())
        .collect();
    let mut cases: Vec<_> = std::fs::read_dir(CAPTURES)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| wanted.contains(p.file_name().unwrap().to_str().unwrap()))
        .filter(|p| !NOT_SIMULATED.contains(&p.file_stem().unwrap().to_str().unwrap()))
        .collect();
    cases.sort();
    let mut differences = Vec::new();
    for path in &cases {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let case: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let want = &case["response"];
        let resp = client.request(request(&case, &base)).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        for d in compare(&name, want, status, &body) {
            differences.push(format!("{name}: {d}"));
        }
    }
    (cases.len(), differences)
}

/// The groups captured from a server started as this sim is: plain `vllm serve`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sim_answers_like_vllm_0_32() {
    let sim = crate::common::sim(|a| {
        a.served_model_name = vec!["tiny".into()];
        a.max_model_len = 1024;
        a.api_key = Some(KEY.into());
        a.zero_delay = true;
    })
    .await;
    let (cases, differences) =
        replay(&sim, &["base", "responses", "messages", "generate_extra"]).await;
    assert!(cases >= 20, "the captures are there: {cases}");
    assert!(
        differences.is_empty(),
        "the sim differs from vLLM 0.32 ({} of {cases} cases):\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// The pooling group, against a sim started as `scripts/real-vllm.sh start --pooling embed`
/// starts vLLM: `--runner pooling --convert embed`, the tiny model's hidden size (128) as the
/// embedding size. Embeddings (float, base64, token ids, Cohere's), /pooling, /score, /rerank,
/// their errors, auth off /v1 and /v2, and the generative routes gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pooling_runner_answers_like_vllm_0_32() {
    let sim = crate::common::sim(|a| {
        a.served_model_name = vec!["tiny".into()];
        a.max_model_len = 1024;
        a.api_key = Some(KEY.into());
        a.runner = fleetgate_sim::Runner::Pooling;
        a.convert = fleetgate_sim::Convert::Embed;
        a.embedding_size = 128;
        a.zero_delay = true;
    })
    .await;
    let (cases, differences) = replay(&sim, &["pooling"]).await;
    assert!(cases >= 40, "the captures are there: {cases}");
    assert!(
        differences.is_empty(),
        "the sim's pooling runner differs from vLLM 0.32 ({} of {cases} cases):\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// The classify group (`start --pooling classify`: `--convert classify`, two labels, so no
/// /score or /rerank).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_classify_runner_answers_like_vllm_0_32() {
    let sim = crate::common::sim(|a| {
        a.served_model_name = vec!["tiny".into()];
        a.max_model_len = 1024;
        a.api_key = Some(KEY.into());
        a.runner = fleetgate_sim::Runner::Pooling;
        a.convert = fleetgate_sim::Convert::Classify;
        a.num_labels = 2;
        a.zero_delay = true;
    })
    .await;
    let (cases, differences) = replay(&sim, &["classify"]).await;
    assert!(cases >= 8, "the captures are there: {cases}");
    assert!(
        differences.is_empty(),
        "the sim's classify runner differs from vLLM 0.32 ({} of {cases} cases):\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// The agents' group, against a sim started as `scripts/real-vllm.sh start --agents` starts
/// vLLM: a 32k context, `--enable-auto-tool-choice`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_mode_answers_like_vllm_0_32() {
    let sim = crate::common::sim(|a| {
        a.served_model_name = vec!["tiny".into()];
        a.max_model_len = 32768;
        a.api_key = Some(KEY.into());
        a.enable_auto_tool_choice = true;
        a.zero_delay = true;
    })
    .await;
    let (cases, differences) = replay(&sim, &["agents"]).await;
    assert!(cases >= 8, "the captures are there: {cases}");
    assert!(
        differences.is_empty(),
        "the sim differs from vLLM 0.32 in the agents' mode ({} of {cases} cases):\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// The first response id an answer names: a body's `id`, or a stream's `response.created`.
fn response_id(body: &Value) -> Option<String> {
    let id = match body {
        Value::Array(events) => events.first()?["data"]["response"]["id"].as_str(),
        other => other["id"].as_str(),
    }?;
    id.starts_with("resp_").then(|| id.to_owned())
}

/// The store's group (`scripts/real-vllm.sh start --store`), replayed in the order it was
/// captured against a sim with `--responses-store`: each captured id stands for the sim's own,
/// background responses run while the next requests read and cancel them (decode steps of
/// 40 ms, so an 8-token answer is still queued when read at once and a 1000-token one is
/// cancelled while it runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_answer_like_vllm_0_32() {
    let sim = crate::common::sim(|a| {
        a.served_model_name = vec!["tiny".into()];
        a.max_model_len = 1024;
        a.api_key = Some(KEY.into());
        a.responses_store = true;
        a.decode_step_ms = 40.0;
    })
    .await;
    let base = sim.url();
    let client = fleetgate_protocol::client::http_client();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(Path::new(CAPTURES).join("manifest.json")).unwrap())
            .unwrap();
    let cases: Vec<String> = manifest["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["group"] == "responses_store")
        .map(|c| c["file"].as_str().unwrap().to_owned())
        .collect();
    assert!(cases.len() >= 20, "{cases:?}");
    // Captured id → the sim's.
    let mut ids: Vec<(String, String)> = Vec::new();
    let mut differences = Vec::new();
    for file in &cases {
        let name = file.trim_end_matches(".json");
        let mut case: Value =
            serde_json::from_slice(&std::fs::read(Path::new(CAPTURES).join(file)).unwrap())
                .unwrap();
        let rewritten = ids
            .iter()
            .fold(case["request"].to_string(), |t, (theirs, ours)| {
                t.replace(theirs.as_str(), ours)
            });
        case["request"] = serde_json::from_str(&rewritten).unwrap();
        if name.ends_with("_later") {
            // "3 s later" in the capture: once the sim's background answer is done.
            let path = case["request"]["path"].as_str().unwrap().to_owned();
            let mut done = false;
            for _ in 0..100 {
                let mut probe = case.clone();
                probe["request"]["path"] = Value::String(path.clone());
                let resp = client.request(request(&probe, &base)).await.unwrap();
                let body = resp.into_body().collect().await.unwrap().to_bytes();
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if !matches!(v["status"].as_str(), Some("queued" | "in_progress")) {
                    done = true;
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            assert!(done, "{name}: the background answer never finished");
        }
        let want = &case["response"];
        let resp = client.request(request(&case, &base)).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let got: Value = if want["body"].is_array() {
            Value::Array(sse_named(&body))
        } else {
            serde_json::from_slice(&body).unwrap_or(Value::Null)
        };
        if let (Some(theirs), Some(ours)) = (response_id(&want["body"]), response_id(&got))
            && !ids.iter().any(|(t, _)| *t == theirs)
        {
            ids.push((theirs, ours));
        }
        // What a background answer says about itself, beside the keys compared below.
        if want["body"].is_object() && got.is_object() {
            for field in ["status", "background"] {
                if want["body"][field] != got[field] {
                    differences.push(format!(
                        "{name}: {field} {}, vLLM {}",
                        got[field], want["body"][field]
                    ));
                }
            }
        }
        for d in compare(name, want, status, &body) {
            differences.push(format!("{name}: {d}"));
        }
    }
    assert!(
        differences.is_empty(),
        "the sim's store differs from vLLM 0.32 ({} of {} cases):\n{}",
        differences.len(),
        cases.len(),
        differences.join("\n")
    );
}
