//! A stream continued on another backend when its own fails mid-answer (issue 60,
//! `[pools.resume]`): the connection closed or reset before the answer's end, vLLM's event
//! saying its engine died (or that the request may be retried), or no token within the stall
//! limit. The relay keeps the text it relayed (`Capture`: the content span the event's
//! classification already found, copied; nothing parsed again), and on a failure asks for a
//! slot on another backend as a retry would (`claim`), sends it the continuation
//! (`fleetgate_protocol::resume::continuation`) with the original prompt counted by its
//! `/tokenize`, and relays the continuation's events made the first answer's own (`SeamState`):
//! its id, created, model and fingerprint, its opening role chunk dropped, one usage.
//!
//! What cannot be continued exactly is refused (`Refused`): the stream ends as it did before,
//! its error event naming the reason, and the refusal is counted.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;

use super::super::error::ApiError;
use super::super::state::ProxyState;
use super::{Out, RelayBody, State, deadline};
use crate::config::ResumeConfig;
use crate::pool::upstream_conn::UpstreamBody;
use crate::pool::{Balancer, InFlight};
use crate::telemetry::RequestRecord;
use crate::telemetry::resume::ResumePart;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::error::ErrorKind;
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::resume::{self as cont, AnswerSoFar, Cause, NotResumable, Seam};
use fleetgate_protocol::sse::{DataLine, SseScanner};

mod refused;
mod upstream;

use refused::Refused;
use upstream::{asks_usage, claim, request_to, send};

/// What the send step keeps for a stream that may be resumed: the body as forwarded (only
/// where an answer can be continued: chat and completions on a pool of several backends; the
/// bytes are shared, not copied). A continuation's head is made anew: a backend needs its own
/// key, the length, the request id and the trace, nothing the client sent.
pub(in crate::proxy) struct Kept {
    pub(in crate::proxy) endpoint: Endpoint,
    pub(in crate::proxy) request: Option<Bytes>,
    pub(in crate::proxy) config: ResumeConfig,
    /// The pool has one backend: nowhere to continue.
    pub(in crate::proxy) alone: bool,
    /// The backends the request may go to (their bits; 0: any): a LoRA adapter's holders.
    pub(in crate::proxy) only: u64,
}

/// What the relay reads of its answer while it relays: the text so far, the first chunk (the
/// identity a continuation takes), and a failure event found in the frame just scanned.
#[derive(Default)]
pub(super) struct Capture {
    so_far: AnswerSoFar,
    first: Vec<u8>,
    /// A failure event: its cause, and whether it began in an earlier frame.
    pub(super) failed: Option<(Cause, bool)>,
}

impl Capture {
    /// One event of the frame being scanned; `false`: it ends the answer's part (a failure
    /// event), and neither it nor what follows is relayed or counted.
    pub(super) fn see(&mut self, line: &DataLine<'_>) -> bool {
        if self.failed.is_some() {
            return false;
        }
        match line.kind {
            DataKind::Content => self.so_far.push(line.payload, line.streamed),
            DataKind::Error => {
                if let Some(cause) = cont::failure_in(line.payload) {
                    self.failed = Some((cause, line.event_span.is_none()));
                    return false;
                }
            }
            _ => {}
        }
        if self.first.is_empty() && matches!(line.kind, DataKind::NoOutput | DataKind::Content) {
            self.first = line.payload.to_vec();
        }
        true
    }
}

/// A relay's resuming: what it keeps, and the continuation under way.
pub(super) struct Resume {
    state: Arc<ProxyState>,
    kept: Kept,
    pub(super) capture: Capture,
    /// The pool's idle limit: the relay's own is the stall limit while a stall may be resumed.
    idle: Duration,
    phase: Phase,
    /// The continuation `check` built, on its way to the next backend.
    next: Option<Next>,
    seam: Option<Box<SeamState>>,
    resumes: u8,
    /// Token events of the answer before the current part began.
    part_start: u32,
    /// A stall could not be resumed: the stream waits out the idle limit, then ends.
    gave_up: Option<Refused>,
}

