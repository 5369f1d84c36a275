//! Admin API tokens: JWTs verified with the algorithm fixed by config (a token with another
//! `alg` is refused), `exp` required, `nbf` honoured when present (both with the same leeway),
//! `role` admin|viewer, audience and issuer checked when configured. `fleetgate admin-token`
//! mints HS256 tokens for operators.

use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation, errors::ErrorKind};
use serde::{Deserialize, Serialize};

use crate::clock::format_wall_ms;
use crate::config::{AdminConfig, JwtAlgorithm, JwtKey};

/// Clock skew tolerated on `exp` and `nbf`, in seconds.
const LEEWAY_SECONDS: u64 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Admin,
    Viewer,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    /// Who: recorded in the audit table.
    #[serde(default)]
    pub sub: Option<String>,
    pub role: Role,
    pub exp: u64,
    /// Not before (epoch seconds): the token is refused until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// One audience or several (RFC 7519 §4.1.3: a token whose list contains the configured
    /// audience is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<Audience>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
}

/// A token's `aud`: a string or a list of strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JwtError {
    NotConfigured,
    Missing,
    Malformed,
    WrongAlgorithm {
        expected: &'static str,
    },
    Expired,
    /// `nbf` is later than now (beyond the leeway): epoch seconds of `nbf` and of now.
    NotYetValid {
        nbf: u64,
        now: u64,
    },
    BadSignature,
    BadAudience,
    BadIssuer,
    /// A claim the configuration requires (`aud`, `iss`) is absent.
    MissingClaim(&'static str),
    /// `exp` lies further ahead than `admin.jwt_max_lifetime_s` allows.
    TooLong {
        max_s: u64,
    },
    BadClaims(String),
}

impl JwtError {
    pub(crate) fn message(&self) -> String {
        match self {
            JwtError::NotConfigured => "The admin API has no JWT key configured: set admin.jwt_secret (HS256) or admin.jwt_public_key_file (RS256/ES256).".into(),
            JwtError::Missing => "The admin API needs `Authorization: Bearer <JWT>`; mint one with `fleetgate admin-token --role admin --ttl 1h`.".into(),
            JwtError::Malformed => "The admin token is not a well-formed JWT.".into(),
            JwtError::WrongAlgorithm { expected } => format!("The admin token is not signed with {expected}, the algorithm this gateway is configured for."),
            JwtError::Expired => "The admin token has expired: mint a new one.".into(),
            JwtError::NotYetValid { nbf, now } => format!(
                "The admin token is not valid yet: it becomes valid at {} (its `nbf`), and this gateway's clock reads {}. Retry then, or check the clock of whatever minted it.",
                format_wall_ms(epoch_ms(*nbf)),
                format_wall_ms(epoch_ms(*now))
            ),
            JwtError::BadSignature => "The admin token's signature does not verify with the configured key.".into(),
            JwtError::BadAudience => "The admin token's audience (`aud`) is not the configured one.".into(),
            JwtError::BadIssuer => "The admin token's issuer (`iss`) is not the configured one.".into(),
            JwtError::MissingClaim(c) => format!("The admin token carries no `{c}`: this gateway requires it (admin.jwt_{}), so a token minted for another service cannot be used here.", if *c == "aud" { "audience" } else { "issuer" }),
            JwtError::TooLong { max_s } => format!("The admin token's `exp` lies more than {max_s} s ahead (admin.jwt_max_lifetime_s): mint one with a shorter lifetime."),
            JwtError::BadClaims(m) => format!("The admin token's claims are not usable: {m} (needs `exp` and `role` admin|viewer)."),
        }
    }
}

fn epoch_ms(seconds: u64) -> i64 {
    i64::try_from(seconds.saturating_mul(1000)).unwrap_or(i64::MAX)
}

fn algorithm(a: JwtAlgorithm) -> Algorithm {
    match a {
        JwtAlgorithm::HS256 => Algorithm::HS256,
        JwtAlgorithm::RS256 => Algorithm::RS256,
        JwtAlgorithm::ES256 => Algorithm::ES256,
    }
}

fn name(a: JwtAlgorithm) -> &'static str {
    match a {
        JwtAlgorithm::HS256 => "HS256",
        JwtAlgorithm::RS256 => "RS256",
        JwtAlgorithm::ES256 => "ES256",
    }
}

/// The verifier built once from config.
pub(crate) struct Verifier {
    key: Option<DecodingKey>,
    validation: Validation,
    alg: JwtAlgorithm,
    max_lifetime_s: Option<u64>,
}

/// Why the admin settings cannot verify tokens.
#[derive(Debug, thiserror::Error)]
pub enum KeyConfigError {
    #[error("admin.jwt_public_key_file: not an RSA public key: {0}")]
    NotRsa(jsonwebtoken::errors::Error),
    #[error("admin.jwt_public_key_file: not an EC public key: {0}")]
    NotEc(jsonwebtoken::errors::Error),
    #[error("HS256 needs admin.jwt_secret")]
    Hs256NeedsSecret,
}

