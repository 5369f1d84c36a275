//! The engine: sends the plan's requests on one thread with its own event loop (arrivals by
//! rate and burstiness, a concurrency cap, warm-ups first, a live progress line) until the plan
//! is done or Ctrl-C, and gives back every request's outcome and the client's CPU time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::Distribution;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::measure::{self, Outcome};
use super::plan::Plan;
use fleetgate_protocol::client::HttpClient;

/// What the engine gives back.
#[derive(Debug, Default)]
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    pub(crate) duration: Duration,
    pub(crate) interrupted: bool,
    /// CPU time of the client's thread (user + system).
    pub(crate) client_cpu: Option<Duration>,
}

/// CPU time (user + system) of the calling thread, to the nanosecond
/// (`CLOCK_THREAD_CPUTIME_ID`; /proc's clock ticks of 10 ms read a short run as 0).
pub(super) fn thread_cpu() -> Option<Duration> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    Some(Duration::new(
        u64::try_from(t.tv_sec()).ok()?,
        u32::try_from(t.tv_nsec()).ok()?,
    ))
}

/// Which target and prompt the j-th arrival carries. One target: prompt j. Two: each prompt
/// goes to both, in consecutive arrivals, the order alternating (AB, BA, AB, ...) so neither
/// target always goes second.
pub(crate) fn assignment(j: usize, targets: usize, prompts: usize) -> (u8, usize) {
    if targets < 2 {
        return (0, j % prompts);
    }
    let pair = j / 2;
    let first = (pair % 2) as u8;
    let t = if j.is_multiple_of(2) {
        first
    } else {
        1 - first
    };
    (t, pair % prompts)
}

/// Run the plan on a thread of its own (one core, its own event loop) until done or `stop`.
pub async fn execute(plan: Arc<Plan>, stop: CancellationToken) -> Result<RunResult, String> {
    on_bench_thread(move || async move { Ok(engine(plan, stop).await) }).await
}

/// Run `run` on the bench's own thread (one core, its own event loop), so the client's timing
/// never shares a scheduler with the caller's tasks.
pub(super) async fn on_bench_thread<F, Fut>(run: F) -> Result<RunResult, String>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<RunResult, String>>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("fleetgate-bench".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = tx.send(rt.block_on(run()));
        })
        .map_err(|e| e.to_string())?;
    rx.await
        .map_err(|_| "the bench thread ended without a result".to_owned())?
}

async fn engine(plan: Arc<Plan>, stop: CancellationToken) -> RunResult {
    let client = fleetgate_protocol::client::http_client();
    if plan.warmups > 0 && !warm_up(&plan, &client, &stop).await {
        return RunResult {
            interrupted: true,
            ..RunResult::default()
        };
    }
    let cpu_before = thread_cpu();
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let progress = plan.progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let total = match plan.duration {
        Some(_) => None,
        None => Some(plan.bodies.len() * plan.targets.len()),
    };
    let ticker = progress.then(|| progress_line(counts.clone(), total, started));
    let mut outcomes = Vec::with_capacity(total.unwrap_or(1024));
    let (set, interrupted) = arrivals(
        &plan,
        &client,
        &stop,
        &counts,
        started,
        total,
        &mut outcomes,
    )
    .await;
    let interrupted = drain(set, interrupted, &stop, &mut outcomes).await;
    let duration = started.elapsed();
    if let Some(t) = ticker {
        t.abort();
        eprint!("\r\x1b[2K");
    }
    let client_cpu = match (cpu_before, thread_cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    // In arrival order (by send time), as vLLM lists its per-request arrays.
    outcomes.sort_by_key(|o| o.sent_at);
    RunResult {
        outcomes,
        duration,
        interrupted,
        client_cpu,
    }
}

/// Warm-up requests, not measured (connections opened, caches warm); false at Ctrl-C.
async fn warm_up(plan: &Arc<Plan>, client: &HttpClient, stop: &CancellationToken) -> bool {
    let sem = Arc::new(tokio::sync::Semaphore::new(
        plan.max_concurrency.unwrap_or(plan.warmups),
    ));
    let mut set = tokio::task::JoinSet::new();
    let start = Instant::now();
    for j in 0..plan.warmups * plan.targets.len() {
        let (t, p) = assignment(j, plan.targets.len(), plan.bodies.len());
        let (plan, client, sem) = (plan.clone(), client.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let target = &plan.targets[usize::from(t)];
            measure::send(
                &client,
                target,
                j,
                plan.bodies[p].clone(),
                0,
                start,
                plan.timeout,
            )
            .await
        });
    }
    // Dropping the set at Ctrl-C aborts the warm-ups still running.
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = async { while set.join_next().await.is_some() {} } => true,
    }
}

/// Requests finished so far, for the progress line.
#[derive(Default)]
struct Counts {
    done: AtomicU64,
    failed: AtomicU64,
}

/// The live progress line on stderr, redrawn every 500 ms until aborted.
fn progress_line(
    counts: Arc<Counts>,
    total: Option<usize>,
    started: Instant,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = (Instant::now(), 0u64);
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let d = counts.done.load(Ordering::Relaxed);
            let f = counts.failed.load(Ordering::Relaxed);
            let now = Instant::now();
            let rate = (d - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
            last = (now, d);
            let of = total.map_or(String::new(), |t| format!("/{t}"));
            eprint!(
                "\r\x1b[2K{d}{of} done, {f} failed, {rate:.1} req/s, {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
    })
}

