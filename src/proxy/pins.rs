//! Stored responses live on one backend: vLLM keeps a response (`store`, the default) in the
//! memory of the server that made it. A `GET /v1/responses/{id}`, a cancel, and a new response
//! with `previous_response_id` must reach that backend; another one would answer "not found".
//! The gateway learns id → backend from the answer that created the response and keeps it
//! here: bounded (the oldest go first), each for a time (`server.response_pin_ttl_s`). No lock
//! is held across an await; a pin is written once per Responses request, read only by the
//! requests that name a response. With `limits.shared = "redis"` every pin is also written to
//! Redis (in the background) and a pin this replica does not hold is looked up there, so a
//! client may reach any replica.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a stored response lives, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    /// The pool's model (the pool that served it).
    pub model: Arc<str>,
    /// The backend's base URL, as configured.
    pub backend: Arc<str>,
    /// The public id of the key that created it (`""`: none): only that key reads it,
    /// cancels it or continues it (vLLM's store has no owner; another team's key must not
    /// read a conversation by guessing or learning its id).
    pub key: Arc<str>,
}

#[derive(Debug)]
struct Entry {
    pin: Pin,
    at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<Box<str>, Entry>,
    /// Insertion order, for eviction by age and size.
    order: VecDeque<(Box<str>, Instant)>,
}

/// The id → backend map of one gateway process.
#[derive(Debug)]
pub struct Pins {
    inner: Mutex<Inner>,
    capacity: usize,
    ttl: Duration,
    /// Shared with the other replicas (`limits.shared = "redis"`).
    shared: Option<crate::limits::shared::PinStore>,
}

impl Pins {
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            ttl,
            shared: None,
        }
    }

    /// Pins shared through Redis as well.
    pub fn shared(mut self, store: Option<crate::limits::shared::PinStore>) -> Self {
        self.shared = store;
        self
    }

    /// Remember where `id` lives (and tell the other replicas).
    pub fn insert(&self, id: &str, pin: Pin) {
        if let Some(store) = &self.shared {
            store.put(
                id,
                format!("{}\t{}\t{}", pin.model, pin.backend, pin.key),
                self.ttl,
            );
        }
        self.insert_local(id, pin);
    }

    /// Where `id` lives: this replica's pin, else the one another replica shared.
    pub async fn locate(&self, id: &str) -> Option<Pin> {
        if let Some(pin) = self.get(id) {
            return Some(pin);
        }
        let value = self.shared.as_ref()?.get(id).await?;
        let mut parts = value.splitn(3, '\t');
        let pin = Pin {
            model: parts.next()?.into(),
            backend: parts.next()?.into(),
            key: parts.next()?.into(),
        };
        self.insert_local(id, pin.clone());
        Some(pin)
    }

    /// Remember where `id` lives here, forgetting the oldest past the capacity.
    fn insert_local(&self, id: &str, pin: Pin) {
        let now = Instant::now();
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let inner = &mut *g;
        inner.map.insert(id.into(), Entry { pin, at: now });
        inner.order.push_back((id.into(), now));
        while inner.order.len() > self.capacity
            || inner
                .order
                .front()
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) > self.ttl)
        {
            let Some((old, at)) = inner.order.pop_front() else {
                break;
            };
            // Only the entry this order slot was written for (the id may have been pinned
            // again since).
            if inner.map.get(&old).is_some_and(|e| e.at == at) {
                inner.map.remove(&old);
            }
        }
    }

    /// Where `id` lives, if it was learned here and has not expired.
    pub fn get(&self, id: &str) -> Option<Pin> {
        let g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = g.map.get(id)?;
        (e.at.elapsed() <= self.ttl).then(|| e.pin.clone())
    }

    /// Pins held now.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// What the relay of a new response needs to pin it once its id is read.
#[derive(Debug)]
pub struct Learn {
    pub pins: Arc<Pins>,
    pub pin: Pin,
}

impl Learn {
    pub fn learned(self, id: String) {
        self.pins.insert(&id, self.pin);
    }
}

/// The top-level `"id"` string a whole response object starts with (`{"id":"resp_...",...`),
/// read from the answer's first frame without parsing the rest.
pub fn leading_id(data: &[u8]) -> Option<String> {
    let body = data.trim_ascii_start().strip_prefix(b"{")?;
    let rest = body.trim_ascii_start().strip_prefix(b"\"id\"")?;
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = memchr::memchr(b'"', rest)?;
    let id = std::str::from_utf8(&rest[..end]).ok()?;
    (!id.is_empty() && !id.contains('\\')).then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(b: &str) -> Pin {
        Pin {
            model: "m".into(),
            backend: b.into(),
            key: "k".into(),
        }
    }

    #[test]
    fn bounded_by_size_and_age() {
        let pins = Pins::new(2, Duration::from_secs(60));
        pins.insert("a", pin("x"));
        pins.insert("b", pin("y"));
        pins.insert("c", pin("z"));
        assert_eq!(pins.get("a"), None, "the oldest went first");
        assert_eq!(pins.get("c"), Some(pin("z")));
        assert_eq!(pins.len(), 2);
        // Pinned again: the newer entry stays when its older order slot is evicted.
        pins.insert("b", pin("w"));
        pins.insert("d", pin("v"));
        assert_eq!(pins.get("b"), Some(pin("w")));

        let pins = Pins::new(10, Duration::ZERO);
        pins.insert("a", pin("x"));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(pins.get("a"), None, "expired");
        pins.insert("b", pin("x"));
        assert!(pins.len() <= 1, "the expired one was dropped");
    }

    #[test]
    fn reads_the_leading_id() {
        assert_eq!(
            leading_id(br#"{"id":"resp_0f1","created_at":1}"#).as_deref(),
            Some("resp_0f1")
        );
        assert_eq!(leading_id(br#" { "id" : "r" }"#).as_deref(), Some("r"));
        assert_eq!(leading_id(br#"{"object":"response","id":"r"}"#), None);
        assert_eq!(leading_id(b"{\"id\":\"abc"), None);
    }
}
