//! Signing in to the console: one-time sign-in links, session cookies and CSRF tokens.
//!
//! - A sign-in link (`fleetgate console-login`) carries a short-lived HS256 token with audience
//!   `fleetgate-console-login`, signed with a key derived from `admin.jwt_secret` (never the
//!   secret itself), a random `jti`, the role and the session's length. The console also
//!   accepts the admin API's own token once (`/console/login?token=<admin JWT>`), which is how
//!   a gateway configured for RS256/ES256 is signed in to.
//! - Either is used once: its `jti` (or the token's hash) is remembered until it expires.
//! - The session is a cookie holding a token with audience `fleetgate-console`, signed with a
//!   second derived key (a random per-process key when no HS256 secret is configured: sessions
//!   then end when the gateway restarts). The admin API's verifier refuses it: other key, other
//!   audience. Signing out remembers the session's `jti` until it would have expired.
//! - The CSRF token of a session is an HMAC of its `jti`, put in every form and checked on every
//!   POST.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::admin::jwt::{MintError, Role, Verifier};
use crate::config::{AdminConfig, JwtKey};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "fleetgate_console";
const LOGIN_AUDIENCE: &str = "fleetgate-console-login";
const SESSION_AUDIENCE: &str = "fleetgate-console";
/// How long a printed sign-in link can be used.
pub(crate) const LINK_TTL: Duration = Duration::from_secs(600);
/// A session started with an admin API token lasts at most this long.
pub(crate) const MAX_SESSION_FROM_ADMIN_TOKEN: Duration = Duration::from_secs(8 * 3600);
/// The longest session a sign-in link may ask for.
pub const MAX_SESSION: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ConsoleClaims {
    sub: String,
    role: Role,
    exp: u64,
    iat: u64,
    jti: String,
    aud: String,
    /// Sign-in links: the session's length in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ttl: Option<u64>,
}

/// A signed-in operator.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) subject: String,
    pub(crate) role: Role,
    pub(crate) jti: String,
    /// Epoch seconds.
    pub(crate) exp: u64,
}

impl Session {
    pub(crate) fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }
}

/// Why a sign-in was refused (shown to the operator as is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LoginError {
    Used,
    Invalid(String),
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn derive(secret: &[u8], context: &[u8]) -> [u8; 32] {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let tag = hmac::sign(&key, context);
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

fn login_key(secret: &[u8]) -> [u8; 32] {
    derive(secret, b"fleetgate console sign-in link v1")
}

fn session_key(secret: &[u8]) -> [u8; 32] {
    derive(secret, b"fleetgate console session v1")
}

fn random_id() -> String {
    let bytes: [u8; 16] = rand::random();
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn validation(audience: &str) -> Validation {
    let mut v = Validation::new(Algorithm::HS256);
    v.set_required_spec_claims(&["exp", "aud"]);
    v.set_audience(&[audience]);
    v.leeway = 5;
    v
}

/// Mint a one-time sign-in link's token (`fleetgate console-login`).
pub fn mint_login(
    cfg: &AdminConfig,
    role: Role,
    subject: &str,
    session_ttl: Duration,
) -> Result<String, MintError> {
    let Some(JwtKey::Secret(secret)) = &cfg.jwt_key else {
        return Err(MintError::NoSecret);
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let claims = ConsoleClaims {
        sub: subject.to_owned(),
        role,
        iat: now,
        exp: now + LINK_TTL.as_secs(),
        jti: random_id(),
        aud: LOGIN_AUDIENCE.to_owned(),
        ttl: Some(session_ttl.min(MAX_SESSION).as_secs()),
    };
    let key = login_key(secret.expose().as_bytes());
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&key),
    )
    .map_err(MintError::from)
}

/// The console's keys and its memory of used links and ended sessions.
pub(crate) struct Sessions {
    login: Option<DecodingKey>,
    session_enc: EncodingKey,
    session_dec: DecodingKey,
    csrf: hmac::Key,
    /// `jti`s (or token hashes) used or signed out, with the epoch second they expire at.
    spent: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions").finish_non_exhaustive()
    }
}

