//! The gateway's two clocks, named apart: wall-clock epoch milliseconds (`wall_ms`: what is
//! stored, shown and compared with other replicas) and milliseconds on the process's monotonic
//! clock (`mono_ms`: ejection and back-off deadlines, driven by tokio's clock so paused-time
//! tests control it).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Milliseconds on the process's monotonic clock (tokio's, so paused-time tests drive it).
pub(crate) fn mono_ms() -> u64 {
    static BASE: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(tokio::time::Instant::now);
    u64::try_from(
        tokio::time::Instant::now()
            .saturating_duration_since(base)
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
    // 0 means "never ejected".
    .saturating_add(1)
}

/// RFC 3339 (UTC) for an epoch-millisecond time.
pub fn format_wall_ms(ms: i64) -> String {
    // RFC 3339 in UTC without a date crate: days from the epoch to a civil date.
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60
    )
}

/// A duration an operator typed that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadDuration {
    #[error("`{0}` is not a duration (e.g. 90s, 10m, 1h, 7d)")]
    NotANumber(String),
    #[error("`{text}`: unknown unit `{unit}` (use s, m, h or d)")]
    UnknownUnit { text: String, unit: String },
}

/// `90s`, `10m`, `1h`, `7d` (or plain seconds).
pub fn parse_duration(text: &str) -> Result<Duration, BadDuration> {
    let t = text.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| BadDuration::NotANumber(text.to_owned()))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => {
            return Err(BadDuration::UnknownUnit {
                text: text.to_owned(),
                unit: unit.to_owned(),
            });
        }
    };
    Ok(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert!(parse_duration("1w").is_err());
        assert!(parse_duration("h").is_err());
    }
}
