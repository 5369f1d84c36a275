//! The API key format: `fg-<env>-<public id>-<secret><checksum>`.
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
use sha2::{Digest, Sha256};

pub const PREFIX: &str = "fg-";
pub const PUBLIC_ID_LEN: usize = 12;
pub const SECRET_LEN: usize = 33;
pub const CHECKSUM_LEN: usize = 6;

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

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "stress" => Some(Environment::Stress),
            "gray" => Some(Environment::Gray),
            "prod" => Some(Environment::Prod),
            _ => None,
        }
    }
}

impl fmt::Display for Environment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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
pub fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
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

pub fn new_public_id() -> String {
    random_base62(&mut rand::rng(), PUBLIC_ID_LEN)
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
