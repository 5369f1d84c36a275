//! Deterministic token texts and the JSON string escaping the hand-written frames rely on.

use bytes::BufMut;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Words the sim "generates". Mostly ASCII with a leading space like BPE tokens; a few
/// multi-byte and escape-needing entries make sure UTF-8 and JSON escaping are exercised on
/// every longer stream.
const VOCAB: &[&str] = &[
    " the",
    " model",
    " token",
    " batch",
    " latency",
    " gateway",
    " request",
    " stream",
    " server",
    " prefill",
    " decode",
    " cache",
    " queue",
    " fleet",
    " key",
    " route",
    " metric",
    " budget",
    " step",
    " sequence",
    " prompt",
    " answer",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " lazy",
    " dog",
    ",",
    ".",
    " and",
    " of",
    " to",
    " in",
    " is",
    " 日本",
    " 東京",
    " café",
    " naïve",
    " Zürich",
    " ü",
    " \"quoted\"",
    " back\\slash",
    "\n",
    " 42",
    " tab\t",
    " ok",
];

/// A per-request source of token texts: the same sim seed and request give the same words.
pub(crate) struct TokenSource {
    rng: SmallRng,
}

impl TokenSource {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    pub fn next_token(&mut self) -> &'static str {
        let i = self.rng.random_range(0..VOCAB.len());
        VOCAB.get(i).copied().unwrap_or(" the")
    }
}

/// FNV-1a, used to fold request content into a token seed; stable across runs and platforms,
/// unlike std's randomly keyed hasher.
pub(crate) fn fnv1a(seed: u64, data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64 finaliser: turns a counter into a well-spread u64 (fault decisions).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d1_049b_b133_111e);
    z ^ (z >> 31)
}

/// Appends `s` as the inside of a JSON string literal (no surrounding quotes).
pub(crate) fn push_json_str<B: BufMut>(buf: &mut B, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut clean_from = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        buf.put_slice(&bytes[clean_from..i]);
        if short.is_empty() {
            buf.put_slice(b"\\u00");
            buf.put_u8(HEX[usize::from(b >> 4)]);
            buf.put_u8(HEX[usize::from(b & 0xf)]);
        } else {
            buf.put_slice(short);
        }
        clean_from = i + 1;
    }
    buf.put_slice(&bytes[clean_from..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn escaped(s: &str) -> String {
        let mut v = Vec::new();
        push_json_str(&mut v, s);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn escaping_round_trips_through_serde() {
        for s in VOCAB
            .iter()
            .copied()
            .chain(["a\u{1}b\u{1f}", "\r\n", "plain", ""])
        {
            let lit = format!("\"{}\"", escaped(s));
            let back: String = serde_json::from_str(&lit).unwrap();
            assert_eq!(back, s);
        }
    }

    #[test]
    fn same_seed_same_words() {
        let mut a = TokenSource::new(7);
        let mut b = TokenSource::new(7);
        let wa: Vec<_> = (0..50).map(|_| a.next_token()).collect();
        let wb: Vec<_> = (0..50).map(|_| b.next_token()).collect();
        assert_eq!(wa, wb);
        assert!(wa.iter().any(|w| !w.is_ascii()) || wa.len() < 50);
    }
}
