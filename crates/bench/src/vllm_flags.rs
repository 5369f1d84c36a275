//! `vllm bench serve`'s command line, as `fleetgate bench` takes it: every flag of vLLM 0.33's
//! parser is accepted (read from vLLM's `vllm/benchmarks/serve.py` and
//! `vllm/benchmarks/datasets/datasets.py`). Before clap reads the arguments, this pass
//! - writes `--flag_name` as `--flag-name`, as vLLM's parser does;
//! - spells vLLM's forms of what fleetgate implements as fleetgate's flags (`--metadata K=V`
//!   is `--label K=V`, `--input-len N` is `--random-input-len N`, ...);
//! - takes out the flags that do not change what fleetgate measures, each with a one-line
//!   warning saying why it is ignored;
//! - marks the flags and values fleetgate does not implement but which would change the
//!   measurement (a ramp-up, LoRA adapters, a dataset it cannot generate): the run then stops
//!   before sending anything, naming them (exit 1), instead of measuring something else.

use std::ffi::OsString;

/// What a vLLM flag takes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arity {
    /// `store_true`: nothing.
    Flag,
    /// One value.
    One,
    /// `nargs='*'` / `'+'`: every value up to the next flag.
    Many,
}

/// vLLM flags that do not change what is measured here: taken out, with why.
const IGNORED: &[(&str, Arity, &str)] = &[
    (
        "--trust-remote-code",
        Arity::Flag,
        "no code is loaded: fleetgate bench reads tokenizer.json files only",
    ),
    (
        "--tokenizer-mode",
        Arity::One,
        "fleetgate bench reads tokenizer.json files only",
    ),
    (
        "--skip-tokenizer-init",
        Arity::Flag,
        "without --tokenizer, prompts are counted as characters / 4 and outputs from the server's usage",
    ),
    (
        "--no-stream",
        Arity::Flag,
        "it concerns Hugging Face datasets, which fleetgate bench does not load",
    ),
    (
        "--no-oversample",
        Arity::Flag,
        "fleetgate bench never repeats a dataset's prompts to reach --num-prompts; it says how many it had",
    ),
    (
        "--disable-shuffle",
        Arity::Flag,
        "prompts are drawn with --seed, the same on every run",
    ),
    (
        "--skip-chat-template",
        Arity::Flag,
        "the server applies its own chat template",
    ),
    (
        "--enable-multimodal-chat",
        Arity::Flag,
        "fleetgate bench sends text prompts only",
    ),
    (
        "--chat-template-kwargs",
        Arity::One,
        "the server applies its own chat template (send template arguments with --extra-body)",
    ),
    (
        "--use-beam-search",
        Arity::Flag,
        "vLLM's own benchmark does not use it either",
    ),
    (
        "--insecure",
        Arity::Flag,
        "fleetgate bench speaks plain http, where there is no certificate to check",
    ),
    (
        "--plot-timeline",
        Arity::Flag,
        "no timeline page is written (the result JSON has every figure)",
    ),
    (
        "--timeline-itl-thresholds",
        Arity::One,
        "no timeline page is written",
    ),
    (
        "--plot-dataset-stats",
        Arity::Flag,
        "no chart of the dataset is written",
    ),
    (
        "--save-detailed",
        Arity::Flag,
        "the result JSON holds the summary figures, not every request's lists",
    ),
    (
        "--append-result",
        Arity::Flag,
        "the result file is written whole (name it with --result-filename)",
    ),
    (
        "--request-id-prefix",
        Arity::One,
        "requests carry no x-request-id of the client's: the gateway gives each its own",
    ),
    (
        "--ready-check-timeout-sec",
        Arity::One,
        "no ready check is sent: the first requests are measured as they come",
    ),
    (
        "--profile",
        Arity::Flag,
        "a gateway does not forward /start_profile; profile a vLLM server directly",
    ),
    (
        "--logprobs",
        Arity::One,
        "token log-probabilities are not asked for (send them with --extra-body)",
    ),
];

