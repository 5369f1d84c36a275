//! Operator commands: `fleetgate keys ...`, `fleetgate migrate`, `fleetgate admin-token`,
//! `fleetgate console-login` and `fleetgate usage`. The store commands talk to the database
//! directly (the same one the gateways use); gateways pick the change up through NOTIFY
//! (PostgreSQL) or the change counter (SQLite).
//!
//! This file holds what the commands share (`StoreArgs` and opening the store, `Actor` and
//! `local_user`, `print_json`) and `fleetgate migrate`; the rest is a file per concern:
//! `keys.rs` (`fleetgate keys`), `tokens.rs` (`admin-token`, `console-login`: credentials for
//! the admin API and the console) and `usage.rs` (`usage`: the request log summarised).

use std::path::PathBuf;

use clap::Args;
use fleetgate_protocol::outln;

use fleetgate_gateway::config::{Config, DatabaseConfig, DbKind};
use fleetgate_gateway::secret::Secret;
use fleetgate_gateway::store::KeyStore;

mod keys;
mod tokens;
mod usage;

pub use keys::{KeysArgs, run_keys};
pub use tokens::{AdminTokenArgs, ConsoleLoginArgs, run_admin_token, run_console_login};
pub use usage::{UsageArgs, run_usage};

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

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), String> {
    outln!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
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
