//! The response relay: upstream body frames are handed to the client as they arrive, the same
//! `Bytes`, never buffered, merged or re-serialised. For SSE it scans each frame just enough to
//! stamp the first token and count content events, enforces the first-token / idle / total
//! timeouts, and turns a failure after the stream started into a final
//! `data: {"error":...}` event and `data: [DONE]` instead of a silently cut stream.
//!
//! Two splices, and only these: the client's name for the model in place of the served one
//! (`proxy::rename`; a field split across frames is held until the next frame completes it), and
//! the `system_fingerprint` of a usage chunk the gateway asked for and removes, put back into the
//! finish chunks (`fleetgate_protocol::fingerprint`). Every frame up to the first token leaves at
//! once; after it, the frames the upstream socket already holds leave in one write: the relay
//! drives the upstream connection itself (`pool::upstream_conn`), so "nothing more now" means the socket
//! is empty, never a timer. A new stored response's id is pinned to the backend that answered
//! (`proxy::pins`). A stream that ended cleanly gets nothing appended.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::pool::upstream_conn::UpstreamBody;
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tokio_util::sync::WaitForCancellationFutureOwned;

mod ready;
mod resume;
mod scan;
mod start;

pub(super) use resume::Kept;
pub(super) use start::start;

use super::error::{ApiError, TimeoutKind};
use super::exchange::Exchange;
use crate::config::Timeouts;
use crate::pool::InFlight;
use crate::queue::QueuedBody;
use fleetgate_protocol::Dialect;
use fleetgate_protocol::error::ErrorKind;
use fleetgate_protocol::resume::Cause;
use fleetgate_protocol::sse::SseScanner;
use ready::Ready;
use scan::{Scan, learn_whole, observe_first_token, scan_frame, timing_trailer};

pin_project! {
    /// The body type of every gateway response: a complete body, or a relayed upstream body.
    #[project = GatewayBodyProj]
    #[project_ref = GatewayBodyRef]
    pub(crate) enum GatewayBody {
        Full { data: Option<Bytes> },
        Relay { #[pin] relay: RelayBody },
        Queued { #[pin] queued: QueuedBody<RelayBody> },
    }
}

impl GatewayBody {
    pub(crate) fn full(b: impl Into<Bytes>) -> Self {
        GatewayBody::Full {
            data: Some(b.into()),
        }
    }
    pub(crate) fn queued(queued: QueuedBody<RelayBody>) -> Self {
        GatewayBody::Queued { queued }
    }

    pub(crate) fn relay(relay: RelayBody) -> Self {
        GatewayBody::Relay { relay }
    }
}

impl Body for GatewayBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project() {
            GatewayBodyProj::Full { data } => Poll::Ready(data.take().map(|b| Ok(Frame::data(b)))),
            GatewayBodyProj::Relay { relay } => relay.poll_frame(cx),
            GatewayBodyProj::Queued { queued } => queued.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GatewayBody::Full { data } => data.is_none(),
            GatewayBody::Relay { relay } => relay.is_end_stream(),
            GatewayBody::Queued { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GatewayBody::Full { data: Some(b) } => SizeHint::with_exact(b.len() as u64),
            GatewayBody::Full { data: None } => SizeHint::with_exact(0),
            GatewayBody::Relay { relay } => relay.size_hint(),
            GatewayBody::Queued { .. } => SizeHint::default(),
        }
    }
}

enum State {
    Relaying,
    /// A failure after the stream started: the error event still to send.
    Closing(Bytes),
    /// Upstream trailers, passed on after the data before them.
    Trailers(http::HeaderMap),
    /// The backend failed mid-answer: the rest comes from another (`resume`).
    Resuming,
    Ended,
}

pin_project! {
    pub(crate) struct RelayBody {
        #[pin]
        upstream: UpstreamBody,
        #[pin]
        timer: Sleep,
        sse: bool,
        dialect: Dialect,
        scanner: SseScanner,
        // A new stored response's id is learned from the answer (the backend holds it).
        pin: Option<super::pins::Learn>,
        state: State,
        sent_at: Instant,
        last_read: Instant,
        timeouts: Timeouts,
        ready: Ready,
        // Non-streaming bodies: the last two frames, where the `usage` object usually is, and
        // the first, where it is when the answer names it before its results (rerank).
        tail: [Option<Bytes>; 2],
        first_frame: Option<Bytes>,
        strip_usage: bool,
        itl: Option<prometheus::Histogram>,
        timing_trailer: bool,
        // The client's name for the model, back in the answer (`None`: it needs no change).
        rename: Option<Box<super::rename::Rename>>,
        // The end of the shutdown grace period: the stream ends with an error event.
        #[pin]
        closing: WaitForCancellationFutureOwned,
        grace: Duration,
        // A streamed background response: its id (once read), and what hands its work to a
        // watcher if the client leaves before the end.
        background: Option<Box<super::background::Handover>>,
        background_id: Option<String>,
        // A stream its pool resumes on another backend should its own fail mid-answer.
        resume: Option<Box<resume::Resume>>,
        // Declared before `ex` so the slot is released before the request is recorded.
        slot: InFlight,
        ex: Exchange,
    }

    impl PinnedDrop for RelayBody {
        // The client of a streamed background response left before its end: the backend goes
        // on, so its slot and its key's hold go to a watcher rather than being released.
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(handover) = this.background.take()
                && let Some(id) = this.background_id.take()
                && !this.ex.record.timeline.stream().done
            {
                let hold = this.ex.hold.take();
                handover.watch(id, this.slot.hand_over(), hold);
            }
        }
    }
}

