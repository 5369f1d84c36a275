//! The continuous-batching engine: a pure step model, the scheduler task that paces it, and the
//! per-request handle a response body reads its tokens from.
//!
//! Token hand-off policy: the scheduler never queues token texts for a client. Each sequence has
//! one shared cell holding "tokens produced so far" plus a waker; the scheduler bumps the count
//! and wakes, the response body derives the texts itself (they are deterministic) and writes one
//! frame per token as fast as the client reads. So a slow client costs O(1) memory and never
//! blocks the batch; it simply falls behind and catches up later, like vLLM's output collector
//! which coalesces pending deltas instead of applying back-pressure to the engine.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::args::{SimConfig, StepTiming};
use super::lora::gauge::adapter_names;
use super::lora::{BatchAdapters, LoraAdapter};
use super::prefix_cache::PrefixCache;
use super::stats::{FinishReason, SimStats};
use super::tokens::TokenSource;

/// What the scheduler and one response body share.
#[derive(Debug, Default)]
pub(crate) struct SeqShared {
    produced: AtomicU32,
    abandoned: AtomicBool,
    waker: AtomicWaker,
    /// When the scheduler took it from the waiting queue (`vllm:request_queue_time_seconds`).
    admitted: std::sync::OnceLock<Instant>,
}

impl SeqShared {
    /// The waiting time ends now (the first time only).
    fn admit(&self) {
        let _ = self.admitted.set(Instant::now());
    }

    fn publish(&self, produced: u32) {
        self.produced.store(produced, Ordering::Release);
        self.waker.wake();
    }

    pub(crate) fn produced(&self) -> u32 {
        self.produced.load(Ordering::Acquire)
    }

