//! fleetgate: an authenticating reverse-proxy gateway for fleets of OpenAI-compatible
//! inference servers. The binary in `main.rs` is a thin CLI over these modules.

pub mod admin;
pub mod auth;
pub mod bench;
pub mod client;
pub mod config;
pub mod demo;
pub mod keys_cli;
pub mod limits;
pub mod pool;
pub mod proxy;
pub mod queue;
pub mod secret;
pub mod server;
pub mod sim;
pub mod store;
pub mod telemetry;
