//! The sim's batches against what real vLLM 0.32 published (tests/fixtures/vllm-0.32.0/
//! kv-events.json): the same fields in the same order, with values of the same msgpack kinds.

use rmpv::Value;

use super::*;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A value's msgpack kind, recursively for the first element of arrays and every field of maps
/// (integers of any width are one kind, so are floats).
fn kind(v: &Value) -> String {
    match v {
        Value::Nil => "nil".into(),
        Value::Boolean(_) => "bool".into(),
        Value::Integer(_) => "int".into(),
        Value::F32(_) | Value::F64(_) => "float".into(),
        Value::String(_) => "str".into(),
        Value::Binary(_) => "bin".into(),
        Value::Array(a) => format!("[{}]", a.first().map(kind).unwrap_or_default()),
        Value::Map(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}:{}", k.as_str().unwrap_or("?"), kind(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Value::Ext(..) => "ext".into(),
    }
}

#[test]
fn a_stored_block_has_real_vllms_fields_and_kinds() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/vllm-0.32.0/kv-events.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // The second frame: a block behind a parent, as most are.
    let real = unhex(fixture["frames"][1]["payload_hex"].as_str().unwrap());
    let real = rmpv::decode::read_value(&mut &real[..]).unwrap();
    let ours = encode(
        1.0,
        &[Outgoing::Stored {
            hashes: &[u64::MAX],
            parent: Some(7),
            token_ids: &[5; 128],
            block_size: 128,
            lora_name: None,
        }],
        0,
        Encoding::Maps,
    );
    let ours = rmpv::decode::read_value(&mut &ours[..]).unwrap();
    assert_eq!(kind(&ours), kind(&real));
}

#[test]
fn the_config_is_vllms_and_refuses_what_the_sim_cannot_do() {
    let on = r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 5, "hwm": 10}"#;
    let s = parse(on, Encoding::Arrays).unwrap().unwrap();
    assert_eq!(
        (
            s.endpoint.as_str(),
            s.bind,
            s.replay_endpoint.as_deref(),
            s.buffer_steps,
            s.topic.as_str()
        ),
        (
            "tcp://0.0.0.0:5557",
            true,
            Some("tcp://0.0.0.0:5558"),
            5,
            "kv"
        )
    );
    let connect = parse(r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.1:5557"}"#, Encoding::Maps).unwrap().unwrap();
    assert!(
        !connect.bind,
        "a host without a wildcard: vLLM's PUB connects"
    );
    for off in [
        r#"{}"#,
        r#"{"enable_kv_cache_events": false, "publisher": "zmq"}"#,
        r#"{"enable_kv_cache_events": true}"#,
    ] {
        assert!(parse(off, Encoding::Maps).unwrap().is_none(), "{off}");
    }
    for (bad, says) in [
        (
            r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
            "kafka",
        ),
        (
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/kv"}"#,
            "tcp:// only",
        ),
        (
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpont": "tcp://*:1"}"#,
            "endpont",
        ),
        ("not json", "not vLLM's KV events config"),
    ] {
        let e = parse(bad, Encoding::Maps).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

/// A LoRA request's blocks name its adapter as vLLM's `BlockStored` does: `lora_name`, and the
/// name as each block's extra keys; a base-model block has neither.
#[test]
fn a_stored_block_of_an_adapter_names_it() {
    let adapter = std::sync::Arc::new(crate::lora::LoraAdapter {
        id: 3,
        name: "sql".into(),
        path: "/adapters/sql".into(),
        parent: "qwen32b".into(),
    });
    let stored = |adapter| Change::Stored {
        hashes: vec![1, 2],
        parent: None,
        tokens: vec![0; 8],
        adapter,
    };
    let payload = encode_batch(&[stored(Some(adapter)), stored(None)], 4, Encoding::Maps);
    let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let field = |event: &Value, name: &str| {
        event
            .as_map()
            .unwrap()
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    let events = batch.as_array().unwrap()[1].as_array().unwrap().clone();
    assert_eq!(field(&events[0], "lora_name"), Value::from("sql"));
    assert_eq!(
        field(&events[0], "extra_keys"),
        Value::Array(vec![Value::Array(vec![Value::from("sql")]); 2])
    );
    assert_eq!(field(&events[1], "lora_name"), Value::Nil);
    assert_eq!(
        field(&events[1], "extra_keys"),
        Value::Array(vec![Value::Nil; 2])
    );
}
