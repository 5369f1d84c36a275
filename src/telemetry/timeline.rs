//! The Timeline: monotonic instants stamped on every request, and the one definition of every
//! latency figure derived from them (TTFT, ITL, E2EL, TPOT and the gateway's own overhead).
//! The figures follow `vllm bench serve`; docs/metrics.md states them in words.

use std::time::{Duration, Instant};

use crate::protocol::sse::DataKind;
use crate::protocol::usage::UsagePart;

pub use crate::protocol::usage::Usage;

/// Where the output-token count of a request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// The backend's own `usage` object.
    Backend,
    /// No usage was reported: the count of content events stands in for it.
    ContentEvents,
    /// Nothing to count (no body, or not a completion).
    None,
}

impl UsageSource {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageSource::Backend => "backend",
            UsageSource::ContentEvents => "content_events",
            UsageSource::None => "none",
        }
    }
}

/// Per-event figures of one SSE stream, as offsets from the moment the request started
/// (for the gateway: `received`; for the bench: the moment the request was sent).
#[derive(Debug, Clone, Default)]
pub struct StreamMetrics {
    /// First and last token events (`DataKind::Content`): TTFT and the end of E2EL.
    pub first_content: Option<Duration>,
    pub last_content: Option<Duration>,
    /// Last data event that is not `[DONE]` (the usage event included).
    pub last_data: Option<Duration>,
    /// Token events (the opening role chunk and the usage event are not).
    pub content_events: u32,
    /// The gap before the latest content event (none for the first).
    pub last_gap: Option<Duration>,
    pub itl_sum: Duration,
    pub itl_max: Duration,
    /// Gaps by power-of-two microseconds (bucket i: [2^i, 2^(i+1)) µs), for a per-request p99
    /// without keeping every gap.
    pub itl_buckets: [u16; ITL_BUCKETS],
    pub usage: Option<Usage>,
    /// An in-stream `{"error": ...}` event was seen.
    pub error: bool,
    pub done: bool,
    /// The backend reported a token count no request can have (`Usage::plausible`): its
    /// usage is treated as none for the whole request.
    pub implausible_usage: bool,
}

pub const ITL_BUCKETS: usize = 24;

impl StreamMetrics {
    /// Account for one `data:` line seen at `at`, with the usage its dialect found in it.
    pub fn on_data(&mut self, kind: DataKind, usage: Option<UsagePart>, at: Duration) {
        // The stream ended at its terminal event: what a backend sends after it is not part
        // of the answer (its tokens and usage are not counted).
        if self.done {
            return;
        }
        match kind {
            DataKind::Content => {
                if let Some(prev) = self.last_content {
                    let gap = at.saturating_sub(prev);
                    self.itl_sum += gap;
                    self.itl_max = self.itl_max.max(gap);
                    self.last_gap = Some(gap);
                    let us = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX).max(1);
                    let b = (63 - us.leading_zeros() as usize).min(ITL_BUCKETS - 1);
                    self.itl_buckets[b] = self.itl_buckets[b].saturating_add(1);
                } else {
                    self.first_content = Some(at);
                }
                self.last_content = Some(at);
                self.content_events += 1;
                self.last_data = Some(at);
            }
            DataKind::NoChoices | DataKind::NoOutput => self.last_data = Some(at),
            DataKind::Error => {
                self.last_data = Some(at);
                self.error = true;
            }
            DataKind::Done => self.done = true,
        }
        // vLLM's `continuous_usage_stats` puts usage on every chunk; the last one wins. An
        // Anthropic `message_delta` names only the output count: the input count stays.
        if let Some(u) = usage {
            self.take_usage(u);
        }
    }

    /// Fold in one usage part, unless it (or an earlier one) is implausible: then the request
    /// has no usage at all.
    fn take_usage(&mut self, part: UsagePart) {
        if self.implausible_usage {
            return;
        }
        if !part.plausible() {
            self.implausible_usage = true;
            self.usage = None;
            return;
        }
        part.apply(&mut self.usage);
    }

    /// Time to first token: the first token event.
    pub fn ttft(&self) -> Option<Duration> {
        self.first_content
    }

    /// End-to-end latency: to the last token event (vLLM 0.33: the usage event and the
    /// events after the last token do not count).
    pub fn e2el(&self) -> Option<Duration> {
        self.last_content
    }

    /// Mean gap between consecutive content events.
    pub fn itl_mean(&self) -> Option<Duration> {
        let gaps = self.content_events.checked_sub(1).filter(|n| *n > 0)?;
        Some(self.itl_sum / gaps)
    }

    /// p99 of the gaps, to the power-of-two bucket (never above the largest gap).
    pub fn itl_p99(&self) -> Option<Duration> {
        let gaps = u64::from(self.content_events.checked_sub(1).filter(|n| *n > 0)?);
        let rank = (gaps * 99).div_ceil(100);
        let mut seen = 0u64;
        for (i, n) in self.itl_buckets.iter().enumerate() {
            seen += u64::from(*n);
            if seen >= rank {
                let upper = Duration::from_micros(1u64 << (i + 1));
                return Some(upper.min(self.itl_max));
            }
        }
        Some(self.itl_max)
    }

    pub fn itl_max(&self) -> Option<Duration> {
        (self.content_events > 1).then_some(self.itl_max)
    }

    /// Output tokens and where the number came from.
    pub fn output_tokens(&self) -> (Option<u64>, UsageSource) {
        match self.usage {
            Some(u) => (Some(u.completion_tokens), UsageSource::Backend),
            None if self.content_events > 0 => (
                Some(u64::from(self.content_events)),
                UsageSource::ContentEvents,
            ),
            None => (None, UsageSource::None),
        }
    }

    /// TPOT = (E2EL − TTFT) / (output tokens − 1); undefined for fewer than two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let (tokens, _) = self.output_tokens();
        tpot(self.ttft()?, self.e2el()?, tokens?)
    }
}

