//! The cache size of an engine that publishes no KV events, from its own `/metrics`:
//! `vllm:cache_config_info`, an info gauge whose labels are vLLM's `CacheConfig`
//! (`num_gpu_blocks`, `block_size` among them), one series per engine.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::EngineCache;
use crate::pool::UpstreamClient;
use crate::pool::backend::Backend;

/// How often the configuration is read: until it is known, and then (an engine restarted
/// with another size is found within this).
const UNTIL_KNOWN: Duration = Duration::from_secs(5);
const ONCE_KNOWN: Duration = Duration::from_secs(30);

/// Reads the backend's cache configuration into `cache`'s estimate until `stop`.
pub(crate) async fn watch(
    cache: Arc<EngineCache>,
    client: UpstreamClient,
    backend: Arc<Backend>,
    timeout: Duration,
    stop: CancellationToken,
) {
    let Some(estimate) = &cache.estimate else {
        return;
    };
    let mut warned = false;
    loop {
        let found = read(&client, &backend, timeout).await;
        match found {
            Some((blocks, block_size)) => {
                if estimate.capacity() == 0 {
                    tracing::info!(backend = %backend.base, num_gpu_blocks = blocks, block_size, "engine cache size known: estimating what it holds from the prompts sent to it");
                }
                estimate.learn(blocks, block_size);
            }
            None if !warned && estimate.capacity() == 0 => {
                warned = true;
                tracing::warn!(backend = %backend.base, "kv_events = false, but the backend's /metrics has no vllm:cache_config_info with num_gpu_blocks and block_size: its cache cannot be estimated, and requests go to it by load alone until it has");
            }
            None => {}
        }
        let wait = if estimate.capacity() == 0 {
            UNTIL_KNOWN
        } else {
            ONCE_KNOWN
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

async fn read(client: &UpstreamClient, backend: &Backend, timeout: Duration) -> Option<(u64, u32)> {
    let text = crate::pool::health::metrics_text(client, backend, timeout).await?;
    parse(&String::from_utf8_lossy(&text))
}

/// (`num_gpu_blocks`, `block_size`) of the engine with the fewest blocks (a request goes to
/// one of a data-parallel backend's engines), from a Prometheus text; `None` when no series
/// says both (an engine still starting says `num_gpu_blocks="None"`).
pub(crate) fn parse(text: &str) -> Option<(u64, u32)> {
    text.lines()
        .filter_map(|line| line.strip_prefix("vllm:cache_config_info{"))
        .filter_map(|rest| {
            let labels = &rest[..rest.find('}')?];
            // A label's value, the name matched whole (`block_size`, not `mamba_block_size`).
            let label = |name: &str| {
                let key = format!("{name}=\"");
                let at = labels
                    .match_indices(&key)
                    .map(|(at, _)| at)
                    .find(|&at| at == 0 || labels.as_bytes()[at - 1] == b',')?
                    + key.len();
                let value = &labels[at..];
                value[..value.find('"')?].parse::<u64>().ok()
            };
            let blocks = label("num_gpu_blocks").filter(|b| *b > 0)?;
            let size = label("block_size").and_then(|s| u32::try_from(s).ok())?;
            (size > 0).then_some((blocks, size))
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's line (0.32, CPU server: tests/fixtures/vllm-0.32.0/metrics.json), some of its
    /// labels, with names that end in `block_size` around the one that is.
    #[test]
    fn reads_vllms_cache_config_info() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"128\",cache_dtype=\"auto\",effective_attention_block_size=\"256\",enable_prefix_caching=\"True\",engine=\"0\",mamba_block_size=\"None\",num_cpu_blocks=\"None\",num_gpu_blocks=\"4096\",num_gpu_blocks_override=\"None\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n";
        assert_eq!(parse(text), Some((4096, 128)));
    }

    /// The whole `/metrics` answer captured from vLLM 0.32's CPU server.
    #[test]
    fn reads_the_captured_vllm_metrics() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vllm-0.32.0/metrics.json"
        );
        let capture: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let body = capture["response"]["body"]["raw"].as_str().unwrap();
        assert_eq!(parse(body), Some((4096, 128)));
    }

    #[test]
    fn an_engine_still_starting_or_a_server_without_it_says_nothing() {
        assert_eq!(
            parse(
                "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"None\"} 1.0\n"
            ),
            None
        );
        assert_eq!(parse("vllm:num_requests_running 0.0\n"), None);
        assert_eq!(
            parse("vllm:cache_config_info{block_size=\"16\",engine=\"0\""),
            None
        );
    }

    #[test]
    fn data_parallel_engines_count_as_the_smallest() {
        let text = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"900\"} 1.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"800\"} 1.0\n";
        assert_eq!(parse(text), Some((800, 16)));
    }
}
