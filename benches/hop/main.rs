//! Hop-cost benchmark: what one hop through fleetgate adds to a streamed chat completion,
//! measured against direct calls to the same backend and against nginx as the floor.
//!
//! Three targets share one backend: `direct` (the sim itself), `fleetgate` (the gateway in
//! front of it) and `nginx` (nginx in front of it). Every phase interleaves the three, so slow
//! drift of the machine falls on all of them alike:
//!
//! 1. latency at concurrency 1: rounds of one request per target in a rotating order;
//! 2. open loop: constant-rate arrivals in slices rotating direct → fleetgate → nginx, with the
//!    CPU time of every given process per completed request;
//! 3. memory: thousands of slow streams held open through fleetgate, then through nginx, with
//!    the resident set of the proxy read from /proc.
//!
//! `scripts/bench-hop.sh` starts the processes and passes their URLs and pids; run by hand with
//! `cargo bench --bench hop -- --help`. Output: a JSON file with every figure, and a markdown
//! summary on stdout.
//!
//! `args` holds the flags; `target` the three targets and one measured request; `procfs` the
//! CPU and memory readings from /proc; `summary` the percentiles; `latency`, `openloop` and
//! `memory` one phase each; `report` the markdown sections, the recorded hop set beside the
//! client-seen added TTFT, and the targets table. This file runs the phases in order and
//! writes the JSON.

mod args;
mod burst;
mod error;
mod latency;
mod memory;
mod openloop;
mod procfs;
mod report;
mod summary;
mod target;

use std::sync::Arc;

use clap::Parser;
use fleetgate_protocol::client;
use serde_json::{Value, json};

use crate::args::Args;
use crate::error::Res;
use crate::latency::phase_latency;
use crate::memory::{mem_one, mib};
use crate::openloop::phase_openloop;
use crate::procfs::Watched;
use crate::summary::{Summary, summarize};
use crate::target::{NAMES, PROTOCOL, Target, api_body, api_uri, measure, request_headers};

