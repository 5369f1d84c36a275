//! vLLM's speech-to-text routes on the sim: `POST /v1/audio/transcriptions` and
//! `/v1/audio/translations`, multipart forms in, vLLM 0.32's JSON or `transcription.chunk` /
//! `translation.chunk` stream out. The sim hears nothing: the audio's length (read from a WAV
//! header, else estimated from the file size) decides how many words it "transcribes", and the
//! words are the sim's deterministic tokens, paced by the engine like any generation.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

use super::api::{self, error::ApiError};
use super::args::SimConfig;
use super::lora::{Adapters, LoraAdapter};
use super::tokens::{fnv1a, push_json_str};

/// Transcription or translation: vLLM's `task_type`, which names ids and chunk objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpeechTask {
    Transcribe,
    Translate,
}

impl SpeechTask {
    pub(crate) fn at(path: &str) -> Option<Self> {
        match path {
            "/v1/audio/transcriptions" => Some(Self::Transcribe),
            "/v1/audio/translations" => Some(Self::Translate),
            _ => None,
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Self::Transcribe => "transcription.chunk",
            Self::Translate => "translation.chunk",
        }
    }

    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            Self::Transcribe => "transcribe-",
            Self::Translate => "translate-",
        }
    }
}

/// Bytes a second of audio that is not WAV is taken to hold: 128 kbit/s, a common MP3 rate.
const COMPRESSED_BYTES_PER_SECOND: f64 = 16_000.0;
/// Words the sim hears in a second of speech (about 180 a minute).
const TOKENS_PER_SECOND: f64 = 3.0;
/// Encoder positions a second of audio costs, as Whisper's 1500 frames for 30 s: counted as
/// prompt tokens so a long recording costs prefill time.
const AUDIO_TOKENS_PER_SECOND: u32 = 50;
/// Whisper's decoder prompt before the caller's: start of transcript, language, task,
/// no timestamps.
const DECODER_PROMPT_TOKENS: u32 = 4;

/// A validated speech-to-text request.
#[derive(Debug)]
pub(crate) struct SpeechRequest {
    pub duration_s: f64,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// The answer ends before its limit (`finish_reason` stop).
    pub natural_end: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub token_seed: u64,
    /// The LoRA adapter the form's `model` names.
    pub adapter: Option<Arc<LoraAdapter>>,
}

fn form_missing(field: &str) -> ApiError {
    let loc = format!("body.{field}");
    ApiError::Validation {
        message: format!(
            "1 validation error:\n  {{'type': 'missing', 'loc': '{loc}', 'msg': 'Field required'}}"
        ),
        loc,
    }
}

fn form_invalid(field: &str, kind: &str, msg: &str) -> ApiError {
    let loc = format!("body.{field}");
    ApiError::Validation {
        message: format!(
            "1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}'}}"
        ),
        loc,
    }
}

fn refuse(message: impl Into<String>) -> ApiError {
    ApiError::Flat {
        status: http::StatusCode::BAD_REQUEST,
        message: message.into(),
        kind: "BadRequestError",
        param: None,
    }
}

/// A form boolean as pydantic reads one.
fn form_bool(field: &str, v: &str) -> Result<bool, ApiError> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" | "t" | "y" => Ok(true),
        "false" | "0" | "no" | "off" | "f" | "n" => Ok(false),
        _ => Err(form_invalid(
            field,
            "bool_parsing",
            "Input should be a valid boolean, unable to interpret input",
        )),
    }
}

/// The form's fields the sim acts on; the rest (temperature, timestamp granularities, ...)
/// are accepted and ignored.
#[derive(Default)]
struct Form {
    file: Option<Bytes>,
    model: Option<String>,
    prompt: String,
    response_format: Option<String>,
    stream: Option<String>,
    include_usage: Option<String>,
    continuous_usage: Option<String>,
    max_completion_tokens: Option<String>,
    seed: Option<String>,
}

