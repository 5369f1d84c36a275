//! `vllm:lora_requests_info`: the adapters with requests running and those with requests
//! waiting, as labels of a gauge whose value is the wall-clock time they were last so.
//!
//! vLLM sets a sample per (max_lora, running, waiting) label set at every engine step and never
//! removes one, so its `/metrics` holds every combination it has been through, the current one
//! carrying the newest time (a reader takes the sample with the highest value). The sim keeps
//! them the same way, the most recent `MAX_SAMPLES`. The label order and the value's format
//! are those of vLLM's multiprocess Prometheus client (a 0.29 CPU server's capture:
//! `vllm:lora_requests_info{max_lora="2",running_lora_adapters="alpaca",waiting_lora_adapters=""}
//! 1.789828498802105e+09`).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use super::LoraAdapter;

/// Label sets kept; past it the one current longest ago goes.
const MAX_SAMPLES: usize = 64;

/// The gauge of one sim started with `--enable-lora`.
#[derive(Debug)]
pub(crate) struct LoraGauge {
    max_loras: u32,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Without a scheduler (all timing zero): the requests in flight per adapter, which all
    /// run at once.
    in_flight: Vec<(Arc<LoraAdapter>, u32)>,
    samples: Vec<Sample>,
}

#[derive(Debug)]
struct Sample {
    running: String,
    waiting: String,
    /// Seconds since the epoch when this label set was last the current one.
    at: f64,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl State {
    fn note(&mut self, running: &str, waiting: &str) {
        let at = now();
        if let Some(s) = self
            .samples
            .iter_mut()
            .find(|s| s.running == running && s.waiting == waiting)
        {
            s.at = at;
            return;
        }
        if self.samples.len() >= MAX_SAMPLES
            && let Some(oldest) = self
                .samples
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.at.total_cmp(&b.1.at))
                .map(|(i, _)| i)
        {
            self.samples.remove(oldest);
        }
        self.samples.push(Sample {
            running: running.to_owned(),
            waiting: waiting.to_owned(),
            at,
        });
    }

    fn note_in_flight(&mut self) {
        let mut running = String::new();
        adapter_names(self.in_flight.iter().map(|(a, _)| &**a), &mut running);
        self.note(&running, "");
    }
}

impl LoraGauge {
    /// The gauge at start: nothing running, nothing waiting.
    pub(crate) fn new(max_loras: u32) -> Self {
        let mut state = State::default();
        state.note("", "");
        Self {
            max_loras,
            state: Mutex::new(state),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A scheduler step: adapters with sequences running and with sequences waiting, each
    /// list comma-separated (vLLM's labels).
    pub(crate) fn observe(&self, running: &str, waiting: &str) {
        self.state().note(running, waiting);
    }

    /// Without a scheduler: a request on `adapter` starts.
    pub(crate) fn enter(&self, adapter: &Arc<LoraAdapter>) {
        let mut state = self.state();
        match state.in_flight.iter_mut().find(|(a, _)| a.id == adapter.id) {
            Some((_, n)) => *n += 1,
            None => state.in_flight.push((adapter.clone(), 1)),
        }
        state.note_in_flight();
    }

    /// Without a scheduler: a request on `adapter` has ended.
    pub(crate) fn leave(&self, adapter: &LoraAdapter) {
        let mut state = self.state();
        if let Some(at) = state.in_flight.iter().position(|(a, _)| a.id == adapter.id) {
            state.in_flight[at].1 -= 1;
            if state.in_flight[at].1 == 0 {
                state.in_flight.remove(at);
            }
        }
        state.note_in_flight();
    }

    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge"
        );
        for s in &self.state().samples {
            let _ = writeln!(
                out,
                "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",\
                 waiting_lora_adapters=\"{}\"}} {}",
                self.max_loras,
                crate::stats::label_value(&s.running),
                crate::stats::label_value(&s.waiting),
                go_float(s.at)
            );
        }
    }
}

/// `adapters` as a gauge label: each name once, in order, comma-separated (vLLM joins the
/// keys of a dict of adapter names).
pub(crate) fn adapter_names<'a>(adapters: impl Iterator<Item = &'a LoraAdapter>, out: &mut String) {
    out.clear();
    for a in adapters {
        if !out.split(',').any(|n| n == a.name) {
            if !out.is_empty() {
                out.push(',');
            }
            out.push_str(&a.name);
        }
    }
}

/// A sample value as the Prometheus Python client writes it (`floatToGoString`): Python's
/// `repr`, but past six integer digits in Go's exponent form (`1.789828498802105e+09`).
fn go_float(v: f64) -> String {
    let s = format!("{v:?}");
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            let mantissa = digits.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_value_is_written_as_prometheus_python_client_writes_it() {
        assert_eq!(go_float(1_789_828_498.802_105), "1.789828498802105e+09");
        assert_eq!(go_float(1_789_828_498.0), "1.789828498e+09");
        assert_eq!(go_float(12.5), "12.5");
    }

    #[test]
    fn every_label_set_is_kept_with_the_time_it_was_last_current() {
        let g = LoraGauge::new(2);
        g.observe("a", "");
        g.observe("a", "b");
        g.observe("a", "");
        let mut out = String::new();
        g.render(&mut out);
        let samples: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.len(), 3, "{out}");
        assert!(samples[1].starts_with(
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} "
        ));
        let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
        assert!(value(samples[1]) >= value(samples[2]), "{out}");
    }
}
