//! The view step: the body parsed once into the few fields the gateway reads (a JSON body, or
//! an audio form's fields), the bytes kept for the backend; the record learns whether the
//! answer streams and whether the response runs in the background.

use http::header;

use super::body::Head;
use super::error::ApiError;
use super::exchange::Exchange;
use bytes::Bytes;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::BodyKind;
use fleetgate_protocol::view::{self, RequestView};

pub(super) async fn read<'b>(
    endpoint: Endpoint,
    head: &Head,
    body: &'b Bytes,
    ex: &mut Exchange,
) -> Result<RequestView<'b>, ApiError> {
    let view = if endpoint.needs().body == BodyKind::Multipart {
        let ct = head
            .outgoing
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        Box::pin(view::form::parse(body, ct, endpoint)).await?
    } else {
        view::parse(body, endpoint)?
    };
    ex.record.stream = view.stream;
    ex.background = view.background;
    Ok(view)
}
