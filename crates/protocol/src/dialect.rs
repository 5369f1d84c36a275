//! One dialect per wire protocol the gateway relays: how an event of its streams reads (token /
//! no output / usage / error / clean end), and where its usage is. Matched per event by this
//! `Copy` enum (no `dyn`, no allocation); the Timeline, limits, queue, relay, request log and
//! metrics stay protocol-agnostic on top of it.
//!
//! | dialect | token event | clean end | usage |
//! |---|---|---|---|
//! | chat chunks | vLLM 0.33's `vllm bench serve` rule (`event::classify`) | `data: [DONE]` | the usage chunk |
//! | Responses events | `response.output_text.delta`, `response.reasoning_text.delta`, `response.function_call_arguments.delta` | `response.completed` / `response.incomplete` (`response.failed` ends it failed) | `response.usage` of the final event |
//! | Anthropic events | `content_block_delta` | `message_stop` | `message_start`'s input + the last `message_delta`'s (cumulative) output |
//! | JSON | the whole answer | the body | `usage` in the body |

use std::borrow::Cow;
use std::sync::LazyLock;

use memchr::{memchr, memmem};
use serde::Deserialize;

use super::event::{self, DataKind, USAGE};
use super::usage::{UsagePart, usage_in};

/// A wire protocol, as its endpoint speaks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI chat completions and completions chunks.
    Chat,
    /// OpenAI's Responses API events (`/v1/responses`).
    Responses,
    /// Anthropic's Messages API events (`/v1/messages`).
    Anthropic,
    /// A whole JSON answer (the tokenizer routes).
    Json,
}

/// One `data:` payload, read by its dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Event {
    pub(crate) kind: DataKind,
    /// The usage this event reports, if any.
    pub(crate) usage: Option<UsagePart>,
    /// What a chat token event streamed (`Unread` elsewhere).
    pub(crate) streamed: event::Streamed,
}

impl Dialect {
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Chat => "chat",
            Dialect::Responses => "responses",
            Dialect::Anthropic => "anthropic",
            Dialect::Json => "json",
        }
    }

    /// Read one `data:` payload of a stream in this dialect.
    pub(crate) fn event(self, payload: &[u8]) -> Event {
        match self {
            Dialect::Chat | Dialect::Json => chat_event(payload),
            Dialect::Responses => typed_event(payload, responses_kind),
            Dialect::Anthropic => typed_event(payload, anthropic_kind),
        }
    }

    /// The gateway's own errors go out in Anthropic's shape.
    pub fn anthropic(self) -> bool {
        self == Dialect::Anthropic
    }
}

#[derive(Deserialize)]
struct UsageEnvelope {
    usage: Option<UsagePart>,
}

/// A chat or completions chunk: classified by vLLM's rule; usage read from the usage chunk, or
/// from any chunk when `continuous_usage_stats` puts it on every one (the last one wins).
fn chat_event(payload: &[u8]) -> Event {
    let (kind, streamed) = event::classify_streamed(payload);
    let usage = match kind {
        DataKind::Content => USAGE.find(payload).and_then(|at| {
            let after = payload[at + 7..].trim_ascii_start().strip_prefix(b":")?;
            if after.trim_ascii_start().starts_with(b"null") {
                return None;
            }
            top_level_usage(payload)
        }),
        DataKind::NoChoices | DataKind::NoOutput if USAGE.find(payload).is_some() => {
            top_level_usage(payload)
        }
        _ => None,
    };
    Event {
        kind,
        usage,
        streamed,
    }
}

fn top_level_usage(payload: &[u8]) -> Option<UsagePart> {
    serde_json::from_slice::<UsageEnvelope>(payload).ok()?.usage
}

/// The top-level `type` of an event (nested objects have their own `type`, which is skipped).
#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(rename = "type", borrow)]
    ty: Option<Cow<'a, str>>,
}

/// What an event's type means: its kind, and whether it carries usage (`None`: not an event
/// type of the protocol).
type Kinds = fn(&[u8]) -> Option<(DataKind, bool)>;

static TYPE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"type\":\""));