    fn is_abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Waits until more than `seen` tokens exist.
    fn poll_beyond(&self, seen: u32, cx: &mut Context<'_>) -> Poll<()> {
        if self.produced() > seen {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Re-check after registering: a publish between the first load and the registration
        // would otherwise be missed.
        if self.produced() > seen {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// What a generation is asked for besides its prompt.
#[derive(Debug, Clone, Default)]
pub(crate) struct Output {
    pub max_tokens: u32,
    /// Seed of the token texts.
    pub token_seed: u64,
    /// Tokens of the seed's answer already given (a continuation): skipped.
    pub skip: u32,
    /// vLLM's `priority`.
    pub priority: i64,
    /// The LoRA adapter the request named as its `model`.
    pub adapter: Option<Arc<LoraAdapter>>,
}

/// A sequence submitted to the scheduler.
pub(crate) struct NewSeq {
    pub shared: Arc<SeqShared>,
    pub prompt_tokens: u32,
    /// Leading prompt tokens found in the prefix cache: no prefill for them.
    pub cached_tokens: u32,
    pub max_tokens: u32,
    /// vLLM's `priority` (lower first), read only with `--scheduling-policy priority`.
    pub priority: i64,
    /// Run when the prompt's prefill completes: its blocks enter the prefix cache then.
    pub on_prefilled: Option<Prefilled>,
    /// Its LoRA adapter: one of at most `--max-loras` in the running batch.
    pub adapter: Option<Arc<LoraAdapter>>,
}

/// What a sequence does when its prefill completes (its blocks into the prefix cache).
pub(crate) struct Prefilled(Box<dyn FnOnce() + Send>);

struct Seq {
    shared: Arc<SeqShared>,
    on_prefilled: Option<Prefilled>,
    priority: i64,
    prompt_tokens: u32,
    prefill_left: u32,
    /// Prompt tokens scheduled in the step being run.
    chunk: u32,
    max_tokens: u32,
    produced: u32,
    adapter: Option<Arc<LoraAdapter>>,
}

/// The scheduling rules, free of clocks so they can be checked step by step in tests.
///
/// One step: decoding sequences take one token of the budget each, sequences still in prefill
/// take what is left in admission order (chunked prefill), then waiting sequences are admitted
/// FIFO while there is a free slot and budget. A sequence whose prefill completes in a step
/// emits its first token at the end of that step; decoding ones emit one token per step.
/// With `--max-loras`, a waiting sequence whose adapter would be one too many in the batch is
/// passed over (vLLM's scheduler skips it and keeps its place), and the ones behind it may go.
pub(crate) struct BatchModel {
    max_num_seqs: usize,
    /// Waiting sequences are admitted by `priority` (then arrival) rather than arrival alone.
    by_priority: bool,
    step_budget: u32,
    timing: StepTiming,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Prompt tokens prefilled so far (cached ones excluded): what prefill time was paid for.
    prefilled_tokens: u64,
    /// The adapters in the batch being planned, with `--enable-lora`.
    loras: Option<BatchAdapters>,
}

impl BatchModel {
    pub(crate) fn new(max_num_seqs: u32, max_num_batched_tokens: u32, timing: StepTiming) -> Self {
        Self {
            max_num_seqs: usize::try_from(max_num_seqs.max(1)).unwrap_or(usize::MAX),
            by_priority: false,
            step_budget: max_num_batched_tokens.max(1),
            timing,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefilled_tokens: 0,
            loras: None,
        }
    }

    /// At most `max` adapters in the running batch (`--max-loras`).
    pub(crate) fn max_loras(mut self, max: Option<u32>) -> Self {
        self.loras = max.map(BatchAdapters::new);
        self
    }

    /// Admit waiting sequences by `priority` (`--scheduling-policy priority`).
    pub(crate) fn by_priority(mut self, on: bool) -> Self {
        self.by_priority = on;
        self
    }

    /// The next waiting sequence to admit: the first of the lowest priority under the priority
    /// policy (vLLM: lower first, arrival order among equals), else the first; in both, only
    /// one whose adapter fits in the batch (`loras`).
    fn next_waiting(&mut self) -> Option<Seq> {
        let loras = &self.loras;
        let fits = |s: &Seq| loras.as_ref().is_none_or(|l| l.fits(s.adapter.as_deref()));
        let at = if self.by_priority {
            self.waiting
                .iter()
                .enumerate()
                .filter(|(_, s)| fits(s))
                .min_by_key(|(i, s)| (s.priority, *i))?
                .0
        } else {
            self.waiting.iter().position(fits)?
        };
        let s = self.waiting.remove(at)?;
        if let Some(l) = &mut self.loras {
            l.admit(s.adapter.as_deref());
        }
        Some(s)
    }

    pub(crate) fn enqueue(&mut self, s: NewSeq) {
        let prompt = s.prompt_tokens.max(1);
        // At least one token is computed, as vLLM's (the last prompt token's logits are needed).
        let cached = s.cached_tokens.min(prompt - 1);
        self.waiting.push_back(Seq {
            shared: s.shared,
            on_prefilled: s.on_prefilled,
            priority: s.priority,
            prompt_tokens: prompt,
            prefill_left: prompt - cached,
            chunk: 0,
            max_tokens: s.max_tokens.max(1),
            produced: 0,
            adapter: s.adapter,
        });
    }

    pub(crate) fn running_len(&self) -> usize {
        self.running.len()
    }

    pub(crate) fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Prompt tokens prefilled so far; cached ones never are.
    pub(crate) fn prefilled_tokens(&self) -> u64 {
        self.prefilled_tokens
    }

    /// The adapters with sequences running and those with sequences waiting, each named once,
    /// in batch (queue) order and comma-separated, as vLLM's `vllm:lora_requests_info` labels.
    pub(crate) fn lora_residency(&self, running: &mut String, waiting: &mut String) {
        adapter_names(
            self.running.iter().filter_map(|s| s.adapter.as_deref()),
            running,
        );
        adapter_names(
            self.waiting.iter().filter_map(|s| s.adapter.as_deref()),
            waiting,
        );
    }

    /// Tokens whose KV entries the running batch holds.
    pub(crate) fn kv_tokens(&self) -> u64 {
        self.running
            .iter()
            .map(|s| u64::from(s.prompt_tokens - s.prefill_left) + u64::from(s.produced))
            .sum()
    }

    /// Drops abandoned sequences, decides the next step and returns its duration, or `None`
    /// when there is nothing to run.
    pub(crate) fn plan(&mut self) -> Option<Duration> {
        self.running.retain(|s| !s.shared.is_abandoned());
        self.waiting.retain(|s| !s.shared.is_abandoned());
        if self.running.is_empty() && self.waiting.is_empty() {
            return None;
        }
        let mut budget = self.step_budget;
        for s in self.running.iter_mut().filter(|s| s.prefill_left == 0) {
            s.chunk = 0;
            budget = budget.saturating_sub(1);
        }
        let mut prefill_tokens = 0u32;
        let mut first_tokens = false;
        let mut give = |s: &mut Seq, budget: &mut u32| {
            let take = s.prefill_left.min(*budget);
            s.chunk = take;
            *budget -= take;
            prefill_tokens += take;
            first_tokens |= take > 0 && take == s.prefill_left;
        };
        for s in self.running.iter_mut().filter(|s| s.prefill_left > 0) {
            give(s, &mut budget);
        }
        if let Some(l) = &mut self.loras {
            l.reset(self.running.iter().filter_map(|s| s.adapter.as_deref()));
        }
        while self.running.len() < self.max_num_seqs && budget > 0 {
            let Some(mut s) = self.next_waiting() else {
                break;
            };
            s.shared.admit();
            give(&mut s, &mut budget);
            self.running.push(s);
        }
        self.prefilled_tokens += u64::from(prefill_tokens);
        let t = &self.timing;
        let slots = u32::try_from(self.running.len()).unwrap_or(u32::MAX);
        let mut d = t
            .decode_step
            .saturating_add(t.decode_per_seq.checked_mul(slots).unwrap_or(Duration::MAX))
            .saturating_add(
                t.prefill_per_token
                    .checked_mul(prefill_tokens)
                    .unwrap_or(Duration::MAX),
            );
        if first_tokens {
            d = d.saturating_add(t.stall_first_token);
        }
        Some(d)
    }

    /// Applies the planned step: prefill progresses, tokens are published, finished sequences
    /// leave the batch.
    pub(crate) fn commit(&mut self) {
        for s in &mut self.running {
            let emits = if s.chunk > 0 {
                s.prefill_left -= s.chunk;
                s.chunk = 0;
                if s.prefill_left == 0
                    && let Some(Prefilled(done)) = s.on_prefilled.take()
                {
                    done();
                }
                s.prefill_left == 0
            } else {
                s.prefill_left == 0
            };
            if emits {
                s.produced += 1;
                s.shared.publish(s.produced);
            }
        }
        self.running.retain(|s| s.produced < s.max_tokens);
    }
}

/// Entry point for new sequences; `None` when timing is all zero and no scheduler runs.
#[derive(Clone)]
pub(crate) struct Engine {
    submit: Option<mpsc::UnboundedSender<NewSeq>>,
    /// `None` with `--kv-cache-tokens 0`. Held only for one lookup, never across an await.
    prefix_cache: Option<Arc<Mutex<PrefixCache>>>,
    /// Where the cache's changes go, with `--kv-events-config`.
    kv_events: Option<crate::kv_events::Publisher>,
    /// `--first-token-at-once`: a sequence's first token waits for no step.
    first_token_at_once: bool,
}

impl Engine {
    /// Spawns the scheduler task unless timing is all zero, in which case bodies produce tokens
    /// on demand and no timer is ever touched.
    pub(crate) fn spawn(
        cfg: &SimConfig,
        stats: Arc<SimStats>,
        cancel: CancellationToken,
        kv_events: Option<crate::kv_events::Publisher>,
    ) -> (Self, Option<JoinHandle<()>>) {
        let prefix_cache =
            PrefixCache::new(cfg.block_size, cfg.prefix_cache_tokens).map(|mut c| {
                if kv_events.is_some() {
                    c.record_changes();
                }
                Arc::new(Mutex::new(c))
            });
        if cfg.timing.is_zero() {
            return (
                Self {
                    submit: None,
                    prefix_cache,
                    kv_events,
                    first_token_at_once: false,
                },
                None,
            );
        }
        // Unbounded like vLLM's waiting queue: admission control is the gateway's job, and
        // each entry is a few words.
        let (tx, rx) = mpsc::unbounded_channel();
        let model = BatchModel::new(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.timing)
            .by_priority(cfg.scheduling_policy == crate::args::SchedulingPolicy::Priority)
            .max_loras(cfg.lora.as_ref().map(|l| l.max_loras));
        let task = tokio::spawn(run_scheduler(model, rx, stats, cancel));
        (
            Self {
                submit: Some(tx),
                prefix_cache,
                kv_events,
                first_token_at_once: cfg.timing.first_token_at_once,
            },
            Some(task),
        )
    }

    /// Starts a generation; the caller has already validated lengths. `prompt_blocks` are
    /// the prompt's block hashes (`prefix_cache::blocks`; empty for a request the
    /// prefix cache does not see).
    pub(crate) fn start(
        &self,
        stats: Arc<SimStats>,
        prompt_tokens: u32,
        prompt_blocks: &crate::prefix_cache::PromptBlocks,
        output: Output,
        arrived: Instant,
    ) -> SeqHandle {
        let Output {
            max_tokens,
            token_seed,
            skip,
            priority,
            adapter,
        } = output;
        // As vLLM: the prompt's blocks are found now, and enter the cache (and the events) when
        // its prefill has computed them, so two prompts prefilling at once both miss what
        // neither has finished. Without a scheduler (zero delays) they enter at once.
        let (cached_tokens, on_prefilled) = match &self.prefix_cache {
            Some(cache) if !prompt_blocks.hashes.is_empty() => {
                let hit = cache
                    .lock()
                    .map_or(0, |mut c| c.lookup(prompt_blocks, prompt_tokens));
                let (cache, events) = (cache.clone(), self.kv_events.clone());
                let blocks = prompt_blocks.clone();
                let owner = adapter.clone();
                let store = move || {
                    if let Ok(mut c) = cache.lock() {
                        c.store(&blocks, owner.as_ref());
                        if let Some(p) = &events {
                            // Under the cache's lock, so batches leave in the order of the
                            // changes.
                            p.publish(c.take_changes());
                        }
                    }
                };
                (hit, Some(store))
            }
            _ => (0, None),
        };
        let on_prefilled = match (&self.submit, on_prefilled) {
            (Some(_), Some(store)) => Some(Prefilled(Box::new(store))),
            (None, Some(store)) => {
                store();
                None
            }
            (_, None) => None,
        };
        let feed = match &self.submit {
            Some(tx) => {
                let shared = Arc::new(SeqShared::default());
                let seq = NewSeq {
                    shared: shared.clone(),
                    prompt_tokens,
                    cached_tokens,
                    max_tokens,
                    priority,
                    on_prefilled,
                    adapter: adapter.clone(),
                };
                match tx.send(seq) {
                    Ok(()) => Feed::Scheduled(shared),
                    // Only during shutdown; answering at once beats hanging.
                    Err(_) => Feed::Instant,
                }
            }
            None => Feed::Instant,
        };
        // Without a scheduler every request runs at once: its adapter runs while it is in flight.
        let in_flight_adapter = adapter.filter(|_| matches!(feed, Feed::Instant));
        if matches!(feed, Feed::Instant) {
            if let (Some(gauge), Some(a)) = (&stats.lora, &in_flight_adapter) {
                gauge.enter(a);
            }
            stats.running.fetch_add(1, Ordering::Relaxed);
            // No scheduler to count prefill: the uncached part counts at once.
            stats.engine.prefilled_tokens.fetch_add(
                u64::from(prompt_tokens.max(1) - cached_tokens.min(prompt_tokens.max(1) - 1)),
                Ordering::Relaxed,
            );
        }
        SeqHandle {
            feed,
            tokens: TokenSource::new(token_seed).skipping(skip),
            prompt_tokens,
            cached_tokens,
            max_tokens: max_tokens.max(1),
            emitted: 0,
            ahead: u32::from(self.first_token_at_once),
            arrived,
            last_token: arrived,
            stats,
            state: GenState::Live,
            in_flight_adapter,
        }
    }
}

async fn run_scheduler(
    mut model: BatchModel,
    mut submit: mpsc::UnboundedReceiver<NewSeq>,
    stats: Arc<SimStats>,
    cancel: CancellationToken,
) {
    let mut step_end = Instant::now();
    let mut residency = (String::new(), String::new());
    loop {
        while let Ok(s) = submit.try_recv() {
            model.enqueue(s);
        }
        let Some(step) = model.plan() else {
            publish_gauges(&stats, &model, &mut residency);
            tokio::select! {
                () = cancel.cancelled() => return,
                s = submit.recv() => match s {
                    Some(s) => model.enqueue(s),
                    None => return,
                },
            }
            continue;
        };
        publish_gauges(&stats, &model, &mut residency);
        // Steps are laid end to end from the previous deadline so timer rounding does not
        // accumulate into drift; after an idle period the clock restarts from now.
        step_end = step_end.max(Instant::now()) + step;
        if step.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep_until(step_end) => {}
            }
        }
        model.commit();
    }
}

/// `residency`: the adapter lists of `vllm:lora_requests_info`, reused from step to step.
fn publish_gauges(stats: &SimStats, model: &BatchModel, residency: &mut (String, String)) {
    let as_u64 = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    stats
        .running
        .store(as_u64(model.running_len()), Ordering::Relaxed);
    stats
        .waiting
        .store(as_u64(model.waiting_len()), Ordering::Relaxed);
    stats
        .engine
        .kv_tokens
        .store(model.kv_tokens(), Ordering::Relaxed);
    stats
        .engine
        .prefilled_tokens
        .store(model.prefilled_tokens(), Ordering::Relaxed);
    if let Some(gauge) = &stats.lora {
        let (running, waiting) = residency;
        model.lora_residency(running, waiting);
        gauge.observe(running, waiting);
    }
}

enum Feed {
    /// Zero timing: every token is ready the moment it is asked for.
    Instant,
    Scheduled(Arc<SeqShared>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum GenState {
    Live,
    Finished,
    Failed,
}

/// One request's view of its sequence. Dropping it while live is the cancellation signal: the
/// scheduler removes the sequence at its next step and `SimStats::cancelled` is counted at once.
pub(crate) struct SeqHandle {
    feed: Feed,
    tokens: TokenSource,
    pub prompt_tokens: u32,
    /// Leading prompt tokens the prefix cache held (`usage.prompt_tokens_details`).
    pub cached_tokens: u32,
    pub max_tokens: u32,
    emitted: u32,
    /// Tokens handed out ahead of the scheduler's steps: 1 with `--first-token-at-once` (the
    /// first token leaves on arrival, the step that would have made it makes the second), else 0.
    ahead: u32,
    arrived: Instant,
    /// When the last token was handed out (`vllm:inter_token_latency_seconds`).
    last_token: Instant,
    stats: Arc<SimStats>,
    state: GenState,
    /// Without a scheduler: the adapter this request keeps running in the LoRA gauge.
    in_flight_adapter: Option<Arc<LoraAdapter>>,
}

impl SeqHandle {
    pub(crate) fn emitted(&self) -> u32 {
        self.emitted
    }

    pub(crate) fn is_last(&self) -> bool {
        self.emitted >= self.max_tokens
    }

    /// Ready once the first token exists (the moment vLLM sends the role chunk).
    pub(crate) fn poll_first(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match &self.feed {
            Feed::Instant => Poll::Ready(()),
            Feed::Scheduled(_) if self.ahead > 0 => Poll::Ready(()),
            Feed::Scheduled(s) => s.poll_beyond(0, cx),
        }
    }

    /// The next token's text, or `None` after the last one.
    pub(crate) fn poll_token(&mut self, cx: &mut Context<'_>) -> Poll<Option<&'static str>> {
        if self.emitted >= self.max_tokens {
            return Poll::Ready(None);
        }
        if let Feed::Scheduled(s) = &self.feed
            && let Some(step) = self.emitted.checked_sub(self.ahead)
            && s.poll_beyond(step, cx).is_pending()
        {
            return Poll::Pending;
        }
        self.emitted += 1;
        let m = &self.stats.engine;
        let now = Instant::now();
        if self.emitted == 1 {
            m.ttft.observe(now - self.arrived);
            let admitted = match &self.feed {
                Feed::Scheduled(s) => s.admitted.get().copied().unwrap_or(self.arrived),
                Feed::Instant => self.arrived,
            };
            m.queue_time
                .observe(admitted.saturating_duration_since(self.arrived));
            m.prefix_cache_queries
                .fetch_add(u64::from(self.prompt_tokens), Ordering::Relaxed);
            m.prefix_cache_hits
                .fetch_add(u64::from(self.cached_tokens), Ordering::Relaxed);
        } else {
            m.itl.observe(now - self.last_token);
        }
        self.last_token = now;
        m.generation_tokens.fetch_add(1, Ordering::Relaxed);
        Poll::Ready(Some(self.tokens.next_token()))
    }

    /// All remaining tokens, for non-streaming responses.
    pub(crate) async fn collect_text(&mut self) -> String {
        let mut text = String::new();
        while let Some(t) = std::future::poll_fn(|cx| self.poll_token(cx)).await {
            text.push_str(t);
        }
        text
    }

    /// Marks a normal end; call before the final bytes go out so a client that has read them
    /// also sees the counters.
    pub(crate) fn finish(&mut self) {
        if self.leave(GenState::Finished) {
            self.stats.completed.fetch_add(1, Ordering::Relaxed);
            self.stats.engine.record_finish(FinishReason::Length);
            let m = &self.stats.engine;
            m.e2e.observe(self.arrived.elapsed());
            m.request_prompt_tokens
                .observe_count(u64::from(self.prompt_tokens));
            m.request_generation_tokens
                .observe_count(u64::from(self.emitted));
        }
    }

    /// Marks an injected fault (dropped or errored stream).
    pub(crate) fn fail_injected(&mut self) {
        if self.leave(GenState::Failed) {
            self.stats.failed_injected.fetch_add(1, Ordering::Relaxed);
            self.stats.engine.record_finish(FinishReason::Abort);
        }
    }

    /// Leaves the live state once; returns whether this call did it.
    fn leave(&mut self, to: GenState) -> bool {
        if self.state != GenState::Live {
            return false;
        }
        self.state = to;
        match &self.feed {
            Feed::Instant => {
                self.stats.running.fetch_sub(1, Ordering::Relaxed);
                if let (Some(gauge), Some(a)) = (&self.stats.lora, &self.in_flight_adapter) {
                    gauge.leave(a);
                }
            }
            Feed::Scheduled(s) => {
                if to != GenState::Finished {
                    s.abandoned.store(true, Ordering::Relaxed);
                }
            }
        }
        true
    }
}

impl Drop for SeqHandle {
    fn drop(&mut self) {
        if self.leave(GenState::Failed) {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            self.stats.engine.record_finish(FinishReason::Abort);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing() -> StepTiming {
        StepTiming {
            decode_step: Duration::from_millis(15),
            decode_per_seq: Duration::from_micros(500),
            prefill_per_token: Duration::from_micros(20),
            stall_first_token: Duration::ZERO,
            first_token_at_once: false,
        }
    }

    /// Runs the model on a virtual clock; returns each sequence's time to first token.
    fn ttfts(model: &mut BatchModel, prompts: &[u32], max_tokens: u32) -> Vec<Duration> {
        let shared: Vec<_> = prompts
            .iter()
            .map(|&p| {
                let s = Arc::new(SeqShared::default());
                model.enqueue(NewSeq {
                    shared: s.clone(),
                    prompt_tokens: p,
                    cached_tokens: 0,
                    max_tokens,
                    priority: 0,
                    on_prefilled: None,
                    adapter: None,
                });
                s
            })
            .collect();
        let mut now = Duration::ZERO;
        let mut first = vec![None; prompts.len()];
        while let Some(step) = model.plan() {
            now += step;
            model.commit();
            for (f, s) in first.iter_mut().zip(&shared) {
                if f.is_none() && s.produced() > 0 {
                    *f = Some(now);
                }
            }
        }
        assert!(shared.iter().all(|s| s.produced() == max_tokens));
        first.into_iter().map(|f| f.unwrap()).collect()
    }

    fn mean(v: &[Duration]) -> Duration {
        v.iter().sum::<Duration>() / u32::try_from(v.len()).unwrap()
    }

    #[test]
    fn ttft_grows_with_concurrent_long_prompts() {
        let one = mean(&ttfts(
            &mut BatchModel::new(32, 8192, timing()),
            &[6000],
            64,
        ));
        let eight = mean(&ttfts(
            &mut BatchModel::new(32, 8192, timing()),
            &[6000; 8],
            64,
        ));
        // One 6000-token prompt fits one step; eight of them share the 8192 budget, so most
        // wait several chunked-prefill steps.
        assert_eq!(
            one,
            Duration::from_micros(15_000 + 500 + 6000 * 20),
            "single prompt: one step"
        );
        assert!(eight > one * 3, "one {one:?} eight {eight:?}");
    }

    /// `--scheduling-policy priority`: a waiting sequence of a lower priority is admitted
    /// before earlier ones of a higher priority, and equals keep their arrival order; without
    /// the policy the priority changes nothing.
    #[test]
    fn the_priority_policy_orders_the_waiting_queue() {
        for policy in [true, false] {
            let mut m = BatchModel::new(1, 8192, timing()).by_priority(policy);
            let seqs: Vec<_> = [5, 10, 10, 0]
                .iter()
                .map(|&priority| {
                    let s = Arc::new(SeqShared::default());
                    m.enqueue(NewSeq {
                        shared: s.clone(),
                        prompt_tokens: 4,
                        cached_tokens: 0,
                        max_tokens: 1,
                        priority,
                        on_prefilled: None,
                        adapter: None,
                    });
                    s
                })
                .collect();
            let mut order = Vec::new();
            for _ in 0..8 {
                if m.plan().is_none() {
                    break;
                }
                m.commit();
                for (i, s) in seqs.iter().enumerate() {
                    if s.produced() == 1 && !order.contains(&i) {
                        order.push(i);
                    }
                }
            }
            let want = if policy { [3, 0, 1, 2] } else { [0, 1, 2, 3] };
            assert_eq!(order, want, "by priority: {policy}");
        }
    }

    #[test]
    fn cached_prefix_is_not_prefilled() {
        let mut m = BatchModel::new(32, 8192, timing());
        let s = Arc::new(SeqShared::default());
        m.enqueue(NewSeq {
            shared: s.clone(),
            prompt_tokens: 6000,
            cached_tokens: 5000,
            max_tokens: 1,
            priority: 0,
            on_prefilled: None,
            adapter: None,
        });
        // Only the 1000 uncached tokens cost prefill time.
        assert_eq!(
            m.plan(),
            Some(Duration::from_micros(15_000 + 500 + 1000 * 20))
        );
        m.commit();
        assert_eq!(s.produced(), 1);
        assert_eq!(m.prefilled_tokens(), 1000);
        // A prompt that is all cached still computes its last token.
        m.enqueue(NewSeq {
            shared: Arc::new(SeqShared::default()),
            prompt_tokens: 64,
            cached_tokens: 64,
            max_tokens: 1,
            priority: 0,
            on_prefilled: None,
            adapter: None,
        });
        m.plan().unwrap();
        assert_eq!(m.prefilled_tokens(), 1001);
    }

    #[test]
    fn fewer_seats_means_queueing() {
        let wide = mean(&ttfts(
            &mut BatchModel::new(32, 8192, timing()),
            &[100; 8],
            32,
        ));
        let narrow = mean(&ttfts(
            &mut BatchModel::new(2, 8192, timing()),
            &[100; 8],
            32,
        ));
        assert!(narrow > wide * 4, "wide {wide:?} narrow {narrow:?}");
    }

    #[test]
    fn long_prompt_is_prefilled_in_chunks() {
        let mut m = BatchModel::new(4, 1000, timing());
        let s = Arc::new(SeqShared::default());
        m.enqueue(NewSeq {
            shared: s.clone(),
            prompt_tokens: 2500,
            cached_tokens: 0,
            max_tokens: 2,
            priority: 0,
            on_prefilled: None,
            adapter: None,
        });
        let mut steps = 0;
        while s.produced() == 0 {
            m.plan().unwrap();
            m.commit();
            steps += 1;
        }
        assert_eq!(steps, 3);
        m.plan().unwrap();
        m.commit();
        assert_eq!(s.produced(), 2);
        assert!(m.plan().is_none(), "finished sequence leaves the batch");
    }

    #[test]
    fn abandoned_sequence_leaves_at_next_step() {
        let mut m = BatchModel::new(1, 100, timing());
        let a = Arc::new(SeqShared::default());
        let b = Arc::new(SeqShared::default());
        for s in [&a, &b] {
            m.enqueue(NewSeq {
                shared: s.clone(),
                prompt_tokens: 10,
                cached_tokens: 0,
                max_tokens: 100,
                priority: 0,
                on_prefilled: None,
                adapter: None,
            });
        }
        m.plan().unwrap();
        m.commit();
        assert_eq!((m.running_len(), m.waiting_len()), (1, 1));
        a.abandoned.store(true, Ordering::Relaxed);
        m.plan().unwrap();
        assert_eq!((m.running_len(), m.waiting_len()), (1, 0));
        m.commit();
        assert_eq!(b.produced(), 1);
    }

    /// `--max-loras 1`: a request for a second adapter waits until the requests of the running
    /// one are done, while those behind it (of the running adapter, of the base model) pass.
    #[test]
    fn a_further_adapter_waits_for_a_seat_in_the_batch() {
        let adapter = |id, name: &str| {
            Arc::new(LoraAdapter {
                id,
                name: name.into(),
                path: "/adapters".into(),
                parent: "m".into(),
            })
        };
        let (a, b) = (adapter(1, "a"), adapter(2, "b"));
        let mut m = BatchModel::new(8, 8192, timing()).max_loras(Some(1));
        let seqs: Vec<_> = [Some(&a), Some(&b), Some(&a), None]
            .into_iter()
            .map(|lora| {
                let s = Arc::new(SeqShared::default());
                m.enqueue(NewSeq {
                    shared: s.clone(),
                    prompt_tokens: 4,
                    cached_tokens: 0,
                    max_tokens: 3,
                    priority: 0,
                    on_prefilled: None,
                    adapter: lora.cloned(),
                });
                s
            })
            .collect();
        let produced = || seqs.iter().map(|s| s.produced()).collect::<Vec<_>>();
        m.plan().unwrap();
        m.commit();
        assert_eq!(produced(), [1, 0, 1, 1]);
        let (mut running, mut waiting) = (String::new(), String::new());
        m.lora_residency(&mut running, &mut waiting);
        assert_eq!((running.as_str(), waiting.as_str()), ("a", "b"));
        for _ in 0..2 {
            m.plan().unwrap();
            m.commit();
        }
        assert_eq!(produced(), [3, 0, 3, 3], "b waits while a runs");
        m.plan().unwrap();
        m.commit();
        assert_eq!(produced(), [3, 1, 3, 3], "b runs once a is done");
        m.lora_residency(&mut running, &mut waiting);
        assert_eq!((running.as_str(), waiting.as_str()), ("b", ""));
    }
}
