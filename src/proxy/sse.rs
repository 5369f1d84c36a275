//! Incremental SSE scanner: finds the `data:` lines of an event stream across arbitrary read
//! boundaries and classifies each payload just enough to time it (content / usage / error /
//! done). It never copies a line that arrives whole; only a line split across reads is
//! carried over.

use std::sync::LazyLock;

use memchr::{memchr, memmem};

/// Searchers built once: `memmem::find` would build one per call.
static CHOICES: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"choices\""));
static ERROR: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"error\""));
pub(crate) static USAGE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// What a `data:` payload is, by the vLLM benchmark's reading of a chat/completions stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// A chunk with non-empty `choices`: a token event (TTFT and ITL are measured on these).
    Content,
    /// A chunk with `choices: []` (the usage chunk) or without choices.
    NoChoices,
    /// `{"error": ...}` sent inside the stream.
    Error,
    /// `[DONE]`.
    Done,
}

/// One `data:` line as the scanner saw it.
#[derive(Debug, Clone, Copy)]
pub struct DataLine<'a> {
    pub kind: DataKind,
    pub payload: &'a [u8],
}

/// Line splitter and classifier; one per stream, reused across reads.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// Bytes of a line whose end has not arrived yet.
    carry: Vec<u8>,
}

impl SseScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed one read's bytes; `on_data` is called for every `data:` line completed in it.
    pub fn feed(&mut self, mut chunk: &[u8], mut on_data: impl FnMut(DataLine<'_>)) {
        if !self.carry.is_empty() {
            match memchr(b'\n', chunk) {
                None => {
                    self.carry.extend_from_slice(chunk);
                    return;
                }
                Some(i) => {
                    self.carry.extend_from_slice(&chunk[..i]);
                    let line = std::mem::take(&mut self.carry);
                    handle_line(&line, &mut on_data);
                    // Keep the allocation for the next split line.
                    self.carry = line;
                    self.carry.clear();
                    chunk = &chunk[i + 1..];
                }
            }
        }
        while let Some(i) = memchr(b'\n', chunk) {
            handle_line(&chunk[..i], &mut on_data);
            chunk = &chunk[i + 1..];
        }
        if !chunk.is_empty() {
            self.carry.extend_from_slice(chunk);
        }
    }

    /// A line has started but its end has not arrived yet.
    pub fn has_partial_line(&self) -> bool {
        !self.carry.is_empty()
    }

    /// The stream ended: a final line without a newline still counts.
    pub fn finish(&mut self, on_data: impl FnMut(DataLine<'_>)) {
        if !self.carry.is_empty() {
            let line = std::mem::take(&mut self.carry);
            let mut on_data = on_data;
            handle_line(&line, &mut on_data);
        }
    }
}

fn handle_line(line: &[u8], on_data: &mut impl FnMut(DataLine<'_>)) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(rest) = line.strip_prefix(b"data:") else {
        return; // comments (`: queued`), `event:`, `id:`, blank separators
    };
    let payload = rest.strip_prefix(b" ").unwrap_or(rest);
    on_data(DataLine {
        kind: classify(payload),
        payload,
    });
}

/// Classify a data payload without parsing the JSON: look for the top-level markers only.
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
            Some((b'[', _)) => DataKind::Content,
            _ => DataKind::NoChoices,
        };
    }
    if ERROR.find(p).is_some() {
        return DataKind::Error;
    }
    DataKind::NoChoices
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

    #[test]
    fn classifies_vllm_chunks() {
        use DataKind::*;
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\": [ ], \"usage\":{}}\n\n: queued\n\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n";
        assert_eq!(kinds(&[stream]), vec![Content, NoChoices, Error, Done]);
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
    fn final_line_without_newline_counts() {
        assert_eq!(kinds(&[b"data: [DONE]"]), vec![DataKind::Done]);
    }
}
