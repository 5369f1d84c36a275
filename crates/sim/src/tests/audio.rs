//! Speech to text: multipart requests to `/v1/audio/transcriptions` and `/translations`, and
//! vLLM's streamed chunks.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::{SimArgs, SimServer, start};

use super::{KEYED, TestClient, client, keys_of, read_all, send, sse_events};

/// A mono 16-bit PCM WAV of `seconds` of silence at 16 kHz.
fn wav(seconds: u32) -> Vec<u8> {
    let data_len = 32_000 * seconds;
    let mut w = Vec::new();
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data_len).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&[1, 0, 1, 0]);
    w.extend_from_slice(&16_000u32.to_le_bytes());
    w.extend_from_slice(&32_000u32.to_le_bytes());
    w.extend_from_slice(&[2, 0, 16, 0]);
    w.extend_from_slice(b"data");
    w.extend_from_slice(&data_len.to_le_bytes());
    w.resize(w.len() + data_len as usize, 0);
    w
}

/// A multipart/form-data body as OpenAI's client sends one.
fn form(fields: &[(&str, &str)], file: &[u8]) -> (String, Bytes) {
    let boundary = "fleetgate-test-boundary";
    let mut b = Vec::new();
    for (k, v) in fields {
        b.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                .as_bytes(),
        );
    }
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
    b.extend_from_slice(file);
    b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (
        format!("multipart/form-data; boundary={boundary}"),
        Bytes::from(b),
    )
}

async fn post_form(
    c: &TestClient,
    sim: &SimServer,
    path: &str,
    ct: &str,
    body: Bytes,
) -> Response<Incoming> {
    let req = Request::post(format!("{}{path}", sim.url()))
        .header("content-type", ct)
        .header("authorization", "Bearer sekret")
        .body(Full::new(body))
        .unwrap();
    c.request(req).await.unwrap()
}

#[tokio::test]
async fn transcriptions_take_multipart_and_stream_vllm_chunks() {
    let sim = start(SimArgs {
        api_key: Some("sekret".into()),
        decode_step_ms: 2.0,
        decode_ms_per_seq: 0.0,
        ..SimArgs::default()
    })
    .await
    .unwrap();
    let c = client();
    let audio = wav(2);
    let (ct, body) = form(&[("model", "qwen32b"), ("language", "en")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(keys_of(&v), ["text", "usage"]);
    assert_eq!(v["usage"], json!({"type": "duration", "seconds": 2}));
    let text = v["text"].as_str().unwrap().to_owned();
    assert!(!text.is_empty());

    let (ct, body) = form(&[("model", "qwen32b")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/translations", &ct, body).await;
    let v: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(keys_of(&v), ["text"], "a translation carries no usage");

    let (ct, body) = form(
        &[("stream", "true"), ("stream_include_usage", "true")],
        &audio,
    );
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_events(&read_all(r).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (usage, content) = chunks.split_last().unwrap();
    assert!(content.iter().all(|c| c["object"] == "transcription.chunk"));
    assert!(
        content[0]["id"]
            .as_str()
            .unwrap()
            .starts_with("transcribe-")
    );
    let streamed: String = content
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text, "the same audio, the same words");
    assert_eq!(
        content.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], content.len());

    let r = send(
        &c,
        &sim,
        "POST",
        "/v1/audio/transcriptions",
        Some(json!({"model": "qwen32b"})),
        &KEYED,
    )
    .await;
    assert_eq!(
        r.status(),
        StatusCode::BAD_REQUEST,
        "JSON instead of a form"
    );
    let e: Value = serde_json::from_slice(&read_all(r).await).unwrap();
    assert_eq!(e["error"]["param"], "body.file");
    let (ct, body) = form(&[("response_format", "srt")], &audio);
    let r = post_form(&c, &sim, "/v1/audio/transcriptions", &ct, body).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    sim.shutdown().await;
}