/// Why a token could not be minted.
#[derive(Debug, thiserror::Error)]
pub enum MintError {
    #[error(
        "admin-token mints HS256 tokens: set admin.jwt_secret, at least 32 characters (config/fleetgate.toml reads it from FLEETGATE_ADMIN_JWT_SECRET: export it where the gateway starts and where you run this command, e.g. `export FLEETGATE_ADMIN_JWT_SECRET=$(head -c 24 /dev/urandom | base64)` before both); for RS256/ES256, sign tokens with your own private key"
    )]
    NoSecret,
    #[error(
        "--ttl {ttl_s}s is longer than admin.jwt_max_lifetime_s = {max_s}: the gateway would refuse the token"
    )]
    TooLong { ttl_s: u64, max_s: u64 },
    #[error("the system clock is before 1970: {0}")]
    Clock(#[from] std::time::SystemTimeError),
    #[error("{0}")]
    Encode(#[from] jsonwebtoken::errors::Error),
}

impl Verifier {
    pub(crate) fn new(cfg: &AdminConfig) -> Result<Self, KeyConfigError> {
        let alg = algorithm(cfg.jwt_algorithm);
        let key = match &cfg.jwt_key {
            None => None,
            Some(JwtKey::Secret(s)) => Some(DecodingKey::from_secret(s.expose().as_bytes())),
            Some(JwtKey::PublicKeyPem(pem)) => Some(match cfg.jwt_algorithm {
                JwtAlgorithm::RS256 => {
                    DecodingKey::from_rsa_pem(pem).map_err(KeyConfigError::NotRsa)?
                }
                JwtAlgorithm::ES256 => {
                    DecodingKey::from_ec_pem(pem).map_err(KeyConfigError::NotEc)?
                }
                JwtAlgorithm::HS256 => return Err(KeyConfigError::Hs256NeedsSecret),
            }),
        };
        let mut validation = Validation::new(alg);
        // jsonwebtoken checks `aud` and `iss` only when a token carries them: a configured
        // audience or issuer must also be present, or a token minted for anything else with
        // the same key would do.
        let mut required = vec!["exp"];
        if cfg.jwt_audience.is_some() {
            required.push("aud");
        }
        if cfg.jwt_issuer.is_some() {
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        validation.leeway = LEEWAY_SECONDS;
        // `nbf` is checked in `verify`, where its value is at hand for the message.
        validation.validate_nbf = false;
        match &cfg.jwt_audience {
            Some(a) => validation.set_audience(&[a]),
            None => validation.validate_aud = false,
        }
        if let Some(i) = &cfg.jwt_issuer {
            validation.set_issuer(&[i]);
        }
        Ok(Self {
            key,
            validation,
            alg: cfg.jwt_algorithm,
            max_lifetime_s: cfg.jwt_max_lifetime.map(|d| d.as_secs()),
        })
    }

    /// Whether a key to verify tokens with is configured (without one every token is
    /// refused, and the answer says to configure one rather than to mint a token).
    pub(crate) fn is_configured(&self) -> bool {
        self.key.is_some()
    }

    pub(crate) fn verify(&self, token: &str) -> Result<Claims, JwtError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.verify_at(token, now)
    }

    /// `verify` with the clock reading `now` (epoch seconds).
    fn verify_at(&self, token: &str, now: u64) -> Result<Claims, JwtError> {
        let key = self.key.as_ref().ok_or(JwtError::NotConfigured)?;
        let claims = jsonwebtoken::decode::<Claims>(token, key, &self.validation)
            .map(|d| d.claims)
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidAlgorithm => JwtError::WrongAlgorithm {
                    expected: name(self.alg),
                },
                ErrorKind::ExpiredSignature => JwtError::Expired,
                ErrorKind::InvalidSignature => JwtError::BadSignature,
                ErrorKind::InvalidAudience => JwtError::BadAudience,
                ErrorKind::InvalidIssuer => JwtError::BadIssuer,
                ErrorKind::MissingRequiredClaim(c) => match c.as_str() {
                    "aud" => JwtError::MissingClaim("aud"),
                    "iss" => JwtError::MissingClaim("iss"),
                    _ => JwtError::BadClaims(format!("`{c}` is missing")),
                },
                ErrorKind::Json(e) => JwtError::BadClaims(e.to_string()),
                ErrorKind::InvalidToken | ErrorKind::Base64(_) | ErrorKind::Utf8(_) => {
                    JwtError::Malformed
                }
                other => JwtError::BadClaims(format!("{other:?}")),
            })?;
        if let Some(max_s) = self.max_lifetime_s
            && claims.exp
                > now
                    .saturating_add(max_s)
                    .saturating_add(self.validation.leeway)
        {
            return Err(JwtError::TooLong { max_s });
        }
        match claims.nbf {
            Some(nbf) if nbf > now.saturating_add(self.validation.leeway) => {
                Err(JwtError::NotYetValid { nbf, now })
            }
            _ => Ok(claims),
        }
    }
}

