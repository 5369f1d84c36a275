//! The wire protocols fleetgate speaks, shared by the gateway and the tools: the endpoints, one
//! dialect per protocol (how its events and usage read), the error bodies (OpenAI's and
//! Anthropic's) and the payload-free error kinds, the SSE scanner, the request-body view (parsed
//! once, the bytes kept), the `system_fingerprint` splice, the `/v1/models` body, W3C trace context, the figures of a
//! stream (`stream`), and the measuring client the bench
//! and the demo use. Nothing here knows about the request path.

// What only this crate reaches is `pub(crate)`, not `pub` (clippy -D warnings holds it).
#![warn(unreachable_pub)]

pub mod base_url;
pub mod cli_out;
pub mod client;
pub mod dialect;
pub mod endpoint;
pub mod error;
pub mod event;
pub mod fingerprint;
pub mod finish;
pub mod kv_events;
pub mod models;
pub mod resume;
pub mod sse;
pub mod stream;
pub mod trace_context;
pub mod usage;
pub mod view;

pub use dialect::Dialect;
pub use endpoint::Endpoint;
