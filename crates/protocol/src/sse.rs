//! Incremental SSE scanner: finds the `data:` lines of an event stream across arbitrary read
//! boundaries and has its dialect (`protocol::dialect`) read each payload just enough to time
//! it (token / no output / usage / error / clean end). It never copies a line that arrives
//! whole; only a line split across reads is carried over. `event:` lines are not read: every
//! dialect's payload names its own type.

use memchr::memchr;

use super::dialect::Dialect;
use super::event::DataKind;
use super::usage::UsagePart;

/// One `data:` line as the scanner saw it.
#[derive(Debug, Clone)]
pub struct DataLine<'a> {
    pub kind: DataKind,
    /// The usage this event reports, if any.
    pub usage: Option<UsagePart>,
    pub payload: &'a [u8],
    /// What a chat token event streamed, from the reading that classified it.
    pub streamed: crate::event::Streamed,
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
    pub(crate) fn with_line_limit(max_line: usize) -> Self {
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
        streamed: event.streamed,
        event_span,
    });
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