enum Phase {
    Idle,
    /// Waiting for a slot on another backend.
    Slot(BoxFuture<'static, Result<InFlight, Refused>>),
    /// The continuation sent: its head, and the original prompt's count.
    Send(BoxFuture<'static, Result<(UpstreamBody, Option<u64>), Refused>>),
}

impl Resume {
    /// A stream's resuming, if its pool resumes streams: the relay's idle limit becomes the
    /// stall limit.
    pub(super) fn new(
        state: &Arc<ProxyState>,
        kept: Option<Box<Kept>>,
        timeouts: &mut crate::config::Timeouts,
    ) -> Option<Box<Self>> {
        let kept = *kept?;
        let idle = timeouts.idle;
        if kept.request.is_some() {
            timeouts.idle = idle.min(kept.config.stall);
        }
        Some(Box::new(Resume {
            state: state.clone(),
            kept,
            capture: Capture::default(),
            idle,
            phase: Phase::Idle,
            next: None,
            seam: None,
            resumes: 0,
            part_start: 0,
            gave_up: None,
        }))
    }

    /// Where the relay keeps the answer so far: only where it could be continued (nothing
    /// is read of an answer no backend could continue, and its events pass as they are).
    pub(super) fn capture(&mut self) -> Option<&mut Capture> {
        self.kept.request.is_some().then_some(&mut self.capture)
    }

    /// The stall limit is in force (it is shorter than the idle limit, and not given up).
    pub(super) fn stall_pending(&self, timeouts: &crate::config::Timeouts) -> bool {
        self.gave_up.is_none() && timeouts.idle < self.idle
    }

    /// A continuation's frame, made the first answer's: `None` when nothing of it is for the
    /// client yet. A stream never resumed passes untouched.
    pub(super) fn rewrite(&mut self, data: Bytes) -> Option<Bytes> {
        match self.seam.as_mut() {
            None => Some(data),
            Some(seam) => seam.rewrite(&data),
        }
    }

    /// Whether (and how) the answer can be continued, checked in the order a user would ask:
    /// the continuation, built once, or why not.
    fn check(&self, partial: bool, balancer: &Balancer, tried: u64) -> Result<Next, Refused> {
        if partial {
            return Err(Refused::PartialEvent);
        }
        if self.resumes >= self.kept.config.max_resumes {
            return Err(Refused::MaxResumes);
        }
        if self.kept.alone {
            return Err(Refused::NoBackend);
        }
        if self.kept.request.is_none() {
            return Err(Refused::Shape(NotResumable::Endpoint));
        }
        if let Some(why) = self.capture.so_far.blocked() {
            return Err(Refused::Shape(why));
        }
        let Some(forwarded) = &self.kept.request else {
            return Err(Refused::Shape(NotResumable::Endpoint));
        };
        let body = cont::continuation(self.kept.endpoint, forwarded, &self.capture.so_far)
            .map_err(Refused::Shape)?
            .ok_or(Refused::LimitReached)?;
        let seam = match &self.seam {
            Some(s) => s.seam.clone(),
            None => Seam::learn(&self.capture.first).ok_or(Refused::Shape(NotResumable::Body))?,
        };
        if !balancer.any_usable_besides(tried) {
            return Err(Refused::NoBackend);
        }
        Ok(Next {
            body,
            seam,
            usage: asks_usage(forwarded),
        })
    }
}

/// A continuation ready to send: its body, the identity its events take, and whether the
/// client's request asked for usage.
struct Next {
    body: Vec<u8>,
    seam: Seam,
    usage: bool,
}

/// What makes a continuation's events the first answer's own.
struct SeamState {
    seam: Seam,
    /// The continuation's raw events, split into lines.
    scanner: SseScanner,
    /// The original prompt's tokens (`None`: known only from the continuation's usage).
    prompt_tokens: Option<u64>,
    /// Token events the client had before this continuation.
    first_part: u32,
    /// The forwarded request asked for usage: the continuation's usage chunk is relayed.
    usage: bool,
}

impl SeamState {
    fn rewrite(&mut self, data: &[u8]) -> Option<Bytes> {
        let mut out = BytesMut::new();
        let Self {
            seam,
            scanner,
            prompt_tokens,
            first_part,
            usage,
        } = self;
        scanner.feed(data, |line| {
            let usage_only = line.kind == DataKind::NoChoices && line.usage.is_some();
            if usage_only && !*usage {
                return;
            }
            let merged;
            let mut payload = line.payload;
            if let Some(u) = line.usage {
                let prompt = prompt_tokens.unwrap_or_else(|| {
                    u.prompt()
                        .unwrap_or(0)
                        .saturating_sub(u64::from(*first_part))
                });
                merged = cont::one_usage(payload, prompt, *first_part);
                if let Some(m) = &merged {
                    payload = m;
                }
            }
            if let Some(event) = seam.rewrite(payload) {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&event);
                out.extend_from_slice(b"\n\n");
            }
        });
        (!out.is_empty()).then(|| out.freeze())
    }
}

impl RelayBody {
    /// The stream's part on this backend failed (`cause`) with `failure`: resume it on another
    /// backend, or end it as before, the error event naming why it was not resumed.
    pub(super) fn fail(
        self: Pin<&mut Self>,
        cause: Cause,
        failure: ApiError,
        partial: bool,
    ) -> Option<Out> {
        self.settle(cause, failure, partial, None)
    }

