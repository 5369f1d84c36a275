//! The upstream TCP connector: hyper's, with every connection's reads stamped by the kernel up
//! to the first token of each answer (`rx_time`), and the stamps handed to the answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tower::Service;

use crate::rx_time::{self, RxClock, Side, StampedStream};

/// The receive stamps of the upstream connection an answer came on, in its extensions.
#[derive(Debug, Clone)]
pub(crate) struct UpstreamRx(pub Arc<RxClock>);

/// hyper's TCP connector, with every connection's reads stamped by the kernel up to the first
/// token of each answer (`rx_time`).
#[derive(Clone)]
pub(crate) struct StampingConnector(pub(super) HttpConnector);

type Connecting =
    Pin<Box<dyn Future<Output = Result<TokioIo<StampedStream>, ConnectError>> + Send + 'static>>;
type ConnectError = <HttpConnector as Service<Uri>>::Error;

impl Service<Uri> for StampingConnector {
    type Response = TokioIo<StampedStream>;
    type Error = ConnectError;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            // Without the option the connection works as before; its answers carry no hop.
            let _ = rx_time::enable(&tcp);
            let clock = Arc::new(RxClock::new(Side::Upstream));
            Ok(TokioIo::new(StampedStream::new(tcp, clock)))
        })
    }
}

/// An answer's connection tells the client its receive stamps (`UpstreamRx` in the answer's
/// extensions).
impl Connection for StampedStream {
    fn connected(&self) -> Connected {
        Connected::new().extra(UpstreamRx(self.clock().clone()))
    }
}
