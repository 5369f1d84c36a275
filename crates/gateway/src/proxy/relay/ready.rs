//! The frames the relay holds while the client's write is pending.

use bytes::{Bytes, BytesMut};

/// Frames read from upstream and not yet handed on. One frame is kept as it came (no copy);
/// frames that arrive while it waits for its write are appended behind it.
#[derive(Default)]
pub(super) struct Ready {
    first: Option<Bytes>,
    more: Option<BytesMut>,
}

/// Most bytes gathered for one write; past it they go at once.
const MAX_GATHER: usize = 32 * 1024;

impl Ready {
    pub(super) fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// Add a frame; false when enough is gathered to write now.
    pub(super) fn push(&mut self, data: Bytes) -> bool {
        match (&self.first, &mut self.more) {
            (None, _) => self.first = Some(data),
            (Some(first), None) => {
                let mut buf = BytesMut::with_capacity((first.len() + data.len()) * 4);
                buf.extend_from_slice(first);
                buf.extend_from_slice(&data);
                self.more = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&data),
        }
        self.len() < MAX_GATHER
    }

    pub(super) fn len(&self) -> usize {
        match (&self.first, &self.more) {
            (_, Some(b)) => b.len(),
            (Some(f), None) => f.len(),
            (None, None) => 0,
        }
    }

    /// Everything gathered, leaving it empty. A single frame is the upstream's own `Bytes`.
    pub(super) fn take(&mut self) -> Option<Bytes> {
        let first = self.first.take()?;
        Some(match self.more.take() {
            Some(b) => b.freeze(),
            None => first,
        })
    }
}
