//! Reading the request log back: requests, errors, tokens and TTFT / overhead percentiles per
//! key, environment, model or backend over a time window (`fleetgate usage`, `GET /admin/usage`).

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::Row;

use crate::store::{KeyStore, StoreError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Key,
    Environment,
    Model,
    Backend,
    /// The API the request called: chat, completions, responses, messages, embeddings, ...
    Endpoint,
}

impl std::str::FromStr for GroupBy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "key" => Ok(GroupBy::Key),
            "env" | "environment" => Ok(GroupBy::Environment),
            "model" => Ok(GroupBy::Model),
            "backend" => Ok(GroupBy::Backend),
            "endpoint" => Ok(GroupBy::Endpoint),
            _ => Err(format!(
                "`{s}`: group by key, env, model, backend or endpoint"
            )),
        }
    }
}

impl GroupBy {
    /// The group of requests without a value in the column: "no key" (refused before a key
    /// was known), as the console names it, "no model" (refused before routing), "no backend".
    pub(crate) fn empty_group(self) -> &'static str {
        match self {
            GroupBy::Key | GroupBy::Environment => "no key",
            GroupBy::Model => "no model",
            GroupBy::Backend => "no backend",
            GroupBy::Endpoint => "no endpoint",
        }
    }

    fn column(self) -> &'static str {
        match self {
            GroupBy::Key => "key_id",
            GroupBy::Environment => "environment",
            GroupBy::Model => "model",
            GroupBy::Backend => "backend",
            GroupBy::Endpoint => "endpoint",
        }
    }
}

/// What to read.
#[derive(Debug, Clone)]
pub struct UsageQuery {
    /// Epoch-ms window [from, to).
    pub from: i64,
    pub to: i64,
    pub environment: Option<String>,
    pub by: GroupBy,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// One group's figures (times in milliseconds).
#[derive(Debug, Clone, Serialize)]
pub struct UsageRow {
    pub group: String,
    /// Grouped by key: the key's name and environment (absent for a key no longer in the store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_environment: Option<String>,
    pub requests: u64,
    pub errors: u64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub client_ttft_ms: Option<Percentiles>,
    pub(crate) upstream_ttft_ms: Option<Percentiles>,
    pub overhead_ms: Option<Percentiles>,
}

fn percentiles(mut v: Vec<f64>) -> Option<Percentiles> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| nearest_rank(&v, p).unwrap_or(0.0);
    Some(Percentiles {
        p50: at(50.0),
        p95: at(95.0),
        p99: at(99.0),
    })
}