/// Send the measured requests at their arrival times (Poisson or gamma gaps, or all at once)
/// until the plan's count or duration is reached, or Ctrl-C (then: true). Outcomes already
/// finished are moved to `outcomes` on the way; the set holds the requests still running.
async fn arrivals(
    plan: &Arc<Plan>,
    client: &HttpClient,
    stop: &CancellationToken,
    counts: &Arc<Counts>,
    started: Instant,
    total: Option<usize>,
    outcomes: &mut Vec<Outcome>,
) -> (JoinSet<Outcome>, bool) {
    let sem = plan
        .max_concurrency
        .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
    // With no rate to pace the loop, the cap paces it: wait for a slot before the next arrival.
    let gate_in_loop = plan.request_rate.is_infinite();
    let mut rng = SmallRng::seed_from_u64(plan.seed);
    // `--request-rate` is per target, as `vllm bench serve` run once against each means it:
    // interleaved targets share one schedule at the sum of their rates.
    let rate = plan.request_rate * plan.targets.len().max(1) as f64;
    let gamma = rand_distr::Gamma::new(plan.burstiness, 1.0 / (rate * plan.burstiness)).ok();
    let mut set = JoinSet::new();
    let mut next = Duration::ZERO;
    let mut j = 0usize;
    loop {
        if total.is_some_and(|t| j >= t) {
            break;
        }
        if let Some(d) = plan.duration
            && started.elapsed() >= d
        {
            break;
        }
        // Collect what finished, so a long run does not hold every task.
        while let Some(r) = set.try_join_next() {
            if let Ok(o) = r {
                outcomes.push(o);
            }
        }
        if !plan.request_rate.is_infinite() {
            let at = tokio::time::Instant::from_std(started + next);
            tokio::select! {
                _ = stop.cancelled() => return (set, true),
                _ = tokio::time::sleep_until(at) => {}
            }
        }
        let permit = match (&sem, gate_in_loop) {
            (Some(s), true) => tokio::select! {
                _ = stop.cancelled() => return (set, true),
                p = s.clone().acquire_owned() => p.ok(),
            },
            _ => None,
        };
        if stop.is_cancelled() {
            return (set, true);
        }
        let (t, p) = assignment(j, plan.targets.len(), plan.bodies.len());
        let request = Request {
            plan: plan.clone(),
            client: client.clone(),
            counts: counts.clone(),
            started,
            target: t,
            prompt: p,
        };
        set.spawn(request.send(permit, sem.clone()));
        j += 1;
        if let Some(g) = &gamma {
            next += Duration::from_secs_f64(g.sample(&mut rng));
        }
    }
    (set, false)
}

/// One measured request of the run.
struct Request {
    plan: Arc<Plan>,
    client: HttpClient,
    counts: Arc<Counts>,
    started: Instant,
    target: u8,
    prompt: usize,
}

impl Request {
    /// Send once a concurrency slot is held (`permit`, or one taken here from `sem`).
    async fn send(
        self,
        permit: Option<OwnedSemaphorePermit>,
        sem: Option<Arc<tokio::sync::Semaphore>>,
    ) -> Outcome {
        let _permit = match (permit, sem) {
            (Some(p), _) => Some(p),
            (None, Some(s)) => s.acquire_owned().await.ok(),
            (None, None) => None,
        };
        let (t, p) = (self.target, self.prompt);
        let target = &self.plan.targets[usize::from(t)];
        let mut o = measure::send(
            &self.client,
            target,
            p,
            self.plan.bodies[p].clone(),
            self.plan.prompts[p].input_tokens,
            self.started,
            self.plan.timeout,
        )
        .await;
        o.target = t;
        o.prompt = p;
        if o.ok() {
            self.counts.done.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
        }
        o
    }
}

/// Wait for the requests still running; at Ctrl-C (then or before) abort them, keeping what
/// they had finished. Returns whether the run was interrupted.
async fn drain(
    mut set: JoinSet<Outcome>,
    mut interrupted: bool,
    stop: &CancellationToken,
    outcomes: &mut Vec<Outcome>,
) -> bool {
    if interrupted {
        set.abort_all();
    }
    tokio::select! {
        _ = stop.cancelled(), if !interrupted => {
            interrupted = true;
            set.abort_all();
            while let Some(r) = set.join_next().await {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
            }
        }
        _ = async {
            while let Some(r) = set.join_next().await {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
            }
        } => {}
    }
    interrupted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_sends_each_prompt_to_both_targets_alternating_order() {
        let seq: Vec<(u8, usize)> = (0..8).map(|j| assignment(j, 2, 100)).collect();
        assert_eq!(
            seq,
            [
                (0, 0),
                (1, 0),
                (1, 1),
                (0, 1),
                (0, 2),
                (1, 2),
                (1, 3),
                (0, 3)
            ]
        );
        assert_eq!(assignment(5, 1, 3), (0, 2));
    }
}
