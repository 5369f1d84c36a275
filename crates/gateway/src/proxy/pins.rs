//! Stored responses live on one backend: vLLM keeps a response (`store`, the default) in the
//! memory of the server that made it. A `GET /v1/responses/{id}`, a cancel, and a new response
//! with `previous_response_id` must reach that backend; another one would answer "not found".
//! The gateway learns id → backend from the answer that created the response and keeps it
//! here, for a time (`server.response_pin_ttl_s`) and within a capacity shared fairly among
//! keys: past it, the key holding the most pins loses its oldest, so one key's traffic never
//! pushes out another's conversations while it holds more than they do. A pin belongs to the
//! key that created it and is never moved to another key, whatever id a later answer carries.
//! No lock is held across an await; a pin is written once per stored response, read only by
//! the requests that name a response. With `limits.shared = "redis"` every pin is also written
//! to Redis (in the background, under the same rule of ownership) and a pin this replica does
//! not hold is looked up there, so a client may reach any replica.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a stored response lives, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pin {
    /// The pool's model (the pool that served it).
    pub(crate) model: Arc<str>,
    /// The backend's base URL, as configured.
    pub(crate) backend: Arc<str>,
    /// The public id of the key that created it (`""`: none): only that key reads it,
    /// cancels it or continues it (vLLM's store has no owner; another team's key must not
    /// read a conversation by guessing or learning its id).
    pub(crate) key: Arc<str>,
}

#[derive(Debug)]
struct Entry {
    pin: Pin,
    at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<Box<str>, Entry>,
    /// Each key's pins in the order they were written, for eviction by age and by share.
    by_key: HashMap<Arc<str>, VecDeque<(Box<str>, Instant)>>,
    /// Order slots held in `by_key`, all keys together.
    slots: usize,
}

impl Inner {
    /// Drop the oldest slot of `key`; the map entry goes too unless the id was pinned again
    /// since (a newer slot stands for it).
    fn pop_oldest(&mut self, key: &Arc<str>) {
        let Some(order) = self.by_key.get_mut(key) else {
            return;
        };
        let Some((old, at)) = order.pop_front() else {
            return;
        };
        if order.is_empty() {
            self.by_key.remove(key);
        }
        self.slots -= 1;
        if self.map.get(&old).is_some_and(|e| e.at == at) {
            self.map.remove(&old);
        }
    }
}

/// The id → backend map of one gateway process.
#[derive(Debug)]
pub(crate) struct Pins {
    inner: Mutex<Inner>,
    capacity: usize,
    ttl: Duration,
    /// Shared with the other replicas (`limits.shared = "redis"`).
    shared: Option<crate::limits::shared::PinStore>,
}

/// Why a pin was not written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The id is pinned to another key: the answer's id collides with another key's stored
    /// response (a backend that made the id from something the client chose).
    OwnedByAnotherKey,
}

impl Pins {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            ttl,
            shared: None,
        }
    }

    /// Pins shared through Redis as well.
    pub(crate) fn shared(mut self, store: Option<crate::limits::shared::PinStore>) -> Self {
        self.shared = store;
        self
    }

    /// Remember where `id` lives (and tell the other replicas), unless another key holds it.
    pub(crate) fn insert(&self, id: &str, pin: Pin) -> Result<(), Refused> {
        self.insert_local(id, pin.clone())?;
        if let Some(store) = &self.shared {
            store.put(
                id,
                format!("{}\t{}\t{}", pin.model, pin.backend, pin.key),
                &pin.key,
                self.ttl,
            );
        }
        Ok(())
    }

    /// Where `id` lives: this replica's pin, else the one another replica shared.
    pub(crate) async fn locate(&self, id: &str) -> Option<Pin> {
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
        // (A pin this replica learned meanwhile wins.)
        let _ = self.insert_local(id, pin.clone());
        self.get(id)
    }

    /// Remember where `id` lives here; past the capacity, the key with the most pins forgets
    /// its oldest.
    fn insert_local(&self, id: &str, pin: Pin) -> Result<(), Refused> {
        let now = Instant::now();
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let inner = &mut *g;
        if let Some(e) = inner.map.get(id)
            && e.pin.key != pin.key
            && now.saturating_duration_since(e.at) <= self.ttl
        {
            return Err(Refused::OwnedByAnotherKey);
        }
        let key = pin.key.clone();
        inner.map.insert(id.into(), Entry { pin, at: now });
        inner
            .by_key
            .entry(key.clone())
            .or_default()
            .push_back((id.into(), now));
        inner.slots += 1;
        // This key's expired pins go first.
        while inner
            .by_key
            .get(&key)
            .and_then(VecDeque::front)
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) > self.ttl)
        {
            inner.pop_oldest(&key);
        }
        while inner.slots > self.capacity {
            let Some(largest) = inner
                .by_key
                .iter()
                .max_by_key(|(_, order)| order.len())
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            inner.pop_oldest(&largest);
        }
        Ok(())
    }

    /// Where `id` lives, if it was learned here and has not expired.
    pub(crate) fn get(&self, id: &str) -> Option<Pin> {
        let g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = g.map.get(id)?;
        (e.at.elapsed() <= self.ttl).then(|| e.pin.clone())
    }

    /// Pins held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .len()
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// What the relay of a new response needs to pin it once its id is read.
#[derive(Debug)]
pub(crate) struct Learn {
    pub(crate) pins: Arc<Pins>,
    pub(crate) pin: Pin,
}

