//! The family step: a key may be limited to some endpoint families (`allowed_endpoints`); a
//! request outside them is refused before its body is read, in the route's dialect.

use super::error::ApiError;
use super::state::ProxyState;
use crate::auth::AuthFailure;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Endpoint;

/// Refuse a request whose endpoint's family the key may not use (requests without a key have
/// no such limit).
pub(super) fn check(
    state: &ProxyState,
    endpoint: Endpoint,
    record: &RequestRecord,
) -> Result<(), ApiError> {
    let Some(key) = record.key.as_deref() else {
        return Ok(());
    };
    if key.allows_family(endpoint.family()) {
        return Ok(());
    }
    let failure = AuthFailure::EndpointNotAllowed {
        family: endpoint.family(),
        path: endpoint.path(),
        allowed: key.allowed_endpoints.unwrap_or_default(),
    };
    state.auth.count(&failure);
    Err(ApiError::Auth(failure))
}
