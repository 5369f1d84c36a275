//! The fleetgate gateway: authentication, limits, the fair queue, routing over the pools, the
//! forwarding path with its relay, the request record, the admin API and console, and the
//! listeners. The `fleetgate` binary is a thin command line over it; the wire protocols it speaks
//! are in `fleetgate_protocol`.
//!
//! Modules are listed by layer, lowest first; a module imports its own layer or lower ones,
//! never in a circle (tests/it/layering.rs keeps it so). docs/architecture.md draws the map.

// What only this crate reaches is `pub(crate)`, not `pub` (clippy -D warnings holds it).
#![warn(unreachable_pub)]

// Layer 0: shared by everything.
pub mod clock;
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
pub(crate) mod queue;
pub(crate) mod route;
pub mod telemetry;

// Layer 3: the forwarding path that calls the stages in order, and the relay.
pub mod proxy;

// Layer 4: the listeners and the admin API.
pub mod admin;
pub mod server;
