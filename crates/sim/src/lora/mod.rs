//! vLLM's LoRA adapters on the sim: the `--lora-modules` values, the adapters loaded now (at
//! start, and at run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` when
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set), and the name an answer reports. An adapter changes
//! no word of an answer: it is a name requests may give as `model`, a key of the prefix cache's
//! blocks, and a seat in the running batch (`--max-loras`: `BatchAdapters`, which the engine's
//! scheduler asks).
//!
//! The messages and status codes are vLLM's: `OpenAIServingModels` in
//! `vllm/entrypoints/openai/models/serving.py` (the checks, the answers, the model cards), the
//! router in `vllm/entrypoints/serve/lora/api_router.py` (plain-text success, the environment
//! flag) and `LoRAAdapterNotFoundError` in `vllm/exceptions.py`.
//!
//! The submodule `gauge` is `vllm:lora_requests_info`, the adapters running and waiting.

pub(crate) mod gauge;

use std::path::Path;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use serde::Deserialize;

use crate::api::error::ApiError;
use crate::args::SimConfig;
use crate::prefix_cache::PromptBlocks;
use crate::tokens::{fnv1a, mix64};

/// One `--lora-modules` value, as vLLM's `LoRAParserAction` reads it: `name=path`, or a JSON
/// object `{"name", "path", "base_model_name"?}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LoraModule {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub base_model_name: Option<String>,
    /// Accepted as vLLM's `LoRAModulePath` has it; the sim has no weights to lay out.
    #[serde(default, rename = "is_3d_lora_weight")]
    _is_3d_lora_weight: bool,
}

impl LoraModule {
    /// vLLM's rule: a value with `=` and no `,` is `name=path`, anything else JSON.
    pub(crate) fn parse(value: &str) -> Result<Self, String> {
        if value.contains('=') && !value.contains(',') {
            let (name, path) = value.split_once('=').unwrap_or((value, ""));
            return Ok(Self {
                name: name.to_owned(),
                path: path.to_owned(),
                base_model_name: None,
                _is_3d_lora_weight: false,
            });
        }
        let json: serde_json::Value = serde_json::from_str(value)
            .map_err(|_| format!("Invalid JSON format for --lora-modules: {value}"))?;
        serde_json::from_value(json)
            .map_err(|e| format!("Invalid fields for --lora-modules: {value} - {e}"))
    }
}

/// `--enable-lora` and the flags that come with it, validated.
#[derive(Debug)]
pub(crate) struct LoraSettings {
    /// `--max-loras`: the most adapters in one running batch.
    pub max_loras: u32,
    /// `--lora-modules`, loaded at start.
    pub modules: Vec<LoraModule>,
}

impl LoraSettings {
    /// `None` without `--enable-lora`. vLLM refuses to start on a module it cannot load, so the
    /// sim does too: a name given twice, or a path that does not exist.
    pub(crate) fn validate(
        enable: bool,
        max_loras: u32,
        modules: &[String],
    ) -> Result<Option<Self>, String> {
        if !enable {
            return match modules.is_empty() {
                true => Ok(None),
                // vLLM's engine refuses the first static module at start with these words.
                false => Err(
                    "--lora-modules needs --enable-lora (vLLM at start: LoRA is not \
                              enabled. Use --enable-lora to enable LoRA.)"
                        .into(),
                ),
            };
        }
        if max_loras == 0 {
            return Err("--max-loras must be >= 1".into());
        }
        let mut parsed: Vec<LoraModule> = Vec::with_capacity(modules.len());
        for value in modules.iter().filter(|v| !v.is_empty()) {
            let m = LoraModule::parse(value)?;
            if m.name.is_empty() || m.path.is_empty() {
                return Err(format!(
                    "--lora-modules {value}: {}",
                    LoraError::NameOrPathMissing
                ));
            }
            if parsed.iter().any(|p| p.name == m.name) {
                return Err(format!(
                    "--lora-modules: {}",
                    LoraError::AlreadyLoaded(m.name.clone())
                ));
            }
            if !Path::new(&m.path).exists() {
                return Err(format!(
                    "--lora-modules: {}",
                    LoraError::NoAdapterAt {
                        name: m.name.clone(),
                        path: m.path.clone(),
                    }
                ));
            }
            parsed.push(m);
        }
        Ok(Some(Self {
            max_loras,
            modules: parsed,
        }))
    }
}

