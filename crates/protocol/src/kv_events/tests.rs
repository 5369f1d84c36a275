//! Both encodings of the same events decode to the same batch; whatever else arrives is an
//! error, never a panic.

use rmpv::Value;

use super::*;

fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    buf
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn ints(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|&i| Value::from(i)).collect())
}

fn bin(b: &[u8]) -> Value {
    Value::Binary(b.to_vec())
}

fn map(fields: &[(&str, Value)]) -> Value {
    Value::Map(fields.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

/// Two blocks of 4 tokens stored after a parent, one of them evicted, then a reset: as vLLM
/// before vllm#42892 writes them (tagged arrays, integer hashes).
fn array_batch() -> Value {
    Value::Array(vec![
        Value::F64(1_765_000_000.5),
        Value::Array(vec![
            Value::Array(vec![
                s("BlockStored"),
                ints(&[11, 12]),
                Value::from(10),
                ints(&[1, 2, 3, 4, 5, 6, 7, 8]),
                Value::from(4),
                Value::Nil,
                s("GPU"),
            ]),
            Value::Array(vec![s("BlockRemoved"), ints(&[11]), s("GPU")]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
        Value::from(1),
    ])
}

/// The same events as vLLM writes them since 2026-06 (tagged maps), with byte hashes, a LoRA
/// adapter and extra keys, and fields this decoder does not read.
fn map_batch() -> Value {
    map(&[
        ("ts", Value::F64(1_765_000_000.5)),
        (
            "events",
            Value::Array(vec![
                map(&[
                    ("type", s("BlockStored")),
                    (
                        "block_hashes",
                        Value::Array(vec![bin(&[0xab; 32]), bin(&[0xcd; 32])]),
                    ),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&[1, 2, 3, 4, 5, 6, 7, 8])),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::from(3)),
                    ("medium", s("GPU")),
                    ("lora_name", s("sql-adapter")),
                    (
                        "extra_keys",
                        Value::Array(vec![Value::Array(vec![s("salt-1")]), Value::Nil]),
                    ),
                    ("group_idx", Value::from(0)),
                    ("kv_cache_spec_kind", s("full_attention")),
                ]),
                map(&[
                    ("type", s("BlockRemoved")),
                    ("block_hashes", Value::Array(vec![bin(&[0xab; 32])])),
                    ("medium", s("GPU")),
                    ("group_idx", Value::from(0)),
                ]),
                map(&[("type", s("AllBlocksCleared"))]),
            ]),
        ),
    ])
}

#[test]
fn tagged_arrays_decode() {
    let b = decode(&encode(&array_batch())).unwrap();
    assert_eq!(b.ts, 1_765_000_000.5);
    assert_eq!(b.data_parallel_rank, Some(1));
    assert_eq!(b.unknown, 0);
    let [Event::Stored(st), Event::Removed(rm), Event::Cleared] = &b.events[..] else {
        panic!("{:?}", b.events);
    };
    assert_eq!(st.hashes.len(), 2);
    assert!(st.parent.is_some());
    assert_eq!(st.token_ids, [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(st.block_size, 4);
    assert_eq!(st.medium.as_deref(), Some("GPU"));
    assert_eq!(st.lora_name, None);
    assert!(st.extra_keys.is_empty());
    // The removal names the first stored block by the same digest.
    assert_eq!(rm.hashes, [st.hashes[0]]);
    assert_ne!(st.hashes[0], st.hashes[1]);
}

#[test]
fn tagged_maps_decode_to_the_same_shape() {
    let b = decode(&encode(&map_batch())).unwrap();
    assert_eq!(b.data_parallel_rank, None);
    let [Event::Stored(st), Event::Removed(rm), Event::Cleared] = &b.events[..] else {
        panic!("{:?}", b.events);
    };
    assert_eq!(st.parent, None);
    assert_eq!(st.token_ids.len(), 8);
    assert_eq!(st.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(st.extra_keys.len(), 2);
    assert!(st.extra_keys[0].is_some() && st.extra_keys[1].is_none());
    assert_eq!(rm.hashes, [st.hashes[0]]);
    // An integer hash and a byte hash are never taken for each other.
    let ints = decode(&encode(&array_batch())).unwrap();
    let Event::Stored(int_st) = &ints.events[0] else {
        unreachable!()
    };
    assert!(int_st.hashes.iter().all(|h| !st.hashes.contains(h)));
}

#[test]
fn unknown_events_are_counted_and_skipped() {
    let v = map(&[
        ("ts", Value::from(1)),
        (
            "events",
            Value::Array(vec![
                map(&[("type", s("BlockPinned")), ("block_hashes", ints(&[1]))]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
        ),
    ]);
    let b = decode(&encode(&v)).unwrap();
    assert_eq!((b.unknown, b.events.len()), (1, 1));
}

#[test]
fn wrong_shapes_name_what_is_wrong() {
    let stored = |tokens: &[u64], block_size: u64| {
        Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![
                s("BlockStored"),
                ints(&[1, 2]),
                Value::Nil,
                ints(tokens),
                Value::from(block_size),
            ])]),
        ])
    };
    let cases = [
        (stored(&[1, 2, 3], 2), "3 token ids for 2 blocks of 2"),
        (
            stored(&[1, 2, 3, 4], 0),
            "`block_size` is not a positive size",
        ),
        (stored(&[1, 2, 3, u64::MAX], 2), "`token_ids` holds"),
        (Value::from(7), "neither an array nor a map"),
        (Value::Array(vec![s("x")]), "`ts` is not a number"),
        (
            Value::Array(vec![Value::F64(0.0), Value::Array(vec![Value::from(1)])]),
            "event 0: neither an array nor a map",
        ),
        (
            Value::Array(vec![
                Value::F64(0.0),
                Value::Array(vec![Value::Array(vec![
                    s("BlockRemoved"),
                    Value::Array(vec![Value::F64(1.0)]),
                ])]),
            ]),
            "neither bytes nor an integer",
        ),
    ];
    for (v, want) in cases {
        let err = decode(&encode(&v)).unwrap_err().to_string();
        assert!(err.contains(want), "{err} (wanted {want})");
    }
}

/// Garbage, every truncation of a real batch, trailing bytes, a depth bomb and an oversized
/// payload: each an error, none a panic.
#[test]
fn garbage_truncation_and_bombs_are_errors() {
    let good = encode(&map_batch());
    for cut in 0..good.len() {
        assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
    }
    let mut trailing = good.clone();
    trailing.push(0xc0);
    assert!(matches!(decode(&trailing), Err(DecodeError::NotMsgpack(_))));
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..2000 {
        let len = (state % 64) as usize;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let _ = decode(&bytes);
    }
    // 10 000 nested one-element arrays.
    let bomb = [vec![0x91u8; 10_000], vec![0xc0]].concat();
    assert!(matches!(decode(&bomb), Err(DecodeError::NotMsgpack(_))));
    // An array header claiming 4 billion elements, with none behind it.
    assert!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    let huge = vec![0u8; MAX_PAYLOAD + 1];
    assert_eq!(decode(&huge), Err(DecodeError::TooLarge(MAX_PAYLOAD + 1)));
}

#[test]
fn sequence_numbers_are_big_endian_u64() {
    assert_eq!(sequence(&[0, 0, 0, 0, 0, 0, 1, 2]), Some(258));
    assert_eq!(sequence(&[0xff; 8]), Some(REPLAY_END));
    assert_eq!(sequence(&[1, 2, 3]), None);
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// What real vLLM 0.32 (CPU build) published while it served a three-turn conversation and one
/// other prompt (tests/fixtures/vllm-0.32.0/kv-events.json, scripts/vllm-kv-capture.py): an
/// array batch of tagged-map events, integer hashes above i64's range, 128-token blocks on
/// the CPU. Every frame decodes; the blocks chain; and every full block of each prompt, as
/// vLLM's own `/tokenize` cuts it, is among the stored blocks, behind the same parents — so
/// the token ids a decoder reads are the model's own. The replay endpoint answers the same
/// frames and then its end marker.
#[test]
fn real_vllm_events_carry_the_prompts_own_tokens() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/vllm-0.32.0/kv-events.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(fixture["vllm_version"], "0.32.0");
    let frames = fixture["frames"].as_array().unwrap();
    assert!(!frames.is_empty(), "the capture holds no frames");
    // (parent, token ids of the block) → the block's hash, for every stored block.
    let mut stored = std::collections::HashMap::new();
    let mut block_size = 0;
    let mut last_seq = None;
    for f in frames {
        let seq = f["seq"].as_u64().unwrap();
        if let Some(prev) = last_seq {
            assert_eq!(seq, prev + 1, "the live frames are consecutive");
        }
        last_seq = Some(seq);
        let batch = decode(&unhex(f["payload_hex"].as_str().unwrap())).unwrap();
        assert_eq!((batch.unknown, batch.data_parallel_rank), (0, Some(0)));
        for e in batch.events {
            let Event::Stored(st) = e else {
                panic!("no eviction or reset happened during the capture: {e:?}")
            };
            assert_eq!(st.medium.as_deref(), Some("GPU"));
            block_size = st.block_size as usize;
            let mut parent = st.parent;
            for (i, h) in st.hashes.iter().enumerate() {
                let tokens = st.token_ids[i * block_size..(i + 1) * block_size].to_vec();
                stored.insert((parent, tokens), *h);
                parent = Some(*h);
            }
        }
    }
    assert_eq!(
        block_size, 128,
        "vLLM's CPU backend caches 128-token blocks"
    );
    let mut full_blocks = 0;
    for r in fixture["requests"].as_array().unwrap() {
        let ids: Vec<u32> = r["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let mut parent = None;
        for block in ids.chunks_exact(block_size) {
            let key = (parent, block.to_vec());
            let h = stored.get(&key).unwrap_or_else(|| {
                panic!(
                    "a full block of a prompt was never stored: {:?}",
                    &key.1[..8]
                )
            });
            parent = Some(*h);
            full_blocks += 1;
        }
    }
    assert!(
        full_blocks >= 3,
        "the prompts span {full_blocks} full blocks"
    );
    let replay = &fixture["replay"]["frames"].as_array().unwrap();
    let (end, replayed) = replay.split_last().unwrap();
    assert_eq!(end["seq"].as_i64(), Some(-1));
    assert_eq!(end["payload_hex"], "");
    for (r, f) in replayed.iter().zip(frames) {
        assert_eq!(
            (&r["seq"], &r["payload_hex"]),
            (&f["seq"], &f["payload_hex"])
        );
    }
    assert_eq!(replayed.len(), frames.len());
}
