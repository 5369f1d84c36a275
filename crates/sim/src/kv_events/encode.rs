//! Batches in vLLM's wire format, as vLLM 0.32 writes them: an array batch `[ts, events,
//! data_parallel_rank]`, each event a tagged map (or, as vLLM before vllm#42892, a tagged
//! array) with vLLM's fields in vLLM's order, block hashes as integers.

use rmpv::Value;

/// Which encoding of an event to write (the batch is an array in both, as vLLM sends it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// `{"type": "BlockStored", "block_hashes": ...}`: vLLM 0.32 and later.
    #[default]
    Maps,
    /// `["BlockStored", block_hashes, ...]`: vLLM before vllm#42892.
    Arrays,
}

impl Encoding {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "map" | "maps" => Some(Self::Maps),
            "array" | "arrays" => Some(Self::Arrays),
            _ => None,
        }
    }
}

/// One event to write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outgoing<'a> {
    Stored {
        hashes: &'a [u64],
        parent: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_name: Option<&'a str>,
    },
    Removed {
        hashes: &'a [u64],
    },
    Cleared,
}

/// The msgpack payload of one batch (`[ts, events, data_parallel_rank]`).
pub fn encode(ts: f64, events: &[Outgoing<'_>], rank: u32, encoding: Encoding) -> Vec<u8> {
    let events = events.iter().map(|e| event(e, encoding)).collect();
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events),
        Value::from(rank),
    ]);
    let mut buf = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &batch);
    buf
}

fn ints(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|&h| Value::from(h)).collect())
}

fn opt_str(s: Option<&str>) -> Value {
    s.map_or(Value::Nil, Value::from)
}

fn event(e: &Outgoing<'_>, encoding: Encoding) -> Value {
    // Fields in vLLM's order, named as vLLM names them.
    let (tag, fields): (&str, Vec<(&str, Value)>) = match *e {
        Outgoing::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
        } => (
            "BlockStored",
            vec![
                ("block_hashes", ints(hashes)),
                ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(block_size)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", opt_str(lora_name)),
                // Per block, the keys hashed with its tokens: a LoRA request's adapter name
                // (vLLM's `generate_block_hash_extra_keys`; the sim has no other).
                (
                    "extra_keys",
                    Value::Array(vec![
                        lora_name.map_or(Value::Nil, |n| Value::Array(vec![
                            Value::from(n)
                        ]));
                        hashes.len()
                    ]),
                ),
                ("group_idx", Value::from(0)),
                ("kv_cache_spec_kind", Value::from("full_attention")),
            ],
        ),
        Outgoing::Removed { hashes } => (
            "BlockRemoved",
            vec![
                ("block_hashes", ints(hashes)),
                ("medium", Value::from("GPU")),
                ("group_idx", Value::from(0)),
            ],
        ),
        Outgoing::Cleared => ("AllBlocksCleared", Vec::new()),
    };
    match encoding {
        Encoding::Maps => Value::Map(
            std::iter::once((Value::from("type"), Value::from(tag)))
                .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                .collect(),
        ),
        Encoding::Arrays => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect(),
        ),
    }
}
