//! `fleetgate bench` as the CLI runs it: `diff` of two result files, or plan → run (or sweep)
//! → print the report → write the result JSON, and the process exit code.

use std::path::PathBuf;
use std::sync::Arc;

use fleetgate_protocol::out;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::args::{BenchArgs, BenchCommand};
use super::engine::execute;
use super::plan::{Plan, plan};
use super::report::{self, EXIT_USAGE, build_report};
use super::sweep;

/// Where `--save-result` / `--output` writes.
fn result_path(args: &BenchArgs, plan: &Plan) -> Option<PathBuf> {
    if let Some(o) = &args.output {
        return Some(o.clone());
    }
    if !args.save_result && args.result_filename.is_none() {
        return None;
    }
    let name = args.result_filename.clone().unwrap_or_else(|| {
        let stamp = time::OffsetDateTime::now_utc();
        let rate = if plan.request_rate.is_finite() {
            format!("{}", plan.request_rate)
        } else {
            "inf".into()
        };
        // vLLM starts the name with its --label.
        format!(
            "{}-{}qps-{}-{:04}{:02}{:02}-{:02}{:02}{:02}.json",
            plan.label
                .as_deref()
                .unwrap_or("fleetgate-bench")
                .replace('/', "_"),
            rate,
            plan.model.replace('/', "_"),
            stamp.year(),
            u8::from(stamp.month()),
            stamp.day(),
            stamp.hour(),
            stamp.minute(),
            stamp.second()
        )
    });
    Some(match &args.result_dir {
        Some(d) => d.join(name),
        None => PathBuf::from(name),
    })
}

/// `fleetgate bench ...`: returns the process exit code.
pub async fn run(args: BenchArgs, stop: CancellationToken) -> u8 {
    if let Some(BenchCommand::Diff { a, b }) = &args.command {
        let read = |p: &PathBuf| -> Result<Value, String> {
            let t = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            serde_json::from_slice(&t).map_err(|e| format!("{}: {e}", p.display()))
        };
        let names = [a.display().to_string(), b.display().to_string()];
        return match read(a)
            .and_then(|x| read(b).and_then(|y| report::diff(&x, &y, [&names[0], &names[1]])))
        {
            Ok(text) => {
                out!("{text}");
                0
            }
            Err(e) => {
                eprintln!("fleetgate bench diff: {e}");
                1
            }
        };
    }
    // A bad settings file is a bad command line: exit 64, before anything is sent.
    if let Some(path) = &args.config
        && let Err(e) = super::plan::read_settings(path)
    {
        eprintln!("fleetgate bench: {e}");
        return EXIT_USAGE;
    }
    let plan = match plan(args.clone()).await {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("fleetgate bench: {e}");
            return 1;
        }
    };
    eprintln!(
        "fleetgate bench: model {}, {} → {}; {}",
        plan.model,
        plan.targets
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(" & "),
        plan.targets
            .iter()
            .map(|t| t
                .replicas
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "))
            .collect::<Vec<_>>()
            .join(" & "),
        plan.dataset_note
    );
    let report = if plan.sweep.is_some() {
        match sweep::run(plan.clone(), stop).await {
            Ok((report, chart)) => {
                match std::fs::write(&plan.sweep_chart, chart) {
                    Ok(()) => eprintln!(
                        "fleetgate bench: chart written to {}",
                        plan.sweep_chart.display()
                    ),
                    Err(e) => eprintln!(
                        "fleetgate bench: cannot write {}: {e}",
                        plan.sweep_chart.display()
                    ),
                }
                report
            }
            Err(e) => {
                eprintln!("fleetgate bench: {e}");
                return 1;
            }
        }
    } else if plan.multi_turn.is_some() {
        match super::multiturn::run(plan.clone(), stop).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("fleetgate bench: {e}");
                return 1;
            }
        }
    } else {
        match execute(plan.clone(), stop).await {
            Ok(r) => build_report(&plan, &r),
            Err(e) => {
                eprintln!("fleetgate bench: {e}");
                return 1;
            }
        }
    };
    out!("{}", report.text);
    if let Some(path) = result_path(&args, &plan) {
        let text = serde_json::to_vec_pretty(&report.json).unwrap_or_default();
        match std::fs::write(&path, text) {
            Ok(()) => eprintln!("fleetgate bench: result written to {}", path.display()),
            Err(e) => {
                eprintln!("fleetgate bench: cannot write {}: {e}", path.display());
                return 1;
            }
        }
    }
    report.exit
}
