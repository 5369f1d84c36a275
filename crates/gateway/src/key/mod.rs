//! API keys below the stages that use them: the key format
//! `fg-<env>-<public id>-<secret><checksum>`, the environments, and `KeyRecord`, a key as the
//! store keeps it and the gateway checks it.
//!
//!
//! - `env` is `stress`, `gray` or `prod`, readable by anyone who sees the key;
//! - the public id (12 base62 characters) is the lookup handle shown in listings and logs;
//! - the secret (33 base62 characters, 196 bits from the OS-seeded CSPRNG) is stored only as a
//!   SHA-256 hash;
//! - the checksum (6 base62 characters of the CRC-32 of everything before it) lets the gateway
//!   reject a mistyped or truncated key without a lookup, and lets secret scanners recognise a
//!   leaked key with few false positives.

use std::fmt;

use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};

use fleetgate_protocol::endpoint::{Families, Family};

pub(crate) const PREFIX: &str = "fg-";
pub(crate) const PUBLIC_ID_LEN: usize = 12;
pub(crate) const SECRET_LEN: usize = 33;
pub(crate) const CHECKSUM_LEN: usize = 6;

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Which environment a key belongs to. Decides queue priority and which pools it may use.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Environment {
    Stress,
    Gray,
    Prod,
}

impl Environment {
    pub const ALL: [Environment; 3] = [Environment::Stress, Environment::Gray, Environment::Prod];

    /// Position in `ALL` (arrays indexed by environment).
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Environment::Stress => "stress",
            Environment::Gray => "gray",
            Environment::Prod => "prod",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "stress" => Some(Environment::Stress),
            "gray" => Some(Environment::Gray),
            "prod" => Some(Environment::Prod),
            _ => None,
        }
    }
}

impl fmt::Display for Environment {
    /// Honours width and alignment (`{:<6}` in `fleetgate keys list`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for Environment {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Environment::parse(s)
            .ok_or_else(|| format!("`{s}` is not an environment: use stress, gray or prod"))
    }
}

/// A key split into its parts (borrowed from the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedKey<'a> {
    pub env: Environment,
    pub public_id: &'a str,
    pub secret: &'a str,
}

/// Why a string is not a usable fleetgate key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormatError {
    /// Does not start with `fg-`.
    NotFleetgate,
    /// `fg-` but the environment part is not one we issue.
    UnknownEnvironment,
    /// Wrong length, a character outside base62, or a checksum that does not match.
    Mistyped,
}

fn is_base62(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_alphanumeric())
}

fn checksum(body: &str) -> [u8; CHECKSUM_LEN] {
    let mut v = crc32fast::hash(body.as_bytes());
    let mut out = [b'0'; CHECKSUM_LEN];
    for slot in out.iter_mut().rev() {
        *slot = BASE62[(v % 62) as usize];
        v /= 62;
    }
    out
}

/// Split and verify a key's format and checksum. No lookup, no allocation.
pub fn parse(key: &str) -> Result<ParsedKey<'_>, KeyFormatError> {
    let rest = key
        .strip_prefix(PREFIX)
        .ok_or(KeyFormatError::NotFleetgate)?;
    let (env, rest) = rest.split_once('-').ok_or(KeyFormatError::Mistyped)?;
    let env = Environment::parse(env).ok_or(KeyFormatError::UnknownEnvironment)?;
    let (public_id, tail) = rest.split_once('-').ok_or(KeyFormatError::Mistyped)?;
    if public_id.len() != PUBLIC_ID_LEN
        || tail.len() != SECRET_LEN + CHECKSUM_LEN
        || !is_base62(public_id)
        || !is_base62(tail)
    {
        return Err(KeyFormatError::Mistyped);
    }
    let (secret, sum) = tail.split_at(SECRET_LEN);
    let body = &key[..key.len() - CHECKSUM_LEN];
    if checksum(body) != sum.as_bytes() {
        return Err(KeyFormatError::Mistyped);
    }
    Ok(ParsedKey {
        env,
        public_id,
        secret,
    })
}

/// SHA-256 of the secret part: what the database stores.
pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Equality that takes the same time wherever the first difference is.
pub(crate) fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn random_base62(rng: &mut impl Rng, len: usize) -> String {
    (0..len)
        .map(|_| BASE62[rng.random_range(0..62)] as char)
        .collect()
}

/// A freshly generated key: the full text (shown once) and what is stored.
pub struct NewKey {
    pub full: String,
    pub public_id: String,
    pub secret_hash: [u8; 32],
}

impl fmt::Debug for NewKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewKey")
            .field("public_id", &self.public_id)
            .field("full", &"*****")
            .finish()
    }
}

/// Generate a key for `env` (with a given public id when rotating).
pub fn generate(env: Environment, public_id: Option<&str>) -> NewKey {
    // ThreadRng: ChaCha, seeded from the OS and reseeded periodically — a CSPRNG.
    let mut rng = rand::rng();
    let public_id = public_id
        .map(str::to_owned)
        .unwrap_or_else(|| random_base62(&mut rng, PUBLIC_ID_LEN));
    let secret = random_base62(&mut rng, SECRET_LEN);
    let body = format!("{PREFIX}{}-{public_id}-{secret}", env.as_str());
    let sum = checksum(&body);
    let mut full = body;
    full.push_str(std::str::from_utf8(&sum).unwrap_or("000000"));
    NewKey {
        full,
        public_id,
        secret_hash: hash_secret(&secret),
    }
}

