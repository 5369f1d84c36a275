//! Operator commands against the key store: `fleetgate keys ...`, `fleetgate migrate` and
//! `fleetgate admin-token`. They talk to the database directly (the same one the gateways
//! use); gateways pick the change up through NOTIFY (PostgreSQL) or the change counter (SQLite).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use fleetgate_protocol::outln;

use fleetgate_gateway::admin::jwt::{self, Role};
use fleetgate_gateway::clock::{format_wall_ms, parse_duration, wall_ms};
use fleetgate_gateway::config::{Config, DatabaseConfig, DbKind};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::key::KeyRecord;
use fleetgate_gateway::secret::Secret;
use fleetgate_gateway::store::{CreateKey, KeyStore};
use fleetgate_gateway::telemetry::usage::GroupBy;

/// Where the key store is: a config file's `[database]`, or given directly. Global: accepted
/// before or after the subcommand (`fleetgate keys --sqlite DB create …` and `fleetgate keys
/// create --sqlite DB …` are the same).
#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
    /// Config file whose `[database]` section names the store.
    #[arg(long, short, global = true, default_value = "config/fleetgate.toml")]
    pub config: PathBuf,
    /// PostgreSQL URL (overrides the config).
    #[arg(
        long,
        global = true,
        env = "FLEETGATE_DATABASE_URL",
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// SQLite file (overrides the config).
    #[arg(long, global = true, conflicts_with = "database_url")]
    pub sqlite: Option<PathBuf>,
}

impl StoreArgs {
    pub fn database(&self) -> Result<DatabaseConfig, String> {
        if let Some(url) = &self.database_url {
            return Ok(DatabaseConfig {
                url: Some(Secret::new(url.clone())),
                ..DatabaseConfig::default()
            });
        }
        if let Some(path) = &self.sqlite {
            return Ok(DatabaseConfig {
                sqlite_path: path.clone(),
                ..DatabaseConfig::default()
            });
        }
        Config::load(&self.config)
            .map(|c| c.database)
            .map_err(|e| e.to_string())
    }
}

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

/// Who makes a change (`keys create`, `revoke`, `rotate`): only the commands that change a key
/// take it.
#[derive(Args, Debug, Clone, Default)]
pub struct Actor {
    /// Recorded in the audit trail as who made the change (default: `<local user>@cli`).
    #[arg(long)]
    pub actor: Option<String>,
}

impl Actor {
    fn name(&self) -> String {
        self.actor
            .clone()
            .unwrap_or_else(|| format!("{}@cli", local_user()))
    }
}

/// The user running the command: `$USER`, else `$LOGNAME`, else the name /etc/passwd gives
/// this process's user id, else `uid N` (a container often sets neither variable).
pub fn local_user() -> String {
    for var in ["USER", "LOGNAME"] {
        if let Ok(v) = std::env::var(var)
            && !v.trim().is_empty()
        {
            return v.trim().to_owned();
        }
    }
    use std::os::unix::fs::MetadataExt;
    let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return "unknown user".into();
    };
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| {
            passwd.lines().find_map(|l| {
                let mut f = l.split(':');
                let name = f.next()?;
                (f.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_owned())
            })
        })
        .unwrap_or_else(|| format!("uid {uid}"))
}

/// How a command may open the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// Reads and changes to keys that exist (`keys list`, `revoke`, `usage`, ...): a store that
    /// does not exist is an error naming where it was looked for; nothing is created.
    Existing,
    /// `keys create`: a new store is created, and stderr says where, so that a key issued into
    /// a file no gateway reads does not go unnoticed.
    CreateSaying,
    /// `migrate`: creates the store, and says so on its own.
    Create,
}

