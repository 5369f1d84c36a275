//! The `GET /v1/models` body, as OpenAI's API and vLLM's server write it: a list of model
//! cards. The gateway reads a backend's card from its list and serves its own list.

use bytes::Bytes;
use serde_json::Value;

/// One card of the list: a backend's own card (vLLM's carries `max_model_len`, `root`,
/// `permission`, …) under the name clients use, or a minimal card when no backend gave one.
pub fn card(id: &str, backend_card: Option<&Value>) -> Value {
    match backend_card {
        Some(c) => {
            let mut c = c.clone();
            c["id"] = Value::from(id);
            c
        }
        None => {
            serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "fleetgate"})
        }
    }
}

/// The body: `{"object": "list", "data": [cards]}`.
pub fn list_body(cards: Vec<Value>) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({"object": "list", "data": cards}))
            .unwrap_or_default(),
    )
}

/// The card of `served` in an OpenAI `/v1/models` list (the only card when the list has one).
pub fn find_card(body: &[u8], served: &str) -> Option<serde_json::Value> {
    let list: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = list.get("data")?.as_array()?;
    data.iter()
        .find(|c| c.get("id").and_then(|i| i.as_str()) == Some(served))
        .or_else(|| (data.len() == 1).then(|| &data[0]))
        .filter(|c| c.is_object())
        .cloned()
}

/// The LoRA adapters in an OpenAI `/v1/models` list, as vLLM lists them: the cards with a
/// `parent` (their base model), each with its `id` (the name requests use).
pub fn adapter_cards(body: &[u8]) -> Vec<(String, Value)> {
    let Ok(list) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let Some(data) = list.get("data").and_then(Value::as_array) else {
        return Vec::new();
    };
    data.iter()
        .filter(|c| c.get("parent").is_some_and(|p| !p.is_null()))
        .filter_map(|c| Some((c.get("id")?.as_str()?.to_owned(), c.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_the_cards_with_a_parent() {
        let body = br#"{"object":"list","data":[
            {"id":"qwen","object":"model","root":"/models/qwen","parent":null,"max_model_len":4096},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"qwen"},
            {"id":"bad","parent":"qwen","root":1},
            {"parent":"qwen"}]}"#;
        let found = adapter_cards(body);
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["sql-lora", "bad"]);
        assert_eq!(found[0].1["root"], "/adapters/sql");
        assert!(adapter_cards(b"not json").is_empty());
    }

    #[test]
    fn a_backends_card_keeps_its_fields_under_the_clients_name() {
        let vllm = serde_json::json!({"id": "/models/qwen", "object": "model", "max_model_len": 32768, "root": "/models/qwen"});
        let body = list_body(vec![card("qwen", Some(&vllm)), card("other", None)]);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], "qwen");
        assert_eq!(v["data"][0]["max_model_len"], 32768);
        assert_eq!(v["data"][0]["root"], "/models/qwen");
        assert_eq!(v["data"][1]["owned_by"], "fleetgate");
    }

    #[test]
    fn picks_the_pool_models_card() {
        let list = br#"{"object":"list","data":[{"id":"a","max_model_len":1024},{"id":"b","root":"/m/b"}]}"#;
        assert_eq!(find_card(list, "b").unwrap()["root"], "/m/b");
        assert!(find_card(list, "c").is_none());
        let one = br#"{"object":"list","data":[{"id":"x","max_model_len":8}]}"#;
        assert_eq!(find_card(one, "other").unwrap()["max_model_len"], 8);
        assert!(find_card(b"not json", "a").is_none());
        assert!(find_card(br#"{"data":[1]}"#, "a").is_none());
    }
}