/// vLLM flags that shape only a dataset fleetgate bench does not generate (`--dataset-name`
/// then stops the run) or a backend it does not speak.
const OTHER_DATASETS: &[(&str, Arity)] = &[
    ("--custom-output-len", Arity::One),
    ("--custom-ensure-client-side-data", Arity::Flag),
    ("--spec-bench-output-len", Arity::One),
    ("--spec-bench-category", Arity::One),
    ("--sonnet-input-len", Arity::One),
    ("--sonnet-output-len", Arity::One),
    ("--sonnet-prefix-len", Arity::One),
    ("--timed-trace-chunk-hash-size", Arity::One),
    ("--timed-trace-sec-multiplier", Arity::One),
    ("--timed-trace-label-timestamp", Arity::One),
    ("--timed-trace-label-input-length", Arity::One),
    ("--timed-trace-label-output-length", Arity::One),
    ("--timed-trace-label-hash-ids", Arity::One),
    ("--blazedit-min-distance", Arity::One),
    ("--blazedit-max-distance", Arity::One),
    ("--asr-max-audio-len-sec", Arity::One),
    ("--asr-min-audio-len-sec", Arity::One),
    ("--random-batch-size", Arity::One),
    ("--no-reranker", Arity::Flag),
    ("--random-mm-base-items-per-request", Arity::One),
    ("--random-mm-num-mm-items-range-ratio", Arity::One),
    ("--random-mm-limit-mm-per-prompt", Arity::One),
    ("--random-mm-bucket-config", Arity::One),
    ("--hf-subset", Arity::One),
    ("--hf-split", Arity::One),
    ("--hf-name", Arity::One),
    ("--hf-output-len", Arity::One),
    ("--bfcl-categories", Arity::One),
    ("--speed-bench-dataset-subset", Arity::One),
    ("--speed-bench-output-len", Arity::One),
    ("--speed-bench-category", Arity::One),
];

/// vLLM flags that would change the measurement and that fleetgate bench does not implement:
/// the run stops before sending, naming each (and what to use instead).
const NOT_IMPLEMENTED: &[(&str, Arity, &str)] = &[
    (
        "--ramp-up-strategy",
        Arity::One,
        "a ramp of the request rate (measure a series of rates with --sweep rate=2,4,8,16)",
    ),
    (
        "--ramp-up-start-rps",
        Arity::One,
        "a ramp of the request rate (measure a series of rates with --sweep rate=2,4,8,16)",
    ),
    (
        "--ramp-up-end-rps",
        Arity::One,
        "a ramp of the request rate (measure a series of rates with --sweep rate=2,4,8,16)",
    ),
    (
        "--lora-modules",
        Arity::Many,
        "requests spread over LoRA adapters (run once per adapter, with --model ADAPTER)",
    ),
    (
        "--lora-assignment",
        Arity::One,
        "requests spread over LoRA adapters (run once per adapter, with --model ADAPTER)",
    ),
    (
        "--probe-request-rate",
        Arity::One,
        "probe requests beside the load (run a second fleetgate bench at the probe rate)",
    ),
    ("--self-timed", Arity::Flag, "the timed_trace dataset"),
    ("--no-self-timed", Arity::Flag, "the timed_trace dataset"),
];

/// The datasets fleetgate bench generates (`--dataset-name`); vLLM's others stop the run.
const DATASETS: &[&str] = &[
    "random",
    "sharegpt",
    "prefix_repetition",
    "prefix-repetition",
];

/// The request formats of vLLM's `--backend` (and of the old `--endpoint-type`) that fleetgate
/// bench speaks, as its `--endpoint-type`.
pub(crate) fn backend_format(name: &str) -> Option<&'static str> {
    Some(match name {
        "vllm" | "openai" => "openai",
        "openai-chat" => "openai-chat",
        "openai-responses" => "openai-responses",
        "anthropic-messages" => "anthropic-messages",
        "openai-embeddings"
        | "openai-embeddings-chat"
        | "openai-embeddings-clip"
        | "openai-embeddings-vlm2vec"
        | "infinity-embeddings"
        | "infinity-embeddings-clip" => "openai-embeddings",
        _ => return None,
    })
}

/// The name of a hidden flag that carries what is not implemented to the plan, which refuses
/// the run with every item named (`BenchArgs::vllm_not_implemented`).
pub(crate) const NOT_IMPLEMENTED_FLAG: &str = "--vllm-not-implemented";

