//! Prompts for the load generator: random prompts of a given length, weighted request classes
//! (the seed's `request_distribution`), or ShareGPT conversations sampled and filtered the way
//! `vllm bench serve` does.
//!
//! Token counts: with `--tokenizer tokenizer.json` (the model's own, as Hugging Face ships it),
//! texts are counted by that tokenizer and random prompts are made to its exact length. Without
//! one, a prompt's length in tokens is estimated as characters / 4 (OpenAI's rule of thumb for
//! English text), and random prompts are made of common short English words, each one token in
//! the GPT, Llama and Qwen BPE vocabularies, so a random prompt of N tokens is N words. The
//! server's own `usage.prompt_tokens` replaces either in the results whenever the server reports
//! it (vLLM does, for every streamed request the bench sends).

use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use super::spec::RequestClass;

/// One request to send.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub text: String,
    /// Estimated prompt tokens (the server's usage replaces it in the results).
    pub input_tokens: u64,
    /// `max_tokens` to ask for.
    pub output_tokens: u64,
    /// The request class it came from (settings.json), for the report.
    pub(crate) class: Option<String>,
}

/// The approximation used when no tokenizer is given, for the report.
pub(crate) const APPROXIMATION: &str = "token counts estimated as characters / 4 (random prompts: one common English word per token; give --tokenizer tokenizer.json for exact counts); the server's usage.prompt_tokens replaces the estimate when reported";

/// Estimated tokens of `text`: characters / 4, at least 1.
pub(crate) fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4).max(1)
}

/// How texts are counted in tokens.
#[derive(Clone, Default)]
pub enum Counter {
    /// Characters / 4.
    #[default]
    Approximate,
    /// A real tokenizer (tokenizer.json).
    Tokenizer(std::sync::Arc<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Counter::Approximate => f.write_str("Approximate"),
            Counter::Tokenizer(_) => f.write_str("Tokenizer"),
        }
    }
}

impl Counter {
    /// Load a Hugging Face `tokenizer.json`.
    pub(crate) fn load(path: &Path) -> Result<Counter, String> {
        // vLLM's --tokenizer is often a model directory: its tokenizer.json.
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_owned()
        };
        let path = file.as_path();
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Counter::Tokenizer(std::sync::Arc::new(t)))
            .map_err(|e| {
                format!(
                    "{}: not a tokenizer.json the tokenizers library can read: {e}",
                    path.display()
                )
            })
    }

    /// Tokens of `text` (without special tokens).
    pub(crate) fn count(&self, text: &str) -> u64 {
        match self {
            Counter::Approximate => estimate_tokens(text),
            Counter::Tokenizer(t) => t
                .encode_fast(text, false)
                .map_or_else(|_| estimate_tokens(text), |e| e.len() as u64),
        }
    }
}

/// Words that are one token each in common BPE vocabularies (with their leading space).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "out", "up", "into",
    "them", "some", "could", "then", "other", "these", "two", "may", "first", "any", "new", "now",
    "like", "our", "over", "also", "man", "made", "only", "after", "did", "many", "before", "must",
    "through", "back", "years", "where", "much", "your", "way", "well", "down", "should",
    "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very",
    "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between",
    "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last",
    "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came",
    "right", "used", "take", "three",
];

/// `text` with its words rotated left by `by` (modulo their number): a message of its own, of
/// the same words and so the same size.
pub(crate) fn rotate_words(text: &str, by: usize) -> String {
    let mut words: Vec<&str> = text.split(' ').collect();
    let by = by % words.len().max(1);
    words.rotate_left(by);
    words.join(" ")
}

/// A random prompt of `tokens` tokens by `counter` (words added or taken off until the count is
/// right, or as close as single words allow), with its count.
pub(crate) fn random_prompt(rng: &mut SmallRng, tokens: u64, counter: &Counter) -> (String, u64) {
    let mut words: Vec<&str> = (0..tokens)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    if let Counter::Approximate = counter {
        return (words.join(" "), tokens);
    }
    let mut text = words.join(" ");
    let mut n = counter.count(&text);
    for _ in 0..64 {
        if n == tokens {
            break;
        }
        if n > tokens {
            if words.len() <= 1 {
                break;
            }
            words.pop();
        } else {
            words.push(WORDS[rng.random_range(0..WORDS.len())]);
        }
        let next = words.join(" ");
        let m = counter.count(&next);
        // Past the target in the other direction: keep the closer of the two.
        if (n < tokens && m > tokens) || (n > tokens && m < tokens) {
            if m.abs_diff(tokens) < n.abs_diff(tokens) {
                text = next;
                n = m;
            }
            break;
        }
        text = next;
        n = m;
    }
    (text, n)
}

