//! Speech to text behind the same key: `/v1/audio/transcriptions` and
//! `/v1/audio/translations` take `multipart/form-data` (the `model` is a form field), within
//! their own body limit, and a transcription with `stream=true` is relayed as SSE, its chunks
//! counted like chat's.

use crate::common::*;

const BOUNDARY: &str = "fleetgate-audio-test";

/// A mono 16 kHz 16-bit PCM WAV of `ms` milliseconds of a quiet tone.
pub(crate) fn wav(ms: u32) -> Vec<u8> {
    let rate = 16_000u32;
    let samples = rate * ms / 1000;
    let data_len = samples * 2;
    let mut out = Vec::with_capacity(44 + data_len as usize);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_len).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // mono
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * 2).to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_len.to_le_bytes());
    for i in 0..samples {
        let v = ((f64::from(i) * 0.05).sin() * 1000.0) as i16;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// A multipart body with these text fields and, when given, the audio `file` (sent first, as
/// curl does with `-F file=@a.wav -F model=...`).
pub(crate) fn form(fields: &[(&str, &str)], file: Option<&[u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(file) = file {
        out.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            )
            .as_bytes(),
        );
        out.extend_from_slice(file);
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in fields {
        out.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .as_bytes(),
        );
    }
    out.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

pub(crate) fn multipart() -> (&'static str, String) {
    (
        "content-type",
        format!("multipart/form-data; boundary={BOUNDARY}"),
    )
}

/// A speech model's pool warms its backend up with a transcription; a transcription and a
/// translation reach the pool the form's `model` names — renamed on the
/// way to the backend, whose served name differs, and back in the answer — and a stream comes
/// back as SSE with its chunks counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speech_is_transcribed_through_the_gateway() {
    let sim = sim(|a| a.served_model_name = vec!["whisper-large-v3".into()]).await;
    let mut p = pool("asr", &[sim.url()]);
    p.served_model_name = Some("whisper-large-v3".into());
    // A speech model is warmed up with a transcription (half a second of silence), not a chat.
    p.kind = fleetgate_gateway::config::PoolKind::Transcription;
    p.warmup.requests = 1;
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    assert_eq!(backend_states_become(&gw, &["healthy"]).await, ["healthy"]);
    let (ct, ctv) = multipart();
    let audio = wav(500);

    for (path, name) in [
        ("/v1/audio/transcriptions", "transcriptions"),
        ("/v1/audio/translations", "translations"),
    ] {
        let id = format!("asr-{name}");
        let m = post(
            &gw.url(path),
            &[(ct, &ctv), ("x-request-id", &id)],
            form(&[("model", "asr"), ("language", "en")], Some(&audio)),
        )
        .await;
        assert_eq!(m.status, 200, "{path}: {:?}", m.body);
        let v = json_body(&m);
        assert!(
            v["text"].as_str().is_some_and(|t| !t.is_empty()),
            "{path}: {v}"
        );
        let seen = gw.record_of(&id).await;
        assert_eq!(seen.endpoint, Some(name));
        assert_eq!(seen.model.as_deref(), Some("asr"));
        assert_eq!(seen.error, None);
    }

    // A stream: SSE chunks, each counted as a token event, ending with [DONE].
    let m = post(
        &gw.url("/v1/audio/transcriptions"),
        &[(ct, &ctv), ("x-request-id", "asr-stream")],
        form(
            &[
                ("model", "asr"),
                ("stream", "true"),
                ("stream_include_usage", "true"),
            ],
            Some(&audio),
        ),
    )
    .await;
    assert_eq!(m.status, 200);
    assert!(
        m.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = String::from_utf8(m.body.clone().unwrap().to_vec()).unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(body.contains("transcription.chunk"), "{body}");
    assert!(
        body.contains("\"model\":\"asr\""),
        "the client's name in every chunk: {body}"
    );
    let seen = gw.record_of("asr-stream").await;
    assert!(seen.stream);
    assert!(seen.timeline.upstream_ttft().is_some(), "a first token");
    assert!(seen.timeline.stream().content_events > 1);
    let usage = seen
        .timeline
        .stream()
        .usage
        .expect("the usage chunk was read");
    assert!(usage.completion_tokens > 0);
}

/// Every way to send the form wrong gets a specific answer before anything reaches a
/// backend: not multipart, no model, no file, a bad `stream`, and a body over the audio limit
/// (which is its own setting, above the JSON limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_audio_forms_are_refused_by_the_gateway() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.server.max_body_bytes = 4096;
        c.server.max_audio_body_bytes = 64 * 1024;
    })
    .await;
    let url = gw.url("/v1/audio/transcriptions");
    let (ct, ctv) = multipart();
    let audio = wav(500); // 16 kB: over the JSON limit, within the audio one
    // (headers, body, status, what the message says, param)
    type Case<'a> = (
        Vec<(&'a str, String)>,
        Vec<u8>,
        u16,
        &'a str,
        Option<&'a str>,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            vec![("content-type", "application/json".into())],
            br#"{"model":"qwen32b"}"#.to_vec(),
            415,
            "multipart/form-data",
            None,
        ),
        (
            vec![(ct, ctv.clone())],
            form(&[("language", "en")], Some(&audio)),
            400,
            "`model` is required",
            Some("model"),
        ),
        (
            vec![(ct, ctv.clone())],
            form(&[("model", "qwen32b")], None),
            400,
            "`file` is required",
            Some("file"),
        ),
        (
            vec![(ct, ctv.clone())],
            form(&[("model", "qwen32b"), ("stream", "yes")], Some(&audio)),
            400,
            "`stream` must be true or false",
            Some("stream"),
        ),
        (
            vec![(ct, ctv.clone())],
            form(&[("model", "qwen32b")], Some(&wav(3000))),
            413,
            "server.max_audio_body_bytes",
            None,
        ),
        (
            vec![(ct, ctv.clone())],
            form(&[("model", "nope")], Some(&audio)),
            404,
            "nope",
            Some("model"),
        ),
    ];
    for (i, (headers, body, status, says, param)) in cases.into_iter().enumerate() {
        let id = format!("bad-audio-{i}");
        let mut h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        h.push(("x-request-id", &id));
        let m = post(&url, &h, body).await;
        assert_eq!(m.status, status, "case {i}: {:?}", m.body);
        let err = openai_error(&m);
        let msg = err["message"].as_str().unwrap();
        assert!(msg.contains(says), "case {i}: {msg}");
        if let Some(p) = param {
            assert_eq!(err["param"], p, "case {i}: {err}");
        }
        assert_eq!(gw.record_of(&id).await.backend, None, "case {i}");
    }
    // Within the audio limit, though over the JSON one, it is answered.
    let m = post(
        &url,
        &[(ct, &ctv)],
        form(&[("model", "qwen32b")], Some(&audio)),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);
}