    /// `fail`, with the continuation already `check`ed where the caller had to (a stall).
    fn settle(
        self: Pin<&mut Self>,
        cause: Cause,
        failure: ApiError,
        partial: bool,
        checked: Option<Next>,
    ) -> Option<Out> {
        let this = self.project();
        let Some(resume) = this.resume.as_deref_mut() else {
            this.ex.record.error = Some(failure.kind());
            *this.state = State::Closing(failure.sse_event(*this.dialect, partial));
            return None;
        };
        // A failure event read before this failure names the cause better.
        let (cause, partial) = match resume.capture.failed.take() {
            Some((seen, began_before)) => (seen, partial || began_before),
            None => (cause, partial),
        };
        let record = &mut this.ex.record;
        let tokens = resume.capture.so_far.tokens();
        let log = record.resume.get_or_insert_with(Box::default);
        log.parts.push(ResumePart {
            backend: this.slot.backend().base.clone(),
            cause,
            tokens: tokens - resume.part_start,
        });
        let balancer = this.slot.balancer().clone();
        let tried = crate::pool::bit(this.slot.position()) | outside(resume.kept.only);
        let checked = match checked {
            Some(next) => Ok(next),
            None => resume.check(partial, &balancer, tried),
        };
        let started = checked.and_then(|next| {
            resume.begin(
                next,
                record,
                (&balancer, tried),
                this.sent_at,
                this.timeouts,
            )
        });
        match started {
            Ok(()) => {
                // A backend that dies cuts every stream on it at once: one failure, not one per
                // stream (each would double the ejection it already earned).
                if this.slot.backend().eligible() {
                    this.slot.backend().record_failure(
                        &balancer.ejection,
                        &format!("stream failed mid-answer ({})", cause.as_str()),
                    );
                }
                tracing::info!(request_id = ?record.request_id, backend = %this.slot.backend().base, cause = cause.as_str(), tokens, "resuming a stream on another backend");
                *this.state = State::Resuming;
            }
            Err(refused) => {
                if let Some(log) = record.resume.as_deref_mut() {
                    log.refused = Some(refused.as_str());
                }
                record.error = Some(failure.kind());
                let err = ApiError::NotResumed {
                    failure: Box::new(failure),
                    reason: refused.as_str(),
                    why: refused.why(),
                };
                tracing::warn!(request_id = ?record.request_id, backend = %this.slot.backend().base, cause = cause.as_str(), reason = refused.as_str(), "a stream that failed mid-answer was not resumed");
                *this.state = State::Closing(err.sse_event(*this.dialect, partial));
            }
        }
        None
    }

