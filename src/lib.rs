//! fleetgate: an authenticating reverse-proxy gateway for fleets of OpenAI-compatible
//! inference servers. The binary in `main.rs` is a thin CLI over these modules.
//!
//! Modules are listed by layer, lowest first; a module imports its own layer or lower ones,
//! never in a circle (tests/layering.rs keeps it so). docs/architecture.md draws the map.

// Layer 0: shared by everything. `cli_out` first: its `outln!`/`out!` macros are in scope in
// every module declared after it.
#[macro_use]
pub mod cli_out;
pub mod clock;
pub mod protocol;
pub mod rx_time;
pub mod secret;

// Layer 1: configuration, keys and the store.
pub mod config;
pub mod key;
pub mod store;

// Layer 2: the request path's stages, in the order a request meets them, and what they record.
pub mod auth;
pub mod limits;
pub mod pool;
pub mod queue;
pub mod route;
pub mod telemetry;

// Layer 3: the forwarding path that calls the stages in order, and the relay.
pub mod proxy;

// Layer 4: the listeners, the admin API, the demo.
pub mod admin;
pub mod demo;
pub mod server;

// Tools beside the gateway: the measuring client, the load generator, the simulated backend and
// the key CLI.
pub mod bench;
pub mod client;
pub mod keys_cli;
pub mod sim;
