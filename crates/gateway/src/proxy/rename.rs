//! The model's name in an answer, as the client wrote it. A client that names a pool by an
//! alias, or a pool whose backends serve the model under another name (`served_model_name`),
//! gets its own name back in `"model"` — in a whole JSON answer and in every SSE chunk — as
//! OpenAI clients compare it with what they sent. Only the bytes of the field change: chunks
//! are not parsed or re-serialised, and a request whose name needs no change pays nothing.
//!
//! The field is matched as the backends write it, `"model":"<served name>"` (compact JSON, as
//! vLLM and the simulator write it); a backend that writes `"model": "…"` with a space keeps
//! its own name in the answer. Inside a JSON string the same bytes cannot occur (its quotes
//! would be escaped), so only the field itself is ever replaced.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;

/// Rewrites `"model":"<served>"` to `"model":"<client's name>"` in a body read frame by frame.
#[derive(Clone)]
pub(super) struct Rename {
    field: Arc<Finder<'static>>,
    /// `"model":` and the client's name as a JSON string.
    to: Bytes,
    /// The end of the last frame when it could be the start of the field: held until the next
    /// frame says (never a whole SSE event: the field is in the middle of a line the client
    /// cannot use before the rest of it arrives).
    held: Option<Bytes>,
}

impl Rename {
    /// `None` when the client's name is not one JSON can carry (it came from JSON, so never).
    pub(super) fn new(field: Arc<Finder<'static>>, client_model: &str) -> Option<Self> {
        let mut to = b"\"model\":".to_vec();
        serde_json::to_writer(&mut to, client_model).ok()?;
        Some(Self {
            field,
            to: Bytes::from(to),
            held: None,
        })
    }

    /// The frame with the field renamed; bytes that may start a field split across frames are
    /// kept for the next call (or `finish`). The result may be empty.
    pub(super) fn apply(&mut self, data: Bytes) -> Bytes {
        let data = match self.held.take() {
            Some(h) => {
                let mut joined = BytesMut::with_capacity(h.len() + data.len());
                joined.extend_from_slice(&h);
                joined.extend_from_slice(&data);
                joined.freeze()
            }
            None => data,
        };
        let pattern = self.field.needle();
        let mut out: Option<BytesMut> = None;
        let mut last = 0;
        for at in self.field.find_iter(&data) {
            let o = out.get_or_insert_with(|| BytesMut::with_capacity(data.len() + 64));
            o.extend_from_slice(&data[last..at]);
            o.extend_from_slice(&self.to);
            last = at + pattern.len();
        }
        let keep = partial_prefix_at_end(&data[last..], pattern);
        let end = data.len() - keep;
        if keep > 0 {
            self.held = Some(data.slice(end..));
        }
        match out {
            None => data.slice(..end),
            Some(mut o) => {
                o.extend_from_slice(&data[last..end]);
                o.freeze()
            }
        }
    }

    /// `apply`, with `None` when everything is held (nothing to send yet).
    pub(super) fn pass(&mut self, data: Bytes) -> Option<Bytes> {
        Some(self.apply(data)).filter(|d| !d.is_empty())
    }

    /// What is still held at the end of the body (a field's start that never completed).
    pub(super) fn finish(&mut self) -> Option<Bytes> {
        self.held.take()
    }
}

/// The length of the longest proper prefix of `pattern` that `data` ends with.
fn partial_prefix_at_end(data: &[u8], pattern: &[u8]) -> usize {
    let longest = pattern.len().saturating_sub(1).min(data.len());
    (1..=longest)
        .rev()
        .find(|&k| data.ends_with(&pattern[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rename() -> Rename {
        let field = Arc::new(Finder::new(b"\"model\":\"Qwen/Qwen2.5-32B\"").into_owned());
        Rename::new(field, "qwen").unwrap()
    }

    const CHUNK: &str = "data: {\"id\":\"c1\",\"model\":\"Qwen/Qwen2.5-32B\",\"choices\":[]}\n\n";
    const RENAMED: &str = "data: {\"id\":\"c1\",\"model\":\"qwen\",\"choices\":[]}\n\n";

    #[test]
    fn renames_every_field_in_a_frame() {
        let mut r = rename();
        let two = format!("{CHUNK}{CHUNK}");
        assert_eq!(r.apply(Bytes::from(two)), format!("{RENAMED}{RENAMED}"));
        assert_eq!(r.finish(), None);
    }

    #[test]
    fn a_frame_without_the_field_passes_as_it_is() {
        let mut r = rename();
        let data = Bytes::from_static(b"data: [DONE]\n\n");
        let out = r.apply(data.clone());
        assert_eq!(out, data);
        assert_eq!(out.as_ptr(), data.as_ptr(), "not copied");
    }

    #[test]
    fn a_field_split_at_every_byte_is_renamed() {
        for cut in 1..CHUNK.len() {
            let mut r = rename();
            let mut got = r
                .apply(Bytes::copy_from_slice(&CHUNK.as_bytes()[..cut]))
                .to_vec();
            got.extend_from_slice(&r.apply(Bytes::copy_from_slice(&CHUNK.as_bytes()[cut..])));
            if let Some(rest) = r.finish() {
                got.extend_from_slice(&rest);
            }
            assert_eq!(String::from_utf8(got).unwrap(), RENAMED, "cut at {cut}");
        }
    }

    #[test]
    fn an_unfinished_field_start_is_given_back_at_the_end() {
        let mut r = rename();
        let out = r.apply(Bytes::from_static(b"{\"id\":1,\"model\":\"Qw"));
        assert_eq!(out, Bytes::from_static(b"{\"id\":1,"));
        assert_eq!(r.finish(), Some(Bytes::from_static(b"\"model\":\"Qw")));
    }
}
