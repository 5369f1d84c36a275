//! Reading a request's credentials: `Authorization: Bearer <key>` or `x-api-key: <key>`,
//! with a precise failure for each common way a client gets the header wrong.

use http::HeaderMap;

use super::{AuthFailure, OAuthIssuer};

/// Read the credentials of a request: the key text, or why there is none usable.
pub fn credentials(headers: &HeaderMap) -> Result<&str, AuthFailure> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION) {
        let v = v.to_str().map_err(|_| AuthFailure::Whitespace)?;
        let v = v.trim_matches(|c| c == ' ' || c == '\t');
        let (scheme, rest) = match v.find([' ', '\t']) {
            Some(i) => (&v[..i], &v[i + 1..]),
            None => (v, ""),
        };
        if scheme.eq_ignore_ascii_case("bearer") {
            let key = token(rest)?;
            // Both headers, two keys: which one was meant is unknown (Anthropic's SDKs send
            // `x-api-key`, its auth token as `Authorization`). The same key twice is fine.
            if let Some(x) = headers.get("x-api-key")
                && x.as_bytes().trim_ascii() != key.as_bytes()
            {
                return Err(AuthFailure::TwoKeys);
            }
            return Ok(key);
        }
        if scheme.len() > 6 && scheme[..6].eq_ignore_ascii_case("bearer") {
            return Err(AuthFailure::NoSpaceAfterBearer);
        }
        if scheme.eq_ignore_ascii_case("basic") {
            return Err(AuthFailure::BasicScheme);
        }
        if let Some(issuer) = oauth_issuer(v) {
            return Err(AuthFailure::OAuthToken(issuer));
        }
        if scheme.eq_ignore_ascii_case("oauth") {
            return Err(AuthFailure::OAuthToken(OAuthIssuer::Other));
        }
        if rest.is_empty() && (v.starts_with("fg-") || v.starts_with("sk-")) {
            // A bare key without a scheme.
            return Err(AuthFailure::OtherScheme("(none)".into()));
        }
        return Err(AuthFailure::OtherScheme(scheme.chars().take(20).collect()));
    }
    if let Some(v) = headers.get("x-api-key") {
        let v = v.to_str().map_err(|_| AuthFailure::Whitespace)?;
        return token(v.trim_matches(|c| c == ' ' || c == '\t'));
    }
    Err(AuthFailure::Missing)
}

fn token(t: &str) -> Result<&str, AuthFailure> {
    if t.is_empty() {
        return Err(AuthFailure::Missing);
    }
    let quoted = |q: char| t.len() >= 2 && t.starts_with(q) && t.ends_with(q);
    if quoted('"') || quoted('\'') || t.starts_with('"') || t.ends_with('"') {
        return Err(AuthFailure::Quoted);
    }
    if t.chars().any(char::is_whitespace) {
        return Err(AuthFailure::Whitespace);
    }
    if let Some(issuer) = oauth_issuer(t) {
        return Err(AuthFailure::OAuthToken(issuer));
    }
    Ok(t)
}

/// Who issued `t`, when it is an OAuth access token: a Claude account's (`sk-ant-oat01-...`,
/// what Claude Code sends when it is logged in to a subscription), or another (a JWT: three
/// base64url parts, header starting `eyJ`; Google's `ya29.`; GitHub's `gho_`).
fn oauth_issuer(t: &str) -> Option<OAuthIssuer> {
    let t = t.rsplit([' ', '\t']).next().unwrap_or(t);
    if t.starts_with("sk-ant-oat") {
        Some(OAuthIssuer::ClaudeAccount)
    } else if (t.starts_with("eyJ") && t.matches('.').count() == 2)
        || t.starts_with("ya29.")
        || t.starts_with("gho_")
    {
        Some(OAuthIssuer::Other)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn creds(auth: Option<&str>, xkey: Option<&str>) -> Result<String, AuthFailure> {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(a).unwrap(),
            );
        }
        if let Some(k) = xkey {
            h.insert("x-api-key", HeaderValue::from_str(k).unwrap());
        }
        credentials(&h).map(str::to_owned)
    }

    #[test]
    fn header_forms() {
        assert_eq!(creds(Some("Bearer fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(Some("bearer fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(Some("BEARER fg-a"), None), Ok("fg-a".into()));
        assert_eq!(creds(None, Some("fg-a")), Ok("fg-a".into()));
        assert_eq!(creds(None, None), Err(AuthFailure::Missing));
        assert_eq!(creds(Some("Bearer"), None), Err(AuthFailure::Missing));
        assert_eq!(
            creds(Some("Bearerfg-a"), None),
            Err(AuthFailure::NoSpaceAfterBearer)
        );
        assert_eq!(
            creds(Some("Bearer \"fg-a\""), None),
            Err(AuthFailure::Quoted)
        );
        assert_eq!(creds(Some("Bearer 'fg-a'"), None), Err(AuthFailure::Quoted));
        assert_eq!(
            creds(Some("Bearer  fg-a"), None),
            Err(AuthFailure::Whitespace)
        );
        assert_eq!(
            creds(Some("Bearer fg-a extra"), None),
            Err(AuthFailure::Whitespace)
        );
        assert_eq!(
            creds(Some("Basic Zm9vOmJhcg=="), None),
            Err(AuthFailure::BasicScheme)
        );
        assert_eq!(
            creds(
                Some("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig"),
                None
            ),
            Err(AuthFailure::OAuthToken(OAuthIssuer::Other))
        );
        // Claude Code logged in to a Claude account sends its OAuth token as a bearer.
        assert_eq!(
            creds(Some("Bearer sk-ant-oat01-abcDEF_123"), None),
            Err(AuthFailure::OAuthToken(OAuthIssuer::ClaudeAccount))
        );
        // An Anthropic API key is a key, refused later as not fleetgate's.
        assert_eq!(
            creds(None, Some("sk-ant-api03-abcDEF_123")),
            Ok("sk-ant-api03-abcDEF_123".into())
        );
        assert_eq!(
            creds(Some("Token abc"), None),
            Err(AuthFailure::OtherScheme("Token".into()))
        );
        assert_eq!(
            creds(Some("fg-prod-x"), None),
            Err(AuthFailure::OtherScheme("(none)".into()))
        );
    }

    proptest! {
        #[test]
        fn credentials_never_panic(a in "\\PC{0,60}", x in "\\PC{0,60}") {
            let mut h = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&a) { h.insert(http::header::AUTHORIZATION, v); }
            if let Ok(v) = HeaderValue::from_str(&x) { h.insert("x-api-key", v); }
            let _ = credentials(&h);
        }
    }
}
