//! The figures of one SSE stream, as `vllm bench serve` defines them (TTFT, ITL, E2EL, TPOT),
//! and the usage of a whole answer. The gateway's Timeline and the measuring clients (the bench,
//! the demo) read streams through this one definition, so what the gateway records and what a
//! client measures cannot drift apart.

use std::time::Duration;

use crate::event::DataKind;
use crate::usage::{Usage, UsagePart};

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
    pub(crate) itl_sum: Duration,
    pub(crate) itl_max: Duration,
    /// Gaps by power-of-two microseconds (bucket i: [2^i, 2^(i+1)) µs), for a per-request p99
    /// without keeping every gap.
    pub(crate) itl_buckets: [u16; ITL_BUCKETS],
    pub usage: Option<Usage>,
    /// An in-stream `{"error": ...}` event was seen.
    pub error: bool,
    pub done: bool,
    /// The backend reported a token count no request can have (`Usage::plausible`): its
    /// usage is treated as none for the whole request.
    pub implausible_usage: bool,
}

pub(crate) const ITL_BUCKETS: usize = 24;

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
pub(crate) fn usage_in_tail(tail: &[Option<bytes::Bytes>; 2]) -> Option<Usage> {
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
    crate::usage::usage_in(body).map(UsagePart::whole)
}

pub fn tpot(ttft: Duration, e2el: Duration, output_tokens: u64) -> Option<Duration> {
    let steps = output_tokens.checked_sub(1).filter(|n| *n > 0)?;
    let steps = u32::try_from(steps).ok()?;
    Some(e2el.saturating_sub(ttft) / steps)
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