impl RelayBody {
    fn deadline(&self) -> Instant {
        deadline(
            self.sent_at,
            self.last_read,
            self.sse,
            self.ex.record.timeline.upstream_first_token().is_some(),
            &self.timeouts,
        )
    }

    fn timeout_kind(&self, now: Instant) -> TimeoutKind {
        if now >= self.sent_at + self.timeouts.total {
            TimeoutKind::Total
        } else if self.sse && self.ex.record.timeline.upstream_first_token().is_none() {
            TimeoutKind::FirstToken
        } else {
            TimeoutKind::Idle
        }
    }

    fn limit_of(&self, kind: TimeoutKind) -> Duration {
        match kind {
            TimeoutKind::FirstToken => self.timeouts.first_token,
            TimeoutKind::Idle => self.timeouts.idle,
            TimeoutKind::Total => self.timeouts.total,
        }
    }
}

/// The instant the current timeout fires: before the first token of a stream the first-token
/// limit, after it the idle limit since the last read; never later than the total limit.
fn deadline(
    sent_at: Instant,
    last_read: Instant,
    sse: bool,
    first_token_seen: bool,
    t: &Timeouts,
) -> Instant {
    let total = sent_at + t.total;
    let soft = if sse && !first_token_seen {
        sent_at + t.first_token
    } else {
        last_read + t.idle
    };
    soft.min(total)
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if matches!(self.state, State::Resuming) {
                match self.as_mut().poll_resuming(cx) {
                    Some(out) => return out,
                    None => continue,
                }
            }
            if let Some(out) = self.as_mut().after_relaying() {
                return out;
            }
            let this = self.as_mut().project();
            if !this.ready.is_empty()
                && *this.sse
                && this.ex.record.timeline.client_first_token().is_none()
            {
                // A frame read with the head: it goes out with the head.
                return Poll::Ready(Some(Ok(Frame::data(self.as_mut().deliver()))));
            }
            let step = match this.upstream.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => self.as_mut().on_frame(frame),
                Poll::Ready(None) => self.as_mut().on_end(),
                Poll::Ready(Some(Err(e))) => self.as_mut().on_error(&e),
                Poll::Pending => match self.as_mut().on_pending() {
                    Some(out) => Some(out),
                    // Upstream has nothing now: is a timeout due?
                    None => self.as_mut().on_quiet(cx),
                },
            };
            if let Some(out) = step {
                return out;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, State::Ended) && self.ready.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            // (A renamed model changes the length: no exact size then.)
            State::Relaying if !self.sse && self.ready.is_empty() && self.rename.is_none() => {
                self.upstream.size_hint()
            }
            _ => SizeHint::default(),
        }
    }
}

/// What `poll_frame` returns; a step that gives `None` lets the loop go on.
type Out = Poll<Option<Result<Frame<Bytes>, std::io::Error>>>;

