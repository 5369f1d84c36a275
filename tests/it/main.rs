//! The root package's integration tests, in one binary (`cargo test --test it`): the gateway,
//! the sim and the bench are linked once, not once per file. Each module tests one concern;
//! docs/testing.md lists them all. `common` is the shared harness.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failure here is a test failure"
)]

mod common;

// The request path, from the client's connection to the backend and back.
mod agent_protocols;
mod audio;
mod connections;
mod errors;
mod listeners;
mod pooling_endpoints;
mod relay;
mod resume;
mod resumed;
mod routes;
mod stored_responses;
mod stream_usage;
mod tokenize;

// Backends and pools: which backend a request reaches, and backends that fail or misbehave.
mod backend_health;
mod balancing;
mod failover;
mod fallbacks;
mod fleet_changes;
mod hostile_backends;
mod kv_estimate;
mod kv_events;
mod lora;
mod model_names;
mod prefix_routing;
mod upstream_http1;

// Keys, limits and the stores behind them.
mod hostile_clients;
mod keys;
mod limits;
mod store_faults;

// What the gateway records.
mod fixture;
mod metrics;
mod otel_traces;
mod request_log;

// Several replicas, and faults under load.
mod multi_replica;
mod soak;

// The binary's commands, the console, and the docs and deployment files.
mod bench;
mod cli;
mod console;
mod deploy;
mod docs;
mod docs_commands;
mod layering;

// Fuzzing what parses untrusted bytes.
mod parser_fuzz;
mod wire_fuzz;

// Real clients, and real vLLM.
mod agent_clis_and_sdks;
mod pooling_sdks;
mod real_vllm;
mod vllm_conformance;