/// The adapters of the batch a scheduler step is planning, under vLLM's `--max-loras` rule: a
/// waiting request whose adapter would be one more than `max` in the batch is skipped (it keeps
/// its place in the queue); requests of the base model always fit.
#[derive(Debug)]
pub(crate) struct BatchAdapters {
    max: usize,
    /// Adapter ids, reused from step to step.
    ids: Vec<u32>,
}

impl BatchAdapters {
    pub(crate) fn new(max_loras: u32) -> Self {
        Self {
            max: usize::try_from(max_loras.max(1)).unwrap_or(usize::MAX),
            ids: Vec::new(),
        }
    }

    /// A step starts from the adapters of the sequences already running.
    pub(crate) fn reset<'a>(&mut self, running: impl Iterator<Item = &'a LoraAdapter>) {
        self.ids.clear();
        for a in running {
            self.admit(Some(a));
        }
    }

    pub(crate) fn fits(&self, adapter: Option<&LoraAdapter>) -> bool {
        adapter.is_none_or(|a| self.ids.contains(&a.id) || self.ids.len() < self.max)
    }

    pub(crate) fn admit(&mut self, adapter: Option<&LoraAdapter>) {
        if let Some(a) = adapter
            && !self.ids.contains(&a.id)
        {
            self.ids.push(a.id);
        }
    }
}

/// vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: on for `1` or `true`, any case, spaces around.
pub(crate) fn env_flag(value: &str) -> Result<bool, std::convert::Infallible> {
    Ok(matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true"
    ))
}

/// A loaded adapter, as requests and `/v1/models` see it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LoraAdapter {
    /// vLLM's `lora_int_id`: 1, 2, … in load order; an in-place reload keeps it.
    pub id: u32,
    pub name: String,
    pub path: String,
    /// The base model it adapts: the module's `base_model_name` when that is a served name,
    /// else the first served name (`parent` in `/v1/models`).
    pub parent: String,
}

impl LoraAdapter {
    /// vLLM hashes every block of an adapter's request with the adapter's name (the extra keys
    /// of `kv_cache_utils._gen_lora_extra_hash_keys`), so the base model and each adapter keep
    /// their own KV blocks. The chain stays a chain: each block's hash already covers its
    /// whole prefix, and the name is folded into every one.
    pub(crate) fn key_blocks(&self, blocks: &mut PromptBlocks) {
        let salt = fnv1a(0x10fa, self.name.as_bytes());
        for h in &mut blocks.hashes {
            *h = mix64(*h ^ salt);
        }
    }
}

/// The name an answer's `model` carries: the adapter's when the request named one, else the
/// first served name (vLLM's `OpenAIServingModels.model_name`).
pub(crate) fn answer_model<'a>(cfg: &'a SimConfig, adapter: Option<&'a LoraAdapter>) -> &'a str {
    adapter.map_or_else(|| cfg.model_name(), |a| a.name.as_str())
}

fn parent_of(base_model_name: Option<&str>, served: &[String]) -> String {
    base_model_name
        .filter(|b| served.iter().any(|s| s == b))
        .or_else(|| served.first().map(String::as_str))
        .unwrap_or_default()
        .to_owned()
}