/// The arguments after `bench`, rewritten for clap (see the module's comment), and the
/// warnings to print (one line each).
pub fn normalize(args: Vec<OsString>) -> (Vec<OsString>, Vec<String>) {
    let mut out: Vec<OsString> = Vec::with_capacity(args.len());
    // vLLM's "copy to" flags (`--input-len`, `--output-len`) win over the flags they set, as in
    // vLLM: they go last, where clap's last-one-wins keeps them.
    let mut last: Vec<OsString> = Vec::new();
    let mut warnings = Vec::new();
    let mut i = 0;
    // `bench diff A B`: nothing to translate.
    if args.first().is_some_and(|a| a == "diff") {
        return (args, warnings);
    }
    while i < args.len() {
        let Some(text) = args[i].to_str() else {
            out.push(args[i].clone());
            i += 1;
            continue;
        };
        if !text.starts_with("--") || text == "--" {
            out.push(args[i].clone());
            i += 1;
            continue;
        }
        // `--flag_name[=value]` → `--flag-name[=value]` (the name only, as vLLM).
        let (name, joined) = match text.split_once('=') {
            Some((n, v)) => (n.replace('_', "-"), Some(v.to_owned())),
            None => (text.replace('_', "-"), None),
        };
        i += 1;
        // The values that follow a flag of `arity` (none when given as `--flag=value`).
        let take = |arity: Arity, i: &mut usize| -> Vec<OsString> {
            if let Some(v) = &joined {
                return vec![OsString::from(v)];
            }
            let mut vals = Vec::new();
            match arity {
                Arity::Flag => {}
                Arity::One => {
                    if *i < args.len() {
                        vals.push(args[*i].clone());
                        *i += 1;
                    }
                }
                Arity::Many => {
                    while *i < args.len() && !is_flag(&args[*i]) {
                        vals.push(args[*i].clone());
                        *i += 1;
                    }
                }
            }
            vals
        };
        if let Some((_, arity, why)) = IGNORED.iter().find(|(n, _, _)| *n == name) {
            take(*arity, &mut i);
            warnings.push(format!("{name} is ignored: {why}"));
            continue;
        }
        if let Some((_, arity)) = OTHER_DATASETS.iter().find(|(n, _)| *n == name) {
            take(*arity, &mut i);
            warnings.push(format!(
                "{name} is ignored: it shapes a vLLM dataset that fleetgate bench does not generate (it generates random, sharegpt and prefix_repetition)"
            ));
            continue;
        }
        if let Some((_, arity, what)) = NOT_IMPLEMENTED.iter().find(|(n, _, _)| *n == name) {
            take(*arity, &mut i);
            out.push(not_implemented(&format!("{name}: {what}")));
            continue;
        }
        match name.as_str() {
            // A value fleetgate bench does not generate (a dataset) or speak (a backend format)
            // would measure something else: carried to the plan, which refuses the run.
            "--dataset-name" | "--backend" => {
                let v = take(Arity::One, &mut i);
                let value = v.first().and_then(|v| v.to_str()).unwrap_or_default();
                let (known, what) = if name == "--dataset-name" {
                    (
                        DATASETS.contains(&value),
                        "dataset (fleetgate bench generates random, sharegpt and prefix_repetition)",
                    )
                } else {
                    (
                        backend_format(value).is_some(),
                        "request format (fleetgate bench speaks vllm/openai, openai-chat, openai-responses, anthropic-messages and the embeddings formats)",
                    )
                };
                if known || value.is_empty() {
                    out.push(name.into());
                    out.extend(v);
                } else {
                    out.push(not_implemented(&format!(
                        "{name} {value}: vLLM's {value} {what}"
                    )));
                }
            }
            // vLLM also takes a JSON object, one ratio per direction: the same ratio for both
            // is the number; two different ones are not implemented.
            "--random-range-ratio" => {
                let v = take(Arity::One, &mut i);
                let value = v.first().and_then(|v| v.to_str()).unwrap_or_default();
                match range_ratio_json(value) {
                    None => {
                        out.push(name.into());
                        out.extend(v);
                    }
                    Some(Ok(r)) => {
                        out.push(name.into());
                        out.push(r.to_string().into());
                    }
                    Some(Err(what)) => out.push(not_implemented(&format!(
                        "--random-range-ratio {value}: {what}"
                    ))),
                }
            }
            // vLLM 0.33's key-value result fields: fleetgate's labels.
            "--metadata" => {
                for v in take(Arity::Many, &mut i) {
                    out.push("--label".into());
                    out.push(v);
                }
            }
            "--input-len" => {
                let v = take(Arity::One, &mut i);
                last.push("--random-input-len".into());
                last.extend(v);
            }
            "--output-len" => {
                let v = take(Arity::One, &mut i);
                for flag in [
                    "--random-output-len",
                    "--sharegpt-output-len",
                    "--prefix-repetition-output-len",
                ] {
                    last.push(flag.into());
                    last.extend(v.iter().cloned());
                }
            }
            _ => match joined {
                Some(v) => out.push(format!("{name}={v}").into()),
                None => out.push(name.into()),
            },
        }
    }
    out.extend(last);
    (out, warnings)
}

