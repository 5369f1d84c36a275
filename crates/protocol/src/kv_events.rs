//! vLLM's KV cache events (`vllm serve --kv-events-config`): what an engine's prefix cache
//! stores and evicts. An engine publishes them over ZeroMQ PUB as three frames: a topic, the
//! batch's sequence number (a big-endian u64, counting from 0 per publisher, so a gap is a
//! lost batch) and the batch, in msgpack. A replay endpoint (ROUTER), when configured, answers
//! a starting sequence number with the batches it still buffers, each as the last two frames,
//! then a sequence number of -1 with an empty payload.
//!
//! Two encodings of a batch exist, and `decode` reads both:
//! - tagged arrays (vLLM before vllm#42892): `[ts, [event, ...], data_parallel_rank?]`, an
//!   event `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name?, extra_keys?, ...]`, `["BlockRemoved", block_hashes, medium?, ...]`,
//!   `["AllBlocksCleared"]`;
//! - tagged maps (since 2026-06): `{"ts", "events", "data_parallel_rank"?}`, an event
//!   `{"type": "BlockStored", "block_hashes", ...}` with the same field names.
//!
//! vLLM 0.32.0 publishes an array batch whose events are tagged maps (captured in
//! tests/fixtures/vllm-0.32.0/kv-events.json); the two levels are read independently.
//!
//! Fields past those read here (`group_idx`, the cache spec) are ignored, as are events of a
//! type this version does not know, which are counted (`Batch::unknown`). A block's hash is
//! the engine's own (bytes since vLLM's `sha256_cbor`, an integer before): it is kept only as
//! a 64-bit digest to recognise a later `BlockRemoved`, never computed or compared with
//! anything the gateway hashes, so the engine's algorithm and seed do not matter.

use rmpv::Value;

/// The largest payload decoded; a larger one is refused whole (`DecodeError::TooLarge`).
pub const MAX_PAYLOAD: usize = 16 << 20;

/// Nesting deeper than this is not a batch (extra keys are a tuple inside a list inside an
/// event inside the events inside the batch; the decoder counts a string or bytes as a level
/// too).
const MAX_DEPTH: usize = 32;

/// An engine's hash of one block, as a 64-bit digest of its bytes or its integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// The gateway's own identity of a block: a digest of the identity of the block before it
/// (none for a prompt's first), its token ids, and the LoRA adapter and extra keys the engine
/// hashed with them. The same whole prefix gives the same chain on the gateway's side (from
/// the request's tokens) as on the engine's (from its events), whatever hash the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u64);

impl BlockId {
    /// The block of `tokens` behind `parent`.
    pub fn chain(
        parent: Option<BlockId>,
        tokens: &[u32],
        lora_name: Option<&str>,
        extra_keys: Option<u64>,
    ) -> BlockId {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut h = parent.map_or(0x6a09_e667_f3bc_c908, |p| p.0);
        h = mix(h ^ tokens.len() as u64);
        for &t in tokens {
            h = (h.rotate_left(23) ^ u64::from(t)).wrapping_mul(K);
        }
        if let Some(name) = lora_name {
            h = mix(h ^ fnv1a(FNV_OFFSET, name.as_bytes()));
        }
        if let Some(extra) = extra_keys {
            h = mix(h ^ extra.rotate_left(17));
        }
        BlockId(mix(h))
    }

    /// The identities of every full block of `tokens`, `block_size` tokens each, in order (a
    /// tail shorter than a block is not a block: engines cache only full ones).
    pub fn of_prompt<'a>(
        tokens: &'a [u32],
        block_size: u32,
        lora_name: Option<&'a str>,
    ) -> impl Iterator<Item = BlockId> + 'a {
        let mut parent = None;
        tokens
            .chunks_exact(block_size.max(1) as usize)
            .map(move |block| {
                let id = BlockId::chain(parent, block, lora_name, None);
                parent = Some(id);
                id
            })
    }
}

