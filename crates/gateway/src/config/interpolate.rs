//! `${VAR}` and `${VAR:-default}` in config text, replaced from the environment before the
//! TOML is parsed, so credentials can stay out of the file.

/// Why the config text could not be interpolated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InterpolateError {
    #[error("unterminated `${{` in config")]
    Unterminated,
    #[error("environment variable `{0}` is not set (write `${{{0}:-default}}` to allow a default)")]
    Unset(String),
}

/// Replace `${VAR}` and `${VAR:-default}` with the environment's values. A missing variable
/// without a default is an error, so a typo cannot silently become an empty key. Comment
/// lines are left alone.
pub(crate) fn interpolate_env(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, InterpolateError> {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                return Err(InterpolateError::Unterminated);
            };
            let expr = &after[..end];
            let (name, default) = match expr.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (expr, None),
            };
            match (lookup(name), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => return Err(InterpolateError::Unset(name.to_owned())),
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The messages are what an operator reads: they must not drift with the error type.
    #[test]
    fn errors_read_as_before() {
        assert_eq!(
            interpolate_env("a = '${X'", |_| None)
                .unwrap_err()
                .to_string(),
            "unterminated `${` in config"
        );
        assert_eq!(
            interpolate_env("a = '${X}'", |_| None)
                .unwrap_err()
                .to_string(),
            "environment variable `X` is not set (write `${X:-default}` to allow a default)"
        );
        assert_eq!(
            interpolate_env("# ${X}\na = '${Y:-d}'", |_| None).unwrap(),
            "# ${X}\na = 'd'"
        );
    }
}