/// Open the store (an existing one is brought up to the current schema, except by `migrate`,
/// which does it itself). `serve` and the demo open theirs elsewhere, creating them.
async fn open(store: &StoreArgs, how: Opening) -> Result<KeyStore, String> {
    let db = store.database()?;
    if db.kind() == DbKind::Sqlite && !db.sqlite_path.exists() && how != Opening::Create {
        let path = std::path::absolute(&db.sqlite_path).unwrap_or_else(|_| db.sqlite_path.clone());
        let named_by = if store.sqlite.is_some() {
            "--sqlite".to_owned()
        } else {
            format!(
                "database.sqlite_path of {}, relative to that file's directory",
                store.config.display()
            )
        };
        if how == Opening::Existing {
            return Err(format!(
                "no key store at {} (named by {named_by}); nothing was created. Point --config or --sqlite at the store your gateway uses (`fleetgate serve`, `fleetgate migrate` and the demo create theirs)",
                path.display(),
            ));
        }
        eprintln!(
            "fleetgate: no key store at {} (named by {named_by}): creating a new one. A gateway accepts the key only if it uses this store",
            path.display()
        );
    }
    let migrate = how != Opening::Create;
    let s = KeyStore::connect(&db)
        .await
        .map_err(|e| format!("{}: {e}", db.describe()))?;
    if migrate {
        s.migrate()
            .await
            .map_err(|e| format!("{}: {e}", db.describe()))?;
    }
    Ok(s)
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

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), String> {
    outln!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
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

/// `fleetgate migrate`.
pub async fn run_migrate(store: StoreArgs) -> Result<(), String> {
    let db = store.database()?;
    let s = open(&store, Opening::Create).await?;
    let n = s
        .migrate()
        .await
        .map_err(|e| format!("{}: {e}", db.describe()))?;
    outln!(
        "{}: {n} migration(s) applied; schema is current.",
        db.describe()
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct AdminTokenArgs {
    #[arg(long, short, default_value = "config/fleetgate.toml")]
    pub config: PathBuf,
    #[arg(long, value_parser = ["admin", "viewer"], default_value = "admin")]
    pub role: String,
    /// Lifetime, e.g. 1h.
    #[arg(long, default_value = "1h")]
    pub ttl: String,
    /// Subject recorded in the audit trail.
    #[arg(long)]
    pub sub: Option<String>,
}

/// `--role admin|viewer` (clap has checked the value).
fn role(name: &str) -> Role {
    if name == "viewer" {
        Role::Viewer
    } else {
        Role::Admin
    }
}

/// `fleetgate admin-token`: print a token minted from the configured HS256 secret.
pub fn run_admin_token(args: AdminTokenArgs) -> Result<(), String> {
    let cfg = Config::load(&args.config).map_err(|e| e.to_string())?;
    let role = role(&args.role);
    let ttl = parse_duration(&args.ttl).map_err(|e| e.to_string())?;
    let sub = args.sub.unwrap_or_else(|| format!("{}@cli", local_user()));
    let token = jwt::mint(&cfg.admin, role, &sub, ttl).map_err(|e| e.to_string())?;
    outln!("{token}");
    Ok(())
}

#[derive(Args, Debug)]
pub struct ConsoleLoginArgs {
    #[arg(long, short, default_value = "config/fleetgate.toml")]
    pub config: PathBuf,
    #[arg(long, value_parser = ["admin", "viewer"], default_value = "admin")]
    pub role: String,
    /// How long the session lasts once the link is opened (at most 7d), e.g. 8h.
    #[arg(long, default_value = "8h")]
    pub ttl: String,
    /// Who signs in: every console action is recorded in the audit trail under this name
    /// (default: the local user, `$USER`, else `$LOGNAME`, else the name of this user id).
    #[arg(long)]
    pub sub: Option<String>,
    /// The console's address as the browser reaches it (default: from admin.listen), e.g.
    /// https://gateway-admin.example.com.
    #[arg(long)]
    pub url: Option<String>,
}

/// `fleetgate console-login`: print a one-time sign-in link to the console.
pub fn run_console_login(args: ConsoleLoginArgs) -> Result<(), String> {
    let cfg = Config::load(&args.config).map_err(|e| e.to_string())?;
    let role = role(&args.role);
    let ttl = parse_duration(&args.ttl).map_err(|e| e.to_string())?;
    if ttl > fleetgate_gateway::admin::console::session::MAX_SESSION {
        return Err(format!(
            "--ttl {}: a console session lasts at most 7d",
            args.ttl
        ));
    }
    let base = match (&args.url, cfg.admin.listen) {
        (Some(u), _) => u.trim_end_matches('/').to_owned(),
        (None, Some(addr)) => {
            let host = match addr.ip() {
                ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
                std::net::IpAddr::V6(ip) => format!("[{ip}]"),
                ip @ std::net::IpAddr::V4(_) => ip.to_string(),
            };
            let scheme = if cfg.admin.tls.is_some() {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{host}:{}", addr.port())
        }
        (None, None) => {
            return Err("the admin listener is off (admin.listen = \"\") and the console is served by it: set admin.listen, or pass --url".into());
        }
    };
    let sub = args.sub.unwrap_or_else(local_user);
    let token = fleetgate_gateway::admin::console::session::mint_login(&cfg.admin, role, &sub, ttl).map_err(|e| match e {
        jwt::MintError::NoSecret => "console-login signs links with admin.jwt_secret (HS256), which is not set: set it, at least 32 characters, where the gateway starts and where you run this command (config/fleetgate.toml reads it from FLEETGATE_ADMIN_JWT_SECRET). With RS256/ES256, open <admin listener>/console/login?token=<an admin API token from your issuer> instead: it signs in once.".to_owned(),
        other => other.to_string(),
    })?;
    outln!("{base}/console/login?token={token}");
    eprintln!(
        "Open this link within 10 minutes; it signs in once, as {sub} ({}), for {}.",
        args.role, args.ttl
    );
    Ok(())
}

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
