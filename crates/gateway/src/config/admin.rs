//! `[admin]`: the admin API listener and how its JWTs are verified (algorithm, key,
//! audience, issuer).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::server::RawTls;
use super::{ConfigError, FileErrors};
use crate::secret::Secret;

/// Signing algorithm accepted for admin JWTs (fixed by config: a token with another `alg` is
/// rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub enum JwtAlgorithm {
    #[default]
    HS256,
    RS256,
    ES256,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwtKey {
    /// HS256 shared secret.
    Secret(Secret),
    /// RS256/ES256 public key (PEM), for verifying only.
    PublicKeyPem(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// The admin API listener (`None`: no admin listener).
    pub listen: Option<SocketAddr>,
    pub jwt_algorithm: JwtAlgorithm,
    /// `None`: the admin API answers 401 explaining that no JWT key is configured.
    pub jwt_key: Option<JwtKey>,
    pub jwt_audience: Option<String>,
    pub jwt_issuer: Option<String>,
    /// Tokens whose `exp` lies further ahead are refused (`None`: no maximum).
    pub jwt_max_lifetime: Option<std::time::Duration>,
    /// TLS on the admin listener (`None`: plain HTTP, for loopback or behind a TLS proxy).
    pub tls: Option<super::TlsConfig>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 8081))),
            jwt_algorithm: JwtAlgorithm::HS256,
            jwt_key: None,
            jwt_audience: None,
            jwt_issuer: None,
            jwt_max_lifetime: None,
            tls: None,
        }
    }
}

pub(super) fn validate(ad: RawAdmin, err: FileErrors<'_>) -> Result<AdminConfig, ConfigError> {
    let listen = if ad.listen.trim().is_empty() {
        None
    } else {
        Some(ad.listen.parse::<SocketAddr>().map_err(|_| {
            err.at(
                "admin.listen",
                format!(
                    "`{}` is not an address:port (\"\" disables the admin listener)",
                    ad.listen
                ),
            )
        })?)
    };
    let secret = ad.jwt_secret.filter(|s| !s.is_empty());
    let jwt_key = match (
        ad.jwt_algorithm,
        secret,
        ad.jwt_public_key_file.map(|p| err.path(p)),
    ) {
        (JwtAlgorithm::HS256, Some(s), None) => {
            if s.len() < 32 {
                return Err(err.at(
                    "admin.jwt_secret",
                    "must be at least 32 characters (e.g. `openssl rand -base64 48`)",
                ));
            }
            Some(JwtKey::Secret(Secret::new(s)))
        }
        (JwtAlgorithm::HS256, None, None) => None,
        (JwtAlgorithm::HS256, _, Some(_)) => {
            return Err(err.at(
                "admin.jwt_public_key_file",
                "HS256 uses admin.jwt_secret; set jwt_algorithm = \"RS256\" or \"ES256\" to use a public key",
            ));
        }
        (_, Some(_), _) => {
            return Err(err.at(
                "admin.jwt_secret",
                "RS256/ES256 verify with admin.jwt_public_key_file, not a shared secret",
            ));
        }
        (_, None, Some(path)) => Some(JwtKey::PublicKeyPem(std::fs::read(&path).map_err(|e| {
            err.at(
                "admin.jwt_public_key_file",
                format!("{}: {e}", path.display()),
            )
        })?)),
        (_, None, None) => None,
    };
    Ok(AdminConfig {
        listen,
        jwt_algorithm: ad.jwt_algorithm,
        jwt_key,
        jwt_audience: ad.jwt_audience,
        jwt_issuer: ad.jwt_issuer,
        jwt_max_lifetime: match ad.jwt_max_lifetime_s {
            None => None,
            Some(0) => {
                return Err(err.at(
                    "admin.jwt_max_lifetime_s",
                    "must be > 0 (seconds; leave it out for no maximum)",
                ));
            }
            Some(s) => Some(std::time::Duration::from_secs(s)),
        },
        tls: ad.tls.map(|t| super::TlsConfig {
            cert: err.path(t.cert),
            key: err.path(t.key),
        }),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    #[serde(default = "default_admin_listen")]
    pub(super) listen: String,
    #[serde(default)]
    pub(super) jwt_algorithm: JwtAlgorithm,
    pub(super) jwt_secret: Option<String>,
    pub(super) jwt_public_key_file: Option<PathBuf>,
    pub(super) jwt_audience: Option<String>,
    pub(super) jwt_issuer: Option<String>,
    /// Longest accepted time from now to a token's `exp`, in seconds.
    pub(super) jwt_max_lifetime_s: Option<u64>,
    /// TLS on the admin listener (the API, `/metrics` and the console).
    #[serde(default)]
    pub(super) tls: Option<RawTls>,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: default_admin_listen(),
            jwt_algorithm: JwtAlgorithm::HS256,
            jwt_secret: None,
            jwt_public_key_file: None,
            jwt_audience: None,
            jwt_issuer: None,
            jwt_max_lifetime_s: None,
            tls: None,
        }
    }
}

fn default_admin_listen() -> String {
    "127.0.0.1:8081".to_owned()
}
