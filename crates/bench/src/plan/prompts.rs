//! What a run's requests carry: the prompts (settings.json's classes, random, ShareGPT, prefix
//! repetition, or multi-turn conversations), how they are counted, and what every request body
//! gets on top of its prompt.

use std::time::Duration;

use serde_json::{Value, json};

use crate::args::{BenchArgs, DatasetName, base_of};
use crate::dataset::{self, Prompt};
use crate::spec::{EndpointType, HotConversation, MultiTurn, RequestClass, Target};

/// What every request body gets on top of the prompt's: the sampling flags, then
/// `--extra-body`, then `--served-model-name` as the model (vLLM's order).
pub(super) fn body_extra(args: &BenchArgs) -> Result<serde_json::Map<String, Value>, String> {
    let mut extra = serde_json::Map::new();
    let floats = [
        ("temperature", args.temperature),
        ("top_p", args.top_p),
        ("min_p", args.min_p),
        ("frequency_penalty", args.frequency_penalty),
        ("presence_penalty", args.presence_penalty),
        ("repetition_penalty", args.repetition_penalty),
    ];
    for (k, v) in floats {
        if let Some(v) = v {
            if !v.is_finite() {
                return Err(format!("--{}: {v} is not a number", k.replace('_', "-")));
            }
            extra.insert(k.into(), json!(v));
        }
    }
    if let Some(k) = args.top_k {
        extra.insert("top_k".into(), json!(k));
    }
    if let Some(text) = &args.extra_body {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(m)) => extra.extend(m),
            Ok(_) => {
                return Err(format!(
                    "--extra-body `{text}`: a JSON object, e.g. '{{\"top_k\": 20}}'"
                ));
            }
            Err(e) => return Err(format!("--extra-body is not JSON: {e}")),
        }
    }
    if let Some(name) = &args.served_model_name {
        extra.insert("model".into(), json!(name));
    }
    Ok(extra)
}

/// The multi-turn shape, and each conversation's user messages as prompts (conversation c's
/// turn t at `MultiTurn::index(c, t)`), every one asking for `--random-output-len` tokens.
pub(super) fn multi_turn(
    args: &BenchArgs,
    conversations: usize,
    kind: EndpointType,
    targets: &[Target],
) -> Result<(MultiTurn, Vec<Prompt>, String), String> {
    if conversations == 0 || args.multi_turn_turns == 0 {
        return Err("--multi-turn-conversations and --multi-turn-turns must be ≥ 1".into());
    }
    if !matches!(
        kind,
        EndpointType::OpenaiChat | EndpointType::OpenaiResponses | EndpointType::AnthropicMessages
    ) {
        return Err(format!(
            "--multi-turn-conversations: {} has no conversation; use --endpoint-type openai-chat, openai-responses or anthropic-messages",
            kind.name()
        ));
    }
    if targets.len() != 1 || args.sweep.is_some() {
        return Err(
            "--multi-turn-conversations runs against one --base-url, without --compare or --sweep"
                .into(),
        );
    }
    if !(args.multi_turn_think_ms.is_finite() && args.multi_turn_think_ms >= 0.0) {
        return Err("--multi-turn-think-ms must be ≥ 0".into());
    }
    let hot = match args.multi_turn_hot_share {
        None => None,
        Some(f) if !(f > 0.0 && f < 1.0) => {
            return Err(format!(
                "--multi-turn-hot-share {f}: the hot conversation's share of all requests must be between 0 and 1, both excluded (e.g. 0.33)"
            ));
        }
        Some(_) if conversations < 2 => {
            return Err(
                "--multi-turn-hot-share needs --multi-turn-conversations ≥ 2: the hot conversation's share is of all conversations' requests".into(),
            );
        }
        Some(share) => Some(HotConversation {
            share,
            lanes: HotConversation::lanes_for(share, conversations),
        }),
    };
    let (counter, _) = counter(args)?;
    let n = conversations * args.multi_turn_turns;
    // The system prompt from a seed of its own, so it does not change with the conversations.
    let system = match args.multi_turn_system_len {
        0 => String::new(),
        len => {
            use rand::SeedableRng;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(args.seed ^ 0x5157_454d);
            dataset::random_prompt(&mut rng, len, &counter).0
        }
    };
    let user_len = args.multi_turn_user_len.max(1);
    let mut prompts = dataset::random(
        n,
        user_len,
        args.random_output_len,
        0.0,
        args.seed,
        &counter,
    );
    // The hot conversation's other lanes: after all conversations' prompts, `turns` per lane
    // (`MultiTurn::lane_index`), each the turn's own message with its words rotated by the
    // lane: a message of its own, of the same words and so the same size.
    if let Some(h) = hot {
        for lane in 1..h.lanes {
            for t in 0..args.multi_turn_turns {
                let own = &prompts[t];
                let text = dataset::rotate_words(&own.text, lane);
                let input_tokens = match counter {
                    dataset::Counter::Approximate => own.input_tokens,
                    _ => counter.count(&text),
                };
                let lane_prompt = Prompt {
                    text,
                    input_tokens,
                    output_tokens: own.output_tokens,
                    class: own.class.clone(),
                };
                prompts.push(lane_prompt);
            }
        }
    }
    let cache_metrics = match &args.cache_metrics_url {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(base_of)
            .collect::<Result<Vec<_>, _>>()?,
        None => targets[0].base.split(", ").map(str::to_owned).collect(),
    };
    let mt = MultiTurn {
        conversations,
        turns: args.multi_turn_turns,
        user_len,
        system_len: args.multi_turn_system_len,
        think: Duration::from_secs_f64(args.multi_turn_think_ms / 1e3),
        system,
        cache_metrics,
        hot,
    };
    let mut note = format!(
        "multi-turn: {conversations} conversations × {} turns, a shared system prompt of {} tokens, {user_len} user tokens and {} out a turn",
        mt.turns, mt.system_len, args.random_output_len
    );
    if let Some(d) = args.duration_seconds {
        note.push_str(&format!(
            "; each conversation starts over as a new one until {d} s have passed"
        ));
    }
    if let Some(h) = hot {
        note.push_str(&format!(
            "; conversation 0 hot: {} lanes a turn, {:.1}% of the requests",
            h.lanes,
            h.planned_share(conversations) * 100.0
        ));
    }
    Ok((mt, prompts, note))
}

