//! One request's record and its hold on the limits, travelling together through the path and
//! into the response body.

use crate::limits::Hold;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Endpoint;

/// One request's record and its hold on the limits, ended together: dropping it settles the
/// hold with the tokens the request really used, then the record is written (its own `Drop`).
/// The limits never reach into the record, nor the record into the limits.
#[derive(Debug)]
pub(crate) struct Exchange {
    pub(crate) hold: Option<Hold>,
    pub(crate) record: RequestRecord,
    /// A background response (`background: true`): its answer ends while the backend still
    /// generates; it holds its slots until the backend is done (`background`), and settles
    /// with the finished response's usage, or at what was reserved when there is none.
    pub(crate) background: bool,
}

impl Exchange {
    pub(super) fn new(mut record: RequestRecord, endpoint: Endpoint) -> Self {
        record.endpoint = Some(endpoint);
        Self {
            hold: None,
            record,
            background: false,
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let Some(mut adm) = self.hold.take() {
            let used = if self.background && self.record.timeline.upstream_sent().is_some() {
                self.record
                    .timeline
                    .stream()
                    .usage
                    .map_or(adm.reserved(), |u| {
                        u.prompt_tokens.saturating_add(u.completion_tokens)
                    })
            } else {
                self.record.used_tokens(adm.prompt_estimate())
            };
            adm.set_used(used);
        }
    }
}