/// The event's type, read without parsing it: the first compact `"type":"<name>"` whose name
/// is one of the protocol's event types. Nested objects have types of their own (`text_delta`,
/// `message`, `output_text`), never an event's name, and a string value cannot hold the
/// sequence unescaped; so the match is the event's own type wherever it sits (vLLM writes a
/// Responses event's `type` last). An event written with spaces is parsed (`Typed`).
fn typed_event(payload: &[u8], kinds: Kinds) -> Event {
    let mut typed = false;
    for at in TYPE.find_iter(payload) {
        typed = true;
        let rest = &payload[at + 8..];
        let Some(end) = memchr(b'"', rest) else {
            break;
        };
        if let Some(k) = kinds(&rest[..end]) {
            return event_of(payload, k);
        }
    }
    if typed {
        // An event type of the protocol the gateway need not tell apart.
        return Event {
            kind: DataKind::NoOutput,
            usage: None,
            streamed: event::Streamed::Unread,
        };
    }
    let ty = serde_json::from_slice::<Typed<'_>>(payload)
        .ok()
        .and_then(|t| t.ty);
    match ty.as_deref().map(|t| kinds(t.as_bytes())) {
        Some(Some(k)) => event_of(payload, k),
        Some(None) => Event {
            kind: DataKind::NoOutput,
            usage: None,
            streamed: event::Streamed::Unread,
        },
        // Not an event of this protocol: a chat-style `{"error": ...}` still counts as one.
        None => Event {
            kind: if event::classify(payload) == DataKind::Error {
                DataKind::Error
            } else {
                DataKind::NoOutput
            },
            usage: None,
            streamed: event::Streamed::Unread,
        },
    }
}

fn event_of(payload: &[u8], (kind, has_usage): (DataKind, bool)) -> Event {
    let usage = if has_usage { usage_in(payload) } else { None };
    Event {
        kind,
        usage,
        streamed: event::Streamed::Unread,
    }
}

/// The Responses API's events, as `vllm bench serve --backend openai-responses` times them:
/// the `.added` / `.created` / `.in_progress` events are not tokens.
fn responses_kind(ty: &[u8]) -> Option<(DataKind, bool)> {
    Some(match ty {
        b"response.output_text.delta"
        | b"response.reasoning_text.delta"
        | b"response.function_call_arguments.delta" => (DataKind::Content, false),
        b"response.completed" | b"response.incomplete" => (DataKind::Done, true),
        // A failed response ends its stream cleanly, as a failed request.
        b"response.failed" => (DataKind::Error, true),
        b"error" => (DataKind::Error, false),
        _ if ty.starts_with(b"response.") => (DataKind::NoOutput, false),
        _ => return None,
    })
}

/// Anthropic's Messages API events.
fn anthropic_kind(ty: &[u8]) -> Option<(DataKind, bool)> {
    Some(match ty {
        b"content_block_delta" => (DataKind::Content, false),
        b"message_stop" => (DataKind::Done, false),
        b"message_start" | b"message_delta" => (DataKind::NoOutput, true),
        b"error" => (DataKind::Error, false),
        b"content_block_start" | b"content_block_stop" | b"ping" => (DataKind::NoOutput, false),
        _ => return None,
    })
}

