//! `[pools.kv_events]`: subscribe to each backend's vLLM KV cache events (`vllm serve
//! --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
//! "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`), so the gateway knows what every
//! engine's prefix cache holds (`engine_cache`).

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, FileErrors};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEventsConfig {
    /// The publisher's port on each backend's host (vLLM's `endpoint`, bound with `*`);
    /// `None` when every backend names its own (`kv_events_port`) or publishes none.
    pub port: Option<u16>,
    /// The replay endpoint's port (vLLM's `replay_endpoint`), to fill gaps.
    pub replay_port: Option<u16>,
    /// Data-parallel ranks behind each backend: rank r publishes on `port + r` (and replays
    /// on `replay_port + r`), as vLLM offsets them.
    pub data_parallel_size: u32,
    /// vLLM's `topic` (empty by default: every message).
    pub topic: String,
    /// Blocks indexed per rank at most.
    pub max_blocks: usize,
    /// The model's directory (its `tokenizer.json` and chat template), to cut requests into
    /// the engines' token blocks (`affinity.by = "kv_events"`).
    pub tokenizer: Option<PathBuf>,
    /// A chat template file instead of the tokenizer directory's (as `vllm serve
    /// --chat-template` takes).
    pub chat_template: Option<PathBuf>,
}

pub(super) const DEFAULT_MAX_BLOCKS: usize = 1 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKvEvents {
    port: Option<u16>,
    replay_port: Option<u16>,
    #[serde(default = "one")]
    data_parallel_size: u32,
    #[serde(default)]
    topic: String,
    #[serde(default = "default_max_blocks")]
    max_blocks: usize,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
}

fn one() -> u32 {
    1
}

fn default_max_blocks() -> usize {
    DEFAULT_MAX_BLOCKS
}

impl RawKvEvents {
    pub(super) fn check(
        self,
        at: &dyn Fn(&str) -> String,
        err: FileErrors<'_>,
    ) -> Result<KvEventsConfig, ConfigError> {
        if self.port == Some(0) {
            return Err(err.at(
                at("kv_events.port"),
                "must be the engines' publisher port (vLLM's default endpoint is tcp://*:5557)",
            ));
        }
        if self.replay_port.is_some() && self.port.is_none() {
            return Err(err.at(
                at("kv_events.replay_port"),
                "goes with `port` (each backend's replay endpoint keeps its distance from its publisher's port)",
            ));
        }
        if !(1..=256).contains(&self.data_parallel_size) {
            return Err(err.at(
                at("kv_events.data_parallel_size"),
                "must be between 1 and 256",
            ));
        }
        let last = |p: u16| u32::from(p) + self.data_parallel_size - 1;
        if self.port.is_some_and(|p| last(p) > 65535)
            || self.replay_port.is_some_and(|p| p == 0 || last(p) > 65535)
        {
            return Err(err.at(
                at("kv_events"),
                "port (and replay_port) plus data_parallel_size - 1 must be a port (1-65535)",
            ));
        }
        if let (Some(r), Some(p)) = (self.replay_port, self.port) {
            let (a, b) = (u32::from(p), u32::from(r));
            if a.max(b) - a.min(b) < self.data_parallel_size {
                return Err(err.at(
                    at("kv_events.replay_port"),
                    "overlaps the publishers' ports (each rank r uses port + r and replay_port + r)",
                ));
            }
        }
        if !(1024..=1 << 26).contains(&self.max_blocks) {
            return Err(err.at(
                at("kv_events.max_blocks"),
                "must be between 1024 and 67108864",
            ));
        }
        let tokenizer = self.tokenizer.map(|t| err.path(t));
        if let Some(dir) = &tokenizer
            && !dir.join("tokenizer.json").is_file()
        {
            return Err(err.at(
                at("kv_events.tokenizer"),
                format!(
                    "{} holds no tokenizer.json (the model's directory, as vllm serve loads it)",
                    dir.display()
                ),
            ));
        }
        let chat_template = self.chat_template.map(|t| err.path(t));
        if let Some(file) = &chat_template {
            if tokenizer.is_none() {
                return Err(err.at(at("kv_events.chat_template"), "goes with `tokenizer`"));
            }
            if !file.is_file() {
                return Err(err.at(
                    at("kv_events.chat_template"),
                    format!("{} does not exist", file.display()),
                ));
            }
        }
        Ok(KvEventsConfig {
            port: self.port,
            replay_port: self.replay_port,
            data_parallel_size: self.data_parallel_size,
            topic: self.topic,
            max_blocks: self.max_blocks,
            tokenizer,
            chat_template,
        })
    }
}
