//! A pool's fallbacks: `fallbacks = [...]`, the pools that take a request this pool cannot serve
//! before its first byte, `context_window_fallbacks = [...]`, the pools that take a prompt too
//! long for this pool's model, `fallback_environments`, the environments whose requests may
//! leave this pool for them, and `max_model_len`, the context length (else learnt from the
//! backends' `/v1/models`).

use std::collections::HashSet;

use super::pools::PoolConfig;
use super::{ConfigError, Environment, FileErrors};

/// A pool's fallbacks, by the model names (or aliases) of the pools they name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FallbackConfig {
    /// Tried in order when the pool has no backend that can take the request, every retry
    /// failed, its queue is full or the request's wait in it ended.
    pub on_failure: Vec<String>,
    /// Tried in order when the prompt plus the requested output exceeds the pool's context
    /// length, or a backend answered vLLM's context-length error.
    pub context_window: Vec<String>,
    /// Environments whose requests may be sent to the fallbacks (`None`: all). A fallback
    /// pool's own `environments` apply too.
    pub environments: Option<Vec<Environment>>,
    /// The pool's context length in tokens, when set (else the least `max_model_len` its
    /// backends' `/v1/models` report).
    pub max_model_len: Option<u32>,
}

impl FallbackConfig {
    /// Nothing to fall back to.
    pub fn is_empty(&self) -> bool {
        self.on_failure.is_empty() && self.context_window.is_empty()
    }
}

/// The raw fields of `[[pools]]` this section reads.
pub(super) struct RawFallbacks {
    pub(super) fallbacks: Vec<String>,
    pub(super) context_window_fallbacks: Vec<String>,
    pub(super) fallback_environments: Option<Vec<Environment>>,
    pub(super) max_model_len: Option<u32>,
}

impl RawFallbacks {
    /// Checked within the pool (`at` names its fields); the names are checked against the
    /// other pools once all are read (`check_names`).
    pub(super) fn check(
        self,
        at: &dyn Fn(&str) -> String,
        err: FileErrors<'_>,
    ) -> Result<FallbackConfig, ConfigError> {
        for (field, list) in [
            ("fallbacks", &self.fallbacks),
            ("context_window_fallbacks", &self.context_window_fallbacks),
        ] {
            let mut seen = HashSet::new();
            for (k, name) in list.iter().enumerate() {
                if !seen.insert(name) {
                    return Err(err.at(
                        at(&format!("{field}[{k}]")),
                        format!("`{name}` is named twice: each pool is tried once"),
                    ));
                }
            }
        }
        if let Some(envs) = &self.fallback_environments
            && envs.is_empty()
        {
            return Err(err.at(
                at("fallback_environments"),
                "must name at least one of stress, gray, prod (leave it out to let every environment fall back; leave out the fallbacks to let none)",
            ));
        }
        if self.max_model_len == Some(0) {
            return Err(err.at(at("max_model_len"), "must be > 0 (tokens)"));
        }
        let config = FallbackConfig {
            on_failure: self.fallbacks,
            context_window: self.context_window_fallbacks,
            environments: self.fallback_environments,
            max_model_len: self.max_model_len,
        };
        if config.environments.is_some() && config.is_empty() {
            return Err(err.at(
                at("fallback_environments"),
                "is set, but the pool has no `fallbacks` or `context_window_fallbacks`",
            ));
        }
        Ok(config)
    }
}

/// Every fallback names another pool, by its model or an alias.
pub(super) fn check_names(pools: &[PoolConfig], err: FileErrors<'_>) -> Result<(), ConfigError> {
    let names = |p: &PoolConfig| -> Vec<String> {
        std::iter::once(p.model.clone())
            .chain(p.aliases.iter().cloned())
            .collect()
    };
    for (i, p) in pools.iter().enumerate() {
        let own = names(p);
        for (field, list) in [
            ("fallbacks", &p.fallback.on_failure),
            ("context_window_fallbacks", &p.fallback.context_window),
        ] {
            for (k, name) in list.iter().enumerate() {
                let at = format!("pools[{i}].{field}[{k}]");
                if own.contains(name) {
                    return Err(err.at(at, "names this pool itself: a fallback is another pool"));
                }
                if !pools.iter().any(|o| names(o).contains(name)) {
                    let models: Vec<_> = pools.iter().map(|o| format!("`{}`", o.model)).collect();
                    return Err(err.at(
                        at,
                        format!("no pool serves `{name}` (the pools: {})", models.join(", ")),
                    ));
                }
            }
        }
    }
    Ok(())
}
