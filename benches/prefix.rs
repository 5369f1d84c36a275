//! Longest-prefix routing's CPU per request: naming a prompt's blocks, looking the
//! names up and recording them, for prompts of 1k, 10k and 100k characters, against an index
//! that already holds many conversations.
//!
//!   cargo bench --bench prefix
//!
//! Linear in the prompt: the 100k prompt should cost about 100 times the 1k one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fleetgate_gateway::pool::prefix::PrefixIndex;

fn prompt(len: usize, conversation: usize) -> Vec<u8> {
    let system = "You are a coding agent; follow the tools' rules. ".repeat(20);
    let mut text = format!("{system} conversation {conversation}: ").into_bytes();
    let mut i = 0;
    while text.len() < len {
        text.extend_from_slice(format!("turn {i} says something about the code. ").as_bytes());
        i += 1;
    }
    text.truncate(len);
    text
}

fn per_request(c: &mut Criterion) {
    let mut group = c.benchmark_group("longest_prefix_per_request");
    for len in [1_000usize, 10_000, 100_000] {
        let index = PrefixIndex::new(256, 262_144, Duration::from_secs(600));
        // Many conversations already known, spread over 8 backends.
        for conv in 0..200 {
            let names = index.names(&prompt(len.min(20_000), conv));
            index.record(&names, (conv % 8) as u32);
        }
        let text = prompt(len, 7);
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_with_input(BenchmarkId::from_parameter(len), &text, |b, text| {
            b.iter(|| {
                let names = index.names(text);
                let found = index.lookup(&names);
                index.record(&names, 3);
                found.len()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, per_request);
criterion_main!(benches);