/// The id of the response a Responses event or body describes: `response.id` of an event
/// (`response.created` first), or the top-level `id` of a whole response object.
pub fn response_id(payload: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Inner<'a> {
        #[serde(borrow)]
        id: Option<Cow<'a, str>>,
    }
    #[derive(Deserialize)]
    struct Outer<'a> {
        #[serde(borrow)]
        id: Option<Cow<'a, str>>,
        #[serde(borrow)]
        response: Option<Inner<'a>>,
        #[serde(borrow)]
        object: Option<Cow<'a, str>>,
    }
    let o: Outer<'_> = serde_json::from_slice(payload).ok()?;
    match (o.response, o.id, o.object.as_deref()) {
        (Some(Inner { id: Some(id) }), _, _) => Some(id.into_owned()),
        (None, Some(id), Some("response")) => Some(id.into_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::Usage;

    fn kind(d: Dialect, p: &str) -> DataKind {
        d.event(p.as_bytes()).kind
    }

    #[test]
    fn responses_events() {
        let d = Dialect::Responses;
        let created = r#"{"response":{"id":"resp_1","object":"response","output":[],"usage":null,"status":"in_progress"},"sequence_number":0,"type":"response.created"}"#;
        assert_eq!(d.event(created.as_bytes()).kind, DataKind::NoOutput);
        assert_eq!(d.event(created.as_bytes()).usage, None);
        assert_eq!(response_id(created.as_bytes()).as_deref(), Some("resp_1"));
        for t in [
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ] {
            let p = format!(
                r#"{{"content_index":0,"delta":"hi","item_id":"msg_1","output_index":0,"sequence_number":4,"type":"{t}"}}"#
            );
            assert_eq!(kind(d, &p), DataKind::Content, "{t}");
        }
        for t in [
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.output_item.done",
        ] {
            let p = format!(
                r#"{{"item":{{"type":"message","content":[{{"type":"output_text","text":"say \"type\":\"response.output_text.delta\""}}]}},"sequence_number":1,"type":"{t}"}}"#
            );
            assert_eq!(kind(d, &p), DataKind::NoOutput, "{t}");
        }
        let done = r#"{"response":{"id":"resp_1","usage":{"input_tokens":11,"output_tokens":4,"total_tokens":15}},"sequence_number":9,"type":"response.completed"}"#;
        let e = d.event(done.as_bytes());
        assert_eq!(e.kind, DataKind::Done);
        assert_eq!(
            e.usage.map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 11,
                completion_tokens: 4,
                cached_tokens: None
            })
        );
        assert_eq!(
            kind(
                d,
                r#"{"response":{"usage":null},"type":"response.incomplete"}"#
            ),
            DataKind::Done
        );
        assert_eq!(
            kind(d, r#"{"response":{},"type":"response.failed"}"#),
            DataKind::Error
        );
        assert_eq!(
            kind(d, r#"{"type":"error","code":"x","message":"m"}"#),
            DataKind::Error
        );
        assert_eq!(kind(d, r#"{"error":{"message":"m"}}"#), DataKind::Error);
        assert_eq!(kind(d, "not json"), DataKind::NoOutput);
        // Written with spaces (another server's serialiser): parsed.
        assert_eq!(
            kind(
                d,
                r#"{ "delta": "x", "type" : "response.output_text.delta" }"#
            ),
            DataKind::Content
        );
        assert_eq!(
            kind(
                d,
                r#"{"type": "response.completed", "response": {"usage": {"input_tokens": 2, "output_tokens": 1}}}"#
            ),
            DataKind::Done
        );
    }

    #[test]
    fn anthropic_events() {
        let d = Dialect::Anthropic;
        let start = r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":12,"output_tokens":0}}}"#;
        let e = d.event(start.as_bytes());
        assert_eq!(e.kind, DataKind::NoOutput);
        assert_eq!(
            e.usage,
            Some(UsagePart {
                prompt_tokens: Some(12),
                completion_tokens: Some(0),
                ..UsagePart::default()
            })
        );
        assert_eq!(
            kind(
                d,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#
            ),
            DataKind::NoOutput
        );
        assert_eq!(
            kind(
                d,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#
            ),
            DataKind::Content
        );
        assert_eq!(
            kind(
                d,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\""}}"#
            ),
            DataKind::Content
        );
        let delta = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":5}}"#;
        assert_eq!(
            d.event(delta.as_bytes()).usage,
            Some(UsagePart {
                prompt_tokens: None,
                completion_tokens: Some(5),
                ..UsagePart::default()
            })
        );
        assert_eq!(kind(d, r#"{"type":"message_stop"}"#), DataKind::Done);
        assert_eq!(kind(d, r#"{"type": "ping"}"#), DataKind::NoOutput);
        assert_eq!(
            kind(
                d,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            DataKind::Error
        );
    }

    /// The chat dialect is the scanner's own rule, with the usage chunk's counts.
    #[test]
    fn chat_chunks_keep_their_rule() {
        let d = Dialect::Chat;
        let u = d.event(br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#);
        assert_eq!(u.kind, DataKind::NoChoices);
        assert_eq!(
            u.usage.map(UsagePart::whole).map(|u| u.completion_tokens),
            Some(2)
        );
        let c = d.event(br#"{"choices":[{"delta":{"content":"x"}}],"usage":null}"#);
        assert_eq!((c.kind, c.usage), (DataKind::Content, None));
        assert_eq!(d.event(b"[DONE]").kind, DataKind::Done);
    }
}