/// The OpenAI Python SDK's `audio.transcriptions.create` (and its stream) through the
/// gateway, with a WAV this test writes: the SDK builds the multipart form itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_transcribes_through_the_gateway() {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if tool_or_skip("openai_sdk_audio", "the openai Python SDK", ok).is_none() {
        return;
    }
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let dir = TempDir(temp_dir("sdk-audio"));
    let path = dir.0.join("speech.wav");
    std::fs::write(&path, wav(800)).unwrap();
    let script = r#"
import sys
from openai import OpenAI
base, key, path = sys.argv[1:4]
c = OpenAI(base_url=base, api_key=key, max_retries=0)
with open(path, "rb") as f:
    t = c.audio.transcriptions.create(model="qwen32b", file=f)
assert t.text, t
with open(path, "rb") as f:
    tr = c.audio.translations.create(model="qwen32b", file=f)
assert tr.text, tr
with open(path, "rb") as f:
    events = list(c.audio.transcriptions.create(model="qwen32b", file=f, stream=True))
assert events, "no stream events"
print("ok", len(events))
"#;
    let mut c = std::process::Command::new("python3");
    c.args([
        "-c",
        script,
        &format!("http://{}/v1", gw.server.local_addr),
        &gw.key,
        path.to_str().unwrap(),
    ])
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let r = output_within(c, std::time::Duration::from_secs(60)).await;
    assert!(r.ok, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    assert!(r.stdout.starts_with("ok "), "{}", r.stdout);
    let records = gw.records.lock().unwrap().clone();
    let names: Vec<_> = records.iter().filter_map(|s| s.endpoint).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "transcriptions").count(),
        2,
        "{names:?}"
    );
    assert!(names.contains(&"translations"), "{names:?}");
    assert!(
        records.iter().all(|s| s.error.is_none() && s.status == 200),
        "{records:?}"
    );
}
