//! Why a request was refused by authentication: one variant per cause, each with its own
//! metric label, status and message, so a client can tell what to fix from the body alone.

use std::time::Duration;

use crate::clock::format_wall_ms;
use crate::key::Environment;
use fleetgate_protocol::endpoint::{Families, Family};
use fleetgate_protocol::error::ErrorKind;

/// Why a request was not let in. Each cause has its own message and code.
#[derive(Debug, Clone, PartialEq)]
pub enum AuthFailure {
    Missing,
    NoSpaceAfterBearer,
    Quoted,
    Whitespace,
    BasicScheme,
    OAuthToken(OAuthIssuer),
    OtherScheme(String),
    NotFleetgate(ForeignKey),
    UnknownEnvironment,
    Mistyped,
    UnknownKey,
    Revoked {
        at: i64,
        reason: String,
    },
    Expired {
        at: i64,
    },
    RotatedOut {
        at: i64,
    },
    ModelNotAllowed {
        model: String,
        allowed: Vec<String>,
    },
    EnvironmentNotAllowed {
        env: Environment,
        model: String,
        allowed: Vec<Environment>,
    },
    /// The key's endpoint families do not include the route's.
    EndpointNotAllowed {
        family: Family,
        path: &'static str,
        allowed: Families,
    },
    TooManyFailures {
        retry_after: Duration,
    },
    /// `Authorization: Bearer` and `x-api-key` name different keys.
    TwoKeys,
}

/// Whose OAuth access token a client sent instead of a key: the fix differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OAuthIssuer {
    /// `sk-ant-oat...`: Claude Code logged in to a Claude account (`/login`).
    ClaudeAccount,
    /// A JWT, Google's or GitHub's token.
    Other,
}

/// Whose key a refused non-fleetgate key looks like, read from its well-known prefix, so the
/// message names the variable to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForeignKey {
    /// `sk-ant-...` (an Anthropic API key, `sk-ant-api03-...`).
    Anthropic,
    /// `sk-...`.
    OpenAi,
    Unknown,
}

impl ForeignKey {
    pub(crate) fn of(text: &str) -> ForeignKey {
        if text.starts_with("sk-ant-") {
            ForeignKey::Anthropic
        } else if text.starts_with("sk-") {
            ForeignKey::OpenAi
        } else {
            ForeignKey::Unknown
        }
    }
}

/// Label for the failure counter: a fixed set.
pub(crate) const FAILURE_REASONS: [&str; 19] = [
    "missing",
    "no_space_after_bearer",
    "quoted",
    "whitespace",
    "basic_scheme",
    "oauth_token",
    "other_scheme",
    "not_fleetgate",
    "unknown_environment",
    "mistyped",
    "unknown_key",
    "revoked",
    "expired",
    "rotated_out",
    "model_not_allowed",
    "environment_not_allowed",
    "too_many_failures",
    "two_keys",
    "endpoint_not_allowed",
];

