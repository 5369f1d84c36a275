//! The Timeline: monotonic instants stamped on every request, and the one definition of every
//! latency figure derived from them (TTFT, ITL, E2EL, TPOT and the gateway's own overhead).
//! The figures follow `vllm bench serve`; docs/metrics.md states them in words.

use std::time::{Duration, Instant};

use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::stream::{StreamMetrics, tpot};
use fleetgate_protocol::usage::{Usage, UsagePart};

/// The instants of one request through the gateway. Stamped only through its methods, each
/// named for the moment it records; the figures below derive from them.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// When the request's first bytes reached the host: the kernel's receive stamp
    /// (`rx_time`), where the platform gives one.
    arrived: Option<Instant>,
    /// Request head read.
    received: Instant,
    body_read: Option<Instant>,
    /// Admission granted (queue left); equal to `body_read` when the request did not wait.
    admitted: Option<Instant>,
    /// Request handed to the upstream connection.
    upstream_sent: Option<Instant>,
    /// Upstream response head received.
    upstream_first_byte: Option<Instant>,
    /// First token event read from upstream (streaming), or the response head
    /// (non-streaming).
    upstream_first_token: Option<Instant>,
    /// The request's last bytes written to the upstream socket, and the kernel's arrival stamp
    /// of the bytes that carried the first token (the head for non-streamed answers).
    upstream_wire: Option<(Instant, Instant)>,
    /// Response head handed to the client connection.
    client_first_byte: Option<Instant>,
    /// The frame holding the first token handed to the client connection.
    client_first_token: Option<Instant>,
    done: Option<Instant>,
    /// Event figures of the relayed stream, offsets from `received`.
    stream: StreamMetrics,
}

impl Timeline {
    pub fn start(received: Instant) -> Self {
        Self {
            arrived: None,
            received,
            body_read: None,
            admitted: None,
            upstream_sent: None,
            upstream_first_byte: None,
            upstream_first_token: None,
            upstream_wire: None,
            client_first_byte: None,
            client_first_token: None,
            done: None,
            stream: StreamMetrics::default(),
        }
    }

    pub fn received(&self) -> Instant {
        self.received
    }
    pub fn body_read(&self) -> Option<Instant> {
        self.body_read
    }
    pub fn admitted(&self) -> Option<Instant> {
        self.admitted
    }
    pub fn upstream_sent(&self) -> Option<Instant> {
        self.upstream_sent
    }
    pub fn upstream_first_byte(&self) -> Option<Instant> {
        self.upstream_first_byte
    }
    pub fn upstream_first_token(&self) -> Option<Instant> {
        self.upstream_first_token
    }
    pub fn client_first_token(&self) -> Option<Instant> {
        self.client_first_token
    }
    pub fn done(&self) -> Option<Instant> {
        self.done
    }
    pub fn stream(&self) -> &StreamMetrics {
        &self.stream
    }

    /// The kernel's arrival stamp of the request's first bytes.
    pub(crate) fn stamp_kernel_arrival(&mut self, at: Instant) {
        self.arrived = Some(at.min(self.received));
    }

    /// The upstream socket's stamps at the first token: request written, first token arrived.
    pub(crate) fn stamp_upstream_wire(
        &mut self,
        written: Option<Instant>,
        arrived: Option<Instant>,
    ) {
        if let (Some(w), Some(a)) = (written.or(self.upstream_sent), arrived)
            && self.upstream_wire.is_none()
        {
            self.upstream_wire = Some((w, a.max(w)));
        }
    }

    pub fn stamp_body_read(&mut self, at: Instant) {
        self.body_read = Some(at);
    }

    /// The request has its backend slot (`at` = `body_read` when it did not wait).
    pub fn stamp_admitted(&mut self, at: Instant) {
        self.admitted = Some(at);
    }

    pub fn stamp_upstream_sent(&mut self, at: Instant) {
        self.upstream_sent = Some(at);
    }

    pub fn stamp_upstream_first_byte(&mut self, at: Instant) {
        self.upstream_first_byte = Some(at);
    }

    /// A non-streamed answer: the head is its first token, upstream at `head_at`, and it
    /// reaches the client at `client_at`.
    pub fn stamp_whole_answer(&mut self, head_at: Instant, client_at: Instant) {
        self.upstream_first_token = Some(head_at);
        self.client_first_token = Some(client_at);
    }

    pub(crate) fn stamp_client_first_byte(&mut self, at: Instant) {
        self.client_first_byte = Some(at);
    }

    /// Frames were handed to the client connection at `at`: the first token's moment when
    /// they carried it (upstream saw a token and none was handed on before).
    pub(crate) fn stamp_delivered(&mut self, at: Instant) {
        if self.client_first_token.is_none() && self.upstream_first_token.is_some() {
            self.client_first_token = Some(at);
        }
    }

    /// One SSE data event read from upstream at `now` (`at`: its offset from `received`, the
    /// same for every event of one read). The first token event stamps the upstream first
    /// token: the one place it is stamped for streams. Returns the gap before this event when
    /// it is a token event that follows another (an ITL sample).
    pub fn on_upstream_event(
        &mut self,
        kind: DataKind,
        usage: Option<UsagePart>,
        now: Instant,
        at: Duration,
    ) -> Option<Duration> {
        let before = self.stream.content_events;
        self.stream.on_data(kind, usage, at);
        if self.stream.content_events == before {
            return None;
        }
        if self.upstream_first_token.is_none() {
            self.upstream_first_token = Some(now);
            return None;
        }
        self.stream.last_gap
    }

