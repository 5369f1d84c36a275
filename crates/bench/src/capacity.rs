//! How many gateway instances a target load needs, from the throughput one measured instance
//! sustains within the SLA.

use serde_json::{Value, json};

/// Instances needed for `target_qps` with `redundancy`, given the measured throughput of
/// `instances` instances at the SLA.
pub(crate) fn capacity(
    target_qps: f64,
    redundancy: f64,
    measured: f64,
    instances: u32,
) -> Option<u64> {
    let per_instance = measured / f64::from(instances.max(1));
    (per_instance > 0.0).then(|| (target_qps * redundancy / per_instance).ceil() as u64)
}

pub(crate) fn capacity_json(
    target_qps: f64,
    redundancy: f64,
    measured: Option<f64>,
    instances: u32,
) -> Value {
    json!({
        "target_qps": target_qps,
        "redundancy": redundancy,
        "measured_instances": instances,
        "per_instance_throughput_at_sla": measured.map(|m| m / f64::from(instances.max(1))),
        "instances_needed": measured.and_then(|m| capacity(target_qps, redundancy, m, instances)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_follows_the_seed_formula() {
        // 100 QPS × 1.25 / (30 req/s on 2 instances = 15 each) = 8.33 → 9.
        assert_eq!(capacity(100.0, 1.25, 30.0, 2), Some(9));
        assert_eq!(capacity(100.0, 1.25, 0.0, 1), None);
    }
}
