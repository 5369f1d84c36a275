//! Incremental SSE scanner: finds the `data:` lines of an event stream across arbitrary read
//! boundaries and has its dialect (`protocol::dialect`) read each payload just enough to time
//! it (token / no output / usage / error / clean end). It never copies a line that arrives
//! whole; only a line split across reads is carried over. `event:` lines are not read: every
//! dialect's payload names its own type.

use std::sync::LazyLock;

use memchr::{memchr, memmem};
use serde_json::value::RawValue;

use super::dialect::Dialect;
use super::usage::UsagePart;

/// Searchers built once: `memmem::find` would build one per call.
static CHOICES: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"choices\""));
static ERROR: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"error\""));
pub(crate) static USAGE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// What a `data:` payload is. For chat and completions, by vLLM 0.33's `vllm bench serve`
/// reading of a stream (`_choice_has_streamed_output` in
/// vllm/benchmarks/lib/endpoint_request_func.py); the other dialects map their event types onto
/// the same kinds (`protocol::dialect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// A token event: TTFT, ITL and E2EL are measured on these. Chat: the first choice's
    /// `delta` has non-empty `content`, `reasoning`, `tool_calls` or `function_call`, or
    /// `content: ""` without a `role`. Completions: any chunk with non-empty `choices`.
    Content,
    /// An event that streams nothing: the opening `role` chunk, an empty delta; a Responses
    /// `response.created`, an Anthropic `message_start` or `ping`.
    NoOutput,
    /// A chat chunk with `choices: []` (the usage chunk) or without choices.
    NoChoices,
    /// An error sent inside the stream (`{"error": ...}`, an `error` event, `response.failed`).
    Error,
    /// The stream's clean end: `[DONE]`, `response.completed` / `response.incomplete`,
    /// `message_stop`.
    Done,
}

/// One `data:` line as the scanner saw it.
#[derive(Debug, Clone)]
pub struct DataLine<'a> {
    pub kind: DataKind,
    /// The usage this event reports, if any.
    pub usage: Option<UsagePart>,
    pub payload: &'a [u8],
    /// Where the event (this line, its newline and a blank line right after it) sits in the
    /// chunk just fed — `None` when the line began in an earlier chunk.
    pub event_span: Option<std::ops::Range<usize>>,
}

/// Line splitter and classifier; one per stream, reused across reads.
#[derive(Debug)]
pub struct SseScanner {
    /// How the stream's events read.
    dialect: Dialect,
    /// Bytes of a line whose end has not arrived yet.
    carry: Vec<u8>,
    /// The longest line carried over; a longer one stops the scan (`overlong`).
    max_line: usize,
    /// A line grew past `max_line` without its end: nothing more is scanned.
    overlong: bool,
}

impl Default for SseScanner {
    fn default() -> Self {
        Self::new()
    }
}

/// The longest SSE line a relay carries across reads by default (`server.max_stream_line_bytes`):
/// vLLM's longest events (a whole tool call's arguments, a usage chunk with logprobs) are a few
/// hundred kilobytes at most.
pub const DEFAULT_MAX_LINE: usize = 1 << 20;

impl SseScanner {
    /// A scanner with no line limit (trusted input: tests, the bench's own measurements).
    pub fn new() -> Self {
        Self::with_line_limit(usize::MAX)
    }

    /// A scanner that carries at most `max_line` bytes of an unfinished line: a backend that
    /// sends a line with no end (a hostile or broken one) cannot grow the memory it holds.
    pub fn with_line_limit(max_line: usize) -> Self {
        Self::for_dialect(Dialect::Chat, max_line)
    }

    /// A scanner of a stream in `dialect`, with a line limit.
    pub fn for_dialect(dialect: Dialect, max_line: usize) -> Self {
        Self {
            dialect,
            carry: Vec::new(),
            max_line,
            overlong: false,
        }
    }

    /// How the stream's events read.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The longest line carried.
    pub fn max_line(&self) -> usize {
        self.max_line
    }

    /// A line grew past the limit without its end; the scan stopped there.
    pub fn overlong(&self) -> bool {
        self.overlong
    }

    /// Carry `bytes` of an unfinished line, or stop the scan when that would pass the limit
    /// (the carry's memory is given back).
    fn carry_over(&mut self, bytes: &[u8]) {
        if self.carry.len() + bytes.len() > self.max_line {
            self.overlong = true;
            self.carry = Vec::new();
        } else {
            self.carry.extend_from_slice(bytes);
        }
    }

