//! `fleetgate keys`: create, list, show, revoke, rotate and audit, its arguments
//! (`KeysCommand`, `KeysArgs`) and how a key is printed.

use std::time::Duration;

use clap::{Args, Subcommand};
use fleetgate_protocol::outln;

use fleetgate_gateway::clock::{format_wall_ms, parse_duration, wall_ms};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::key::KeyRecord;
use fleetgate_gateway::store::{CreateKey, KeyStore};

use super::{Actor, Opening, StoreArgs, open, print_json};

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Issue a key (printed once).
    #[command(
        after_help = "Examples:\n  fleetgate keys create --env stress --name 'nightly load test' --rpm 600 --tpm 2000000 --max-streams 64\n  fleetgate keys create --env prod --name 'chat frontend' --models qwen32b --expires 90d\n  fleetgate keys create --env prod --name 'search indexer' --models embed --endpoints embeddings,rerank\n  export OPENAI_API_KEY=$(fleetgate keys create --env gray --name canary -q)"
    )]
    Create {
        /// The key's environment: stress, gray or prod (it decides the key's priority in the
        /// admission queue, and labels its requests in the metrics and the request log).
        #[arg(long)]
        env: Environment,
        /// A name for people: shown by `keys list`, in the console and in the audit trail.
        #[arg(long)]
        name: String,
        /// Models the key may use (comma-separated; default all).
        #[arg(long, value_delimiter = ',')]
        models: Option<Vec<String>>,
        /// Endpoint families the key may call (comma-separated; default all): chat,
        /// completions, responses, messages, tokenize, embeddings, rerank, score, classify,
        /// pooling, audio.
        #[arg(long, value_delimiter = ',')]
        endpoints: Option<Vec<String>>,
        /// Requests per minute.
        #[arg(long)]
        rpm: Option<i64>,
        /// Tokens per minute.
        #[arg(long)]
        tpm: Option<i64>,
        /// Concurrent streams.
        #[arg(long)]
        max_streams: Option<i64>,
        /// Lifetime, e.g. 7d, 12h.
        #[arg(long)]
        expires: Option<String>,
        /// Free-form JSON object stored with the key.
        #[arg(long)]
        metadata: Option<String>,
        /// Print the key and its record as JSON.
        #[arg(long, conflicts_with = "quiet")]
        json: bool,
        /// Print only the key (for scripts:
        /// `export OPENAI_API_KEY=$(fleetgate keys create --env prod --name x -q)`).
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        actor: Actor,
    },
    /// List keys (never their secrets).
    #[command(
        after_help = "Examples:\n  fleetgate keys list --env prod\n  fleetgate keys list --json --sqlite fleetgate.db"
    )]
    List {
        #[arg(long)]
        env: Option<Environment>,
        #[arg(long)]
        json: bool,
    },
    /// Show one key (by its id, or the whole key).
    #[command(after_help = "Examples:\n  fleetgate keys show AbCdEfGhIjKl --json")]
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key at once, on every gateway.
    #[command(
        after_help = "Examples:\n  fleetgate keys revoke AbCdEfGhIjKl --reason 'leaked in CI log'"
    )]
    Revoke {
        id: String,
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        actor: Actor,
    },
    /// Give a key a new secret; the old one keeps working for the grace period.
    #[command(
        after_help = "Examples:\n  fleetgate keys rotate AbCdEfGhIjKl --grace 10m\n  export OPENAI_API_KEY=$(fleetgate keys rotate AbCdEfGhIjKl --grace 1h -q)"
    )]
    Rotate {
        id: String,
        #[arg(long, default_value = "10m")]
        grace: String,
        /// Print only the new key (for scripts).
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        actor: Actor,
    },
    /// The audit trail (of one key, or all).
    #[command(
        after_help = "Examples:\n  fleetgate keys audit AbCdEfGhIjKl\n  fleetgate keys audit --limit 200 --json"
    )]
    Audit {
        id: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
pub struct KeysArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(subcommand)]
    pub command: KeysCommand,
}

fn when(ms: Option<i64>) -> String {
    ms.map_or_else(|| "-".into(), format_wall_ms)
}

