//! The wire protocols the gateway speaks, shared by every layer (layer 0): the endpoints, one
//! dialect per protocol (how its events and usage read), the error bodies (OpenAI's and
//! Anthropic's) and the payload-free error kinds, the SSE scanner, and the request-body view
//! (parsed once, the bytes kept). Nothing here knows about the
//! request path; the proxy, telemetry, admin API and tools all build on it.

pub mod dialect;
pub mod endpoint;
pub mod error;
pub mod sse;
pub mod usage;
pub mod view;

pub use dialect::Dialect;
pub use endpoint::Endpoint;
