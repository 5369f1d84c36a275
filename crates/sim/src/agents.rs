//! The agents' protocols in vLLM 0.32's shapes (tests/fixtures/vllm-0.32.0, groups `responses`,
//! `messages`, `responses_store`): OpenAI's Responses API (`/v1/responses`, and by id with
//! `--responses-store`) and Anthropic's Messages API (`/v1/messages`, `count_tokens`). The
//! per-token frames are written by hand into a reused buffer, as chat's are; the opening and
//! closing events, once per stream, through serde in vLLM's field order.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde_json::{Value, json};

use super::api::error::ApiError;
use super::tokens::push_json_str;

/// The Responses API's object, in the order vLLM 0.32 writes its fields.
#[derive(Serialize, Clone)]
pub(crate) struct ResponseObject {
    pub id: String,
    pub created_at: u64,
    pub incomplete_details: Option<Value>,
    pub instructions: Option<String>,
    pub metadata: Option<Value>,
    pub model: String,
    pub object: &'static str,
    pub output: Vec<Value>,
    pub parallel_tool_calls: bool,
    pub temperature: f64,
    pub tool_choice: &'static str,
    pub tools: Vec<Value>,
    pub top_p: f64,
    pub background: bool,
    pub max_output_tokens: Option<u32>,
    pub max_tool_calls: Option<u32>,
    pub previous_response_id: Option<String>,
    pub prompt: Option<Value>,
    pub reasoning: Option<Value>,
    pub service_tier: &'static str,
    pub status: &'static str,
    pub text: Option<Value>,
    pub top_logprobs: Option<u32>,
    pub truncation: &'static str,
    pub usage: Option<Value>,
    pub user: Option<String>,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub kv_transfer_params: Option<Value>,
    pub ec_transfer_params: Option<Value>,
    pub input_messages: Option<Value>,
    pub output_messages: Option<Value>,
    /// Prompt tokens the prefix cache held: `usage.input_tokens_details.cached_tokens`
    /// (vLLM writes it whatever `--enable-prompt-tokens-details` says).
    #[serde(skip)]
    pub cached_tokens: u32,
}

impl ResponseObject {
    pub(crate) fn new(
        id: String,
        created_at: u64,
        model: &str,
        instructions: Option<String>,
        max_output_tokens: u32,
        previous_response_id: Option<String>,
    ) -> Self {
        Self {
            id,
            created_at,
            incomplete_details: None,
            instructions,
            metadata: None,
            model: model.to_owned(),
            object: "response",
            output: Vec::new(),
            parallel_tool_calls: true,
            temperature: 1.0,
            tool_choice: "none",
            tools: Vec::new(),
            top_p: 1.0,
            background: false,
            max_output_tokens: Some(max_output_tokens),
            max_tool_calls: None,
            previous_response_id,
            prompt: None,
            reasoning: None,
            service_tier: "auto",
            status: "in_progress",
            text: None,
            top_logprobs: None,
            truncation: "disabled",
            usage: None,
            user: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            kv_transfer_params: None,
            ec_transfer_params: None,
            input_messages: None,
            output_messages: None,
            cached_tokens: 0,
        }
    }

    /// Finished: the message, the usage, and `incomplete` when the limit cut it.
    pub(crate) fn complete(
        &mut self,
        msg_id: &str,
        text: &str,
        prompt: u32,
        completion: u32,
        cut: bool,
    ) {
        self.output = vec![message_item(msg_id, text, "completed", Value::Null)];
        self.status = if cut { "incomplete" } else { "completed" };
        self.incomplete_details = cut.then(|| json!({"reason": "max_output_tokens"}));
        self.usage = Some(json!({
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion,
        }));
    }
}

fn message_item(id: &str, text: &str, status: &str, logprobs: Value) -> Value {
    json!({
        "id": id,
        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": null,
    })
}