/// vLLM's `--random-prefix-len`: one random prefix of `len` tokens (from a seed of its own),
/// the same at the start of every prompt.
fn with_prefix(
    mut prompts: Vec<Prompt>,
    len: u64,
    seed: u64,
    counter: &dataset::Counter,
) -> Vec<Prompt> {
    if len == 0 {
        return prompts;
    }
    use rand::SeedableRng;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x7072_6566);
    let (prefix, tokens) = dataset::random_prompt(&mut rng, len, counter);
    for p in &mut prompts {
        p.text = format!("{prefix} {}", p.text);
        p.input_tokens += tokens;
    }
    prompts
}

/// How prompts are counted: `--tokenizer` (a tokenizer.json, or a model directory holding
/// one), and the note saying so. A path that does not exist is, for vLLM, a model id on
/// Hugging Face's hub; nothing is downloaded here: prompts are counted as characters / 4, and
/// a warning says so.
fn counter(args: &BenchArgs) -> Result<(dataset::Counter, String), String> {
    match &args.tokenizer {
        Some(p) if p.exists() => Ok((
            dataset::Counter::load(p)?,
            format!("token counts by the tokenizer {}", p.display()),
        )),
        Some(p) => {
            eprintln!(
                "fleetgate bench: warning: --tokenizer {}: no such file or directory (fleetgate bench reads a tokenizer.json, or a model directory holding one, and downloads nothing); prompts are counted as characters / 4",
                p.display()
            );
            Ok((
                dataset::Counter::Approximate,
                format!(
                    "{} (--tokenizer {} not found)",
                    dataset::APPROXIMATION,
                    p.display()
                ),
            ))
        }
        None => Ok((
            dataset::Counter::Approximate,
            dataset::APPROXIMATION.to_owned(),
        )),
    }
}

/// The prompts (settings.json's classes, random, or ShareGPT) and a note saying which.
pub(super) fn prompts(
    args: &BenchArgs,
    classes: Option<Vec<RequestClass>>,
) -> Result<(Vec<Prompt>, String), String> {
    let (counter, counting) = counter(args)?;
    Ok(match (classes, args.dataset_name) {
        (Some(c), _) if !c.is_empty() => (
            dataset::classes(args.num_prompts, &c, args.seed, &counter)?,
            format!(
                "settings.json request_distribution ({} classes); {counting}",
                c.len()
            ),
        ),
        (_, DatasetName::Random) => (
            with_prefix(
                dataset::random(
                    args.num_prompts,
                    args.random_input_len,
                    args.random_output_len,
                    args.random_range_ratio,
                    args.seed,
                    &counter,
                ),
                args.random_prefix_len,
                args.seed,
                &counter,
            ),
            if args.kind().streams() {
                format!(
                    "random: {}{} in / {} out tokens (range ratio {}); {counting}",
                    if args.random_prefix_len > 0 {
                        format!("a shared prefix of {} + ", args.random_prefix_len)
                    } else {
                        String::new()
                    },
                    args.random_input_len,
                    args.random_output_len,
                    args.random_range_ratio
                )
            } else {
                format!(
                    "random: {} in tokens (range ratio {}); {counting}",
                    args.random_input_len, args.random_range_ratio
                )
            },
        ),
        (_, DatasetName::Sharegpt) => {
            let path = args
                .dataset_path
                .as_ref()
                .ok_or("--dataset-name sharegpt needs --dataset-path (e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")?;
            let (p, stats) = dataset::sharegpt(
                path,
                args.num_prompts,
                args.sharegpt_output_len,
                args.seed,
                &counter,
            )?;
            let short = if p.len() < args.num_prompts {
                format!(" (only {} of the {} asked for)", p.len(), args.num_prompts)
            } else {
                String::new()
            };
            (
                p,
                format!("sharegpt {}: {stats}{short}; {counting}", path.display()),
            )
        }
        (_, DatasetName::PrefixRepetition) => {
            let shape = dataset::PrefixRepetition {
                prefix_len: args.prefix_repetition_prefix_len,
                suffix_len: args.prefix_repetition_suffix_len,
                num_prefixes: args.prefix_repetition_num_prefixes,
                output_len: args.prefix_repetition_output_len,
            };
            let p = dataset::prefix_repetition(args.num_prompts, &shape, args.seed, &counter)?;
            let note = format!(
                "prefix_repetition: {} prompts, {} prefixes of {} tokens each shared by {}, suffixes of {}, {} out; {counting}",
                p.len(),
                shape.num_prefixes,
                shape.prefix_len,
                p.len() / shape.num_prefixes.max(1),
                shape.suffix_len,
                shape.output_len
            );
            (p, note)
        }
    })
}