    /// Feed one read's bytes; `on_data` is called for every `data:` line completed in it.
    pub fn feed(&mut self, chunk: &[u8], mut on_data: impl FnMut(DataLine<'_>)) {
        if self.overlong {
            return;
        }
        let mut pos = 0;
        if !self.carry.is_empty() {
            match memchr(b'\n', chunk) {
                None => {
                    self.carry_over(chunk);
                    return;
                }
                Some(i) => {
                    self.carry_over(&chunk[..i]);
                    if self.overlong {
                        return;
                    }
                    let line = std::mem::take(&mut self.carry);
                    handle_line(self.dialect, &line, None, &mut on_data);
                    // Keep the allocation for the next split line.
                    self.carry = line;
                    self.carry.clear();
                    pos = i + 1;
                }
            }
        }
        while let Some(i) = memchr(b'\n', &chunk[pos..]) {
            let end = pos + i + 1;
            let span = pos..end + blank_line_at(&chunk[end..]);
            handle_line(self.dialect, &chunk[pos..pos + i], Some(span), &mut on_data);
            pos = end;
        }
        if pos < chunk.len() {
            self.carry_over(&chunk[pos..]);
        }
    }

    /// The stream ended: a final line without a newline still counts.
    pub fn finish(&mut self, on_data: impl FnMut(DataLine<'_>)) {
        if !self.carry.is_empty() {
            let line = std::mem::take(&mut self.carry);
            let mut on_data = on_data;
            handle_line(self.dialect, &line, None, &mut on_data);
        }
    }

    /// A line has started but its end has not arrived yet.
    pub fn has_partial_line(&self) -> bool {
        !self.carry.is_empty()
    }
}

/// Length of a blank line (`\n` or `\r\n`) at the start of `rest`, else 0.
fn blank_line_at(rest: &[u8]) -> usize {
    match rest {
        [b'\n', ..] => 1,
        [b'\r', b'\n', ..] => 2,
        _ => 0,
    }
}

fn handle_line(
    dialect: Dialect,
    line: &[u8],
    event_span: Option<std::ops::Range<usize>>,
    on_data: &mut impl FnMut(DataLine<'_>),
) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(rest) = line.strip_prefix(b"data:") else {
        return; // comments (`: queued`), `event:`, `id:`, blank separators
    };
    let payload = rest.strip_prefix(b" ").unwrap_or(rest);
    let event = dialect.event(payload);
    on_data(DataLine {
        kind: event.kind,
        usage: event.usage,
        payload,
        event_span,
    });
}

/// Classify a chat or completions payload without parsing the JSON: look for the top-level
/// markers only.
pub fn classify(payload: &[u8]) -> DataKind {
    let p = trim_ascii(payload);
    if p == b"[DONE]" {
        return DataKind::Done;
    }
    if let Some(at) = CHOICES.find(p) {
        let after = skip_ws(&p[at + 9..]);
        let after = match after.split_first() {
            Some((b':', r)) => skip_ws(r),
            _ => after,
        };
        return match after.split_first() {
            Some((b'[', r)) if skip_ws(r).first() == Some(&b']') => DataKind::NoChoices,
            Some((b'[', r)) if streams_output(r) => DataKind::Content,
            Some((b'[', _)) => DataKind::NoOutput,
            _ => DataKind::NoChoices,
        };
    }
    if ERROR.find(p).is_some() {
        return DataKind::Error;
    }
    DataKind::NoChoices
}

static DELTA: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"delta\""));

/// The fields of a chat delta that decide whether it streams output, borrowed from the bytes.
#[derive(serde::Deserialize)]
struct Delta<'a> {
    #[serde(borrow)]
    role: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    function_call: Option<&'a RawValue>,
}

/// Does the first choice (`choices` starts just after its `[`) stream output? A choice without
/// a `delta` (completions' `text`) does. A chat delta does when one of its output fields is
/// non-empty, or it has `content: ""` and no `role`. Only the delta object is parsed (serde
/// stops at its end, the values stay borrowed): this runs on every relayed event.
fn streams_output(choices: &[u8]) -> bool {
    let Some(at) = DELTA.find(choices) else {
        return true;
    };
    let rest = skip_ws(&choices[at + 7..]);
    let Some((b':', rest)) = rest.split_first() else {
        return false;
    };
    let Some(Ok(d)) = serde_json::Deserializer::from_slice(rest)
        .into_iter::<Delta<'_>>()
        .next()
    else {
        return false;
    };
    let output = [d.content, d.reasoning, d.tool_calls, d.function_call]
        .into_iter()
        .flatten()
        .any(|v| !is_empty_value(v.get().as_bytes()));
    let role = d.role.is_some_and(|r| r.get() != "null");
    output || (!role && d.content.is_some_and(|c| c.get() == "\"\""))
}

/// `null`, `""`, `[]` or `{}` (with any whitespace inside the brackets).
fn is_empty_value(v: &[u8]) -> bool {
    match v {
        b"null" | b"\"\"" => true,
        [b'[', inner @ .., b']'] | [b'{', inner @ .., b'}'] => skip_ws(inner).is_empty(),
        _ => false,
    }
}

fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b
        .iter()
        .take_while(|c| matches!(c, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    &b[n..]
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(reads: &[&[u8]]) -> Vec<DataKind> {
        let mut s = SseScanner::new();
        let mut out = Vec::new();
        for r in reads {
            s.feed(r, |d| out.push(d.kind));
        }
        s.finish(|d| out.push(d.kind));
        out
    }

    /// A line with no end stops the scan at the limit and gives its memory back; a line
    /// of exactly the limit, split over reads, still passes.
    #[test]
    fn an_endless_line_stops_at_the_limit() {
        let mut s = SseScanner::with_line_limit(1 << 20);
        let mut seen = 0;
        s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"", |_| {
            seen += 1
        });
        let junk = vec![b'a'; 256 * 1024];
        for _ in 0..3 {
            s.feed(&junk, |_| seen += 1);
            assert!(!s.overlong());
        }
        s.feed(&junk, |_| seen += 1);
        assert!(s.overlong(), "past 1 MiB");
        assert_eq!(s.carry.capacity(), 0, "the carried bytes are freed");
        s.feed(b"\"}}]}\n\ndata: [DONE]\n\n", |_| seen += 1);
        assert_eq!(seen, 0, "nothing is scanned after the violation");

        let mut s = SseScanner::with_line_limit(16);
        let mut kinds = Vec::new();
        s.feed(b"data: [DO", |l| kinds.push(l.kind));
        s.feed(b"NE]1234\n", |l| kinds.push(l.kind));
        assert!(!s.overlong());
        s.feed(b"data: 12345678901", |l| kinds.push(l.kind));
        assert!(s.overlong());
        assert_eq!(kinds, [DataKind::NoChoices]);
    }

    #[test]
    fn classifies_vllm_chunks() {
        use DataKind::*;
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\": [ ], \"usage\":{}}\n\n: queued\n\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n";
        assert_eq!(kinds(&[stream]), vec![NoOutput, NoChoices, Error, Done]);
    }

    /// vLLM 0.33's token events: output in the first choice's delta, or `content: ""` without a
    /// role; the opening role chunk and empty deltas are not tokens; completions chunks are.
    #[test]
    fn token_events_by_vllm_0_33() {
        let cases: &[(&str, DataKind)] = &[
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":null},"finish_reason":"stop"}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta":{"reasoning":"think"}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant","reasoning":"a \"q\" {x}","content":null}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[ ]}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta":{"function_call":{"name":"f"}}}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"delta":{"logprobs":{"content":[1]},"role":"assistant"}}]}"#,
                DataKind::NoOutput,
            ),
            (
                r#"{"choices":[{"delta" : { "role" : "assistant" , "content" : "x" }}]}"#,
                DataKind::Content,
            ),
            (
                r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#,
                DataKind::Content,
            ),
            (r#"{"choices":[{"index":0,"text":""}]}"#, DataKind::Content),
        ];
        for (payload, want) in cases {
            assert_eq!(classify(payload.as_bytes()), *want, "{payload}");
        }
    }

    #[test]
    fn any_split_gives_the_same_events() {
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"\xe6\x97\xa5\"}}]}\r\n\r\ndata:{\"choices\":[]}\r\n\r\ndata:[DONE]\r\n\r\n";
        let whole = kinds(&[stream]);
        assert_eq!(whole.len(), 3);
        for cut in 0..stream.len() {
            assert_eq!(
                kinds(&[&stream[..cut], &stream[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(kinds(&bytes), whole);
    }

    #[test]
    fn event_spans_cover_line_and_blank_line() {
        let chunk: &[u8] = b"data: {\"choices\":[{}]}\n\ndata: {\"choices\":[],\"usage\":{}}\r\n\r\ndata: [DONE]\n\n";
        let mut spans = Vec::new();
        SseScanner::new().feed(chunk, |l| spans.push((l.kind, l.event_span)));
        assert_eq!(
            spans[0].1.clone().map(|r| &chunk[r]),
            Some(&b"data: {\"choices\":[{}]}\n\n"[..])
        );
        assert_eq!(
            spans[1].1.clone().map(|r| &chunk[r]),
            Some(&b"data: {\"choices\":[],\"usage\":{}}\r\n\r\n"[..])
        );
        let mut s = SseScanner::new();
        s.feed(b"data: {\"cho", |_| {});
        s.feed(b"ices\":[]}\n\n", |l| assert!(l.event_span.is_none()));
    }

    #[test]
    fn final_line_without_newline_counts() {
        assert_eq!(kinds(&[b"data: [DONE]"]), vec![DataKind::Done]);
    }
}
