//! The breakdown of a target's requests by request class (settings.json's
//! `request_distribution`), as a table and as result keys.

use serde_json::{Value, json};

use crate::measure::Outcome;
use crate::plan::Plan;
use crate::summary::{Summary, p_word};

/// The breakdown by request class (settings.json's `request_distribution`): per class, its
/// requests and TTFT / TPOT / E2EL (mean, median and each measured percentile), as a table and
/// as the result's `classes` key. None when the prompts carry no class.
pub(super) fn per_class(plan: &Plan, mine: &[&Outcome], dur: f64) -> Option<(String, Value)> {
    let mut names: Vec<&str> = Vec::new();
    for p in &plan.prompts {
        if let Some(c) = p.class.as_deref()
            && !names.contains(&c)
        {
            names.push(c);
        }
    }
    if names.is_empty() {
        return None;
    }
    let class_of = |o: &Outcome| plan.prompts[o.prompt].class.as_deref().unwrap_or("-");
    let pcts = &plan.percentiles;
    let mut text = format!("{:-^50}\n", "Per request class");
    let mut header = format!("{:<12} {:>6} {:>6}", "class", "ok", "failed");
    let keys: Vec<&str> = ["ttft", "tpot", "e2el"]
        .into_iter()
        .filter(|k| plan.endpoint_type.metrics().contains(k))
        .collect();
    for m in keys.iter().map(|k| k.to_uppercase()) {
        header.push_str(&format!(" {:>10}", format!("{m} mean")));
        for p in pcts {
            header.push_str(&format!(" {:>10}", format!("{m} P{}", p_word(*p))));
        }
    }
    text.push_str(&header);
    text.push_str("  (ms)\n");
    let mut json = serde_json::Map::new();
    for name in names {
        let of: Vec<&Outcome> = mine
            .iter()
            .copied()
            .filter(|o| class_of(o) == name)
            .collect();
        let s = Summary::of(&of, dur, pcts, &Vec::new());
        let mut line = format!("{:<12} {:>6} {:>6}", name, s.completed, s.failed);
        let mut j = serde_json::Map::new();
        j.insert("completed".into(), json!(s.completed));
        j.insert("failed".into(), json!(s.failed));
        let ok = s.completed.max(1) as f64;
        j.insert("mean_input_tokens".into(), json!(s.total_input as f64 / ok));
        j.insert(
            "mean_output_tokens".into(),
            json!(s.total_output as f64 / ok),
        );
        for &key in &keys {
            let st = s.metrics.get(key).cloned().unwrap_or_default();
            let val = |v: f64| if st.count > 0 { json!(v) } else { Value::Null };
            let cell = |v: f64| {
                if st.count > 0 {
                    format!(" {v:>10.2}")
                } else {
                    format!(" {:>10}", "-")
                }
            };
            line.push_str(&cell(st.mean));
            j.insert(format!("mean_{key}_ms"), val(st.mean));
            j.insert(format!("median_{key}_ms"), val(st.median));
            for (p, v) in &st.percentiles {
                line.push_str(&cell(*v));
                j.insert(format!("p{}_{key}_ms", p_word(*p)), val(*v));
            }
        }
        text.push_str(&line);
        text.push('\n');
        json.insert(name.to_owned(), Value::Object(j));
    }
    text.push_str(&format!("{:=^50}\n", ""));
    Some((text, Value::Object(json)))
}