/// A length drawn uniformly from [len × (1 − r), len × (1 + r)] (vLLM's `--random-range-ratio`).
fn around(rng: &mut SmallRng, len: u64, ratio: f64) -> u64 {
    if ratio <= 0.0 {
        return len.max(1);
    }
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as u64;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as u64;
    rng.random_range(lo..=hi)
}

/// `n` random prompts (vLLM's random dataset).
pub(crate) fn random(
    n: usize,
    input: u64,
    output: u64,
    range_ratio: f64,
    seed: u64,
    counter: &Counter,
) -> Vec<Prompt> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let i = around(&mut rng, input, range_ratio);
            let o = around(&mut rng, output, range_ratio);
            let (text, input_tokens) = random_prompt(&mut rng, i, counter);
            Prompt {
                text,
                input_tokens,
                output_tokens: o,
                class: None,
            }
        })
        .collect()
}

/// The shape of vLLM's `prefix_repetition` dataset (its `--prefix-repetition-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PrefixRepetition {
    pub(crate) prefix_len: u64,
    pub(crate) suffix_len: u64,
    pub(crate) num_prefixes: usize,
    pub(crate) output_len: u64,
}

/// vLLM 0.32's `PrefixRepetitionRandomDataset`: `num_prefixes` random prefixes, each followed
/// by `n / num_prefixes` random suffixes (so `n` rounded down to a multiple of
/// `num_prefixes` prompts, as vLLM), shuffled with the seed so that the prompts sharing a
/// prefix do not arrive together.
pub(crate) fn prefix_repetition(
    n: usize,
    shape: &PrefixRepetition,
    seed: u64,
    counter: &Counter,
) -> Result<Vec<Prompt>, String> {
    let per_prefix = n.checked_div(shape.num_prefixes).unwrap_or(0);
    if per_prefix == 0 {
        return Err(format!(
            "--num-prompts ({n}) must be at least --prefix-repetition-num-prefixes ({}), which must be ≥ 1",
            shape.num_prefixes
        ));
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(per_prefix * shape.num_prefixes);
    for _ in 0..shape.num_prefixes {
        let (prefix, prefix_tokens) = random_prompt(&mut rng, shape.prefix_len.max(1), counter);
        for _ in 0..per_prefix {
            let (suffix, suffix_tokens) = random_prompt(&mut rng, shape.suffix_len.max(1), counter);
            out.push(Prompt {
                text: format!("{prefix} {suffix}"),
                input_tokens: prefix_tokens + suffix_tokens,
                output_tokens: shape.output_len.max(1),
                class: None,
            });
        }
    }
    for i in (1..out.len()).rev() {
        let j = rng.random_range(0..=i);
        out.swap(i, j);
    }
    Ok(out)
}

/// `n` prompts drawn from weighted classes.
pub(crate) fn classes(
    n: usize,
    classes: &[RequestClass],
    seed: u64,
    counter: &Counter,
) -> Result<Vec<Prompt>, String> {
    let total: f64 = classes.iter().map(|c| c.weight).sum();
    if classes.is_empty() || !(total.is_finite() && total > 0.0) {
        return Err("request_distribution needs at least one class with a weight > 0".into());
    }
    if let Some(c) = classes
        .iter()
        .find(|c| c.weight < 0.0 || !c.weight.is_finite())
    {
        return Err(format!(
            "request_distribution: class {:?} has weight {} (must be ≥ 0)",
            c.name, c.weight
        ));
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let mut r = rng.random_range(0.0..total);
            let c = classes
                .iter()
                .find(|c| {
                    r -= c.weight;
                    r < 0.0
                })
                .unwrap_or(&classes[classes.len() - 1]);
            let (text, input_tokens) = random_prompt(&mut rng, c.input_tokens.max(1), counter);
            Prompt {
                text,
                input_tokens,
                output_tokens: c.output_tokens.max(1),
                class: c.name.clone(),
            }
        })
        .collect())
}

#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    #[serde(default)]
    value: String,
}

/// What ShareGPT sampling kept and skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShareGptStats {
    pub conversations: usize,
    pub fewer_than_two_turns: usize,
    pub prompt_too_short: usize,
    pub output_too_short: usize,
    pub prompt_too_long: usize,
    pub(crate) total_too_long: usize,
    pub kept: usize,
}

impl std::fmt::Display for ShareGptStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} conversations read; skipped: {} with fewer than two turns, {} prompts under 4 tokens, {} completions under 4 tokens, {} prompts over 1024 tokens, {} prompt + output over 2048 tokens; {} kept",
            self.conversations,
            self.fewer_than_two_turns,
            self.prompt_too_short,
            self.output_too_short,
            self.prompt_too_long,
            self.total_too_long,
            self.kept
        )
    }
}