/// The nearest-rank percentile `p` of sorted samples (`None`: no samples).
pub(crate) fn nearest_rank(sorted: &[f64], p: f64) -> Option<f64> {
    let rank = ((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied()
}

#[derive(Default)]
struct Acc {
    requests: u64,
    errors: u64,
    prompt: i64,
    completion: i64,
    client_ttft: Vec<f64>,
    upstream_ttft: Vec<f64>,
    overhead: Vec<f64>,
}

/// Aggregate the window (rows are read and summarised here, so the same code serves both
/// stores).
pub async fn usage(store: &KeyStore, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
    let col = q.by.column();
    let sql = format!(
        "SELECT {col} AS grp, status, prompt_tokens, completion_tokens, client_ttft_us, upstream_ttft_us, \
         overhead_pre_us, overhead_relay_us FROM request_log WHERE at >= $1 AND at < $2 {}",
        if q.environment.is_some() {
            "AND environment = $3"
        } else {
            ""
        }
    );
    let mut query = sqlx::query(&sql).bind(q.from).bind(q.to);
    if let Some(env) = &q.environment {
        query = query.bind(env.clone());
    }
    let rows = query.fetch_all(store.pool()).await?;
    let mut groups: BTreeMap<String, Acc> = BTreeMap::new();
    for r in rows {
        let group: Option<String> = r.try_get("grp")?;
        let acc = groups
            .entry(group.unwrap_or_else(|| q.by.empty_group().into()))
            .or_default();
        acc.requests += 1;
        let status: i32 = r.try_get("status")?;
        if status >= 400 {
            acc.errors += 1;
        }
        acc.prompt += r.try_get::<Option<i64>, _>("prompt_tokens")?.unwrap_or(0);
        acc.completion += r
            .try_get::<Option<i64>, _>("completion_tokens")?
            .unwrap_or(0);
        let ms = |v: Option<i64>| v.map(|us| us as f64 / 1000.0);
        if let Some(v) = ms(r.try_get("client_ttft_us")?) {
            acc.client_ttft.push(v);
        }
        if let Some(v) = ms(r.try_get("upstream_ttft_us")?) {
            acc.upstream_ttft.push(v);
        }
        let pre: Option<i64> = r.try_get("overhead_pre_us")?;
        let relay: Option<i64> = r.try_get("overhead_relay_us")?;
        if let (Some(a), Some(b)) = (pre, relay) {
            acc.overhead.push((a + b) as f64 / 1000.0);
        }
    }
    let names = if q.by == GroupBy::Key {
        key_names(store, groups.keys()).await?
    } else {
        BTreeMap::new()
    };
    Ok(groups
        .into_iter()
        .map(|(group, a)| UsageRow {
            key_name: names.get(&group).map(|(n, _)| n.clone()),
            key_environment: names.get(&group).map(|(_, e)| e.clone()),
            group,
            requests: a.requests,
            errors: a.errors,
            prompt_tokens: a.prompt,
            completion_tokens: a.completion,
            client_ttft_ms: percentiles(a.client_ttft),
            upstream_ttft_ms: percentiles(a.upstream_ttft),
            overhead_ms: percentiles(a.overhead),
        })
        .collect())
}

/// Name and environment of each key id (one query per 500 ids).
async fn key_names<'a>(
    store: &KeyStore,
    ids: impl Iterator<Item = &'a String>,
) -> Result<BTreeMap<String, (String, String)>, StoreError> {
    let ids: Vec<&String> = ids.filter(|id| id.as_str() != "-").collect();
    let mut out = BTreeMap::new();
    for chunk in ids.chunks(500) {
        let placeholders: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
        let sql = format!(
            "SELECT public_id, name, environment FROM api_keys WHERE public_id IN ({})",
            placeholders.join(", ")
        );
        let mut query = sqlx::query(&sql);
        for id in chunk {
            query = query.bind(id.as_str());
        }
        for r in query.fetch_all(store.pool()).await? {
            out.insert(
                r.try_get::<String, _>("public_id")?,
                (r.try_get("name")?, r.try_get("environment")?),
            );
        }
    }
    Ok(out)
}

/// A month an operator typed that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a month: use YYYY-MM")]
pub struct BadMonth(pub String);

/// Epoch-ms bounds of a calendar month `YYYY-MM` (UTC).
pub fn month_window(month: &str) -> Result<(i64, i64), BadMonth> {
    let (y, m) = month
        .split_once('-')
        .and_then(|(y, m)| Some((y.parse::<i64>().ok()?, m.parse::<i64>().ok()?)))
        .filter(|(_, m)| (1..=12).contains(m))
        .ok_or_else(|| BadMonth(month.to_owned()))?;
    let start = days_from_civil(y, m) * 86_400_000;
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    Ok((start, days_from_civil(ny, nm) * 86_400_000))
}

/// Days from 1970-01-01 to the first of month `m` of year `y` (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months() {
        assert_eq!(month_window("1970-01").unwrap(), (0, 31 * 86_400_000));
        let (a, b) = month_window("2024-02").unwrap();
        assert_eq!((b - a) / 86_400_000, 29);
        assert!(month_window("2024-13").is_err());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let p = percentiles((1..=100).map(f64::from).collect()).unwrap();
        assert_eq!((p.p50, p.p95, p.p99), (50.0, 95.0, 99.0));
        assert!(percentiles(vec![]).is_none());
    }
}