/// `event: <type>` + `data: <json>`: every event of both protocols.
fn event(out: &mut BytesMut, name: &str, data: &impl Serialize) {
    out.put_slice(b"event: ");
    out.put_slice(name.as_bytes());
    out.put_slice(b"\ndata: ");
    let _ = serde_json::to_writer(out.writer(), data);
    out.put_slice(b"\n\n");
}

/// The frames of one Responses stream; `sequence_number` counts from 0.
pub(crate) struct ResponsesFrames {
    pub object: ResponseObject,
    msg_id: String,
    seq: u32,
    text: String,
    buf: BytesMut,
    /// Every event sent, kept for a background response (`GET ?stream=true` replays them).
    pub log: Option<BytesMut>,
}

impl ResponsesFrames {
    pub(crate) fn new(object: ResponseObject, msg_id: String) -> Self {
        let log = object.background.then(BytesMut::new);
        Self {
            object,
            msg_id,
            seq: 0,
            text: String::new(),
            buf: BytesMut::with_capacity(1024),
            log,
        }
    }

    /// The events written since the last call (kept in `log` too, when there is one).
    fn out(&mut self) -> Bytes {
        let b = self.buf.split().freeze();
        if let Some(log) = &mut self.log {
            log.extend_from_slice(&b);
        }
        b
    }

    fn next_seq(&mut self) -> u32 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// `response.created` and `response.in_progress`: sent at once, before the first token.
    pub(crate) fn start(&mut self) -> Bytes {
        for name in ["response.created", "response.in_progress"] {
            let seq = self.next_seq();
            let data = json!({"response": &self.object, "sequence_number": seq, "type": name});
            event(&mut self.buf, name, &data);
        }
        self.out()
    }

    /// The message item and its text part open with the first token.
    pub(crate) fn first(&mut self) -> Bytes {
        let seq = self.next_seq();
        let item = json!({"id": self.msg_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message", "phase": null});
        event(
            &mut self.buf,
            "response.output_item.added",
            &json!({"item": item, "output_index": 0, "sequence_number": seq, "type": "response.output_item.added"}),
        );
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "response.content_part.added",
            &json!({"content_index": 0, "item_id": self.msg_id, "output_index": 0, "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}, "sequence_number": seq, "type": "response.content_part.added"}),
        );
        self.out()
    }

    /// One `response.output_text.delta`.
    pub(crate) fn token(&mut self, text: &str) -> Bytes {
        self.text.push_str(text);
        let seq = self.next_seq();
        let b = &mut self.buf;
        b.put_slice(b"event: response.output_text.delta\ndata: {\"content_index\":0,\"delta\":\"");
        push_json_str(b, text);
        b.put_slice(b"\",\"item_id\":\"");
        push_json_str(b, &self.msg_id);
        b.put_slice(b"\",\"logprobs\":[],\"output_index\":0,\"sequence_number\":");
        b.put_slice(itoa::Buffer::new().format(seq).as_bytes());
        b.put_slice(b",\"type\":\"response.output_text.delta\"}\n\n");
        self.out()
    }

    /// The closing events, `response.completed` last with the usage.
    pub(crate) fn finish(&mut self, prompt: u32, completion: u32, cut: bool) -> Bytes {
        let (id, text) = (self.msg_id.clone(), std::mem::take(&mut self.text));
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "response.output_text.done",
            &json!({"content_index": 0, "item_id": id, "logprobs": [], "output_index": 0, "sequence_number": seq, "text": text, "type": "response.output_text.done"}),
        );
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "response.content_part.done",
            &json!({"content_index": 0, "item_id": id, "output_index": 0, "part": {"annotations": [], "text": text, "type": "output_text", "logprobs": null}, "sequence_number": seq, "type": "response.content_part.done"}),
        );
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "response.output_item.done",
            &json!({"item": message_item(&id, &text, "completed", Value::Null), "output_index": 0, "sequence_number": seq, "type": "response.output_item.done"}),
        );
        self.object.complete(&id, &text, prompt, completion, cut);
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "response.completed",
            &json!({"response": &self.object, "sequence_number": seq, "type": "response.completed"}),
        );
        self.out()
    }

    /// An error after the head went out.
    pub(crate) fn error(&mut self, message: &str) -> Bytes {
        let seq = self.next_seq();
        event(
            &mut self.buf,
            "error",
            &json!({"type": "error", "code": "InternalServerError", "message": message, "param": null, "sequence_number": seq}),
        );
        self.out()
    }
}

