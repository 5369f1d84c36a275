//! The limits step: the key's request rate, token budget and concurrency (`crate::limits`),
//! held until the answer ends (the `Exchange` settles the hold with the tokens really used).
//! Requests without a key have no limits. Tokenization counts as a request, not as inference;
//! a pooling request spends its input's tokens and generates none.

use super::error::ApiError;
use super::state::ProxyState;
use crate::limits::Hold;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::view::RequestView;

pub(super) async fn hold(
    state: &ProxyState,
    endpoint: Endpoint,
    view: &RequestView<'_>,
    record: &RequestRecord,
) -> Result<Option<Hold>, ApiError> {
    let Some(key) = &record.key else {
        return Ok(None);
    };
    let needs = endpoint.needs();
    let held = if needs.spends_tokens {
        // A pooling request generates nothing: it reserves its input only, never
        // `default_max_tokens`.
        let max_tokens = if needs.reserves_output {
            view.max_tokens
        } else {
            Some(0)
        };
        let demand = state.limits.demand(view.prompt_chars, max_tokens, view.n);
        state.limits.hold(key, demand).await
    } else {
        state.limits.hold_request(key).await
    };
    match held {
        Ok(adm) => Ok(Some(adm)),
        Err(refusal) => Err(ApiError::Limited(Box::new(refusal))),
    }
}
