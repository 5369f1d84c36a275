//! Hand-written SSE frames in vLLM's exact field order. The per-token path is three memcpys and
//! an escape scan into a reused buffer: no serde, no allocation once the buffer has grown.

use bytes::{BufMut, Bytes, BytesMut};

use super::tokens::push_json_str;

/// Which OpenAI endpoint a stream answers; decides object names and the choice layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completions,
    /// OpenAI's Responses API (`sim::agents`).
    Responses,
    /// Anthropic's Messages API (`sim::agents`): vLLM names its messages like chat completions.
    Messages,
}

impl Endpoint {
    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Messages => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
            Endpoint::Responses => "resp_",
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
            Endpoint::Responses | Endpoint::Messages => "",
        }
    }
}

pub(crate) const DONE: &[u8] = b"data: [DONE]\n\n";

/// vLLM 0.32's first chat chunk: the role, then (after any usage) the prompt fields, null
/// unless asked for.
const ROLE_CHOICE: &[u8] =
    br#"{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]"#;
const ROLE_END: &[u8] = br#","prompt_token_ids":null,"prompt_text":null}"#;

/// Formats the frames of one stream.
pub(crate) struct FrameWriter {
    endpoint: Endpoint,
    /// `data: {"id":..,"object":..,"created":..,"model":..,"choices":[` — shared by every frame.
    head: Bytes,
    buf: BytesMut,
    /// `continuous_usage_stats`: the prompt's tokens, to put usage on every chunk.
    continuous: Option<u32>,
    /// Tokens written so far (for continuous usage).
    tokens: u32,
    /// `--enable-prompt-tokens-details`: the cached prompt tokens the usage chunk reports.
    cached: Option<u32>,
}

impl FrameWriter {
    pub(crate) fn new(endpoint: Endpoint, id: &str, created: u64, model: &str) -> Self {
        let mut head = BytesMut::with_capacity(128 + id.len() + model.len());
        head.put_slice(b"data: {\"id\":\"");
        push_json_str(&mut head, id);
        head.put_slice(b"\",\"object\":\"");
        head.put_slice(endpoint.chunk_object().as_bytes());
        head.put_slice(b"\",\"created\":");
        head.put_slice(itoa::Buffer::new().format(created).as_bytes());
        head.put_slice(b",\"model\":\"");
        push_json_str(&mut head, model);
        head.put_slice(b"\",\"choices\":[");
        Self {
            endpoint,
            head: head.freeze(),
            buf: BytesMut::with_capacity(4096),
            continuous: None,
            tokens: 0,
            cached: None,
        }
    }

    /// Usage on every chunk (`stream_options.continuous_usage_stats` with `include_usage`).
    pub(crate) fn continuous_usage(&mut self, prompt_tokens: u32) {
        self.continuous = Some(prompt_tokens);
    }

    /// `usage.prompt_tokens_details` on the usage chunk, as vLLM with
    /// `--enable-prompt-tokens-details`.
    pub(crate) fn prompt_tokens_details(&mut self, cached_tokens: u32) {
        self.cached = Some(cached_tokens);
    }

