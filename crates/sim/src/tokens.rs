//! Deterministic token texts, the sim's tokenizer, and the JSON string escaping the
//! hand-written frames rely on.

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
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// The same source, `n` tokens on.
    pub(crate) fn skipping(mut self, n: u32) -> Self {
        for _ in 0..n {
            self.next_token();
        }
        self
    }

    pub(crate) fn next_token(&mut self) -> &'static str {
        let i = self.rng.random_range(0..VOCAB.len());
        VOCAB.get(i).copied().unwrap_or(" the")
    }
}

/// The sim's tokenizer: how it counts prompt tokens and what `/tokenize` answers. It keeps the
/// sim's rule of thumb of four characters per token for ASCII text — a run of ASCII characters
/// is cut into pieces of four, the last piece taking the one to three left over (a run shorter
/// than four is one piece) — and makes every other character a token of its own (closer to
/// what BPE vocabularies do with such text, and what lets every id name its text). Ids need no
/// vocabulary: a single character is its code point, a piece of two to seven ASCII characters
/// is `PIECE_BASE` plus its characters packed seven bits each behind a marker bit. So the same
/// text has the same ids on every sim, and `/detokenize` inverts `/tokenize` exactly.
pub(crate) fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let first = rest.chars().next()?;
        let len = if first.is_ascii() {
            // Four characters, or the whole of a run of at most seven (looking no further
            // than eight bytes ahead: the cost stays linear in the text).
            let run = rest.bytes().take(8).take_while(u8::is_ascii).count();
            if run < 8 { run } else { 4 }
        } else {
            first.len_utf8()
        };
        let (piece, tail) = rest.split_at(len);
        rest = tail;
        Some(piece)
    })
}

/// Tokens of `text` by the sim's tokenizer (`pieces`).
pub(crate) fn count(text: &str) -> usize {
    pieces(text).count()
}

/// Ids of multi-character pieces start here, above every code point.
const PIECE_BASE: u64 = 0x11_0000;

/// The id of one piece of `pieces`.
pub(crate) fn token_id(piece: &str) -> u64 {
    let mut chars = piece.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => u64::from(c),
        _ => {
            let packed = piece
                .bytes()
                .fold(1u64, |acc, b| (acc << 7) | u64::from(b & 0x7f));
            PIECE_BASE + packed
        }
    }
}

/// The text of the token `id`, if it is one `token_id` gives.
pub(crate) fn token_text(id: u64) -> Option<String> {
    if id < PIECE_BASE {
        return char::from_u32(u32::try_from(id).ok()?).map(String::from);
    }
    let packed = id - PIECE_BASE;
    // The marker bit, then seven bits per character: two to seven characters.
    let bits = packed.checked_ilog2()?;
    if bits % 7 != 0 || !(2..=7).contains(&(bits / 7)) {
        return None;
    }
    let text: String = (0..bits / 7)
        .rev()
        .map(|i| char::from(((packed >> (7 * i)) & 0x7f) as u8))
        .collect();
    Some(text)
}

/// FNV-1a, used to fold request content into a token seed; stable across runs and platforms,
/// unlike std's randomly keyed hasher.
pub(crate) fn fnv1a(seed: u64, data: &[u8]) -> u64 {
    data.iter()
        .fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, &b| fnv1a_step(h, b))
}

/// One byte folded into an FNV-1a state.
pub(crate) fn fnv1a_step(h: u64, b: u8) -> u64 {
    (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
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
    fn tokenizer_counts_four_ascii_characters_a_token_and_inverts() {
        fn n(t: &str) -> Vec<&str> {
            pieces(t).collect()
        }
        assert_eq!(n("hello there, sim"), ["hell", "o th", "ere,", " sim"]);
        assert_eq!(n("12345678"), ["1234", "5678"]);
        assert_eq!(n("abcdefghij"), ["abcd", "efghij"]);
        assert_eq!(n("ab"), ["ab"]);
        assert_eq!(n("a café"), ["a caf", "é"]);
        assert_eq!(n("日本"), ["日", "本"]);
        assert_eq!(count(""), 0);
        for text in [
            "hello there, sim",
            "a café au lait, 日本語\n\t\"q\"",
            "x",
            "\u{10FFFF}z",
        ] {
            let ids: Vec<u64> = pieces(text).map(token_id).collect();
            let back: String = ids.iter().map(|id| token_text(*id).unwrap()).collect();
            assert_eq!(back, text);
            assert!(ids.iter().all(|id| *id < 1 << 53), "{ids:?}");
        }
        assert_eq!(token_text(0xD800), None);
        assert_eq!(token_text(PIECE_BASE + 5), None);
        assert_eq!(token_text(u64::MAX), None);
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