/// `POST /v1/load_lora_adapter` (vLLM's `LoadLoRAAdapterRequest`).
#[derive(Deserialize)]
pub(crate) struct LoadRequest {
    lora_name: String,
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter` (vLLM's `UnloadLoRAAdapterRequest`; `lora_int_id` is
/// accepted and, as in vLLM, not read).
#[derive(Deserialize)]
pub(crate) struct UnloadRequest {
    lora_name: String,
    #[serde(default, rename = "lora_int_id")]
    _lora_int_id: Option<i64>,
}

/// Why a load or an unload is refused, in vLLM's words.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoraError {
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    NameOrPathMissing,
    #[error(
        "The lora adapter '{0}' has already been loaded. If you want to load the adapter in \
         place, set 'load_inplace' to True."
    )]
    AlreadyLoaded(String),
    /// The path holds no adapter: vLLM's `LoRAAdapterNotFoundError` (a local path that does
    /// not exist and no Hugging Face repository of that name). The sim looks on disk only.
    #[error("Loading lora {name} failed: No adapter found for {path}")]
    NoAdapterAt { name: String, path: String },
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING without `--enable-lora`: vLLM registers the routes and
    /// its engine refuses the load (the worker's `_ensure_lora_enabled`).
    #[error("LoRA is not enabled. Use --enable-lora to enable LoRA.")]
    NotEnabled,
    #[error("'lora_name' needs to be provided to unload a LoRA adapter.")]
    UnloadNameMissing,
    #[error("The lora adapter '{0}' cannot be found.")]
    NotLoaded(String),
}

impl From<LoraError> for ApiError {
    fn from(e: LoraError) -> ApiError {
        use http::StatusCode;
        let (status, kind) = match &e {
            LoraError::NameOrPathMissing
            | LoraError::AlreadyLoaded(_)
            | LoraError::UnloadNameMissing => (StatusCode::BAD_REQUEST, "InvalidUserInput"),
            LoraError::NoAdapterAt { .. } | LoraError::NotLoaded(_) => {
                (StatusCode::NOT_FOUND, "NotFoundError")
            }
            LoraError::NotEnabled => (StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError"),
        };
        ApiError::Flat {
            status,
            message: e.to_string(),
            kind,
            param: None,
        }
    }
}

/// The adapters loaded now, shared by every connection.
///
/// Requests read the list (only for a `model` that is not a served name, so a request naming
/// the base model never touches it); loads and unloads take turns on `turn` and swap entries
/// under the write lock, which is never held across an await.
pub(crate) struct Adapters {
    /// In load order, as vLLM lists them (an in-place reload keeps its place).
    loaded: RwLock<Vec<Arc<LoraAdapter>>>,
    /// One load or unload at a time, holding the last `lora_int_id` given. vLLM locks per name,
    /// but its engine core runs the `add_lora` / `remove_lora` calls one after the other, so
    /// loads of different names wait for each other there too.
    turn: tokio::sync::Mutex<u32>,
}

impl Adapters {
    /// The registry with `--lora-modules` loaded, ids 1, 2, … in flag order.
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        let modules = cfg.lora.as_ref().map_or(&[][..], |l| &l.modules[..]);
        let loaded: Vec<Arc<LoraAdapter>> = modules
            .iter()
            .zip(1u32..)
            .map(|(m, id)| {
                Arc::new(LoraAdapter {
                    id,
                    name: m.name.clone(),
                    path: m.path.clone(),
                    parent: parent_of(m.base_model_name.as_deref(), &cfg.served_names),
                })
            })
            .collect();
        let last_id = u32::try_from(loaded.len()).unwrap_or(u32::MAX);
        Self {
            loaded: RwLock::new(loaded),
            turn: tokio::sync::Mutex::new(last_id),
        }
    }

    /// The adapter loaded under `name`.
    pub(crate) fn find(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        let loaded = self.loaded.read().unwrap_or_else(PoisonError::into_inner);
        loaded.iter().find(|a| a.name == name).cloned()
    }

    /// Every loaded adapter, in load order.
    pub(crate) fn list(&self) -> Vec<Arc<LoraAdapter>> {
        self.loaded
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `/v1/load_lora_adapter`, in vLLM's order: the request's checks, then the engine's load
    /// (`delay`, vLLM's `add_lora`), after which the adapter is listed and served. A load that
    /// fails fails at once: vLLM finds a missing path before reading any weights.
    pub(crate) async fn load(
        &self,
        r: LoadRequest,
        cfg: &SimConfig,
        delay: Duration,
    ) -> Result<String, LoraError> {
        let mut last_id = self.turn.lock().await;
        if r.lora_name.is_empty() || r.lora_path.is_empty() {
            return Err(LoraError::NameOrPathMissing);
        }
        let existing = self.find(&r.lora_name);
        if existing.is_some() && !r.load_inplace {
            return Err(LoraError::AlreadyLoaded(r.lora_name));
        }
        // vLLM draws the id before the engine tries the load, so a failed load spends one.
        let id = match &existing {
            Some(a) => a.id,
            None => {
                *last_id = last_id.saturating_add(1);
                *last_id
            }
        };
        if cfg.lora.is_none() {
            return Err(LoraError::NotEnabled);
        }
        if !Path::new(&r.lora_path).exists() {
            return Err(LoraError::NoAdapterAt {
                name: r.lora_name,
                path: r.lora_path,
            });
        }
        let message = format!(
            "Success: LoRA adapter '{}' added successfully.",
            r.lora_name
        );
        let pending = PendingLoad {
            adapters: self,
            adapter: Some(Arc::new(LoraAdapter {
                id,
                name: r.lora_name,
                path: r.lora_path,
                parent: parent_of(None, &cfg.served_names),
            })),
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        drop(pending);
        Ok(message)
    }

    /// `/v1/unload_lora_adapter`. Requests already running on the adapter finish on it.
    pub(crate) async fn unload(&self, r: UnloadRequest) -> Result<String, LoraError> {
        let _turn = self.turn.lock().await;
        if r.lora_name.is_empty() {
            return Err(LoraError::UnloadNameMissing);
        }
        let mut loaded = self.loaded.write().unwrap_or_else(PoisonError::into_inner);
        let at = loaded
            .iter()
            .position(|a| a.name == r.lora_name)
            .ok_or_else(|| LoraError::NotLoaded(r.lora_name.clone()))?;
        loaded.remove(at);
        Ok(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            r.lora_name
        ))
    }

    fn insert(&self, adapter: Arc<LoraAdapter>) {
        let mut loaded = self.loaded.write().unwrap_or_else(PoisonError::into_inner);
        match loaded.iter_mut().find(|a| a.name == adapter.name) {
            Some(slot) => *slot = adapter,
            None => loaded.push(adapter),
        }
    }
}

/// A load the engine is running. It completes when dropped: at the end of the delay, or
/// earlier if the client leaves, since vLLM finishes a load whose caller has gone.
struct PendingLoad<'a> {
    adapters: &'a Adapters,
    adapter: Option<Arc<LoraAdapter>>,
}

impl Drop for PendingLoad<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.adapter.take() {
            self.adapters.insert(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_values_are_read_as_vllm_reads_them() {
        let plain = LoraModule::parse("sql=/data/sql").unwrap();
        assert_eq!(
            (plain.name.as_str(), plain.path.as_str()),
            ("sql", "/data/sql")
        );
        assert_eq!(plain.base_model_name, None);
        let json =
            LoraModule::parse(r#"{"name": "sql", "path": "/data/sql", "base_model_name": "b"}"#)
                .unwrap();
        assert_eq!(json.base_model_name.as_deref(), Some("b"));
        assert_eq!(
            LoraModule::parse("{not json").unwrap_err(),
            "Invalid JSON format for --lora-modules: {not json"
        );
        assert!(
            LoraModule::parse(r#"{"name": "a", "path": "/p", "rank": 8}"#)
                .unwrap_err()
                .starts_with("Invalid fields for --lora-modules:")
        );
    }

    #[test]
    fn the_environment_flag_is_one_or_true() {
        for (v, on) in [
            ("1", true),
            ("TRUE", true),
            (" true ", true),
            ("yes", false),
            ("0", false),
        ] {
            assert_eq!(env_flag(v), Ok(on), "{v:?}");
        }
    }

    #[test]
    fn an_adapter_keys_its_blocks_apart_from_the_base_model() {
        let base = crate::prefix_cache::text_blocks(&"word ".repeat(64), 16, false);
        let adapter = |name: &str| LoraAdapter {
            id: 1,
            name: name.into(),
            path: "/p".into(),
            parent: "m".into(),
        };
        let (mut a, mut a2, mut b) = (base.clone(), base.clone(), base.clone());
        adapter("a").key_blocks(&mut a);
        adapter("a").key_blocks(&mut a2);
        adapter("b").key_blocks(&mut b);
        assert_eq!(a, a2);
        assert!(a.hashes.iter().all(|h| !base.hashes.contains(h)));
        assert!(a.hashes.iter().all(|h| !b.hashes.contains(h)));
    }
}