/// The frames of one Anthropic Messages stream.
pub(crate) struct MessagesFrames {
    id: String,
    model: String,
    prompt: u32,
    buf: BytesMut,
}

impl MessagesFrames {
    pub(crate) fn new(id: String, model: &str, prompt: u32) -> Self {
        Self {
            id,
            model: model.to_owned(),
            prompt,
            buf: BytesMut::with_capacity(512),
        }
    }

    /// `message_start` and the text block's start, with the first token.
    pub(crate) fn first(&mut self) -> Bytes {
        event(
            &mut self.buf,
            "message_start",
            &json!({"type": "message_start", "message": {"id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model, "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": self.prompt, "output_tokens": 0}}}),
        );
        event(
            &mut self.buf,
            "content_block_start",
            &json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}),
        );
        self.buf.split().freeze()
    }

    /// One `content_block_delta`.
    pub(crate) fn token(&mut self, text: &str) -> Bytes {
        let b = &mut self.buf;
        b.put_slice(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"");
        push_json_str(b, text);
        b.put_slice(b"\"},\"index\":0}\n\n");
        self.buf.split().freeze()
    }

    /// The block's end, the usage, the message's end.
    pub(crate) fn finish(&mut self, completion: u32, cut: bool) -> Bytes {
        event(
            &mut self.buf,
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        );
        let reason = if cut { "max_tokens" } else { "end_turn" };
        event(
            &mut self.buf,
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": null}, "usage": {"input_tokens": self.prompt, "output_tokens": completion}}),
        );
        event(
            &mut self.buf,
            "message_stop",
            &json!({"type": "message_stop"}),
        );
        self.buf.split().freeze()
    }

    pub(crate) fn error(&mut self, message: &str) -> Bytes {
        event(
            &mut self.buf,
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        );
        self.buf.split().freeze()
    }
}

/// A whole Anthropic message, as vLLM writes it (None-valued fields left out). With
/// `--enable-prompt-tokens-details`, `cached` is `Some`: vLLM then reports the cached part as
/// `cache_read_input_tokens` and only the rest as `input_tokens`.
pub(crate) fn message_json(
    id: &str,
    model: &str,
    text: &str,
    prompt: u32,
    completion: u32,
    cached: Option<u32>,
    cut: bool,
) -> Vec<u8> {
    let reason = if cut { "max_tokens" } else { "end_turn" };
    let mut usage = json!({"input_tokens": prompt, "output_tokens": completion});
    if let Some(cached) = cached {
        usage = json!({
            "input_tokens": prompt.saturating_sub(cached),
            "output_tokens": completion,
            "cache_read_input_tokens": cached,
        });
    }
    serde_json::to_vec(&json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": reason,
        "usage": usage,
    }))
    .unwrap_or_default()
}

/// vLLM's store of responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`): the last ones, by id,
/// with what a background response still needs (its task, to cancel it; a streamed one's
/// events, to replay them).
#[derive(Default)]
pub(crate) struct Store {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

#[derive(Default)]
struct Stored {
    object: Option<ResponseObject>,
    /// The task generating a background response, until it ends.
    task: Option<tokio::task::AbortHandle>,
    /// A background stream's events, as sent (`GET ?stream=true` replays them).
    events: Option<Bytes>,
}

/// Why a cancel is refused.
pub(crate) enum CancelRefused {
    NotFound,
    /// Not a background response, or no longer running: vLLM's one message for both.
    NotRunning,
}

/// A background response's status that a cancel can still change.
fn running(status: &str) -> bool {
    matches!(status, "queued" | "in_progress")
}

/// Responses kept by the sim's store.
const STORE_CAPACITY: usize = 10_000;

impl Store {
    fn with<T>(
        &self,
        f: impl FnOnce(&mut HashMap<String, Stored>, &mut VecDeque<String>) -> T,
    ) -> T {
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (map, order) = &mut *g;
        f(map, order)
    }