/// A 64-bit finaliser (splitmix64's).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One decoded batch of events.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The engine's wall clock when it made the batch (seconds since the epoch).
    pub ts: f64,
    pub events: Vec<Event>,
    /// The publisher's data-parallel rank, where it says.
    pub data_parallel_rank: Option<u32>,
    /// Events of a type this decoder does not know, skipped.
    pub unknown: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    /// Every block of the engine's cache is gone (a reset).
    Cleared,
}

/// Blocks the engine now holds: `hashes[i]` names the block of `token_ids[i * block_size ..
/// (i + 1) * block_size]`, each block continuing the one before it, the first continuing
/// `parent` (`None`: the start of a prompt).
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub hashes: Vec<EngineHash>,
    pub parent: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<Box<str>>,
    /// Where the blocks live (`"GPU"`, `"CPU"` for an offloading connector); `None`: the GPU.
    pub medium: Option<Box<str>>,
    /// Per block, a digest of the extra keys the engine hashed with its tokens (multimodal
    /// inputs, LoRA name, cache salt), where it sent them.
    pub extra_keys: Vec<Option<u64>>,
}

/// Blocks the engine evicted.
#[derive(Debug, Clone, PartialEq)]
pub struct Removed {
    pub hashes: Vec<EngineHash>,
    pub medium: Option<Box<str>>,
}

/// Why a payload is not a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("a batch of {0} bytes, over the {MAX_PAYLOAD}-byte limit")]
    TooLarge(usize),
    /// Not one msgpack value (truncated, trailing bytes, nested too deep).
    #[error("not a msgpack value: {0}")]
    NotMsgpack(String),
    /// msgpack, but not in the shape of a batch: which field, and what is wrong.
    #[error("not a KV event batch: {0}")]
    Shape(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// The sequence number of a batch's second frame.
pub fn sequence(frame: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(frame.try_into().ok()?))
}

/// The replay endpoint's end marker: sequence -1 (all ones).
pub const REPLAY_END: u64 = u64::MAX;

/// Decode one batch, in either encoding.
pub fn decode(payload: &[u8]) -> Result<Batch, DecodeError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::NotMsgpack(format!(
            "{} bytes after the batch",
            rd.len()
        )));
    }
    let (ts, events, rank) = match &value {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => (
            field(m, "ts"),
            field(m, "events"),
            field(m, "data_parallel_rank"),
        ),
        _ => return Err(shape("the batch is neither an array nor a map")),
    };
    let ts = ts
        .and_then(Value::as_f64)
        .ok_or_else(|| shape("`ts` is not a number"))?;
    let events = events
        .and_then(Value::as_array)
        .ok_or_else(|| shape("`events` is not a list"))?;
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| shape("`data_parallel_rank` is not a rank"))?,
        ),
    };
    let mut batch = Batch {
        ts,
        events: Vec::with_capacity(events.len()),
        data_parallel_rank,
        unknown: 0,
    };
    for (i, e) in events.iter().enumerate() {
        let decoded = event(e).map_err(|err| match err {
            DecodeError::Shape(m) => shape(format!("event {i}: {m}")),
            other => other,
        })?;
        match decoded {
            Some(e) => batch.events.push(e),
            None => batch.unknown += 1,
        }
    }
    Ok(batch)
}

fn field<'v>(map: &'v [(Value, Value)], name: &str) -> Option<&'v Value> {
    map.iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

/// An event's fields by name, in either encoding (an array's by position after its tag).
struct Fields<'v> {
    map: Option<&'v [(Value, Value)]>,
    array: &'v [Value],
}

impl<'v> Fields<'v> {
    fn get(&self, name: &str, position: usize) -> Option<&'v Value> {
        match self.map {
            Some(m) => field(m, name),
            None => self.array.get(position),
        }
        .filter(|v| !v.is_nil())
    }
}

