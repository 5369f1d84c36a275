//! The body of a stream that waits in the admission queue: the response head goes out at
//! once, `: queued` SSE comments keep the connection alive while the request waits, then the
//! backend's stream takes over (or a final error event ends it). Generic over the relayed body
//! so the queue does not depend on the proxy.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame};
use pin_project_lite::pin_project;
use tokio::time::Sleep;

/// How a queued stream continues once its wait is over.
pub(crate) enum Continued<B> {
    /// The backend's stream, relayed.
    Relay(Pin<Box<B>>),
    /// A final error event and `[DONE]`.
    Tail(Bytes),
}

type Rest<B> = Pin<Box<dyn Future<Output = Continued<B>> + Send>>;

static QUEUED_COMMENT: &[u8] = b": queued\n\n";

pin_project! {
    /// The body of a stream that waits in the admission queue: `: queued` comment lines (the
    /// first at once, then every `interval`) while `rest` waits for a backend slot and sends
    /// the request; then the backend's stream, or an error event.
    pub(crate) struct QueuedBody<B> {
        rest: Option<Rest<B>>,
        #[pin]
        tick: Sleep,
        interval: Duration,
        first_sent: bool,
        relay: Option<Pin<Box<B>>>,
        tail: Option<Bytes>,
    }
}

impl<B> QueuedBody<B> {
    pub(crate) fn new(rest: Rest<B>, interval: Duration) -> Self {
        Self {
            rest: Some(rest),
            tick: tokio::time::sleep(interval),
            interval,
            first_sent: false,
            relay: None,
            tail: None,
        }
    }
}

impl<B: Body<Data = Bytes, Error = std::io::Error>> Body for QueuedBody<B> {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut this = self.project();
        if let Some(relay) = this.relay.as_mut() {
            return relay.as_mut().poll_frame(cx);
        }
        if let Some(tail) = this.tail.take() {
            return Poll::Ready(Some(Ok(Frame::data(tail))));
        }
        let Some(rest) = this.rest.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(next) = rest.as_mut().poll(cx) {
            *this.rest = None;
            match next {
                Continued::Relay(mut relay) => {
                    let frame = relay.as_mut().poll_frame(cx);
                    *this.relay = Some(relay);
                    return frame;
                }
                Continued::Tail(tail) => return Poll::Ready(Some(Ok(Frame::data(tail)))),
            }
        }
        if !*this.first_sent {
            *this.first_sent = true;
            let at = Instant::now() + *this.interval;
            this.tick.as_mut().reset(at.into());
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(QUEUED_COMMENT)))));
        }
        match this.tick.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let at = Instant::now() + *this.interval;
                this.tick.as_mut().reset(at.into());
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(QUEUED_COMMENT)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
