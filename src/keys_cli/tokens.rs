//! `fleetgate admin-token` and `fleetgate console-login`: an admin API token, and a one-time
//! sign-in link to the console, both minted from the configured HS256 secret.

use std::path::PathBuf;

use clap::Args;
use fleetgate_protocol::outln;

use fleetgate_gateway::admin::jwt::{self, Role};
use fleetgate_gateway::clock::parse_duration;
use fleetgate_gateway::config::Config;

use super::local_user;

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
