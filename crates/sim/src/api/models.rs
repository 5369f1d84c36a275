//! `GET /v1/models`: the served names and the LoRA adapters loaded as vLLM's model cards.

use std::sync::Arc;

use serde::Serialize;

use crate::args::SimConfig;
use crate::lora::LoraAdapter;

#[derive(Serialize)]
struct ModelPermission {
    id: String,
    object: &'static str,
    created: u64,
    allow_create_engine: bool,
    allow_sampling: bool,
    allow_logprobs: bool,
    allow_search_indices: bool,
    allow_view: bool,
    allow_fine_tuning: bool,
    organization: &'static str,
    group: Option<()>,
    is_blocking: bool,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<&'a str>,
    max_model_len: Option<u32>,
    permission: [ModelPermission; 1],
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

fn permission(created: u64) -> [ModelPermission; 1] {
    [ModelPermission {
        id: format!("modelperm-{:016x}", rand::random::<u64>()),
        object: "model_permission",
        created,
        allow_create_engine: false,
        allow_sampling: true,
        allow_logprobs: true,
        allow_search_indices: false,
        allow_view: true,
        allow_fine_tuning: false,
        organization: "*",
        group: None,
        is_blocking: false,
    }]
}

/// `GET /v1/models`: one card per served name, then one per loaded LoRA adapter, as vLLM's
/// `show_available_models` lists them. A base card's `root` is the model vLLM loaded (its
/// path), the same on every one: the sim's stand-in is its first served name. An adapter's card
/// has its path as `root`, its base model as `parent`, and no `max_model_len`.
pub(crate) fn model_list(cfg: &SimConfig, adapters: &[Arc<LoraAdapter>], created: u64) -> Vec<u8> {
    let root = cfg.served_names.first().map_or("", String::as_str);
    let base = cfg.served_names.iter().map(|name| ModelCard {
        id: name,
        object: "model",
        created,
        owned_by: "vllm",
        root,
        parent: None,
        max_model_len: Some(cfg.max_model_len),
        permission: permission(created),
    });
    let lora = adapters.iter().map(|a| ModelCard {
        id: &a.name,
        object: "model",
        created,
        owned_by: "vllm",
        root: &a.path,
        parent: Some(&a.parent),
        max_model_len: None,
        permission: permission(created),
    });
    let data = base.chain(lora).collect();
    serde_json::to_vec(&ModelList {
        object: "list",
        data,
    })
    .unwrap_or_default()
}
