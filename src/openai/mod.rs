//! Wire types shared by every layer of the gateway (layer 0): OpenAI's endpoints, its error
//! body and the payload-free error kinds, the SSE scanner, and the request-body view (parsed
//! once, the bytes kept). Nothing here knows about the
//! request path; the proxy, telemetry, admin API and tools all build on it.

pub mod endpoint;
pub mod error;
pub mod sse;
pub mod view;

pub use endpoint::Endpoint;