    /// Store (or update) `r`. A cancelled background response stays cancelled: its task may
    /// still finish a moment after the cancel.
    pub(crate) fn put(&self, r: &ResponseObject) {
        self.with(|map, order| {
            let entry = map.entry(r.id.clone()).or_insert_with(|| {
                order.push_back(r.id.clone());
                Stored::default()
            });
            if entry
                .object
                .as_ref()
                .is_some_and(|o| o.status == "cancelled")
            {
                return;
            }
            entry.object = Some(r.clone());
            if !running(r.status) {
                entry.task = None;
            }
            while order.len() > STORE_CAPACITY {
                if let Some(old) = order.pop_front() {
                    map.remove(&old);
                }
            }
        });
    }

    pub(crate) fn get(&self, id: &str) -> Option<ResponseObject> {
        self.with(|map, _| map.get(id).and_then(|e| e.object.clone()))
    }

    /// The task generating background response `id`, for a cancel to stop it.
    pub(crate) fn running_task(&self, id: &str, task: tokio::task::AbortHandle) {
        self.with(|map, _| {
            if let Some(e) = map.get_mut(id)
                && e.object.as_ref().is_some_and(|o| running(o.status))
            {
                e.task = Some(task);
            }
        });
    }

    /// A background stream's events so far (the whole stream once it ended).
    pub(crate) fn events(&self, id: &str, events: Bytes) {
        self.with(|map, _| {
            if let Some(e) = map.get_mut(id) {
                e.events = Some(events);
            }
        });
    }

    /// `id`'s stored events with a `sequence_number` above `after`, and whether it has any
    /// (only a streamed background response has).
    pub(crate) fn replay(&self, id: &str, after: Option<u64>) -> Option<Bytes> {
        let all = self.with(|map, _| map.get(id).and_then(|e| e.events.clone()))?;
        let Some(after) = after else {
            return Some(all);
        };
        let mut out = BytesMut::new();
        for block in split_events(&all) {
            if sequence_number(block).is_some_and(|n| n > after) {
                out.put_slice(block);
                out.put_slice(b"\n\n");
            }
        }
        Some(out.freeze())
    }

    /// Cancel background response `id` while it runs: its status becomes `cancelled` and its
    /// generation stops.
    pub(crate) fn cancel(&self, id: &str) -> Result<ResponseObject, CancelRefused> {
        self.with(|map, _| {
            let e = map.get_mut(id).ok_or(CancelRefused::NotFound)?;
            let o = e.object.as_mut().ok_or(CancelRefused::NotFound)?;
            if !(o.background && running(o.status)) {
                return Err(CancelRefused::NotRunning);
            }
            o.status = "cancelled";
            if let Some(task) = e.task.take() {
                task.abort();
            }
            Ok(o.clone())
        })
    }
}

/// The events of an SSE body (without their blank-line ends).
fn split_events(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = body;
    std::iter::from_fn(move || {
        while rest.starts_with(b"\n") {
            rest = &rest[1..];
        }
        if rest.is_empty() {
            return None;
        }
        let end = rest
            .windows(2)
            .position(|w| w == b"\n\n")
            .unwrap_or(rest.len());
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// An event's `"sequence_number":N`.
fn sequence_number(event: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"sequence_number\":";
    let at = event.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let digits: Vec<u8> = event[at..]
        .iter()
        .copied()
        .take_while(u8::is_ascii_digit)
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// vLLM's answer for an id it does not hold.
pub(crate) fn response_not_found(id: &str) -> ApiError {
    ApiError::Flat {
        status: http::StatusCode::NOT_FOUND,
        message: format!("Response with id '{id}' not found."),
        kind: "invalid_request_error",
        param: Some("response_id"),
    }
}