fn print_key(k: &KeyRecord) {
    let v = k.view();
    outln!("id:           {}", v.public_id);
    outln!("name:         {}", v.name);
    outln!("environment:  {}", v.environment);
    outln!("status:       {}", v.status);
    outln!(
        "created:      {} by {}",
        format_wall_ms(v.created_at),
        v.created_by
    );
    outln!("expires:      {}", when(v.expires_at));
    if let Some(at) = v.revoked_at {
        outln!(
            "revoked:      {} by {} ({})",
            format_wall_ms(at),
            v.revoked_by.unwrap_or("-"),
            v.revoke_reason.unwrap_or("-")
        );
    }
    if let Some(until) = v.previous_secret_valid_until {
        outln!("old secret:   valid until {}", format_wall_ms(until));
    }
    outln!(
        "models:       {}",
        v.allowed_models
            .map_or_else(|| "all".into(), |m| m.join(", "))
    );
    outln!(
        "endpoints:    {}",
        v.allowed_endpoints
            .map_or_else(|| "all".into(), |e| e.join(", "))
    );
    let limit = |v: Option<i64>| v.map_or_else(|| "default".into(), |v| v.to_string());
    outln!(
        "limits:       {} req/min, {} tokens/min, {} concurrent streams",
        limit(v.requests_per_minute),
        limit(v.tokens_per_minute),
        limit(v.max_concurrent_streams)
    );
}

pub async fn run_keys(args: KeysArgs) -> Result<(), String> {
    let how = match args.command {
        KeysCommand::Create { .. } => Opening::CreateSaying,
        _ => Opening::Existing,
    };
    let store = open(&args.store, how).await?;
    match args.command {
        KeysCommand::Create {
            env,
            name,
            models,
            endpoints,
            rpm,
            tpm,
            max_streams,
            expires,
            metadata,
            json,
            quiet,
            actor,
        } => {
            let req = CreateKey {
                name,
                environment: Some(env),
                allowed_models: models,
                allowed_endpoints: endpoints,
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
                max_concurrent_streams: max_streams,
                expires_in_seconds: lifetime_seconds(expires.as_deref())?,
                metadata: metadata_json(metadata.as_deref())?,
            };
            let print = if json {
                Print::Json
            } else if quiet {
                Print::KeyOnly
            } else {
                Print::Text
            };
            create(&store, &req, &actor.name(), print).await
        }
        KeysCommand::List { env, json } => list(&store, env, json).await,
        KeysCommand::Show { id, json } => show(&store, key_id(&id), json).await,
        KeysCommand::Revoke { id, reason, actor } => {
            revoke(&store, key_id(&id), &reason, &actor.name()).await
        }
        KeysCommand::Rotate {
            id,
            grace,
            quiet,
            actor,
        } => rotate(&store, key_id(&id), &grace, &actor.name(), quiet).await,
        KeysCommand::Audit { id, limit, json } => {
            audit(&store, id.as_deref().map(key_id), limit, json).await
        }
    }
}

/// A key's public id, given as the id or as the whole key (`keys revoke "$OPENAI_API_KEY"`).
fn key_id(given: &str) -> &str {
    fleetgate_gateway::key::parse(given.trim()).map_or(given, |k| k.public_id)
}

/// `--expires` (e.g. `7d`) in seconds.
fn lifetime_seconds(expires: Option<&str>) -> Result<Option<i64>, String> {
    match expires {
        Some(e) => Ok(Some(
            i64::try_from(parse_duration(e).map_err(|e| e.to_string())?.as_secs())
                .map_err(|e| e.to_string())?,
        )),
        None => Ok(None),
    }
}

fn metadata_json(metadata: Option<&str>) -> Result<Option<serde_json::Value>, String> {
    match metadata {
        Some(m) => Ok(Some(
            serde_json::from_str::<serde_json::Value>(m)
                .map_err(|e| format!("--metadata is not JSON: {e}"))?,
        )),
        None => Ok(None),
    }
}

/// How `keys create` prints what it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Print {
    Text,
    Json,
    KeyOnly,
}