    /// Offset of `now` from `received` (event offsets in the stream figures).
    pub fn offset(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.received)
    }

    /// The usage object of a non-streamed body (none when it is implausible).
    pub(crate) fn set_usage(&mut self, usage: Option<Usage>) {
        match usage {
            Some(u) if !u.plausible() => {
                self.stream.implausible_usage = true;
                self.stream.usage = None;
            }
            _ => self.stream.usage = usage,
        }
    }

    /// An attempt that failed before the client had a byte is forgotten: the Timeline
    /// describes the attempt that answers.
    pub(crate) fn forget_attempt(&mut self) {
        self.upstream_first_token = None;
        self.upstream_wire = None;
        self.client_first_token = None;
    }

    /// The request leaves its pool for a fallback: what its attempts there stamped is
    /// forgotten (the queue wait stays: it is the request's).
    pub(crate) fn forget_upstream(&mut self) {
        self.upstream_sent = None;
        self.upstream_first_byte = None;
        self.forget_attempt();
    }

    /// The request ended at `at`; a second end changes nothing.
    pub fn stamp_done(&mut self, at: Instant) {
        if self.done.is_none() {
            self.done = Some(at);
        }
    }

    /// Stream figures, for building a Timeline outside the request path (benchmarks, tests).
    pub fn stream_mut(&mut self) -> &mut StreamMetrics {
        &mut self.stream
    }

    pub fn queue_wait(&self) -> Duration {
        match (self.body_read, self.admitted) {
            (Some(b), Some(a)) => a.saturating_duration_since(b),
            _ => Duration::ZERO,
        }
    }

    /// What a direct call would have seen: request written → first token.
    pub fn upstream_ttft(&self) -> Option<Duration> {
        Some(
            self.upstream_first_token?
                .saturating_duration_since(self.upstream_sent?),
        )
    }

    /// What the client saw: request received → first token handed to it.
    pub fn client_ttft(&self) -> Option<Duration> {
        Some(
            self.client_first_token?
                .saturating_duration_since(self.received),
        )
    }

    /// Gateway time before the request left for the backend, queue wait excluded.
    pub fn overhead_pre(&self) -> Option<Duration> {
        let sent = self.upstream_sent?;
        Some(
            sent.saturating_duration_since(self.received)
                .saturating_sub(self.queue_wait()),
        )
    }

    /// Gateway time between the first token arriving from upstream and reaching the client.
    pub fn overhead_relay(&self) -> Option<Duration> {
        Some(
            self.client_first_token?
                .saturating_duration_since(self.upstream_first_token?),
        )
    }

    /// The hop cost: what the gateway added to the first token's time as the host's kernel
    /// saw it on both sockets, queue wait excluded:
    /// (first token written to the client − request arrived) − (first token arrived from
    /// upstream − request written upstream) − queue wait. Unlike `overhead_total` it holds the
    /// time a request waits in the kernel before the gateway reads it. `None` without the
    /// kernel's stamps.
    pub fn hop(&self) -> Option<Duration> {
        let (written, first_arrived) = self.upstream_wire?;
        let client = self
            .client_first_token?
            .saturating_duration_since(self.arrived?);
        Some(
            client
                .saturating_sub(self.queue_wait())
                .saturating_sub(first_arrived.saturating_duration_since(written)),
        )
    }

    /// client TTFT − upstream TTFT − queue wait (= pre + relay).
    pub fn overhead_total(&self) -> Option<Duration> {
        Some(self.overhead_pre()? + self.overhead_relay()?)
    }

    /// End-to-end latency: to the last data event for streams, else to the end of the body.
    pub(crate) fn e2el(&self) -> Option<Duration> {
        self.stream
            .e2el()
            .or_else(|| Some(self.done?.saturating_duration_since(self.received)))
    }

    /// TPOT measured on the client side of the gateway.
    pub fn tpot(&self) -> Option<Duration> {
        let (tokens, _) = self.stream.output_tokens();
        tpot(self.client_ttft()?, self.e2el()?, tokens?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overhead_splits_into_pre_and_relay() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut t = Timeline::start(t0);
        t.body_read = Some(at(1));
        t.admitted = Some(at(11)); // 10 ms in a queue
        t.upstream_sent = Some(at(12));
        t.upstream_first_byte = Some(at(20));
        t.upstream_first_token = Some(at(100));
        t.client_first_token = Some(at(101));
        assert_eq!(t.queue_wait(), Duration::from_millis(10));
        assert_eq!(t.upstream_ttft(), Some(Duration::from_millis(88)));
        assert_eq!(t.client_ttft(), Some(Duration::from_millis(101)));
        assert_eq!(t.overhead_pre(), Some(Duration::from_millis(2)));
        assert_eq!(t.overhead_relay(), Some(Duration::from_millis(1)));
        // client TTFT − upstream TTFT − queue wait
        assert_eq!(t.overhead_total(), Some(Duration::from_millis(3)));
        assert_eq!(t.hop(), None, "no kernel stamps, no hop");

        // The request waited 2 ms in the kernel before it was read; upstream's first token
        // arrived 30 µs before the gateway read it, and the request left 20 µs after it was
        // handed to the upstream connection.
        t.stamp_kernel_arrival(t0 - Duration::from_millis(2));
        t.stamp_upstream_wire(
            Some(at(12) + Duration::from_micros(20)),
            Some(at(100) - Duration::from_micros(30)),
        );
        // (101 + 2) − 10 − (88 − 0.05) ms
        assert_eq!(t.hop(), Some(Duration::from_micros(5_050)));
        t.forget_attempt();
        assert_eq!(t.hop(), None);
    }
}