fn main() -> Res<()> {
    let args = Args::parse();
    let _ = PROTOCOL.set(args.protocol);
    let runtime = if args.driver_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.driver_threads)
            .enable_all()
            .build()?
    };
    runtime.block_on(run(args))
}
async fn run(args: Args) -> Res<()> {
    let phases: Vec<&str> = args.phases.iter().map(|s| s.trim()).collect();
    for p in &phases {
        if !["burst", "latency", "openloop", "memory"].contains(p) {
            return Err(format!("unknown phase `{p}` (burst, latency, openloop, memory)").into());
        }
    }
    let bases = [&args.direct, &args.fleetgate, &args.nginx];
    let mut targets = Vec::new();
    for (name, base) in NAMES.iter().zip(bases) {
        targets.push(Target {
            name,
            client: client::http_client(),
            uri: api_uri(base)?,
        });
    }
    let headers = Arc::new(request_headers(args.api_key.as_deref())?);
    let body = api_body(&args.model, args.max_tokens, !args.no_include_usage);
    let watched = Watched {
        groups: vec![
            ("gateway", args.gateway_pid.into_iter().collect()),
            ("nginx", args.nginx_pids.clone()),
            ("sim", args.sim_pid.into_iter().collect()),
        ],
    };
    // Fail fast with the reason when a target does not answer correctly.
    for t in &targets {
        measure(&t.client, &t.uri, &headers, body.clone(), args.max_tokens)
            .await
            .map_err(|e| format!("{} ({}) does not answer correctly: {e}", t.name, t.uri))?;
    }

    let env = report::environment();
    let mut md = String::new();
    let mut out = json!({
        "environment": env,
        "request": {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "stream": true,
            "include_usage": !args.no_include_usage,
            "body_bytes": body.len(),
        },
        "targets": {"direct": args.direct, "fleetgate": args.fleetgate, "nginx": args.nginx},
        "pids": {"gateway": args.gateway_pid, "nginx": args.nginx_pids, "sim": args.sim_pid},
        "driver_threads": args.driver_threads,
        "label": args.label,
    });
    report::heading(&mut md, &args, &env);

    // The burst phase runs first: its first burst is the proxies' first traffic but for the
    // one request that checked each target above.
    if phases.contains(&"burst") {
        let mut plan = Vec::new();
        for (name, base, pids) in [
            (
                "fleetgate",
                args.mem_fleetgate.clone(),
                args.gateway_pid.into_iter().collect::<Vec<_>>(),
            ),
            (
                "nginx",
                args.burst_nginx.clone().or_else(|| args.mem_nginx.clone()),
                args.nginx_pids.clone(),
            ),
            (
                "direct",
                args.burst_direct.clone(),
                args.burst_sim_pid.into_iter().collect(),
            ),
        ] {
            match base {
                Some(base) if !pids.is_empty() => plan.push((name, base, pids)),
                _ => eprintln!("hop: burst via {name} skipped (no base URL or no pid)"),
            }
        }
        eprintln!(
            "hop: burst: {} rounds of {} streams at once per proxy",
            args.burst_rounds, args.burst_streams
        );
        let bursts = burst::bursts(&args, &plan, &headers).await?;
        report::burst_section(&mut md, &args, &bursts);
        out["burst"] = Value::Array(bursts);
    }

    let mut added_p50 = None;
    let mut hop_rows: Vec<Value> = Vec::new();
    let mut added_p99 = None;
    if phases.contains(&"latency") {
        eprintln!(
            "hop: latency at concurrency 1, {} rounds after {} warm-up rounds",
            args.rounds, args.warmup_rounds
        );
        let lat = phase_latency(&args, &targets, &headers, &body, &watched).await?;
        report::latency_section(&mut md, &args, &lat);
        hop_rows.push(report::hop_json(
            "latency_c1",
            &lat.hop[1],
            lat.added_diff[0][0],
            lat.ttft[1].mean - lat.ttft[0].mean,
            lat.added_paired[0].p50,
        ));
        added_p50 = Some(lat.added_diff[0][0]);
        added_p99 = Some(lat.added_diff[0][2]);
        out["latency_c1"] = lat.json;
    }

    let mut ol_p99_ok = None;
    let mut cpu_ratio = None;
    let mut ol_figures = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    if phases.contains(&"openloop") {
        eprintln!(
            "hop: open loop at {}/s, {} s slices × {} rotations",
            args.rate, args.slice_secs, args.repeats
        );
        let warmed = phases.contains(&"latency");
        let ol = phase_openloop(&args, &targets, &headers, &body, &watched, warmed).await?;
        let sums: Vec<Summary> = ol.per_target.iter().map(|a| summarize(&a.ttft)).collect();
        let fg_hop = summarize(&ol.per_target[1].hop);
        report::openloop_section(&mut md, &args, &ol, &sums, &fg_hop);
        hop_rows.push(report::hop_json(
            "open_loop",
            &fg_hop,
            sums[1].p50 - sums[0].p50,
            sums[1].mean - sums[0].mean,
            f64::NAN,
        ));
        let fg_added = sums[1].p99 - sums[0].p99;
        let ng_added = sums[2].p99 - sums[0].p99;
        if fg_added.is_finite() && ng_added.is_finite() {
            ol_p99_ok = Some(fg_added <= ng_added);
        }
        let fg_cpu = ol.per_target[1].cpu_us_per_request("gateway");
        let ng_cpu = ol.per_target[2].cpu_us_per_request("nginx");
        if args.gateway_pid.is_some() && !args.nginx_pids.is_empty() && ng_cpu > 0.0 {
            cpu_ratio = Some(fg_cpu / ng_cpu);
        }
        ol_figures = (fg_added, ng_added, fg_cpu, ng_cpu);
        out["open_loop"] = ol.json;
    }

    let mut peak_rss_mib = None;
    if phases.contains(&"memory") {
        let mut mem = Vec::new();
        let plan = [
            (
                "fleetgate",
                args.mem_fleetgate.as_deref(),
                args.gateway_pid.into_iter().collect::<Vec<_>>(),
            ),
            ("nginx", args.mem_nginx.as_deref(), args.nginx_pids.clone()),
        ];
        for (name, base, pids) in plan {
            let Some(base) = base else {
                eprintln!("hop: memory via {name} skipped (no --mem-{name})");
                continue;
            };
            if pids.is_empty() {
                eprintln!("hop: memory via {name} skipped (no pid given)");
                continue;
            }
            eprintln!("hop: memory: {} open streams via {name}", args.mem_streams);
            mem.push(mem_one(&args, name, base, &pids, &headers).await?);
        }
        report::memory_section(&mut md, &args, &mem);
        for m in &mem {
            if m["via"] == "fleetgate"
                && m["open_at_reading"].as_u64() == Some(args.mem_streams as u64)
            {
                peak_rss_mib = Some(mib(m["hwm_open_kib"].as_u64().unwrap_or(0)));
            }
        }
        out["memory"] = Value::Array(mem);
    }

    if !args.no_targets {
        report::targets_table(
            &mut md,
            &args,
            [added_p50, added_p99],
            ol_p99_ok,
            ol_figures,
            cpu_ratio,
            peak_rss_mib,
        );
        out["targets_met"] = json!({
            "added_ttft_p50_c1_le_60us": added_p50.map(|v| v <= 60.0),
            "added_ttft_p99_c1_le_250us": added_p99.map(|v| v <= 250.0),
            "open_loop_added_p99_le_nginx": ol_p99_ok,
            "gateway_cpu_le_1_5x_nginx": cpu_ratio.map(|r| r <= 1.5),
            "peak_rss_le_64mib": peak_rss_mib.map(|v| v <= 64.0),
        });
    }

    out["recorded_hop"] = Value::Array(hop_rows);

    if let Some(dir) = args.out.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&out)?)?;
    print!("{md}");
    eprintln!("hop: wrote {}", args.out.display());
    Ok(())
}
