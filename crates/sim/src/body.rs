//! Response bodies: whole buffers and the token stream, with optional byte capture for tests.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};

use super::agents::{MessagesFrames, ResponsesFrames, Store};
use super::args::StreamFault;
use super::audio::AudioFrames;
use super::engine::SeqHandle;
use super::frames::{self, FrameWriter};
use super::stats::SimStats;

/// What vLLM 0.32 says when its engine core died (`vllm.v1.engine.exceptions.EngineDeadError`).
pub(crate) const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// Why a body ended abnormally; hyper turns it into an aborted connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SimBodyError {
    #[error("injected fault: connection dropped after {0} content chunks")]
    InjectedDrop(u32),
}

/// Copies of the bytes sent, stored in `SimStats` under the request's `x-request-id`.
pub(crate) struct Capture {
    stats: Arc<SimStats>,
    key: Option<String>,
    sent: BytesMut,
}

impl Capture {
    /// `None` unless capture is on; a request without an id is stored under its generated id.
    pub(crate) fn new(stats: &Arc<SimStats>, key: String) -> Option<Self> {
        stats.capturing().then(|| Self {
            stats: stats.clone(),
            key: Some(key),
            sent: BytesMut::new(),
        })
    }

    fn record(&mut self, b: &[u8]) {
        self.sent.extend_from_slice(b);
    }

