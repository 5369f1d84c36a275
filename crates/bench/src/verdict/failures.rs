//! The requests a side of a comparison failed, counted by kind of error.

use crate::summary::Summary;

/// The requests one side of a comparison failed (refused, cut, timed out): how many of how
/// many, and their errors, the most frequent first.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Failures {
    pub(crate) target: String,
    pub(crate) failed: usize,
    pub(crate) sent: usize,
    /// The kinds of error (`HTTP 429 requests_per_minute_exceeded`), the most frequent first,
    /// at most three: (kind, count, one of its messages cut to 200 characters).
    pub(crate) errors: Vec<(String, usize, String)>,
}

impl Failures {
    /// One per side that failed any request.
    pub(crate) fn of(names: [&str; 2], summaries: &[Summary]) -> Vec<Failures> {
        names
            .iter()
            .zip(summaries)
            .filter(|(_, s)| s.failed > 0)
            .map(|(name, s)| {
                // Messages differ by key and retry time: counted by their kind, the part
                // before the first `: ` (status and code).
                let mut kinds: Vec<(String, usize, String)> = Vec::new();
                for (e, n) in &s.errors {
                    let kind = e.split_once(": ").map_or(e.as_str(), |(k, _)| k);
                    match kinds.iter_mut().find(|k| k.0 == kind) {
                        Some(k) => k.1 += n,
                        None => kinds.push((kind.to_owned(), *n, e.chars().take(200).collect())),
                    }
                }
                let mut errors = kinds;
                errors.sort_by_key(|e| std::cmp::Reverse(e.1));
                errors.truncate(3);
                Failures {
                    target: (*name).to_owned(),
                    failed: s.failed,
                    sent: s.failed + s.completed,
                    errors,
                }
            })
            .collect()
    }

    pub(super) fn render(&self) -> String {
        let errors: Vec<String> = self
            .errors
            .iter()
            .map(|(kind, n, example)| {
                if example == kind {
                    format!("{n} × {kind}")
                } else {
                    format!("{n} × {kind} (\"{example}\")")
                }
            })
            .collect();
        format!(
            "WARNING: {} failed {} of its {} requests: {}\n",
            self.target,
            self.failed,
            self.sent,
            errors.join("; ")
        )
    }
}
