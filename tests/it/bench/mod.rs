//! `fleetgate bench` end to end: against the sim with known timing, vLLM's result keys, the
//! comparison through a real gateway, SLA exit codes, ShareGPT sampling, settings.json, and
//! in-stream errors counted as failures.

mod compare;
mod datasets;
mod endpoints;
mod measures;
mod runs;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::common::*;
use clap::Parser;
use fleetgate_bench::BenchArgs;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(flags: &[&str]) -> BenchArgs {
    let mut all = vec!["bench", "--no-progress"];
    all.extend_from_slice(flags);
    Cli::try_parse_from(all).unwrap().args
}

async fn run(flags: &[&str]) -> (fleetgate_bench::Plan, fleetgate_bench::Report) {
    let plan = fleetgate_bench::plan(args(flags)).await.unwrap();
    let result = fleetgate_bench::execute(Arc::new(plan.clone()), CancellationToken::new())
        .await
        .unwrap();
    let report = fleetgate_bench::build_report(&plan, &result);
    (plan, report)
}