    fn store(&mut self) {
        if let Some(key) = self.key.take() {
            let sent = std::mem::take(&mut self.sent).freeze();
            self.stats.store_capture(key, sent);
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.store();
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Events before the first token (a Responses stream's `response.created`).
    Start,
    Role,
    Tokens,
    Usage,
    ErrorEvent,
    Done,
    End,
}

/// Who writes a stream's frames: chat and completions chunks, or the agents' protocols.
pub(crate) enum Frames {
    Chat(FrameWriter),
    Responses(Box<ResponsesFrames>, Option<Arc<Store>>),
    Messages(MessagesFrames),
    /// Speech-to-text chunks (`sim::audio`).
    Audio(AudioFrames),
}

/// The SSE token stream of one request.
pub(crate) struct TokenStream {
    generation: SeqHandle,
    frames: Frames,
    phase: Phase,
    include_usage: bool,
    fault: Option<StreamFault>,
    /// The last token ends the sequence (`stop`), rather than reaching the limit (`length`).
    natural_end: bool,
    /// Set once hyper has had a chance to flush before an injected drop.
    drop_flushed: bool,
    capture: Option<Capture>,
}

impl TokenStream {
    pub(crate) fn new(
        generation: SeqHandle,
        frames: Frames,
        with_role_chunk: bool,
        include_usage: bool,
        fault: Option<StreamFault>,
        capture: Option<Capture>,
    ) -> Self {
        let phase = match &frames {
            Frames::Responses(..) => Phase::Start,
            Frames::Messages(_) => Phase::Role,
            Frames::Chat(_) if with_role_chunk => Phase::Role,
            Frames::Chat(_) | Frames::Audio(_) => Phase::Tokens,
        };
        Self {
            generation,
            frames,
            phase,
            include_usage,
            fault,
            natural_end: false,
            drop_flushed: false,
            capture,
        }
    }

    /// The answer ends at its end of sequence, not at its limit.
    pub(crate) fn ending(mut self, natural: bool) -> Self {
        self.natural_end = natural;
        self
    }

    fn next_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, SimBodyError>>> {
        loop {
            match self.phase {
                Phase::Start => {
                    self.phase = Phase::Role;
                    if let Frames::Responses(f, _) = &mut self.frames {
                        return Poll::Ready(Some(Ok(f.start())));
                    }
                }
                Phase::Role => {
                    ready!(self.generation.poll_first(cx));
                    self.phase = Phase::Tokens;
                    let first = match &mut self.frames {
                        Frames::Chat(f) => f.role(),
                        Frames::Responses(f, _) => f.first(),
                        Frames::Messages(f) => f.first(),
                        // (Its stream has no role chunk: it starts at the tokens.)
                        Frames::Audio(_) => continue,
                    };
                    return Poll::Ready(Some(Ok(first)));
                }
                Phase::Tokens => {
                    let sent = self.generation.emitted();
                    match self.fault {
                        Some(StreamFault::Drop(k)) if sent == k && !self.generation.is_last() => {
                            // hyper drops its unflushed write buffer when a body fails, so the
                            // client would never see the K chunks. Yielding once makes hyper flush
                            // them first; the abort follows on the next poll.
                            if !self.drop_flushed {
                                self.drop_flushed = true;
                                cx.waker().wake_by_ref();
                                return Poll::Pending;
                            }
                            self.generation.fail_injected();
                            self.phase = Phase::End;
                            return Poll::Ready(Some(Err(SimBodyError::InjectedDrop(k))));
                        }
                        Some(StreamFault::Stall(k)) if sent == k && !self.generation.is_last() => {
                            // Never woken: the body hangs until the client leaves.
                            return Poll::Pending;
                        }
                        Some(StreamFault::EngineDead(k))
                            if sent == k && !self.generation.is_last() =>
                        {
                            self.generation.fail_injected();
                            self.phase = Phase::ErrorEvent;
                            continue;
                        }
                        _ => {}
                    }
                    let Some(text) = ready!(self.generation.poll_token(cx)) else {
                        self.phase = match self.frames {
                            Frames::Chat(_) | Frames::Audio(_) => Phase::Done,
                            _ => Phase::End,
                        };
                        continue;
                    };
                    let last = self.generation.is_last();
                    if last {
                        self.generation.finish();
                    }
                    let g = &self.generation;
                    let cut = !self.natural_end;
                    let frame = match &mut self.frames {
                        Frames::Chat(f) => {
                            let finish = last.then_some(if cut { "length" } else { "stop" });
                            self.phase = match (last, self.include_usage) {
                                (true, true) => Phase::Usage,
                                (true, false) => Phase::Done,
                                (false, _) => Phase::Tokens,
                            };
                            f.token(text, finish, !self.include_usage)
                        }
                        Frames::Audio(f) => {
                            let finish = last.then_some(if cut { "length" } else { "stop" });
                            self.phase = match (last, self.include_usage) {
                                (true, true) => Phase::Usage,
                                (true, false) => Phase::Done,
                                (false, _) => Phase::Tokens,
                            };
                            f.token(text, finish)
                        }
                        // The closing events go out with the last token, as vLLM's do.
                        Frames::Responses(f, store) => {
                            let mut out = BytesMut::from(&f.token(text)[..]);
                            if last {
                                out.extend_from_slice(&f.finish(
                                    g.prompt_tokens,
                                    g.emitted(),
                                    true,
                                ));
                                if let Some(store) = store {
                                    store.put(&f.object);
                                    if let Some(log) = &f.log {
                                        store.events(&f.object.id, log.clone().freeze());
                                    }
                                }
                                self.phase = Phase::End;
                            }
                            out.freeze()
                        }
                        Frames::Messages(f) => {
                            let mut out = BytesMut::from(&f.token(text)[..]);
                            if last {
                                out.extend_from_slice(&f.finish(g.emitted(), cut));
                                self.phase = Phase::End;
                            }
                            out.freeze()
                        }
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Phase::Usage => {
                    self.phase = Phase::Done;
                    let g = &self.generation;
                    match &mut self.frames {
                        Frames::Chat(f) => {
                            return Poll::Ready(Some(Ok(f.usage(g.prompt_tokens, g.emitted()))));
                        }
                        Frames::Audio(f) => return Poll::Ready(Some(Ok(f.usage()))),
                        Frames::Responses(..) | Frames::Messages(_) => {}
                    }
                }
                Phase::ErrorEvent => {
                    // vLLM 0.32's words when its engine core dies mid-answer (EngineDeadError,
                    // sent as an InternalServerError event, then `[DONE]` on chat).
                    let msg = ENGINE_DEAD;
                    let (frame, next) = match &mut self.frames {
                        Frames::Chat(_) | Frames::Audio(_) => {
                            (frames::error_event(msg), Phase::Done)
                        }
                        Frames::Responses(f, _) => (f.error(msg), Phase::End),
                        Frames::Messages(f) => (f.error(msg), Phase::End),
                    };
                    self.phase = next;
                    return Poll::Ready(Some(Ok(frame)));
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    return Poll::Ready(Some(Ok(Bytes::from_static(frames::DONE))));
                }
                Phase::End => return Poll::Ready(None),
            }
        }
    }
}

/// Every response body the sim sends.
pub(crate) enum SimBody {
    Full(Option<Bytes>),
    Stream(Box<TokenStream>),
    /// A stream generated by a task of its own, read from its channel: it runs to its end
    /// whether or not the client stays.
    Detached(tokio::sync::mpsc::Receiver<Result<Bytes, SimBodyError>>),
}

impl SimBody {
    pub(crate) fn empty() -> Self {
        SimBody::Full(None)
    }

    /// A complete body; captured at once since it is already final.
    pub(crate) fn full(b: impl Into<Bytes>, capture: Option<Capture>) -> Self {
        let b = b.into();
        if let Some(mut c) = capture {
            c.record(&b);
            c.store();
        }
        SimBody::Full((!b.is_empty()).then_some(b))
    }
}

impl SimBody {
    /// `body` generated by a task of its own (`running` gets its handle, for a cancel).
    pub(crate) fn detached(body: SimBody, running: impl FnOnce(tokio::task::AbortHandle)) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let task = tokio::spawn(async move {
            use http_body_util::BodyExt;
            let mut body = std::pin::pin!(body);
            while let Some(frame) = body.frame().await {
                let data = frame.map(|f| f.into_data().unwrap_or_default());
                // The client may have left: the generation goes on regardless.
                let _ = tx.send(data).await;
            }
        });
        running(task.abort_handle());
        SimBody::Detached(rx)
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = SimBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, SimBodyError>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Detached(rx) => rx
                .poll_recv(cx)
                .map(|next| next.map(|r| r.map(Frame::data))),
            SimBody::Stream(s) => {
                let next = ready!(s.next_frame(cx));
                if let Some(c) = &mut s.capture {
                    if let Some(Ok(b)) = &next {
                        c.record(b);
                    }
                    // Store with the final frame, before the client can have read it.
                    if s.phase == Phase::End {
                        c.store();
                    }
                }
                Poll::Ready(next.map(|r| r.map(Frame::data)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            SimBody::Full(b) => b.is_none(),
            SimBody::Stream(s) => s.phase == Phase::End,
            SimBody::Detached(rx) => rx.is_closed() && rx.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            SimBody::Stream(_) | SimBody::Detached(_) => SizeHint::default(),
        }
    }
}