impl AuthFailure {
    pub(crate) fn reason(&self) -> &'static str {
        FAILURE_REASONS[self.index()]
    }

    /// Position in `FAILURE_REASONS`: the failure counter's index, no search.
    pub(super) fn index(&self) -> usize {
        match self {
            AuthFailure::Missing => 0,
            AuthFailure::NoSpaceAfterBearer => 1,
            AuthFailure::Quoted => 2,
            AuthFailure::Whitespace => 3,
            AuthFailure::BasicScheme => 4,
            AuthFailure::OAuthToken(_) => 5,
            AuthFailure::OtherScheme(_) => 6,
            AuthFailure::NotFleetgate(_) => 7,
            AuthFailure::UnknownEnvironment => 8,
            AuthFailure::Mistyped => 9,
            AuthFailure::UnknownKey => 10,
            AuthFailure::Revoked { .. } => 11,
            AuthFailure::Expired { .. } => 12,
            AuthFailure::RotatedOut { .. } => 13,
            AuthFailure::ModelNotAllowed { .. } => 14,
            AuthFailure::EnvironmentNotAllowed { .. } => 15,
            AuthFailure::TooManyFailures { .. } => 16,
            AuthFailure::TwoKeys => 17,
            AuthFailure::EndpointNotAllowed { .. } => 18,
        }
    }

    pub(crate) fn kind(&self) -> ErrorKind {
        match self {
            AuthFailure::ModelNotAllowed { .. }
            | AuthFailure::EnvironmentNotAllowed { .. }
            | AuthFailure::EndpointNotAllowed { .. } => ErrorKind::Forbidden,
            AuthFailure::TooManyFailures { .. } => ErrorKind::AuthThrottled,
            AuthFailure::Missing
            | AuthFailure::NoSpaceAfterBearer
            | AuthFailure::Quoted
            | AuthFailure::Whitespace
            | AuthFailure::BasicScheme
            | AuthFailure::OAuthToken(_)
            | AuthFailure::OtherScheme(_)
            | AuthFailure::NotFleetgate(_)
            | AuthFailure::UnknownEnvironment
            | AuthFailure::Mistyped
            | AuthFailure::UnknownKey
            | AuthFailure::Revoked { .. }
            | AuthFailure::Expired { .. }
            | AuthFailure::RotatedOut { .. }
            | AuthFailure::TwoKeys => ErrorKind::Unauthenticated,
        }
    }

    /// (type, code, message) for the OpenAI error body.
    pub(crate) fn describe(&self) -> (&'static str, &'static str, String) {
        (self.error_type(), self.code(), self.message())
    }

    /// The OpenAI error `type`, derived from the kind so that it always agrees with the status.
    fn error_type(&self) -> &'static str {
        match self.kind() {
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::AuthThrottled => "rate_limit_error",
            _ => "authentication_error",
        }
    }

    fn code(&self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing_api_key",
            AuthFailure::NoSpaceAfterBearer
            | AuthFailure::Quoted
            | AuthFailure::Whitespace
            | AuthFailure::BasicScheme
            | AuthFailure::OtherScheme(_)
            | AuthFailure::TwoKeys => "invalid_authorization_header",
            AuthFailure::OAuthToken(_) => "oauth_not_supported",
            AuthFailure::NotFleetgate(_)
            | AuthFailure::UnknownEnvironment
            | AuthFailure::Mistyped
            | AuthFailure::UnknownKey => "invalid_api_key",
            AuthFailure::Revoked { .. } => "key_revoked",
            AuthFailure::Expired { .. } => "key_expired",
            AuthFailure::RotatedOut { .. } => "key_rotated",
            AuthFailure::ModelNotAllowed { .. } => "model_not_allowed",
            AuthFailure::EnvironmentNotAllowed { .. } => "environment_not_allowed",
            AuthFailure::EndpointNotAllowed { .. } => "endpoint_not_allowed",
            AuthFailure::TooManyFailures { .. } => "too_many_auth_failures",
        }
    }

    fn message(&self) -> String {
        const HOW: &str = "send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a fleetgate key `fg-<env>-...`";
        match self {
            AuthFailure::Missing => format!("No API key was sent: {HOW}."),
            AuthFailure::NoSpaceAfterBearer => "The Authorization header needs a space after `Bearer`: `Authorization: Bearer <key>`.".into(),
            AuthFailure::Quoted => "The key is wrapped in quotes: send it bare, `Authorization: Bearer fg-...` (check the client's config file or environment variable).".into(),
            AuthFailure::Whitespace => "The key has extra whitespace in or around it (a copied line break or double space?): send exactly `Authorization: Bearer <key>`.".into(),
            AuthFailure::BasicScheme => "HTTP Basic authentication is not supported: send `Authorization: Bearer <key>`.".into(),
            AuthFailure::OAuthToken(OAuthIssuer::ClaudeAccount) => "That is a Claude account's OAuth token (`sk-ant-oat...`: Claude Code logged in with `/login`), not a fleetgate key. Set ANTHROPIC_AUTH_TOKEN to the fleetgate key `fg-<env>-...` (it replaces the login's token) and ANTHROPIC_BASE_URL to the gateway's URL without /v1; or run `claude /logout` and set ANTHROPIC_API_KEY to the key.".into(),
            AuthFailure::OAuthToken(OAuthIssuer::Other) => "Only static API keys are accepted; OAuth is not supported. Configure the client with an API key (`fg-<env>-...`) instead of an OAuth login.".into(),
            AuthFailure::OtherScheme(s) => format!("The Authorization scheme `{s}` is not supported: send `Authorization: Bearer <key>`."),
            AuthFailure::NotFleetgate(ForeignKey::Anthropic) => "That looks like an Anthropic API key (`sk-ant-...`), not a fleetgate key: set ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) to the `fg-<env>-...` key issued for this gateway, and ANTHROPIC_BASE_URL to the gateway's URL without /v1.".into(),
            AuthFailure::NotFleetgate(ForeignKey::OpenAi) => "That looks like an OpenAI (`sk-...`) key, not a fleetgate key: set OPENAI_API_KEY to the `fg-<env>-...` key issued for this gateway, and OPENAI_BASE_URL to the gateway's URL ending in /v1.".into(),
            AuthFailure::NotFleetgate(ForeignKey::Unknown) => "That is not a fleetgate key: keys look like `fg-<env>-<id>-<secret>`. Check that the client uses the key issued for this gateway.".into(),
            AuthFailure::UnknownEnvironment => "The key names an environment this gateway does not issue (stress, gray, prod): the key is mistyped or from another system.".into(),
            AuthFailure::Mistyped => "The key is mistyped or truncated (its checksum does not match): copy the whole key again.".into(),
            AuthFailure::UnknownKey => "The key is not valid on this gateway (unknown, or its secret does not match): ask an operator for a current key.".into(),
            AuthFailure::Revoked { at, reason } => format!("The key was revoked at {} (reason: {reason}). Ask an operator for a new key.", format_wall_ms(*at)),
            AuthFailure::Expired { at } => format!("The key expired at {}. Ask an operator for a new key.", format_wall_ms(*at)),
            AuthFailure::RotatedOut { at } => format!("The key was rotated and this old secret stopped working at {}: use the new key issued at rotation.", format_wall_ms(*at)),
            AuthFailure::ModelNotAllowed { model, allowed } => format!(
                "This key may not use model `{model}`; it may use: {}.",
                allowed.iter().map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", ")
            ),
            AuthFailure::EnvironmentNotAllowed { env, model, allowed } => format!(
                "Keys of environment `{env}` may not use model `{model}`; its pool serves: {}.",
                allowed.iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ")
            ),
            AuthFailure::EndpointNotAllowed { family, path, allowed } => format!(
                "This key may not call {path} (endpoint family `{}`); it may call the families: {}. Ask an operator for a key that allows `{}`.",
                family.as_str(),
                allowed.names().iter().map(|f| format!("`{f}`")).collect::<Vec<_>>().join(", "),
                family.as_str()
            ),
            AuthFailure::TooManyFailures { retry_after } => format!(
                "Too many failed authentication attempts from your address: no key from it is checked for the next {} s, not even a valid one. Fix the key, then retry after that.",
                retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0)
            ),
            AuthFailure::TwoKeys => "`Authorization: Bearer` and `x-api-key` carry two different keys: send one key, in either header (check the client's environment: ANTHROPIC_AUTH_TOKEN and ANTHROPIC_API_KEY both set?).".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_has_its_own_message() {
        let all = [
            AuthFailure::Missing,
            AuthFailure::NoSpaceAfterBearer,
            AuthFailure::Quoted,
            AuthFailure::Whitespace,
            AuthFailure::BasicScheme,
            AuthFailure::OAuthToken(OAuthIssuer::Other),
            AuthFailure::OAuthToken(OAuthIssuer::ClaudeAccount),
            AuthFailure::OtherScheme("Token".into()),
            AuthFailure::NotFleetgate(ForeignKey::OpenAi),
            AuthFailure::NotFleetgate(ForeignKey::Anthropic),
            AuthFailure::NotFleetgate(ForeignKey::Unknown),
            AuthFailure::UnknownEnvironment,
            AuthFailure::Mistyped,
            AuthFailure::UnknownKey,
            AuthFailure::Revoked {
                at: 0,
                reason: "leak".into(),
            },
            AuthFailure::Expired { at: 0 },
            AuthFailure::RotatedOut { at: 0 },
            AuthFailure::ModelNotAllowed {
                model: "m".into(),
                allowed: vec!["a".into()],
            },
            AuthFailure::EnvironmentNotAllowed {
                env: Environment::Stress,
                model: "m".into(),
                allowed: vec![Environment::Prod],
            },
            AuthFailure::TooManyFailures {
                retry_after: Duration::from_secs(3),
            },
            AuthFailure::TwoKeys,
            AuthFailure::EndpointNotAllowed {
                family: Family::Embeddings,
                path: "/v1/embeddings",
                allowed: Families::parse(&["chat"]).unwrap(),
            },
        ];
        let messages: std::collections::HashSet<String> =
            all.iter().map(|f| f.describe().2).collect();
        assert_eq!(messages.len(), all.len());
        let reasons: std::collections::HashSet<&str> = all.iter().map(|f| f.reason()).collect();
        assert_eq!(reasons.len(), FAILURE_REASONS.len());
    }

    #[test]
    fn times_render_as_rfc3339() {
        assert_eq!(format_wall_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_wall_ms(1_767_225_600_000), "2026-01-01T00:00:00Z");
        assert_eq!(
            format_wall_ms(951_782_400_000 + 3_723_000),
            "2000-02-29T01:02:03Z"
        );
    }
}
