//! `[request_log]`: the per-request rows written to the store (batching, spill file,
//! retention).

use std::time::Duration;

use super::raw::RawRequestLog;
use super::{ConfigError, FileErrors, RequestLogConfig};

pub(super) fn validate(
    rl: RawRequestLog,
    err: FileErrors<'_>,
) -> Result<RequestLogConfig, ConfigError> {
    if rl.batch_rows == 0 || rl.batch_rows > 1000 {
        return Err(err.at(
            "request_log.batch_rows",
            "must be between 1 and 1000 (one INSERT carries 25 values per row)",
        ));
    }
    if rl.retention_days == 0 {
        return Err(err.at("request_log.retention_days", "must be ≥ 1"));
    }
    Ok(RequestLogConfig {
        enabled: rl.enabled,
        channel_capacity: rl.channel_capacity.max(1),
        batch_rows: rl.batch_rows,
        flush_interval: Duration::from_millis(rl.flush_interval_ms),
        spill_path: rl.spill_path,
        retention_days: rl.retention_days,
    })
}