impl Sessions {
    pub(crate) fn new(cfg: &AdminConfig) -> Self {
        let (login, key) = match &cfg.jwt_key {
            Some(JwtKey::Secret(s)) => {
                let s = s.expose().as_bytes();
                (
                    Some(DecodingKey::from_secret(&login_key(s))),
                    session_key(s),
                )
            }
            _ => (None, rand::random::<[u8; 32]>()),
        };
        Self {
            login,
            session_enc: EncodingKey::from_secret(&key),
            session_dec: DecodingKey::from_secret(&key),
            csrf: hmac::Key::new(hmac::HMAC_SHA256, &derive(&key, b"csrf")),
            spent: Mutex::new(HashMap::new()),
        }
    }

    /// Remember `id` as spent until `exp`; false when it already was.
    fn spend(&self, id: String, exp: u64) -> bool {
        let now = now_secs();
        let mut spent = self
            .spent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        spent.retain(|_, e| *e + 10 > now);
        match spent.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(exp);
                true
            }
        }
    }

    fn is_spent(&self, id: &str) -> bool {
        self.spent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(id)
    }

    /// Exchange a sign-in link's token, or an admin API token, for a session (once).
    /// Returns the session, the cookie value and how it signed in (`link` or `admin-token`).
    pub(crate) fn sign_in(
        &self,
        token: &str,
        admin: &Verifier,
    ) -> Result<(Session, String, &'static str), LoginError> {
        let now = now_secs();
        let (subject, role, spent_id, spent_until, ttl, via) = match self
            .login
            .as_ref()
            .map(|k| jsonwebtoken::decode::<ConsoleClaims>(token, k, &validation(LOGIN_AUDIENCE)))
        {
            Some(Ok(d)) => {
                let c = d.claims;
                let ttl = c.ttl.unwrap_or(MAX_SESSION_FROM_ADMIN_TOKEN.as_secs());
                (c.sub, c.role, c.jti, c.exp, ttl, "link")
            }
            Some(Err(e))
                if matches!(e.kind(), jsonwebtoken::errors::ErrorKind::ExpiredSignature) =>
            {
                return Err(LoginError::Invalid(
                    "This sign-in link has expired (links last 10 minutes): run `fleetgate console-login` again.".into(),
                ));
            }
            _ => match admin.verify(token) {
                Ok(c) => {
                    let hash = crate::key::hash_secret(token);
                    let left = c.exp.saturating_sub(now);
                    (
                        c.sub.unwrap_or_else(|| "admin-token".into()),
                        c.role,
                        hex(&hash),
                        c.exp,
                        left.min(MAX_SESSION_FROM_ADMIN_TOKEN.as_secs()),
                        "admin-token",
                    )
                }
                Err(e) => {
                    return Err(LoginError::Invalid(format!(
                        "This sign-in link is not valid: {} Run `fleetgate console-login` for a new one.",
                        e.message()
                    )));
                }
            },
        };
        if !self.spend(spent_id, spent_until) {
            return Err(LoginError::Used);
        }
        let claims = ConsoleClaims {
            sub: subject.clone(),
            role,
            iat: now,
            exp: now + ttl.max(60),
            jti: random_id(),
            aud: SESSION_AUDIENCE.to_owned(),
            ttl: None,
        };
        let cookie =
            jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.session_enc)
                .map_err(|e| LoginError::Invalid(format!("cannot start a session: {e}")))?;
        Ok((
            Session {
                subject,
                role,
                jti: claims.jti,
                exp: claims.exp,
            },
            cookie,
            via,
        ))
    }

    /// The session a cookie value stands for, if it is valid and not signed out.
    pub(crate) fn session(&self, cookie: &str) -> Option<Session> {
        let c = jsonwebtoken::decode::<ConsoleClaims>(
            cookie,
            &self.session_dec,
            &validation(SESSION_AUDIENCE),
        )
        .ok()?
        .claims;
        if self.is_spent(&c.jti) {
            return None;
        }
        Some(Session {
            subject: c.sub,
            role: c.role,
            jti: c.jti,
            exp: c.exp,
        })
    }

    /// End a session: its cookie is refused from now on, even if a copy of it is replayed.
    pub(crate) fn sign_out(&self, s: &Session) {
        self.spend(s.jti.clone(), s.exp);
    }

    /// The CSRF token every form of this session carries.
    pub(crate) fn csrf_token(&self, s: &Session) -> String {
        hex(hmac::sign(&self.csrf, s.jti.as_bytes()).as_ref())
    }

    pub(crate) fn csrf_ok(&self, s: &Session, token: &str) -> bool {
        let Some(bytes) = unhex(token) else {
            return false;
        };
        hmac::verify(&self.csrf, s.jti.as_bytes(), &bytes).is_ok()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The session cookie's value in a `Cookie` header.
pub(crate) fn cookie_value(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Secret;

    fn cfg() -> AdminConfig {
        AdminConfig {
            jwt_key: Some(JwtKey::Secret(Secret::new(
                "0123456789abcdef0123456789abcdef",
            ))),
            ..AdminConfig::default()
        }
    }

    #[test]
    fn a_link_signs_in_once_and_the_session_is_not_an_admin_token() {
        let c = cfg();
        let s = Sessions::new(&c);
        let v = Verifier::new(&c).unwrap();
        let link = mint_login(&c, Role::Viewer, "ops", Duration::from_secs(3600)).unwrap();
        // The link itself is no admin API token.
        assert!(v.verify(&link).is_err());
        let (session, cookie, via) = s.sign_in(&link, &v).unwrap();
        assert_eq!(session.role, Role::Viewer);
        assert_eq!(via, "link");
        assert_eq!(s.sign_in(&link, &v).unwrap_err(), LoginError::Used);
        // The cookie is refused by the admin API, and a link is no cookie.
        assert!(v.verify(&cookie).is_err());
        assert!(s.session(&link).is_none());
        let back = s.session(&cookie).unwrap();
        assert_eq!(back.subject, "ops");
        let csrf = s.csrf_token(&back);
        assert!(s.csrf_ok(&back, &csrf));
        assert!(!s.csrf_ok(&back, "00"));
        assert!(!s.csrf_ok(&back, "zz"));
        s.sign_out(&back);
        assert!(s.session(&cookie).is_none());
    }

    #[test]
    fn an_admin_token_signs_in_once() {
        let c = cfg();
        let s = Sessions::new(&c);
        let v = Verifier::new(&c).unwrap();
        let t = crate::admin::jwt::mint(&c, Role::Admin, "alice", Duration::from_secs(60)).unwrap();
        let (session, _, via) = s.sign_in(&t, &v).unwrap();
        assert!(session.is_admin());
        assert_eq!(via, "admin-token");
        assert!(session.exp <= now_secs() + 61);
        assert_eq!(s.sign_in(&t, &v).unwrap_err(), LoginError::Used);
        assert!(matches!(
            s.sign_in("garbage", &v).unwrap_err(),
            LoginError::Invalid(_)
        ));
    }

    #[test]
    fn a_cookie_from_another_secret_is_refused() {
        let other = AdminConfig {
            jwt_key: Some(JwtKey::Secret(Secret::new(
                "ffffffffffffffffffffffffffffffff",
            ))),
            ..AdminConfig::default()
        };
        let link = mint_login(&other, Role::Admin, "x", Duration::from_secs(60)).unwrap();
        let theirs = Sessions::new(&other);
        let (_, cookie, _) = theirs
            .sign_in(&link, &Verifier::new(&other).unwrap())
            .unwrap();
        assert!(Sessions::new(&cfg()).session(&cookie).is_none());
    }
}