/// One event, or `None` for a type this decoder does not know.
fn event(value: &Value) -> Result<Option<Event>, DecodeError> {
    let (tag, fields) = match value {
        Value::Array(a) => (
            a.first().and_then(Value::as_str),
            Fields {
                map: None,
                array: a.get(1..).unwrap_or_default(),
            },
        ),
        Value::Map(m) => (
            field(m, "type").and_then(Value::as_str),
            Fields {
                map: Some(m),
                array: &[],
            },
        ),
        _ => return Err(shape("neither an array nor a map")),
    };
    let tag = tag.ok_or_else(|| shape("no type tag"))?;
    Ok(Some(match tag {
        "BlockStored" => Event::Stored(stored(&fields)?),
        "BlockRemoved" => Event::Removed(Removed {
            hashes: hashes(fields.get("block_hashes", 0), "block_hashes")?,
            medium: text(fields.get("medium", 1), "medium")?,
        }),
        "AllBlocksCleared" => Event::Cleared,
        _ => return Ok(None),
    }))
}

fn stored(f: &Fields<'_>) -> Result<Stored, DecodeError> {
    let hashes = hashes(f.get("block_hashes", 0), "block_hashes")?;
    let parent = f.get("parent_block_hash", 1).map(engine_hash).transpose()?;
    let token_ids = f
        .get("token_ids", 2)
        .and_then(Value::as_array)
        .ok_or_else(|| shape("`token_ids` is not a list"))?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| shape("`token_ids` holds something other than token ids"))?;
    let block_size = f
        .get("block_size", 3)
        .and_then(Value::as_u64)
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0)
        .ok_or_else(|| shape("`block_size` is not a positive size"))?;
    // `lora_id` (position 4) is the deprecated integer; the name is what the engine hashes.
    let medium = text(f.get("medium", 5), "medium")?;
    let lora_name = text(f.get("lora_name", 6), "lora_name")?;
    let extra_keys = match f.get("extra_keys", 7) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .ok_or_else(|| shape("`extra_keys` is not a list"))?
            .iter()
            .map(|k| (!k.is_nil()).then(|| digest_value(k)))
            .collect(),
    };
    if token_ids.len() != hashes.len() * block_size as usize {
        return Err(shape(format!(
            "{} token ids for {} blocks of {block_size}",
            token_ids.len(),
            hashes.len()
        )));
    }
    if !extra_keys.is_empty() && extra_keys.len() != hashes.len() {
        return Err(shape(format!(
            "{} extra keys for {} blocks",
            extra_keys.len(),
            hashes.len()
        )));
    }
    Ok(Stored {
        hashes,
        parent,
        token_ids,
        block_size,
        lora_name,
        medium,
        extra_keys,
    })
}

fn hashes(value: Option<&Value>, name: &str) -> Result<Vec<EngineHash>, DecodeError> {
    value
        .and_then(Value::as_array)
        .ok_or_else(|| shape(format!("`{name}` is not a list")))?
        .iter()
        .map(engine_hash)
        .collect()
}

fn engine_hash(value: &Value) -> Result<EngineHash, DecodeError> {
    match value {
        Value::Binary(b) => Ok(EngineHash(fnv1a(FNV_OFFSET, b))),
        Value::Integer(i) => {
            // Python's builtin hash is a signed 64-bit integer; a larger one does not fit.
            let bits = i
                .as_u64()
                .or_else(|| i.as_i64().map(|v| v as u64))
                .ok_or_else(|| shape("a block hash out of range"))?;
            Ok(EngineHash(fnv1a(FNV_OFFSET ^ 1, &bits.to_le_bytes())))
        }
        _ => Err(shape("a block hash that is neither bytes nor an integer")),
    }
}

fn text(value: Option<&Value>, name: &str) -> Result<Option<Box<str>>, DecodeError> {
    value
        .map(|v| {
            v.as_str()
                .map(Box::from)
                .ok_or_else(|| shape(format!("`{name}` is not a string")))
        })
        .transpose()
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64-bit: a digest for recognising what the engine sent again, not a defence against
/// a hostile engine.
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// A digest of any value, by its msgpack encoding.
fn digest_value(value: &Value) -> u64 {
    let mut buf = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, value);
    fnv1a(FNV_OFFSET, &buf)
}

#[cfg(test)]
mod tests;