impl RelayBody {
    /// The states past relaying: the error event still to send, trailers, the end. `None`
    /// while relaying.
    fn after_relaying(self: Pin<&mut Self>) -> Option<Out> {
        let this = self.project();
        match std::mem::replace(this.state, State::Ended) {
            State::Ended => Some(Poll::Ready(None)),
            State::Closing(tail) => {
                // Frames read before the failure go first, in the same write.
                let out = match this.ready.take() {
                    Some(held) => {
                        let mut both = BytesMut::with_capacity(held.len() + tail.len());
                        both.extend_from_slice(&held);
                        both.extend_from_slice(&tail);
                        both.freeze()
                    }
                    None => tail,
                };
                this.ex.record.finish(Instant::now());
                Some(Poll::Ready(Some(Ok(Frame::data(out)))))
            }
            State::Trailers(t) => Some(Poll::Ready(Some(Ok(Frame::trailers(t))))),
            keep @ (State::Relaying | State::Resuming) => {
                *this.state = keep;
                None
            }
        }
    }

    /// A frame from upstream: scanned (SSE), gathered, and handed on at once up to the first
    /// token; after it, frames already read are gathered into one write.
    fn on_frame(mut self: Pin<&mut Self>, frame: Frame<Bytes>) -> Option<Out> {
        let this = self.as_mut().project();
        let now = Instant::now();
        *this.last_read = now;
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                // Trailers: after whatever was read before them.
                if let Ok(t) = frame.into_trailers() {
                    *this.state = State::Trailers(t);
                }
                if !this.ready.is_empty() {
                    return Some(Poll::Ready(Some(Ok(Frame::data(self.deliver())))));
                }
                return None;
            }
        };
        if *this.sse {
            if let Some(r) = this.resume.as_deref_mut() {
                // A continuation's events, made the first answer's.
                data = r.rewrite(data)?;
            }
            let had_first = this.ex.record.timeline.upstream_first_token().is_some();
            let scanned = scan_frame(
                this.scanner,
                &mut this.ex.record,
                data,
                now,
                Scan {
                    strip_usage: *this.strip_usage,
                    itl: this.itl.as_ref(),
                    backend: this.slot.backend(),
                    pin: this.pin,
                    learned: this.background.as_ref().map(|_| &mut *this.background_id),
                    capture: this.resume.as_deref_mut().and_then(|r| r.capture()),
                },
            );
            if !had_first && this.ex.record.timeline.upstream_first_token().is_some() {
                observe_first_token(this.slot, &mut this.ex.record, this.upstream.rx());
                // The timer is re-armed lazily, which only works for deadlines that move later;
                // the first token moves it from the first-token limit to the idle limit, which
                // is usually earlier, so it is re-armed here, once per stream.
                let idle = deadline(*this.sent_at, now, true, true, this.timeouts);
                this.timer.reset(idle.into());
            }
            if this.scanner.overlong() {
                // The backend broke the protocol: a line with no end, past the limit. What the
                // scanner carried is freed; the stream ends with an error event, and dropping
                // the upstream body closes the connection (the backend stops writing).
                this.ex.record.error = Some(ErrorKind::UpstreamProtocol);
                let err = ApiError::UpstreamLineTooLong {
                    backend: this.slot.backend().shown.to_string(),
                    limit: this.scanner.max_line(),
                };
                tracing::warn!(backend = %this.slot.backend().base, limit = this.scanner.max_line(), "backend sent an SSE line past the limit: stream ended");
                *this.state = State::Closing(err.sse_event(*this.dialect, true));
                return None;
            }
            // An event saying the engine died: what came before it goes out, then the answer
            // is resumed (or ends, naming why not).
            let failed = this
                .resume
                .as_deref_mut()
                .and_then(|r| r.capture.failed.take());
            if let Some((cause, partial)) = failed {
                if let Some(rest) = scanned.filter(|d| !d.is_empty())
                    && let Some(rest) = match this.rename.as_mut() {
                        Some(r) => r.pass(rest),
                        None => Some(rest),
                    }
                {
                    this.ready.push(rest);
                }
                let err = ApiError::UpstreamStreamFailed {
                    backend: this.slot.backend().shown.to_string(),
                    detail: format!("it said its engine failed ({})", cause.as_str()),
                };
                return self.fail(cause, err, partial);
            }
            match scanned {
                Some(rest) => data = rest,
                None => return None, // only the hidden usage event: nothing to send
            }
        }
        if let Some(r) = this.rename.as_mut() {
            // `None`: held, the start of a field the next frame completes.
            data = r.pass(data)?;
        }
        if !*this.sse {
            learn_whole(this.pin, &data);
            if this.first_frame.is_none() {
                *this.first_frame = Some(data.clone());
            }
            this.tail[0] = this.tail[1].replace(data.clone());
        }
        let full = !this.ready.push(data);
        // Up to the first token every frame of a stream leaves at once: TTFT is never traded
        // for fewer writes. After it, frames already read are gathered. A whole answer (no
        // SSE) is gathered from the start, so its end is read with its last bytes: the client
        // connection drops the body once the content length is written, and the request must
        // be finished by then (a tokenizer answer has no first token to stamp before).
        let first_token_unsent =
            *this.sse && this.ex.record.timeline.client_first_token().is_none();
        if full || first_token_unsent {
            return Some(Poll::Ready(Some(Ok(Frame::data(self.deliver())))));
        }
        None
    }

    /// Upstream's body ended: a stream without `[DONE]` is cut (an error event says so);
    /// a non-streamed body gives up its usage; what was gathered goes out.
    fn on_end(mut self: Pin<&mut Self>) -> Option<Out> {
        let this = self.as_mut().project();
        let now = Instant::now();
        if let Some(rest) = this.rename.as_mut().and_then(|r| r.finish()) {
            this.ready.push(rest);
        }
        if *this.sse {
            let tl = &mut this.ex.record.timeline;
            let at = tl.offset(now);
            let partial = this.scanner.has_partial_line();
            this.scanner.finish(|line| {
                tl.on_upstream_event(line.kind, line.usage, now, at);
            });
            if !tl.stream().done && !tl.stream().error {
                let err = ApiError::UpstreamStreamCut {
                    backend: this.slot.backend().shown.to_string(),
                };
                return self.fail(Cause::Closed, err, partial);
            }
        } else {
            this.ex
                .record
                .timeline
                .set_usage(fleetgate_protocol::stream::usage_in_answer(
                    this.first_frame.as_deref(),
                    this.tail,
                ));
            // A traced answer's finish reasons: in its first frame, else its last ones.
            if let Some(scope) = this.ex.record.otel.as_deref_mut().filter(|s| s.sampled()) {
                let dialect = *this.dialect;
                for frame in std::iter::once(this.first_frame.as_deref())
                    .chain(this.tail.iter().map(|t| t.as_deref()))
                    .flatten()
                {
                    fleetgate_protocol::finish::reasons_in(dialect, frame, |r| {
                        scope.finish_reason(r);
                    });
                    if scope.has_finish_reasons() {
                        break;
                    }
                }
            }
        }
        if this.ready.is_empty() {
            let trailer = timing_trailer(*this.timing_trailer, &this.ex.record);
            this.ex.record.finish(now);
            if let Some(t) = trailer {
                *this.state = State::Trailers(t);
                return None;
            }
            return Some(Poll::Ready(None));
        }
        // Deliver what was read; the next poll ends the body (after the trailer, if any).
        let out = self.as_mut().deliver();
        let this = self.project();
        let now = Instant::now();
        *this.state = match timing_trailer(*this.timing_trailer, &this.ex.record) {
            Some(t) => State::Trailers(t),
            None => State::Ended,
        };
        this.ex.record.finish(now);
        Some(Poll::Ready(Some(Ok(Frame::data(out)))))
    }

    /// Upstream failed after the head: an error event for a stream, an I/O error otherwise.
    fn on_error(self: Pin<&mut Self>, e: &std::io::Error) -> Option<Out> {
        if self.answered() {
            return self.end_answered();
        }
        let err = ApiError::UpstreamStreamFailed {
            backend: self.slot.backend().shown.to_string(),
            detail: e.to_string(),
        };
        if self.sse {
            let partial = self.scanner.has_partial_line();
            return self.fail(Cause::Closed, err, partial);
        }
        let this = self.project();
        this.ex.record.error = Some(ErrorKind::UpstreamStreamError);
        this.ex.record.finish(Instant::now());
        Some(Poll::Ready(Some(Err(std::io::Error::other(err.message())))))
    }

    /// Nothing more right now: what was gathered goes out. The upstream connection is driven
    /// by this poll, so "nothing more" means its socket has nothing more: nothing is ever held
    /// waiting for bytes that have not arrived. `None`: nothing gathered.
    fn on_pending(self: Pin<&mut Self>) -> Option<Out> {
        if self.ready.is_empty() {
            return None;
        }
        Some(Poll::Ready(Some(Ok(Frame::data(self.deliver())))))
    }

    /// Upstream is quiet: pending until the current timeout; when it fires, an error event
    /// for a stream, a timed-out I/O error otherwise.
    fn on_quiet(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Option<Out> {
        if self.as_mut().project().closing.poll(cx).is_ready() {
            return self.on_closing();
        }
        if self.as_mut().project().timer.poll(cx).is_pending() {
            return Some(Poll::Pending);
        }
        let deadline = self.deadline();
        let now = Instant::now();
        if now < deadline {
            // Data arrived since the timer was armed: re-arm lazily (no reset per chunk).
            self.as_mut().project().timer.reset(deadline.into());
            return None;
        }
        if self.answered() {
            return self.end_answered();
        }
        let kind = self.timeout_kind(now);
        if kind == TimeoutKind::Idle
            && self
                .resume
                .as_deref()
                .is_some_and(|r| r.stall_pending(&self.timeouts))
        {
            // The stall limit: resumed elsewhere, or the idle limit waited out.
            return self.stalled();
        }
        let limit = self.limit_of(kind);
        let err = ApiError::UpstreamTimeout {
            backend: self.slot.backend().shown.to_string(),
            kind,
            after_ms: limit.as_millis(),
        };
        if self.sse {
            let partial = self.scanner.has_partial_line();
            return self.fail(Cause::Stalled, err, partial);
        }
        let this = self.project();
        this.ex.record.error = Some(ErrorKind::UpstreamTimeout);
        *this.state = State::Ended;
        this.ex.record.finish(now);
        Some(Poll::Ready(Some(Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            err.message(),
        )))))
    }

    /// The shutdown grace period ended with the stream still open: a stream ends with an error
    /// event and `[DONE]` (then the chunked terminator), a whole answer is cut; the record says
    /// `shutdown`, not that the client left.
    fn on_closing(self: Pin<&mut Self>) -> Option<Out> {
        if self.answered() {
            return self.end_answered();
        }
        let this = self.project();
        this.ex.record.error = Some(ErrorKind::Shutdown);
        let err = ApiError::Shutdown {
            grace_ms: this.grace.as_millis(),
        };
        if *this.sse {
            let partial = this.scanner.has_partial_line();
            *this.state = State::Closing(err.sse_event(*this.dialect, partial));
            return None;
        }
        *this.state = State::Ended;
        this.ex.record.finish(Instant::now());
        Some(Poll::Ready(Some(Err(std::io::Error::other(err.message())))))
    }

    /// A stream whose terminal event has been read is a complete answer: whatever the backend
    /// does after it (fails, stalls, sends more) is not the client's concern.
    fn answered(&self) -> bool {
        self.sse && self.ex.record.timeline.stream().done
    }

    /// End a complete stream quietly: what was gathered goes out, then the body ends.
    fn end_answered(mut self: Pin<&mut Self>) -> Option<Out> {
        let this = self.as_mut().project();
        *this.state = State::Ended;
        if this.ready.is_empty() {
            this.ex.record.finish(Instant::now());
            return Some(Poll::Ready(None));
        }
        Some(Poll::Ready(Some(Ok(Frame::data(self.deliver())))))
    }

    /// Hand the gathered frames to the client connection, stamping the first token. Once the
    /// stream's terminal event (`[DONE]`, `response.completed`, `message_stop`) is handed on,
    /// the answer is complete: a client that hangs up on reading it (Codex does) has not left
    /// early, even if the backend's end of body is still on its way.
    fn deliver(self: Pin<&mut Self>) -> Bytes {
        let this = self.project();
        let out = this.ready.take().unwrap_or_default();
        let now = Instant::now();
        let tl = &mut this.ex.record.timeline;
        tl.stamp_delivered(now);
        if tl.stream().done {
            this.ex.record.finish(now);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetgate_protocol::event::DataKind;

    #[test]
    fn error_tail_parses_as_one_error_event() {
        let tail = ApiError::UpstreamStreamFailed {
            backend: "http://b:1".into(),
            detail: "boom".into(),
        }
        .sse_event(Dialect::Chat, true);
        let mut scanner = SseScanner::new();
        scanner.feed(b"data: {\"choi", |_| {});
        let mut kinds = Vec::new();
        scanner.feed(&tail, |l| kinds.push(l.kind));
        // The half line is closed (it is not a valid event), then error, then [DONE].
        assert_eq!(
            &kinds[kinds.len() - 2..],
            &[DataKind::Error, DataKind::Done]
        );
    }
}