/// `n` prompts from a ShareGPT file, as vLLM samples them: conversations with at least two
/// turns, shuffled with `seed`; the first turn is the prompt, the second's length the output
/// length (unless `fixed_output` is given); pairs with a prompt or output under 4 tokens, a
/// prompt over 1024 or a total over 2048 are skipped.
pub fn sharegpt(
    path: &Path,
    n: usize,
    fixed_output: Option<u64>,
    seed: u64,
    counter: &Counter,
) -> Result<(Vec<Prompt>, ShareGptStats), String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let data: Vec<Conversation> = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{}: not a ShareGPT file (a JSON array of {{\"conversations\": [{{\"from\", \"value\"}}, ...]}}): {e}",
            path.display()
        )
    })?;
    let mut stats = ShareGptStats {
        conversations: data.len(),
        ..ShareGptStats::default()
    };
    let mut pairs: Vec<(String, String)> = Vec::with_capacity(data.len());
    for mut c in data {
        if c.conversations.len() < 2 {
            stats.fewer_than_two_turns += 1;
            continue;
        }
        let completion = std::mem::take(&mut c.conversations[1].value);
        let prompt = std::mem::take(&mut c.conversations[0].value);
        pairs.push((prompt, completion));
    }
    // Fisher-Yates with the seed (the order differs from Python's `random.shuffle`, the
    // filtering does not).
    let mut rng = SmallRng::seed_from_u64(seed);
    for i in (1..pairs.len()).rev() {
        let j = rng.random_range(0..=i);
        pairs.swap(i, j);
    }
    let mut out = Vec::with_capacity(n);
    for (prompt, completion) in pairs {
        if out.len() == n {
            break;
        }
        let prompt_len = counter.count(&prompt);
        let output_len = fixed_output.unwrap_or_else(|| counter.count(&completion));
        if prompt_len < 4 {
            stats.prompt_too_short += 1;
        } else if fixed_output.is_none() && output_len < 4 {
            stats.output_too_short += 1;
        } else if prompt_len > 1024 {
            stats.prompt_too_long += 1;
        } else if prompt_len + output_len > 2048 {
            stats.total_too_long += 1;
        } else {
            out.push(Prompt {
                text: prompt,
                input_tokens: prompt_len,
                output_tokens: output_len,
                class: None,
            });
        }
    }
    stats.kept = out.len();
    if out.is_empty() {
        return Err(format!(
            "{}: no usable conversation: {stats}",
            path.display()
        ));
    }
    Ok((out, stats))
}

/// A request body for `prompt`, as `vllm bench serve` sends it: streamed, usage included,
/// temperature 0, then `extra` over it (the sampling flags, `--extra-body`). The Responses API names its limit `max_output_tokens`; neither it nor
/// Anthropic's API takes `stream_options` (their final events always carry usage). An embeddings
/// request is the prompt as `input`, not streamed.
pub(crate) fn body(
    prompt: &Prompt,
    model: &str,
    kind: super::spec::EndpointType,
    ignore_eos: bool,
    extra: &serde_json::Map<String, serde_json::Value>,
) -> bytes::Bytes {
    use super::spec::EndpointType;
    let merged = |v| with_extra(v, extra);
    if kind == EndpointType::OpenaiEmbeddings {
        // What `vllm bench serve` sends (`async_request_openai_embeddings`): no output length,
        // no stream; `truncate_prompt_tokens: -1` so that a long prompt is cut to the model's
        // context instead of refused (embedding models' contexts are short).
        let mut v = serde_json::json!({
            "model": model,
            "input": prompt.text,
            "truncate_prompt_tokens": -1,
        });
        if ignore_eos {
            v["ignore_eos"] = true.into();
        }
        return merged(v);
    }
    let mut v = match kind {
        EndpointType::OpenaiChat | EndpointType::AnthropicMessages => serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt.text}],
        }),
        EndpointType::Openai => serde_json::json!({"model": model, "prompt": prompt.text}),
        EndpointType::OpenaiResponses | EndpointType::OpenaiEmbeddings => {
            serde_json::json!({"model": model, "input": prompt.text})
        }
    };
    let limit = match kind {
        EndpointType::OpenaiResponses => "max_output_tokens",
        _ => "max_tokens",
    };
    v[limit] = prompt.output_tokens.into();
    v["temperature"] = 0.0.into();
    v["stream"] = true.into();
    if matches!(kind, EndpointType::OpenaiChat | EndpointType::Openai) {
        v["stream_options"] = serde_json::json!({"include_usage": true});
    }
    if ignore_eos {
        v["ignore_eos"] = true.into();
    }
    merged(v)
}