/// The last `"usage": {...}` object of a non-streaming body, from its last two frames (the
/// object closes the body, so it lies there).
pub fn usage_in_tail(tail: &[Option<bytes::Bytes>; 2]) -> Option<Usage> {
    let last = tail[1].as_ref()?;
    if let Some(u) = usage_in(last) {
        return Some(u);
    }
    let prev = tail[0].as_ref()?;
    let mut both = Vec::with_capacity(prev.len() + last.len());
    both.extend_from_slice(prev);
    both.extend_from_slice(last);
    usage_in(&both)
}

/// The usage of a whole (non-streaming) answer: at its end (`usage_in_tail`), else in its
/// first frame (a rerank answer names it before its results).
pub fn usage_in_answer(first: Option<&[u8]>, tail: &[Option<bytes::Bytes>; 2]) -> Option<Usage> {
    usage_in_tail(tail).or_else(|| usage_in(first?))
}

/// The last `"usage": {...}` object in `body`, in either protocol's words.
pub fn usage_in(body: &[u8]) -> Option<Usage> {
    crate::protocol::usage::usage_in(body).map(UsagePart::whole)
}

pub fn tpot(ttft: Duration, e2el: Duration, output_tokens: u64) -> Option<Duration> {
    let steps = output_tokens.checked_sub(1).filter(|n| *n > 0)?;
    let steps = u32::try_from(steps).ok()?;
    Some(e2el.saturating_sub(ttft) / steps)
}

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
    pub fn client_first_byte(&self) -> Option<Instant> {
        self.client_first_byte
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
    pub fn stamp_kernel_arrival(&mut self, at: Instant) {
        self.arrived = Some(at.min(self.received));
    }

    /// The upstream socket's stamps at the first token: request written, first token arrived.
    pub fn stamp_upstream_wire(&mut self, written: Option<Instant>, arrived: Option<Instant>) {
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

    pub fn stamp_client_first_byte(&mut self, at: Instant) {
        self.client_first_byte = Some(at);
    }

    /// Frames were handed to the client connection at `at`: the first token's moment when
    /// they carried it (upstream saw a token and none was handed on before).
    pub fn stamp_delivered(&mut self, at: Instant) {
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
    pub fn set_usage(&mut self, usage: Option<Usage>) {
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
    pub fn forget_attempt(&mut self) {
        self.upstream_first_token = None;
        self.upstream_wire = None;
        self.client_first_token = None;
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
    pub fn e2el(&self) -> Option<Duration> {
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
    fn usage_of_a_non_streaming_body() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"the usage field"}}],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5},"prompt_logprobs":null}"#;
        let u = usage_in(body).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 5));
        let (a, b) = body.split_at(body.len() - 40);
        let tail = [
            Some(bytes::Bytes::copy_from_slice(a)),
            Some(bytes::Bytes::copy_from_slice(b)),
        ];
        assert_eq!(usage_in_tail(&tail), Some(u));
        assert_eq!(usage_in(br#"{"usage":null}"#), None);
    }

    /// vLLM's rerank answer names its usage before its results: when those fill the last
    /// frames, the usage is read from the first.
    #[test]
    fn usage_before_the_results() {
        let first = br#"{"id":"score-1","model":"m","usage":{"prompt_tokens":24,"total_tokens":24},"results":[{"index":0,"#;
        let tail = [
            Some(bytes::Bytes::from_static(
                br#""document":{"text":"a long document"},"#,
            )),
            Some(bytes::Bytes::from_static(br#""relevance_score":0.38}]}"#)),
        ];
        assert_eq!(usage_in_tail(&tail), None);
        let u = usage_in_answer(Some(first), &tail).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (24, 0));
        assert_eq!(usage_in_answer(None, &tail), None);
    }
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

    #[test]
    fn itl_p99_from_buckets() {
        let mut m = StreamMetrics::default();
        let mut t = Duration::ZERO;
        m.on_data(DataKind::Content, None, t);
        for i in 0..100 {
            t += if i == 99 {
                Duration::from_millis(300)
            } else {
                Duration::from_millis(10)
            };
            m.on_data(DataKind::Content, None, t);
        }
        // 99 gaps of 10 ms and one of 300 ms: p99 is in the 10 ms bucket (8.192–16.384 ms).
        let p99 = m.itl_p99().unwrap();
        assert!(
            p99 >= Duration::from_millis(10) && p99 <= Duration::from_micros(16_384),
            "{p99:?}"
        );
        assert_eq!(m.itl_max(), Some(Duration::from_millis(300)));
    }

    #[test]
    fn missing_usage_falls_back_to_content_events() {
        let mut m = StreamMetrics::default();
        m.on_data(DataKind::Content, None, Duration::from_millis(10));
        m.on_data(DataKind::Content, None, Duration::from_millis(20));
        m.on_data(DataKind::Content, None, Duration::from_millis(30));
        assert_eq!(m.output_tokens(), (Some(3), UsageSource::ContentEvents));
        assert_eq!(m.tpot(), Some(Duration::from_millis(10)));
    }
}
