//! Cost of admission and of the balancing decision on the request path when nothing is
//! contended: the limits check (a key
//! with a request rate, a token budget and a concurrency cap, in an environment with an
//! aggregate rate and concurrency cap) plus the backend slot (the admission queue's fast path),
//! and releasing both with the token settlement — beside the same for a key without limits.
//!
//!   cargo bench --bench limits [-- --iterations 1000000]
//!
//! Each figure is the median and p99 over batches of 1000 admissions, per admission.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use std::sync::Arc;
use std::time::Instant;

use fleetgate_gateway::config::{BackendConfig, EnvLimits, LimitsConfig, PoolConfig, QueueConfig};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::limits::{Demand, Limits};
use fleetgate_gateway::pool::Generation;

use common::{arg, key_record};

const BATCH: usize = 1000;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i]
}

fn main() {
    let iterations = arg("--iterations", 1_000_000).max(BATCH);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cfg = LimitsConfig::default();
        cfg.environments[Environment::Prod.index()] = EnvLimits {
            aggregate_requests_per_second: Some(u32::MAX / 2),
            aggregate_max_concurrent: Some(100_000),
            ..EnvLimits::default()
        };
        let limits = Arc::new(Limits::new(cfg, None));
        let pools = Generation::new(
            &[PoolConfig::new(
                "m",
                vec![
                    "http://127.0.0.1:9".parse().unwrap(),
                    "http://127.0.0.1:10".parse().unwrap(),
                ],
            )],
            &QueueConfig::default(),
        )
        .unwrap();
        let pool = pools.get("m").unwrap();

        let mut limited = key_record("fg-prod-bench", [0; 32]);
        limited.id = 1;
        limited.requests_per_minute = Some(i64::from(u32::MAX / 2));
        limited.tokens_per_minute = Some(i64::MAX / 4);
        limited.max_concurrent_streams = Some(1000);
        let mut plain = key_record("fg-gray-bench", [0; 32]);
        plain.id = 2;
        plain.environment = Environment::Gray;
        let demand = Demand {
            prompt_tokens: 120,
            max_tokens: 256,
        };

        println!("## Admission cost, uncontended ({iterations} admissions each)\n");
        println!("| path | p50 per admission | p99 per admission |\n|---|---|---|");
        for (name, key) in [
            (
                "key with rate + tokens + concurrency, environment caps",
                &limited,
            ),
            ("key and environment without limits", &plain),
        ] {
            let mut per = Vec::with_capacity(iterations / BATCH);
            for _ in 0..iterations / BATCH {
                let t = Instant::now();
                for _ in 0..BATCH {
                    let mut adm = limits.hold(key, demand).await.expect("admitted");
                    let slot = pool.balancer.try_acquire().expect("a slot");
                    adm.set_used(300);
                    std::hint::black_box(&slot);
                    drop(slot);
                    drop(adm);
                }
                per.push(t.elapsed().as_secs_f64() * 1e9 / BATCH as f64);
            }
            println!(
                "| {name} | {:.0} ns | {:.0} ns |",
                pct(&mut per, 50.0),
                pct(&mut per, 99.0)
            );
        }
        // The queue's own fast path alone: a slot on the least loaded backend and its release.
        let mut per = Vec::with_capacity(iterations / BATCH);
        for _ in 0..iterations / BATCH {
            let t = Instant::now();
            for _ in 0..BATCH {
                let slot = pool.balancer.try_acquire().expect("a slot");
                std::hint::black_box(&slot);
            }
            per.push(t.elapsed().as_secs_f64() * 1e9 / BATCH as f64);
        }
        println!(
            "| backend slot only (queue fast path) | {:.0} ns | {:.0} ns |",
            pct(&mut per, 50.0),
            pct(&mut per, 99.0)
        );

        // The balancing decision on a larger pool: weighted power of two choices over 8
        // backends of weights 1..8, with 0..7 requests already in flight on them.
        let mut cfg = PoolConfig::new("big", vec![]);
        cfg.backends = (0..8u32)
            .map(|i| BackendConfig {
                weight: i + 1,
                ..BackendConfig::new(format!("http://127.0.0.1:{}", 20 + i).parse().unwrap())
            })
            .collect();
        let big = Generation::new(&[cfg], &QueueConfig::default()).unwrap();
        let big = big.get("big").unwrap();
        let held: Vec<_> = (0..28).filter_map(|_| big.balancer.try_acquire()).collect();
        let mut per = Vec::with_capacity(iterations / BATCH);
        for _ in 0..iterations / BATCH {
            let t = Instant::now();
            for _ in 0..BATCH {
                let slot = big.balancer.try_acquire().expect("a slot");
                std::hint::black_box(&slot);
            }
            per.push(t.elapsed().as_secs_f64() * 1e9 / BATCH as f64);
        }
        drop(held);
        println!(
            "| balancing decision, 8 weighted backends under load (P2C) + release | {:.0} ns | {:.0} ns |",
            pct(&mut per, 50.0),
            pct(&mut per, 99.0)
        );
    });
}