/// A request body `v` with `extra` merged over it (the sampling flags, `--extra-body`,
/// `--served-model-name`), as bytes.
pub(crate) fn with_extra(
    mut v: serde_json::Value,
    extra: &serde_json::Map<String, serde_json::Value>,
) -> bytes::Bytes {
    if let Some(o) = v.as_object_mut() {
        o.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    bytes::Bytes::from(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_have_the_asked_lengths_and_repeat_with_the_seed() {
        let approx = Counter::Approximate;
        let a = random(20, 100, 50, 0.0, 7, &approx);
        assert!(a.iter().all(|p| p.text.split(' ').count() == 100));
        assert!(a.iter().all(|p| p.output_tokens == 50));
        let b = random(20, 100, 50, 0.0, 7, &approx);
        assert_eq!(a[3].text, b[3].text);
        let c = random(200, 100, 50, 0.5, 7, &approx);
        assert!(c.iter().all(|p| (50..=150).contains(&p.input_tokens)));
        assert!(c.iter().any(|p| p.input_tokens < 80) && c.iter().any(|p| p.input_tokens > 120));
    }

    #[test]
    fn prefix_repetition_prompts_share_their_prefixes() {
        let shape = PrefixRepetition {
            prefix_len: 40,
            suffix_len: 10,
            num_prefixes: 3,
            output_len: 7,
        };
        // 10 asked, 3 prefixes: 3 prompts per prefix, 9 in all (vLLM rounds down too).
        let p = prefix_repetition(10, &shape, 5, &Counter::Approximate).unwrap();
        assert_eq!(p.len(), 9);
        assert!(
            p.iter()
                .all(|p| p.input_tokens == 50 && p.output_tokens == 7)
        );
        let prefix = |t: &str| t.split(' ').take(40).collect::<Vec<_>>().join(" ");
        let mut groups: Vec<(String, usize)> = Vec::new();
        for q in &p {
            let k = prefix(&q.text);
            match groups.iter_mut().find(|(g, _)| *g == k) {
                Some((_, n)) => *n += 1,
                None => groups.push((k, 1)),
            }
        }
        assert_eq!(groups.len(), 3);
        assert!(groups.iter().all(|(_, n)| *n == 3), "{groups:?}");
        let suffixes: std::collections::HashSet<_> = p
            .iter()
            .map(|q| q.text.split(' ').skip(40).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(suffixes.len(), 9, "every suffix its own");
        assert!(prefix_repetition(2, &shape, 5, &Counter::Approximate).is_err());
    }

    #[test]
    fn classes_follow_their_weights() {
        let cls = [
            RequestClass {
                name: Some("short".into()),
                weight: 0.6,
                input_tokens: 256,
                output_tokens: 128,
            },
            RequestClass {
                name: Some("long".into()),
                weight: 0.3,
                input_tokens: 2048,
                output_tokens: 512,
            },
            RequestClass {
                name: Some("tail".into()),
                weight: 0.1,
                input_tokens: 8192,
                output_tokens: 2048,
            },
        ];
        let p = classes(2000, &cls, 1, &Counter::Approximate).unwrap();
        let short = p
            .iter()
            .filter(|p| p.class.as_deref() == Some("short"))
            .count();
        let tail = p
            .iter()
            .filter(|p| p.class.as_deref() == Some("tail"))
            .count();
        assert!((1100..1300).contains(&short), "{short}");
        assert!((140..260).contains(&tail), "{tail}");
        assert!(classes(3, &[], 1, &Counter::Approximate).is_err());
    }

    /// A word-level tokenizer.json that splits on whitespace and punctuation: one token per
    /// word or punctuation run, whatever its length.
    pub(crate) fn word_tokenizer(dir: &Path) -> std::path::PathBuf {
        let vocab: serde_json::Map<String, serde_json::Value> = ["[UNK]", "the", "of", "and"]
            .iter()
            .enumerate()
            .map(|(i, w)| ((*w).to_owned(), serde_json::json!(i)))
            .collect();
        let t = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, t.to_string()).unwrap();
        p
    }

    #[test]
    fn a_tokenizer_counts_and_random_prompts_match_it() {
        let dir = std::env::temp_dir().join(format!("fg-tok-{}", std::process::id()));
        let counter = Counter::load(&word_tokenizer(&dir)).unwrap();
        // 11 tokens by the tokenizer (10 words and a full stop), 15 by characters / 4.
        let text = "Explain the difference between TCP and UDP in two sentences.";
        assert_eq!(counter.count(text), 11);
        assert_eq!(estimate_tokens(text), 15);
        let mut rng = SmallRng::seed_from_u64(3);
        for n in [1, 7, 100] {
            let (t, got) = random_prompt(&mut rng, n, &counter);
            assert_eq!(got, n);
            assert_eq!(counter.count(&t), n);
        }
        let e = Counter::load(&dir.join("missing.json")).unwrap_err();
        assert!(e.contains("missing.json"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
