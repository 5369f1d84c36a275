//! The engines' own KV-cache figures, refreshed at scrape time: each backend's KV event
//! subscribers (state, blocks indexed, batches by outcome).

use super::RequestMetrics;

impl RequestMetrics {
    pub(super) fn update_kv_events(
        &self,
        model: &str,
        backend: &str,
        cache: &crate::pool::engine_cache::EngineCache,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(e) = &cache.estimate {
            // No events: the estimate, as one rank named `estimated` (3 once the engine's cache
            // size is known, 0 before: routed by load alone).
            let labels = [model, backend, "estimated"];
            let known = e.learned_ms.load(Relaxed) > 0;
            self.kv_events_state
                .with_label_values(&labels)
                .set(if known { 3 } else { 0 });
            self.kv_events_blocks
                .with_label_values(&labels)
                .set(i64::try_from(e.len()).unwrap_or(i64::MAX));
            return;
        }
        let mut totals = [0u64; 4];
        for r in cache.ranks.iter() {
            let rank = r.rank.to_string();
            let labels = [model, backend, rank.as_str()];
            let state = match r.state() {
                "live" => 2,
                "partial" => 1,
                _ => 0,
            };
            self.kv_events_state.with_label_values(&labels).set(state);
            let blocks = r.index.read().map(|i| i.len()).unwrap_or(0);
            self.kv_events_blocks
                .with_label_values(&labels)
                .set(i64::try_from(blocks).unwrap_or(i64::MAX));
            for (t, n) in totals
                .iter_mut()
                .zip([&r.applied, &r.replayed, &r.lost, &r.bad])
            {
                *t += n.load(Relaxed);
            }
        }
        for (outcome, now) in ["applied", "replayed", "lost", "bad"]
            .into_iter()
            .zip(totals)
        {
            let c = self
                .kv_events_batches
                .with_label_values(&[model, backend, outcome]);
            c.inc_by(now.saturating_sub(c.get()));
        }
    }
}