/// One key as the gateway knows it. The secret itself is never held, only its hash.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    pub id: i64,
    pub public_id: Box<str>,
    pub name: String,
    pub environment: Environment,
    pub secret_hash: [u8; 32],
    /// The previous secret's hash and until when it is accepted (rotation grace).
    pub previous: Option<([u8; 32], i64)>,
    pub created_at: i64,
    pub created_by: String,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub revoked_by: Option<String>,
    pub revoke_reason: Option<String>,
    /// `None`: every model.
    pub allowed_models: Option<Vec<String>>,
    /// The endpoint families it may call; `None`: every family.
    pub allowed_endpoints: Option<Families>,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_minute: Option<i64>,
    pub max_concurrent_streams: Option<i64>,
    pub metadata: serde_json::Value,
    pub updated_at: i64,
}

/// The listing view of a key: everything but the hashes.
#[derive(Debug, Serialize)]
pub struct KeyView<'a> {
    pub public_id: &'a str,
    pub name: &'a str,
    pub environment: Environment,
    pub status: &'static str,
    pub created_at: i64,
    pub created_by: &'a str,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub revoked_by: Option<&'a str>,
    pub revoke_reason: Option<&'a str>,
    pub previous_secret_valid_until: Option<i64>,
    pub allowed_models: Option<&'a [String]>,
    pub allowed_endpoints: Option<Vec<&'static str>>,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_minute: Option<i64>,
    pub max_concurrent_streams: Option<i64>,
    pub(crate) metadata: &'a serde_json::Value,
}

impl KeyRecord {
    pub fn status(&self, now: i64) -> &'static str {
        if self.revoked_at.is_some() {
            "revoked"
        } else if self.expires_at.is_some_and(|e| e <= now) {
            "expired"
        } else {
            "active"
        }
    }

    pub fn view(&self) -> KeyView<'_> {
        KeyView {
            public_id: &self.public_id,
            name: &self.name,
            environment: self.environment,
            status: self.status(crate::clock::wall_ms()),
            created_at: self.created_at,
            created_by: &self.created_by,
            expires_at: self.expires_at,
            revoked_at: self.revoked_at,
            revoked_by: self.revoked_by.as_deref(),
            revoke_reason: self.revoke_reason.as_deref(),
            previous_secret_valid_until: self.previous.map(|(_, until)| until),
            allowed_models: self.allowed_models.as_deref(),
            allowed_endpoints: self.allowed_endpoints.map(Families::names),
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent_streams: self.max_concurrent_streams,
            metadata: &self.metadata,
        }
    }

    /// May this key call the endpoints of `family`?
    pub(crate) fn allows_family(&self, family: Family) -> bool {
        self.allowed_endpoints.is_none_or(|f| f.contains(family))
    }

    /// May this key use the model clients know as `model`?
    pub(crate) fn allows_model(&self, model: &str) -> bool {
        self.allowed_models
            .as_ref()
            .is_none_or(|m| m.iter().any(|a| a == model))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn generated_keys_parse_back() {
        for env in Environment::ALL {
            let k = generate(env, None);
            let p = parse(&k.full).unwrap();
            assert_eq!(p.env, env);
            assert_eq!(p.public_id, k.public_id);
            assert_eq!(hash_secret(p.secret), k.secret_hash);
            assert!(k.full.starts_with(&format!("fg-{env}-")));
            assert!(!format!("{k:?}").contains(&k.full));
        }
    }

    #[test]
    fn secret_has_at_least_192_bits() {
        let bits = (SECRET_LEN as f64) * 62f64.log2();
        assert!(bits >= 192.0, "{bits}");
    }

    #[test]
    fn truncated_and_mistyped_keys_fail_the_checksum() {
        let k = generate(Environment::Prod, None).full;
        assert_eq!(parse(&k[..k.len() - 1]), Err(KeyFormatError::Mistyped));
        let mut typo = k.clone().into_bytes();
        let i = typo.len() - 10;
        typo[i] = if typo[i] == b'a' { b'b' } else { b'a' };
        assert_eq!(
            parse(std::str::from_utf8(&typo).unwrap()),
            Err(KeyFormatError::Mistyped)
        );
        assert_eq!(parse("sk-abc"), Err(KeyFormatError::NotFleetgate));
        assert_eq!(
            parse("fg-dev-abc-def"),
            Err(KeyFormatError::UnknownEnvironment)
        );
    }

    #[test]
    fn rotation_keeps_the_public_id() {
        let a = generate(Environment::Gray, None);
        let b = generate(Environment::Gray, Some(&a.public_id));
        assert_eq!(a.public_id, b.public_id);
        assert_ne!(a.secret_hash, b.secret_hash);
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,80}") {
            let _ = parse(&s);
        }

        #[test]
        fn any_single_character_change_is_caught(pos in 0usize..60, c in "[0-9A-Za-z]") {
            let k = generate(Environment::Stress, None).full;
            let pos = pos % k.len();
            let mut chars: Vec<char> = k.chars().collect();
            let c = c.chars().next().unwrap();
            prop_assume!(chars[pos] != c && chars[pos] != '-');
            chars[pos] = c;
            let changed: String = chars.into_iter().collect();
            // CRC-32 catches every single-character change: never another valid key.
            prop_assert!(parse(&changed).is_err());
        }
    }
}