    /// `,"usage":{…}` of a continuous-usage chunk.
    fn put_running_usage(&mut self) {
        let Some(prompt) = self.continuous else {
            return;
        };
        let mut n = itoa::Buffer::new();
        self.buf.put_slice(br#","usage":{"prompt_tokens":"#);
        self.buf.put_slice(n.format(prompt).as_bytes());
        self.buf.put_slice(br#","total_tokens":"#);
        self.buf.put_slice(
            n.format(u64::from(prompt) + u64::from(self.tokens))
                .as_bytes(),
        );
        self.buf.put_slice(br#","completion_tokens":"#);
        self.buf.put_slice(n.format(self.tokens).as_bytes());
        self.buf.put_slice(br#","completion_tokens_details":null}"#);
    }

    fn take(&mut self) -> Bytes {
        self.buf.split().freeze()
    }

    /// Makes room for one frame; once earlier frames have been written out and dropped this
    /// reclaims the same allocation instead of growing.
    fn begin(&mut self, extra: usize) {
        self.buf.reserve(self.head.len() + extra + 160);
        self.buf.put_slice(&self.head);
    }

    /// Chat only: the first chunk, carrying the assistant role and empty content.
    pub(crate) fn role(&mut self) -> Bytes {
        self.begin(ROLE_CHOICE.len());
        self.buf.put_slice(ROLE_CHOICE);
        self.put_running_usage();
        self.buf.put_slice(ROLE_END);
        self.buf.put_slice(b"\n\n");
        self.take()
    }

    /// One token; `finish` marks the last one with its finish reason. vLLM puts the
    /// `system_fingerprint` on the last chunk before `[DONE]`: this one without a usage chunk
    /// (`fingerprint`), else the usage chunk.
    pub(crate) fn token(&mut self, text: &str, finish: Option<&str>, fingerprint: bool) -> Bytes {
        self.begin(text.len() * 2);
        match self.endpoint {
            Endpoint::Chat => {
                self.buf.put_slice(br#"{"index":0,"delta":{"content":""#);
                push_json_str(&mut self.buf, text);
                self.buf
                    .put_slice(br#""},"logprobs":null,"finish_reason":"#);
            }
            // (Their frames are `sim::agents`'.)
            Endpoint::Completions | Endpoint::Responses | Endpoint::Messages => {
                self.buf.put_slice(br#"{"index":0,"text":""#);
                push_json_str(&mut self.buf, text);
                self.buf.put_slice(br#"","logprobs":null,"finish_reason":"#);
            }
        }
        match finish {
            Some(reason) => {
                self.buf.put_u8(b'"');
                self.buf.put_slice(reason.as_bytes());
                self.buf.put_slice(br#"","stop_reason":null"#);
            }
            None if self.endpoint == Endpoint::Chat => self.buf.put_slice(b"null"),
            // vLLM sets stop_reason explicitly on every completions chunk.
            None => self.buf.put_slice(br#"null,"stop_reason":null"#),
        }
        if self.endpoint == Endpoint::Completions {
            self.buf.put_slice(br#","prompt_token_ids":null"#);
        }
        self.buf.put_slice(br#","token_ids":null}]"#);
        self.tokens += 1;
        self.put_running_usage();
        if finish.is_some() && fingerprint {
            self.buf.put_slice(br#","system_fingerprint":""#);
            self.buf
                .put_slice(super::api::answer::SYSTEM_FINGERPRINT.as_bytes());
            self.buf.put_u8(b'"');
        }
        self.buf.put_u8(b'}');
        self.buf.put_slice(b"\n\n");
        self.take()
    }

    /// The `stream_options.include_usage` chunk: no choices, just the totals.
    pub(crate) fn usage(&mut self, prompt: u32, completion: u32) -> Bytes {
        self.begin(0);
        let mut n = itoa::Buffer::new();
        self.buf.put_slice(br#"],"usage":{"prompt_tokens":"#);
        self.buf.put_slice(n.format(prompt).as_bytes());
        self.buf.put_slice(br#","total_tokens":"#);
        self.buf.put_slice(
            n.format(u64::from(prompt) + u64::from(completion))
                .as_bytes(),
        );
        self.buf.put_slice(br#","completion_tokens":"#);
        self.buf.put_slice(n.format(completion).as_bytes());
        if let Some(cached) = self.cached {
            self.buf
                .put_slice(br#","prompt_tokens_details":{"cached_tokens":"#);
            self.buf.put_slice(n.format(cached).as_bytes());
            self.buf
                .put_slice(br#","created_cache_tokens":null,"multimodal_tokens":null}"#);
        }
        self.buf.put_slice(br#"},"system_fingerprint":""#);
        self.buf
            .put_slice(super::api::answer::SYSTEM_FINGERPRINT.as_bytes());
        self.buf.put_slice(b"\"}\n\n");
        self.take()
    }
}

/// The in-stream error event vLLM sends when generation fails after the headers went out.
pub(crate) fn error_event(message: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(128 + message.len());
    b.put_slice(br#"data: {"error":{"message":""#);
    push_json_str(&mut b, message);
    b.put_slice(br#"","type":"InternalServerError","param":null,"code":500}}"#);
    b.put_slice(b"\n\n");
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(frame: &Bytes) -> serde_json::Value {
        let s = std::str::from_utf8(frame).unwrap();
        let body = s
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn frames_are_valid_json_in_vllm_shape() {
        let mut w = FrameWriter::new(Endpoint::Chat, "chatcmpl-a\"b", 1700000000, "qwen32b");
        let role = json(&w.role());
        assert_eq!(role["id"], "chatcmpl-a\"b");
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
        assert!(role["prompt_token_ids"].is_null() && role.get("prompt_text").is_some());
        let tok = json(&w.token(" 日本\n", None, false));
        assert_eq!(tok["choices"][0]["delta"]["content"], " 日本\n");
        assert!(tok["choices"][0]["finish_reason"].is_null());
        let last = json(&w.token(" end", Some("length"), false));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(
            last.get("system_fingerprint").is_none(),
            "on the usage chunk then"
        );
        let alone = json(&w.token(" end", Some("length"), true));
        assert_eq!(
            alone["system_fingerprint"],
            crate::api::answer::SYSTEM_FINGERPRINT
        );
        let usage = json(&w.usage(3, 4));
        assert_eq!(
            usage["system_fingerprint"],
            crate::api::answer::SYSTEM_FINGERPRINT
        );
        assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
        assert_eq!(usage["usage"]["total_tokens"], 7);

        let mut c = FrameWriter::new(Endpoint::Completions, "cmpl-x", 1, "m");
        let t = json(&c.token(" \"q\"", None, false));
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["text"], " \"q\"");
        assert!(t["choices"][0]["stop_reason"].is_null());
        let e = json(&error_event("boom"));
        assert_eq!(e["error"]["code"], 500);
    }
}