    /// A stall: resume when it may be, else give up the stall limit and wait out the idle one
    /// (`None`: resuming under way or given up; the poll loop goes on either way).
    pub(super) fn stalled(mut self: Pin<&mut Self>) -> Option<Out> {
        let this = self.as_mut().project();
        let resume = this.resume.as_deref_mut()?;
        let balancer = this.slot.balancer().clone();
        let tried = crate::pool::bit(this.slot.position()) | outside(resume.kept.only);
        let next = match resume.check(false, &balancer, tried) {
            Ok(next) => next,
            Err(refused) => {
                // Nothing to resume it with: the stream waits as long as it did before
                // resuming existed (the idle limit), and ends as it did then.
                resume.gave_up = Some(refused);
                this.timeouts.idle = resume.idle;
                let at = deadline(*this.sent_at, *this.last_read, true, true, this.timeouts);
                this.timer.reset(at.into());
                return None;
            }
        };
        let failure = ApiError::UpstreamTimeout {
            backend: this.slot.backend().shown.to_string(),
            kind: super::super::error::TimeoutKind::Idle,
            after_ms: this.timeouts.idle.as_millis(),
        };
        self.settle(Cause::Stalled, failure, false, Some(next))
    }

    /// Resuming: what was read before the failure goes out first, then the continuation's
    /// slot and head are awaited; once it answers, relaying goes on from its body.
    pub(super) fn poll_resuming(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Option<Out> {
        if !self.ready.is_empty() {
            return Some(Poll::Ready(Some(Ok(http_body::Frame::data(
                self.deliver(),
            )))));
        }
        if self.as_mut().project().closing.poll(cx).is_ready() {
            let grace_ms = self.grace.as_millis();
            return self.resume_ended(ApiError::Shutdown { grace_ms });
        }
        let mut this = self.as_mut().project();
        let Some(resume) = this.resume.as_deref_mut() else {
            *this.state = State::Ended;
            return Some(Poll::Ready(None));
        };
        let refused = match &mut resume.phase {
            Phase::Idle => {
                *this.state = State::Relaying;
                return None;
            }
            Phase::Slot(claiming) => match claiming.as_mut().poll(cx) {
                Poll::Pending => return Some(Poll::Pending),
                Poll::Ready(Err(refused)) => refused,
                Poll::Ready(Ok(slot)) => {
                    match resume.send_to(slot, &mut this.ex.record, this.timeouts, *this.sent_at) {
                        Ok(slot) => {
                            // The failed backend's slot is released here.
                            *this.slot = slot;
                            return None;
                        }
                        Err(refused) => refused,
                    }
                }
            },
            Phase::Send(sending) => match sending.as_mut().poll(cx) {
                Poll::Pending => return Some(Poll::Pending),
                Poll::Ready(Err(refused)) => refused,
                Poll::Ready(Ok((upstream, counted))) => {
                    resume.phase = Phase::Idle;
                    resume.installed(counted, &mut this.ex.record);
                    this.slot.prefilled();
                    let now = Instant::now();
                    *this.last_read = now;
                    this.upstream.set(upstream);
                    let at = deadline(*this.sent_at, now, true, true, this.timeouts);
                    this.timer.reset(at.into());
                    *this.state = State::Relaying;
                    return None;
                }
            },
        };
        self.refuse(refused)
    }

    /// The continuation could not be had: the stream ends with the first failure's error
    /// event, naming why.
    fn refuse(self: Pin<&mut Self>, refused: Refused) -> Option<Out> {
        let this = self.project();
        let record = &mut this.ex.record;
        if let Some(log) = record.resume.as_deref_mut() {
            log.refused = Some(refused.as_str());
        }
        if let Some(resume) = this.resume.as_deref_mut() {
            resume.phase = Phase::Idle;
            resume.next = None;
        }
        record.error = Some(ErrorKind::UpstreamStreamError);
        tracing::warn!(request_id = ?record.request_id, reason = refused.as_str(), "a stream's continuation failed: the stream ends");
        let err = ApiError::NotResumed {
            failure: Box::new(ApiError::UpstreamStreamCut {
                backend: this.slot.backend().shown.to_string(),
            }),
            reason: refused.as_str(),
            why: refused.why(),
        };
        *this.state = State::Closing(err.sse_event(*this.dialect, false));
        None
    }

    /// Resuming ended by the gateway's shutdown.
    fn resume_ended(self: Pin<&mut Self>, err: ApiError) -> Option<Out> {
        let this = self.project();
        if let Some(resume) = this.resume.as_deref_mut() {
            resume.phase = Phase::Idle;
        }
        this.ex.record.error = Some(err.kind());
        *this.state = State::Closing(err.sse_event(*this.dialect, false));
        None
    }
}

/// The bits of the backends a request may not go to: those outside `only` (0: none).
fn outside(only: u64) -> u64 {
    if only == 0 { 0 } else { !only }
}

impl Resume {
    /// Start resuming: the continuation's body is built now (refused if the answer cannot be
    /// continued exactly), and its slot asked for.
    fn begin(
        &mut self,
        next: Next,
        record: &mut RequestRecord,
        (balancer, tried): (&Arc<Balancer>, u64),
        sent_at: &Instant,
        timeouts: &crate::config::Timeouts,
    ) -> Result<(), Refused> {
        let until = *sent_at + timeouts.total;
        if Instant::now() >= until {
            return Err(Refused::Deadline);
        }
        let now = Instant::now();
        if let Some(scope) = record.otel.as_deref_mut() {
            scope.attempt_failed(now, 0, Some(ErrorKind::UpstreamStreamError));
        }
        self.next = Some(next);
        let who = (
            record.key.clone(),
            record.model.clone().unwrap_or_else(|| Arc::from("")),
        );
        self.phase = Phase::Slot(Box::pin(claim(
            self.state.clone(),
            balancer.clone(),
            who,
            (tried, self.kept.only),
            until,
        )));
        Ok(())
    }

