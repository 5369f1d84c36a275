//! The shared harness, by concern: a real gateway, requests and their answers, the admin API,
//! backends, the shared stores (PostgreSQL, Redis), outside programs and the coding agents.
//! Everything is on 127.0.0.1:0; tests import it whole (`use crate::common::*`).

mod admin;
mod agents;
mod backends;
mod gateway;
mod otlp;
mod processes;
mod requests;
mod stores;

pub use admin::*;
pub use agents::*;
pub use backends::*;
pub use gateway::*;
pub use otlp::*;
pub use processes::*;
pub use requests::*;
pub use stores::*;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fleetgate_gateway::config::{Config, PoolConfig, ServerConfig};
use fleetgate_gateway::server::Server;
use fleetgate_gateway::telemetry::{Recorder, RequestRecord};
use fleetgate_protocol::client::{self, HttpClient, Measured};
use fleetgate_sim::{SimArgs, SimServer};
use http::{HeaderMap, HeaderValue, Uri};
use tokio::net::TcpListener;
