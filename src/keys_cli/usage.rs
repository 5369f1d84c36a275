//! `fleetgate usage`: the request log summarised per key, environment, model, backend or
//! endpoint, over a window ending now or a calendar month.

use clap::Args;
use fleetgate_protocol::outln;

use fleetgate_gateway::clock::{format_wall_ms, parse_duration, wall_ms};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::telemetry::usage::GroupBy;

use super::{Opening, StoreArgs, open, print_json};

#[derive(Args, Debug)]
pub struct UsageArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Only this environment (stress, gray, prod).
    #[arg(long)]
    pub env: Option<Environment>,
    /// Window ending now, e.g. 1h, 7d.
    #[arg(long, default_value = "1h", conflicts_with = "month")]
    pub since: String,
    /// A calendar month instead (UTC), e.g. 2026-11: the monthly totals per key.
    #[arg(long)]
    pub month: Option<String>,
    /// Group by key, env, model, backend or endpoint (chat, completions, responses, messages,
    /// embeddings, ...).
    #[arg(long, default_value = "key")]
    pub by: GroupBy,
    #[arg(long)]
    pub json: bool,
}

/// `fleetgate usage`: the request log summarised.
pub async fn run_usage(args: UsageArgs) -> Result<(), String> {
    use fleetgate_gateway::telemetry::usage::{UsageQuery, month_window, usage};
    let store = open(&args.store, Opening::Existing).await?;
    let (from, to) = match &args.month {
        Some(m) => month_window(m).map_err(|e| e.to_string())?,
        None => {
            let since = parse_duration(&args.since).map_err(|e| e.to_string())?;
            let now = wall_ms();
            (
                now - i64::try_from(since.as_millis()).unwrap_or(i64::MAX),
                now + 1,
            )
        }
    };
    let q = UsageQuery {
        from,
        to,
        environment: args.env.map(|e| e.as_str().to_owned()),
        by: args.by,
    };
    let rows = usage(&store, &q).await.map_err(|e| e.to_string())?;
    if args.json {
        return print_json(&serde_json::json!({"from": from, "to": to, "groups": rows}));
    }
    outln!("{} .. {}", format_wall_ms(from), format_wall_ms(to));
    // Grouped by key, the key's environment and name follow the figures, under their own
    // headers.
    let key_columns = if args.by == GroupBy::Key {
        format!("  {:<6}  NAME", "ENV")
    } else {
        String::new()
    };
    outln!(
        "{:<24} {:>9} {:>7} {:>12} {:>12}  {:>24}  {:>24}{key_columns}",
        match args.by {
            GroupBy::Key => "KEY",
            GroupBy::Environment => "ENV",
            GroupBy::Model => "MODEL",
            GroupBy::Backend => "BACKEND",
            GroupBy::Endpoint => "ENDPOINT",
        },
        "REQUESTS",
        "ERRORS",
        "PROMPT TOK",
        "COMPL TOK",
        "TTFT ms p50/p95/p99",
        "OVERHEAD ms p50/p95/p99"
    );
    let p = |v: &Option<fleetgate_gateway::telemetry::usage::Percentiles>| {
        v.as_ref().map_or_else(
            || "-".into(),
            |p| format!("{:.1}/{:.1}/{:.1}", p.p50, p.p95, p.p99),
        )
    };
    let op = |v: &Option<fleetgate_gateway::telemetry::usage::Percentiles>| {
        v.as_ref().map_or_else(
            || "-".into(),
            |p| format!("{:.3}/{:.3}/{:.3}", p.p50, p.p95, p.p99),
        )
    };
    for r in &rows {
        // Grouped by key: its environment and name follow the figures.
        let key = match (&r.key_environment, &r.key_name) {
            (Some(env), Some(name)) => format!("  {env:<6}  {name}"),
            _ => String::new(),
        };
        outln!(
            "{:<24} {:>9} {:>7} {:>12} {:>12}  {:>24}  {:>24}{key}",
            r.group,
            r.requests,
            r.errors,
            r.prompt_tokens,
            r.completion_tokens,
            p(&r.client_ttft_ms),
            op(&r.overhead_ms)
        );
    }
    if rows.is_empty() {
        outln!("(no requests in this window)");
    }
    Ok(())
}