/// Mint an HS256 token (operators' `fleetgate admin-token`).
pub fn mint(
    cfg: &AdminConfig,
    role: Role,
    subject: &str,
    ttl: Duration,
) -> Result<String, MintError> {
    let Some(JwtKey::Secret(secret)) = &cfg.jwt_key else {
        return Err(MintError::NoSecret);
    };
    if let Some(max) = cfg.jwt_max_lifetime
        && ttl > max
    {
        return Err(MintError::TooLong {
            ttl_s: ttl.as_secs(),
            max_s: max.as_secs(),
        });
    }
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        + ttl.as_secs();
    let claims = Claims {
        sub: Some(subject.to_owned()),
        role,
        exp,
        nbf: None,
        aud: cfg.jwt_audience.clone().map(Audience::One),
        iss: cfg.jwt_issuer.clone(),
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.expose().as_bytes()),
    )
    .map_err(MintError::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Secret;

    fn cfg(secret: &str) -> AdminConfig {
        AdminConfig {
            jwt_key: Some(JwtKey::Secret(Secret::new(secret))),
            ..AdminConfig::default()
        }
    }

    #[test]
    fn mint_and_verify_round_trip() {
        let c = cfg("0123456789abcdef0123456789abcdef");
        let t = mint(&c, Role::Viewer, "alice", Duration::from_secs(60)).unwrap();
        let claims = Verifier::new(&c).unwrap().verify(&t).unwrap();
        assert_eq!(claims.role, Role::Viewer);
        assert_eq!(claims.sub.as_deref(), Some("alice"));
    }

    #[test]
    fn rejects_wrong_key_wrong_alg_and_expired() {
        let c = cfg("0123456789abcdef0123456789abcdef");
        let other = cfg("ffffffffffffffffffffffffffffffff");
        let t = mint(&other, Role::Admin, "x", Duration::from_secs(60)).unwrap();
        assert_eq!(
            Verifier::new(&c).unwrap().verify(&t).unwrap_err(),
            JwtError::BadSignature
        );
        let hs384 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS384),
            &Claims {
                sub: None,
                role: Role::Admin,
                exp: u64::MAX / 2,
                nbf: None,
                aud: None,
                iss: None,
            },
            &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
        )
        .unwrap();
        assert!(matches!(
            Verifier::new(&c).unwrap().verify(&hs384).unwrap_err(),
            JwtError::WrongAlgorithm { .. }
        ));
        let expired = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                sub: None,
                role: Role::Admin,
                exp: 1000,
                nbf: None,
                aud: None,
                iss: None,
            },
            &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
        )
        .unwrap();
        assert_eq!(
            Verifier::new(&c).unwrap().verify(&expired).unwrap_err(),
            JwtError::Expired
        );
        assert_eq!(
            Verifier::new(&c).unwrap().verify("nope").unwrap_err(),
            JwtError::Malformed
        );
        assert_eq!(
            Verifier::new(&AdminConfig::default())
                .unwrap()
                .verify(&t)
                .unwrap_err(),
            JwtError::NotConfigured
        );
    }

    #[test]
    fn es256_with_a_public_key() {
        let kp = rcgen::KeyPair::generate().unwrap();
        let cfg = AdminConfig {
            jwt_algorithm: JwtAlgorithm::ES256,
            jwt_key: Some(JwtKey::PublicKeyPem(kp.public_key_pem().into_bytes())),
            jwt_audience: Some("fleetgate-admin".into()),
            ..AdminConfig::default()
        };
        let v = Verifier::new(&cfg).unwrap();
        let sign = |aud: &str| {
            jsonwebtoken::encode(
                &Header::new(Algorithm::ES256),
                &Claims {
                    sub: Some("sso-user".into()),
                    role: Role::Admin,
                    exp: u64::MAX / 4,
                    nbf: None,
                    aud: Some(Audience::One(aud.into())),
                    iss: None,
                },
                &EncodingKey::from_ec_pem(kp.serialize_pem().as_bytes()).unwrap(),
            )
            .unwrap()
        };
        assert_eq!(
            v.verify(&sign("fleetgate-admin")).unwrap().sub.as_deref(),
            Some("sso-user")
        );
        assert_eq!(
            v.verify(&sign("someone-else")).unwrap_err(),
            JwtError::BadAudience
        );
        // An HS256 token is refused by an ES256 verifier, whatever its signature.
        let hs = mint(&cfg_hs(), Role::Admin, "x", Duration::from_secs(60)).unwrap();
        assert!(matches!(
            v.verify(&hs).unwrap_err(),
            JwtError::WrongAlgorithm { .. }
        ));
    }

    #[test]
    fn nbf_is_honoured_with_the_leeway_of_exp() {
        let c = cfg_hs();
        let v = Verifier::new(&c).unwrap();
        let now = 1_800_000_000;
        let signed = |nbf: Option<u64>| {
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &Claims {
                    sub: None,
                    role: Role::Admin,
                    exp: u64::MAX / 4,
                    nbf,
                    aud: None,
                    iss: None,
                },
                &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
            )
            .unwrap()
        };
        assert!(v.verify_at(&signed(None), now).is_ok());
        assert!(v.verify_at(&signed(Some(now - 1)), now).is_ok());
        assert!(
            v.verify_at(&signed(Some(now + LEEWAY_SECONDS)), now)
                .is_ok()
        );
        let e = v
            .verify_at(&signed(Some(now + LEEWAY_SECONDS + 1)), now)
            .unwrap_err();
        assert_eq!(
            e,
            JwtError::NotYetValid {
                nbf: now + LEEWAY_SECONDS + 1,
                now
            }
        );
        assert!(
            e.message().contains("2027-01-15T08:00:06Z"),
            "{}",
            e.message()
        );
    }

    fn cfg_hs() -> AdminConfig {
        cfg("0123456789abcdef0123456789abcdef")
    }

    /// Sign arbitrary claims with the test secret.
    fn sign_json(claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
        )
        .unwrap()
    }

    /// With an audience and an issuer configured, a token lacking either is refused (it was
    /// accepted before: jsonwebtoken checks them only when present); a list-valued `aud`
    /// containing the audience is accepted, one without it is not.
    #[test]
    fn a_configured_audience_and_issuer_are_required() {
        let c = AdminConfig {
            jwt_audience: Some("fleetgate-admin".into()),
            jwt_issuer: Some("sso".into()),
            ..cfg_hs()
        };
        let v = Verifier::new(&c).unwrap();
        let exp = u64::MAX / 4;
        let bare = sign_json(serde_json::json!({"role": "admin", "exp": exp}));
        let e = v.verify(&bare).unwrap_err();
        assert!(matches!(e, JwtError::MissingClaim(_)), "{e:?}");
        let no_iss =
            sign_json(serde_json::json!({"role": "admin", "exp": exp, "aud": "fleetgate-admin"}));
        assert_eq!(
            v.verify(&no_iss).unwrap_err(),
            JwtError::MissingClaim("iss")
        );
        assert!(
            v.verify(&no_iss)
                .unwrap_err()
                .message()
                .contains("admin.jwt_issuer")
        );
        let no_aud = sign_json(serde_json::json!({"role": "admin", "exp": exp, "iss": "sso"}));
        assert_eq!(
            v.verify(&no_aud).unwrap_err(),
            JwtError::MissingClaim("aud")
        );
        let listed = sign_json(serde_json::json!({
            "role": "admin", "exp": exp, "iss": "sso", "aud": ["other", "fleetgate-admin"]
        }));
        assert_eq!(v.verify(&listed).unwrap().role, Role::Admin);
        let elsewhere = sign_json(serde_json::json!({
            "role": "admin", "exp": exp, "iss": "sso", "aud": ["other", "another"]
        }));
        assert_eq!(v.verify(&elsewhere).unwrap_err(), JwtError::BadAudience);
        // Minted tokens carry both and pass.
        let t = mint(&c, Role::Viewer, "ops", Duration::from_secs(60)).unwrap();
        assert_eq!(v.verify(&t).unwrap().role, Role::Viewer);
    }

    /// `admin.jwt_max_lifetime_s` refuses a token whose `exp` lies further ahead (an `exp` of
    /// 2^63 was accepted); without it, any future `exp` is.
    #[test]
    fn a_maximum_lifetime_refuses_far_expiries() {
        let c = AdminConfig {
            jwt_max_lifetime: Some(Duration::from_secs(3600)),
            ..cfg_hs()
        };
        let v = Verifier::new(&c).unwrap();
        let now = 1_800_000_000;
        let token = |exp: u64| sign_json(serde_json::json!({"role": "admin", "exp": exp}));
        assert!(v.verify_at(&token(now + 3600), now).is_ok());
        assert_eq!(
            v.verify_at(&token(1 << 63), now).unwrap_err(),
            JwtError::TooLong { max_s: 3600 }
        );
        assert_eq!(
            v.verify_at(&token(now + 3600 + LEEWAY_SECONDS + 1), now)
                .unwrap_err(),
            JwtError::TooLong { max_s: 3600 }
        );
        assert!(
            Verifier::new(&cfg_hs())
                .unwrap()
                .verify_at(&token(1 << 63), now)
                .is_ok()
        );
    }
}
