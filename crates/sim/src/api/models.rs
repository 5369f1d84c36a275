//! `GET /v1/models`: the served names as vLLM's model cards.

use serde::Serialize;

use crate::args::SimConfig;

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
    parent: Option<()>,
    max_model_len: u32,
    permission: [ModelPermission; 1],
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

/// `GET /v1/models`: one card per served name, as vLLM lists them. `root` is the model vLLM
/// loaded (its path), the same on every card: the sim's stand-in is its first served name.
pub(crate) fn model_list(cfg: &SimConfig, created: u64) -> Vec<u8> {
    let root = cfg.served_names.first().map_or("", String::as_str);
    let data = cfg
        .served_names
        .iter()
        .map(|name| ModelCard {
            id: name,
            object: "model",
            created,
            owned_by: "vllm",
            root,
            parent: None,
            max_model_len: cfg.max_model_len,
            permission: [ModelPermission {
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
            }],
        })
        .collect();
    serde_json::to_vec(&ModelList {
        object: "list",
        data,
    })
    .unwrap_or_default()
}