/// Reads the multipart form (`multer`); a body that is not `multipart/form-data` has no
/// `file`, which is what FastAPI tells such a caller.
async fn read_form(content_type: Option<&str>, body: Bytes) -> Result<Form, ApiError> {
    let Some(boundary) = content_type.and_then(|ct| multer::parse_boundary(ct).ok()) else {
        return Err(form_missing("file"));
    };
    let stream =
        futures_util::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut form = Form::default();
    let malformed =
        |e: multer::Error| ApiError::BadRequest(format!("malformed multipart/form-data body: {e}"));
    while let Some(field) = multipart.next_field().await.map_err(malformed)? {
        let name = field.name().unwrap_or_default().to_owned();
        let value = field.bytes().await.map_err(malformed)?;
        let text = || String::from_utf8_lossy(&value).into_owned();
        match name.as_str() {
            "file" => form.file = Some(value.clone()),
            "model" => form.model = Some(text()),
            "prompt" => form.prompt = text(),
            "response_format" => form.response_format = Some(text()),
            "stream" => form.stream = Some(text()),
            "stream_include_usage" => form.include_usage = Some(text()),
            "stream_continuous_usage_stats" => form.continuous_usage = Some(text()),
            "max_completion_tokens" => form.max_completion_tokens = Some(text()),
            "seed" => form.seed = Some(text()),
            _ => {}
        }
    }
    Ok(form)
}

/// Seconds of audio in `file`: exact for PCM WAV (its `fmt ` byte rate and `data` size), an
/// estimate at 128 kbit/s for anything else.
pub(crate) fn audio_seconds(file: &[u8]) -> Option<f64> {
    if file.is_empty() {
        return None;
    }
    if file.len() >= 12 && &file[0..4] == b"RIFF" && &file[8..12] == b"WAVE" {
        let mut at = 12;
        let mut byte_rate = None;
        while at + 8 <= file.len() {
            let id = &file[at..at + 4];
            let size = u32::from_le_bytes([file[at + 4], file[at + 5], file[at + 6], file[at + 7]]);
            let size = usize::try_from(size).ok()?;
            let data = at + 8;
            if id == b"fmt " && data + 12 <= file.len() {
                let rate = &file[data + 8..data + 12];
                byte_rate = Some(u32::from_le_bytes([rate[0], rate[1], rate[2], rate[3]]));
            }
            if id == b"data" {
                let rate = f64::from(byte_rate.filter(|r| *r > 0)?);
                // A streamed WAV may claim more data than it holds.
                let held = size.min(file.len().saturating_sub(data));
                return Some(held as f64 / rate);
            }
            at = data.saturating_add(size).saturating_add(size % 2);
        }
        return None;
    }
    Some(file.len() as f64 / COMPRESSED_BYTES_PER_SECOND)
}

/// Parses and validates a request in vLLM's order: the form, the model, the response format,
/// the audio.
pub(crate) async fn parse(
    content_type: Option<&str>,
    body: Bytes,
    cfg: &SimConfig,
    adapters: &Adapters,
) -> Result<SpeechRequest, ApiError> {
    let form = read_form(content_type, body).await?;
    let file = form.file.ok_or_else(|| form_missing("file"))?;
    let flag =
        |field: &str, v: &Option<String>| v.as_deref().map_or(Ok(false), |v| form_bool(field, v));
    let stream = flag("stream", &form.stream)?;
    let include_usage = flag("stream_include_usage", &form.include_usage)?;
    let continuous_usage =
        include_usage && flag("stream_continuous_usage_stats", &form.continuous_usage)?;
    let int = |field: &str, v: &Option<String>| -> Result<Option<i64>, ApiError> {
        v.as_deref()
            .map(|v| {
                v.trim().parse::<i64>().map_err(|_| {
                    form_invalid(
                        field,
                        "int_parsing",
                        "Input should be a valid integer, unable to parse string as an integer",
                    )
                })
            })
            .transpose()
    };
    let max_completion_tokens = int("max_completion_tokens", &form.max_completion_tokens)?;
    let seed = int("seed", &form.seed)?;
    let adapter = api::check_model(
        form.model.as_deref().filter(|m| !m.is_empty()),
        cfg,
        adapters,
    )?;
    let model = cfg.model_name();
    match form.response_format.as_deref().unwrap_or("json") {
        "json" | "text" => {}
        // The sim, like most speech models in vLLM, has no segment timestamps or speakers.
        f @ ("verbose_json" | "diarized_json") => {
            return Err(refuse(format!("Currently do not support {f} for {model}")));
        }
        _ => {
            return Err(refuse(
                "Currently only support response_format: `text`, `json`, `verbose_json` or `diarized_json`",
            ));
        }
    }
    let duration_s =
        audio_seconds(&file).ok_or_else(|| refuse("Invalid or unsupported audio file."))?;
    let seconds = duration_s.ceil().max(1.0);
    let audio_tokens = (seconds as u32).saturating_mul(AUDIO_TOKENS_PER_SECOND);
    let prompt_tokens = DECODER_PROMPT_TOKENS
        .saturating_add(tokens_of(&form.prompt))
        .saturating_add(audio_tokens);
    let limit = match max_completion_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::BadRequest(format!(
                "max_tokens must be at least 1, got {m}."
            )));
        }
        Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
        None => cfg.default_max_tokens,
    };
    let heard = ((duration_s * TOKENS_PER_SECOND).ceil() as u32).max(1);
    let max_tokens = heard.min(limit).max(1);
    let mut token_seed = fnv1a(cfg.seed, &file);
    if let Some(s) = seed {
        token_seed = fnv1a(token_seed, &s.to_le_bytes());
    }
    Ok(SpeechRequest {
        duration_s,
        prompt_tokens,
        max_tokens,
        natural_end: heard < limit,
        stream,
        include_usage,
        continuous_usage,
        token_seed,
        adapter,
    })
}

