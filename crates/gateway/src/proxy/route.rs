//! The route step: the request's model (or alias) to its pool in the current generation, the
//! key's rights on it, the long-prompt pool, the gray canary, affinity and the rename
//! (`crate::route`); the record learns the pool, even when the key may not use it.

use bytes::Bytes;

use super::error::ApiError;
use super::state::ProxyState;
use crate::pool::Generation;
use crate::route::{self, Route, RouteError};
use crate::telemetry::RequestRecord;
use crate::telemetry::fallback::FallbackLog;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::view::RequestView;

/// What the route and the upstream request are made from.
#[derive(Clone, Copy)]
pub(super) struct Asked<'a> {
    pub(super) view: &'a RequestView<'a>,
    pub(super) body: &'a Bytes,
    pub(super) endpoint: Endpoint,
}

/// The route in `pools`, with the pool named in the record.
pub(super) fn route<'p>(
    state: &ProxyState,
    asked: Asked<'_>,
    headers: &http::HeaderMap,
    pools: &'p Generation,
    record: &mut RequestRecord,
) -> Result<Route<'p>, ApiError> {
    let key = record.key.as_deref();
    let Asked {
        view,
        body,
        endpoint,
    } = asked;
    let asked = route::Request {
        view,
        body,
        endpoint,
        headers,
    };
    match route::resolve(asked, key, pools, |chars| state.limits.prompt_tokens(chars)) {
        Ok(route) => {
            // A prompt too long for the asked pool's context went to a fallback.
            if let Some((cause, from)) = route.fallback {
                record.fallback = Some(Box::new(FallbackLog {
                    hops: vec![(from.model.clone(), cause)],
                    tried: vec![from.index],
                }));
            }
            record.model = Some(route.pool.model.clone());
            record.pool_metrics_index = Some(route.pool.metrics_index);
            if let Some(scope) = record.otel.as_deref_mut() {
                scope.max_tokens = view.max_tokens;
                scope.response_model = Some(route.pool.served_name.clone());
            }
            Ok(route)
        }
        Err(RouteError::ModelNotFound { model, available }) => {
            Err(ApiError::ModelNotFound { model, available })
        }
        Err(RouteError::Denied {
            failure,
            model,
            pool_metrics_index,
        }) => {
            record.model = Some(model);
            record.pool_metrics_index = Some(pool_metrics_index);
            state.auth.count(&failure);
            Err(ApiError::Auth(failure))
        }
    }
}
