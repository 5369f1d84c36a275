//! `fleetgate bench`: a load generator compatible with `vllm bench serve` (its flags, its
//! metric definitions, its result keys) and with the seed's `bench_client.py --config
//! settings.json --output result.json`, that can also run the comparison the product exists
//! for: the same prompts and arrival schedule sent interleaved to the backend directly and
//! through the gateway (`--compare direct=URL gateway=URL`), with a verdict.
//!
//! The client runs on one thread with its own event loop (one core), so its CPU time per
//! request is reported and it cannot borrow the machine's other core from what it measures.

// What only this crate reaches is `pub(crate)`, not `pub` (clippy -D warnings holds it).
#![warn(unreachable_pub)]
pub(crate) mod args;
pub(crate) mod capacity;
pub(crate) mod command;
pub mod dataset;
pub mod engine;
pub mod interval;
pub mod measure;
pub mod multiturn;
pub mod plan;
pub mod report;
pub mod spec;
pub mod summary;
pub mod sweep;
pub mod verdict;
pub mod vllm_flags;

pub use args::BenchArgs;
pub use command::run;
pub use engine::RunResult;
pub use engine::execute;
pub use plan::{Plan, plan};
pub use report::{EXIT_COMPARE, EXIT_SLA, EXIT_USAGE, Report, build_report};