fn tokens_of(text: &str) -> u32 {
    if text.is_empty() {
        0
    } else {
        api::prompt_tokens(text)
    }
}

#[derive(Serialize)]
struct AudioUsage {
    #[serde(rename = "type")]
    kind: &'static str,
    seconds: u64,
}

#[derive(Serialize)]
struct TranscriptionResponse<'a> {
    text: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<AudioUsage>,
}

/// The whole answer: `{"text", "usage": {"type": "duration", "seconds"}}` for a transcription
/// (whole seconds, rounded up), `{"text"}` for a translation. vLLM answers `response_format`
/// `text` with the same JSON.
pub(crate) fn answer_json(task: SpeechTask, text: &str, duration_s: f64) -> Vec<u8> {
    let usage = (task == SpeechTask::Transcribe).then(|| AudioUsage {
        kind: "duration",
        seconds: duration_s.ceil() as u64,
    });
    serde_json::to_vec(&TranscriptionResponse { text, usage }).unwrap_or_default()
}

/// The chunks of a streamed answer, as vLLM 0.32 writes them (pydantic with
/// `exclude_unset`): no role chunk; each chunk's choice holds just the delta, the last one
/// also `finish_reason` and `stop_reason`; usage on every chunk with continuous usage, and a
/// closing usage chunk with `stream_include_usage`.
pub(crate) struct AudioFrames {
    /// `data: {"id":..,"object":..,"created":..,"model":..,"choices":[` — shared by every frame.
    head: Bytes,
    prompt_tokens: u32,
    continuous: bool,
    sent: u32,
}

impl AudioFrames {
    pub(crate) fn new(
        task: SpeechTask,
        id: &str,
        created: u64,
        model: &str,
        prompt_tokens: u32,
        continuous: bool,
    ) -> Self {
        let mut head = BytesMut::with_capacity(128 + id.len() + model.len());
        head.put_slice(b"data: {\"id\":\"");
        push_json_str(&mut head, id);
        head.put_slice(b"\",\"object\":\"");
        head.put_slice(task.chunk_object().as_bytes());
        head.put_slice(b"\",\"created\":");
        head.put_slice(itoa::Buffer::new().format(created).as_bytes());
        head.put_slice(b",\"model\":\"");
        push_json_str(&mut head, model);
        head.put_slice(b"\",\"choices\":[");
        Self {
            head: head.freeze(),
            prompt_tokens,
            continuous,
            sent: 0,
        }
    }