    /// The continuation's slot is had: send it there (the attempt traced as the request's
    /// next), and count the original prompt beside it where no usage said it.
    fn send_to(
        &mut self,
        slot: InFlight,
        record: &mut RequestRecord,
        timeouts: &crate::config::Timeouts,
        sent_at: Instant,
    ) -> Result<InFlight, Refused> {
        let next = self
            .next
            .as_mut()
            .map(|n| std::mem::take(&mut n.body))
            .ok_or(Refused::Shape(NotResumable::Body))?;
        let Some(body) = &self.kept.request else {
            return Err(Refused::Shape(NotResumable::Endpoint));
        };
        let headers = (&record.request_id, self.kept.endpoint);
        let endpoint = self.kept.endpoint;
        let backend = slot.backend().clone();
        let generation = self.state.generation.load();
        let model = record.model.as_deref().unwrap_or("");
        let Some(pool) = generation.get(model) else {
            return Err(Refused::NoBackend);
        };
        let now = Instant::now();
        let mut req = request_to(&backend, backend.uri(endpoint).clone(), headers, next);
        if let Some(scope) = record.otel.as_deref_mut() {
            let traceparent = scope.attempt(&backend.base, now);
            scope.write_headers(req.headers_mut(), traceparent);
        }
        let known = record.timeline.stream().usage.map(|u| u.prompt_tokens);
        let count = match known {
            Some(_) => None,
            None => cont::tokenize_body(endpoint, body).ok().map(|b| {
                request_to(
                    &backend,
                    backend.uri(Endpoint::Tokenize).clone(),
                    (headers.0, Endpoint::Tokenize),
                    b,
                )
            }),
        };
        record.backend = Some(backend.base.clone());
        record.backend_metrics_index = Some(backend.metrics_index);
        let head_deadline = (now + timeouts.first_token).min(sent_at + timeouts.total);
        self.phase = Phase::Send(Box::pin(send(
            pool.client.clone(),
            backend,
            (req, count),
            head_deadline,
            slot.balancer().ejection,
        )));
        Ok(slot)
    }

    /// The continuation answered: its events are rewritten from now on.
    fn installed(&mut self, counted: Option<u64>, record: &mut RequestRecord) {
        let first_part = self.capture.so_far.tokens();
        let prompt_tokens = record
            .timeline
            .stream()
            .usage
            .map(|u| u.prompt_tokens)
            .or(counted);
        if let Some(log) = record.resume.as_deref_mut() {
            // The continuation's prompt: the original one and the answer so far.
            log.continuation_prompt_tokens = log
                .continuation_prompt_tokens
                .saturating_add(prompt_tokens.unwrap_or(0) + u64::from(first_part));
        }
        let Some(Next { seam, usage, .. }) = self.next.take() else {
            return;
        };
        self.seam = Some(Box::new(SeamState {
            seam,
            scanner: SseScanner::new(),
            prompt_tokens,
            first_part,
            usage,
        }));
        self.resumes += 1;
        self.part_start = first_part;
    }
}