impl Learn {
    pub(crate) fn learned(self, id: String) {
        if let Err(Refused::OwnedByAnotherKey) = self.pins.insert(&id, self.pin) {
            tracing::warn!(
                response_id = %id,
                "a backend answered with a stored response id another key holds: not pinned to this key (the other key's pin stays)"
            );
        }
    }
}

/// The top-level `"id"` string a whole response object starts with (`{"id":"resp_...",...`),
/// read from the answer's first frame without parsing the rest.
pub(crate) fn leading_id(data: &[u8]) -> Option<String> {
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
        pins.insert("a", pin("x")).unwrap();
        pins.insert("b", pin("y")).unwrap();
        pins.insert("c", pin("z")).unwrap();
        assert_eq!(pins.get("a"), None, "the oldest went first");
        assert_eq!(pins.get("c"), Some(pin("z")));
        assert_eq!(pins.len(), 2);
        // Pinned again: the newer entry stays when its older order slot is evicted.
        pins.insert("b", pin("w")).unwrap();
        pins.insert("d", pin("v")).unwrap();
        assert_eq!(pins.get("b"), Some(pin("w")));

        let pins = Pins::new(10, Duration::ZERO);
        pins.insert("a", pin("x")).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(pins.get("a"), None, "expired");
        pins.insert("b", pin("x")).unwrap();
        assert!(pins.len() <= 1, "the expired one was dropped");
    }

    fn pin_of(key: &str) -> Pin {
        Pin {
            model: "m".into(),
            backend: "b".into(),
            key: key.into(),
        }
    }

    /// Past the capacity the key holding the most pins loses its oldest: a key flooding the
    /// map pushes out its own pins, never a smaller key's.
    #[test]
    fn a_flooding_key_evicts_its_own_pins_first() {
        let pins = Pins::new(4, Duration::from_secs(60));
        pins.insert("a1", pin_of("A")).unwrap();
        pins.insert("a2", pin_of("A")).unwrap();
        for i in 0..100 {
            pins.insert(&format!("b{i}"), pin_of("B")).unwrap();
        }
        assert_eq!(pins.get("a1"), Some(pin_of("A")));
        assert_eq!(pins.get("a2"), Some(pin_of("A")));
        assert_eq!(pins.get("b99"), Some(pin_of("B")));
        assert_eq!(pins.get("b97"), None, "B keeps only its share");
        assert_eq!(pins.len(), 4);
    }

    /// A pin is never moved to another key; the same key may pin an id again (a client that
    /// reuses its own request id).
    #[test]
    fn a_pin_is_never_moved_to_another_key() {
        let pins = Pins::new(10, Duration::from_secs(60));
        pins.insert("r", pin_of("A")).unwrap();
        assert_eq!(
            pins.insert("r", pin_of("B")),
            Err(Refused::OwnedByAnotherKey)
        );
        assert_eq!(pins.get("r"), Some(pin_of("A")));
        let moved = Pin {
            backend: "c".into(),
            ..pin_of("A")
        };
        pins.insert("r", moved.clone()).unwrap();
        assert_eq!(pins.get("r"), Some(moved));
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