/// `fleetgate keys create`.
async fn create(store: &KeyStore, req: &CreateKey, who: &str, print: Print) -> Result<(), String> {
    let (full, record) = store.create(req, who).await.map_err(|e| e.to_string())?;
    match print {
        Print::Json => {
            return print_json(&serde_json::json!({"key": full, "record": record.view()}));
        }
        Print::KeyOnly => {
            outln!("{full}");
            return Ok(());
        }
        Print::Text => {}
    }
    outln!(
        "Created key {} ({}). It is shown only this once:\n",
        record.public_id,
        record.environment
    );
    outln!("  {full}\n");
    outln!("  export FLEETGATE_API_KEY={full}\n");
    print_key(&record);
    Ok(())
}

/// `fleetgate keys list`.
async fn list(store: &KeyStore, env: Option<Environment>, json: bool) -> Result<(), String> {
    let keys = store.list(env).await.map_err(|e| e.to_string())?;
    if json {
        let views: Vec<_> = keys.iter().map(KeyRecord::view).collect();
        return print_json(&views);
    }
    let now = wall_ms();
    outln!(
        "{:<12}  {:<6}  {:<7}  {:<20}  {:<20}  NAME",
        "ID",
        "ENV",
        "STATUS",
        "CREATED",
        "EXPIRES"
    );
    for k in &keys {
        outln!(
            "{:<12}  {:<6}  {:<7}  {:<20}  {:<20}  {}",
            k.public_id,
            k.environment,
            k.status(now),
            format_wall_ms(k.created_at),
            when(k.expires_at),
            k.name
        );
    }
    if keys.is_empty() {
        outln!("(no keys — create one with `fleetgate keys create --env stress --name ...`)");
    }
    Ok(())
}

/// `fleetgate keys show`.
async fn show(store: &KeyStore, id: &str, json: bool) -> Result<(), String> {
    let k = store
        .get(id)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("key `{id}` not found (list them with `fleetgate keys list`)"))?;
    if json {
        return print_json(&k.view());
    }
    print_key(&k);
    Ok(())
}

/// `fleetgate keys revoke`.
async fn revoke(store: &KeyStore, id: &str, reason: &str, who: &str) -> Result<(), String> {
    let k = store
        .revoke(id, reason, who)
        .await
        .map_err(|e| e.to_string())?;
    // The gateways learn it through NOTIFY or their poll of the change counter: the command
    // returns once they have, so that the next request with the key, sent after it, is refused.
    tokio::time::sleep(fleetgate_gateway::auth::sync::propagation(store.kind())).await;
    outln!(
        "Revoked {} at {}: every gateway on this store refuses it from now on.",
        k.public_id,
        when(k.revoked_at)
    );
    Ok(())
}

/// `fleetgate keys rotate`.
async fn rotate(
    store: &KeyStore,
    id: &str,
    grace: &str,
    who: &str,
    quiet: bool,
) -> Result<(), String> {
    let grace: Duration = parse_duration(grace).map_err(|e| e.to_string())?;
    let (full, k) = store
        .rotate(id, grace, who)
        .await
        .map_err(|e| e.to_string())?;
    if quiet {
        outln!("{full}");
        return Ok(());
    }
    outln!(
        "New secret for {} (shown only this once):\n\n  {full}\n",
        k.public_id
    );
    outln!(
        "The old secret keeps working until {}.",
        when(k.previous.map(|(_, until)| until))
    );
    Ok(())
}

/// `fleetgate keys audit`.
async fn audit(store: &KeyStore, id: Option<&str>, limit: i64, json: bool) -> Result<(), String> {
    let entries = store
        .audit_log(id, limit.clamp(1, 100_000))
        .await
        .map_err(|e| e.to_string())?;
    if json {
        return print_json(&entries);
    }
    for e in entries {
        outln!(
            "{}  {:<8}  {:<12}  {:<20}  {}",
            format_wall_ms(e.at),
            e.action,
            e.key_public_id.as_deref().unwrap_or("-"),
            e.actor,
            e.detail_for_people()
        );
    }
    Ok(())
}