    fn put_usage(&self, b: &mut BytesMut) {
        let mut n = itoa::Buffer::new();
        b.put_slice(br#","usage":{"prompt_tokens":"#);
        b.put_slice(n.format(self.prompt_tokens).as_bytes());
        b.put_slice(br#","total_tokens":"#);
        b.put_slice(
            n.format(u64::from(self.prompt_tokens) + u64::from(self.sent))
                .as_bytes(),
        );
        b.put_slice(br#","completion_tokens":"#);
        b.put_slice(n.format(self.sent).as_bytes());
        b.put_u8(b'}');
    }

    /// One token; `finish` marks the last.
    pub(crate) fn token(&mut self, text: &str, finish: Option<&str>) -> Bytes {
        self.sent += 1;
        let mut b = BytesMut::with_capacity(self.head.len() + text.len() * 2 + 160);
        b.put_slice(&self.head);
        b.put_slice(br#"{"delta":{"content":""#);
        push_json_str(&mut b, text);
        b.put_slice(br#""}"#);
        if let Some(reason) = finish {
            b.put_slice(br#","finish_reason":""#);
            b.put_slice(reason.as_bytes());
            b.put_slice(br#"","stop_reason":null"#);
        }
        b.put_slice(b"}]");
        if self.continuous {
            self.put_usage(&mut b);
        }
        b.put_slice(b"}\n\n");
        b.freeze()
    }

    /// The closing usage chunk (`stream_include_usage`).
    pub(crate) fn usage(&mut self) -> Bytes {
        let mut b = BytesMut::with_capacity(self.head.len() + 128);
        b.put_slice(&self.head);
        b.put_u8(b']');
        self.put_usage(&mut b);
        b.put_slice(b"}\n\n");
        b.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wav(seconds: u32) -> Vec<u8> {
        let rate = 16_000u32;
        let data = vec![0u8; (rate * 2 * seconds) as usize];
        let mut w = Vec::new();
        w.extend_from_slice(b"RIFF");
        w.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
        w.extend_from_slice(b"WAVEfmt ");
        w.extend_from_slice(&16u32.to_le_bytes());
        w.extend_from_slice(&1u16.to_le_bytes()); // PCM
        w.extend_from_slice(&1u16.to_le_bytes()); // mono
        w.extend_from_slice(&rate.to_le_bytes());
        w.extend_from_slice(&(rate * 2).to_le_bytes());
        w.extend_from_slice(&2u16.to_le_bytes());
        w.extend_from_slice(&16u16.to_le_bytes());
        w.extend_from_slice(b"data");
        w.extend_from_slice(&(data.len() as u32).to_le_bytes());
        w.extend_from_slice(&data);
        w
    }

    #[test]
    fn wav_length_comes_from_its_header() {
        assert_eq!(audio_seconds(&wav(3)), Some(3.0));
        let mut cut = wav(3);
        cut.truncate(44 + 16_000);
        assert_eq!(
            audio_seconds(&cut),
            Some(0.5),
            "a short file holds what it holds"
        );
        assert_eq!(
            audio_seconds(&[0u8; 32_000]),
            Some(2.0),
            "not WAV: 128 kbit/s"
        );
        assert_eq!(audio_seconds(b""), None);
        assert_eq!(audio_seconds(b"RIFF\0\0\0\0WAVE"), None, "WAV without data");
    }

    #[test]
    fn chunks_are_json_in_vllm_shape() {
        let mut f = AudioFrames::new(SpeechTask::Transcribe, "transcribe-x", 7, "m", 54, true);
        let parse = |b: Bytes| -> serde_json::Value {
            let s = std::str::from_utf8(&b).unwrap();
            serde_json::from_str(s.strip_prefix("data: ").unwrap().trim_end()).unwrap()
        };
        let first = parse(f.token(" a\"b", None));
        assert_eq!(first["object"], "transcription.chunk");
        assert_eq!(first["choices"][0]["delta"]["content"], " a\"b");
        assert!(first["choices"][0].get("finish_reason").is_none());
        assert_eq!(first["usage"]["completion_tokens"], 1);
        let last = parse(f.token(" c", Some("stop")));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert!(last["choices"][0]["stop_reason"].is_null());
        let usage = parse(f.usage());
        assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
        assert_eq!(usage["usage"]["total_tokens"], 56);
    }
}