/// vLLM's JSON form of `--random-range-ratio` (`{"input": r, "output": r}`): None when the value
/// is not a JSON object (a plain number, for clap to read), the ratio when both directions
/// have the same one, else why it is not implemented.
fn range_ratio_json(value: &str) -> Option<Result<f64, String>> {
    if !value.trim_start().starts_with('{') {
        return None;
    }
    let v: serde_json::Value = match serde_json::from_str(value) {
        Ok(v) => v,
        Err(e) => return Some(Err(format!("not JSON: {e}"))),
    };
    let get = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    let (input, output) = (get("input"), get("output"));
    Some(if (input - output).abs() < 1e-12 {
        Ok(input)
    } else {
        Err(format!(
            "a range ratio per direction (input {input}, output {output}); fleetgate bench draws both lengths with one --random-range-ratio"
        ))
    })
}

/// The hidden flag carrying `what` (joined with `=`: the text starts with `--`).
fn not_implemented(what: &str) -> OsString {
    format!("{NOT_IMPLEMENTED_FLAG}={what}").into()
}

/// A token that starts a flag (`--x`, `-h`), not a value (`-1` is a value).
fn is_flag(a: &OsString) -> bool {
    a.to_str().is_some_and(|s| {
        s.starts_with("--")
            || (s.starts_with('-')
                && s.len() > 1
                && !s[1..2].chars().all(|c| c.is_ascii_digit() || c == '.'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(line: &str) -> (Vec<String>, Vec<String>) {
        let (a, w) = normalize(line.split(' ').map(OsString::from).collect());
        (a.into_iter().map(|s| s.into_string().unwrap()).collect(), w)
    }

    #[test]
    fn vllm_spellings_become_fleetgates() {
        let (a, w) = norm(
            "--base_url http://x:1 --trust-remote-code --metadata a=1 b=2 --num_prompts=3 --input-len 7 --random-input-len 9",
        );
        assert_eq!(
            a,
            [
                "--base-url",
                "http://x:1",
                "--label",
                "a=1",
                "--label",
                "b=2",
                "--num-prompts=3",
                "--random-input-len",
                "9",
                "--random-input-len",
                "7"
            ]
        );
        assert_eq!(w.len(), 1);
        assert!(
            w[0].starts_with("--trust-remote-code is ignored: "),
            "{w:?}"
        );
    }

    #[test]
    fn what_would_change_the_measurement_is_carried_to_the_plan() {
        let (a, w) = norm(
            "--dataset-name sonnet --sonnet-input-len 5 --ramp-up-strategy linear --backend vllm-rerank --backend vllm",
        );
        assert_eq!(
            a.iter()
                .filter(|s| s.starts_with(NOT_IMPLEMENTED_FLAG))
                .count(),
            3,
            "{a:?}"
        );
        assert!(a.ends_with(&["--backend".to_owned(), "vllm".to_owned()]));
        assert_eq!(w.len(), 1, "the sonnet length: {w:?}");
        // vLLM's JSON range ratio: one ratio for both directions is the number.
        let (a, _) = norm(r#"--random-range-ratio {"input":0.25,"output":0.25}"#);
        assert_eq!(a, ["--random-range-ratio", "0.25"]);
        let (a, _) = norm(r#"--random-range-ratio {"input":0.1,"output":0.5}"#);
        assert!(a[0].starts_with(NOT_IMPLEMENTED_FLAG), "{a:?}");
        // Values that look like numbers are values.
        let (a, _) = norm("--lora-modules a b --seed -1");
        assert_eq!(a[1..], ["--seed", "-1"]);
    }
}
