//! The sim's pooling model: an input's embedding and class probabilities, drawn from its hash,
//! and the ways vLLM writes the numbers out (widened floats, base64 of f32, packed bits).

use base64::Engine as _;

use crate::tokens::mix64;

use super::Prompt;

/// The sim model's embedding of one input: `dims` numbers drawn from its hash, at unit length
/// (vLLM normalises by default).
pub(super) fn embedding(p: Prompt, dims: u32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..u64::from(dims))
        .map(|i| {
            let u = mix64(p.hash ^ mix64(i));
            (u >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    for x in &mut v {
        *x /= norm;
    }
    v
}

/// Class probabilities of one input: a softmax over `labels` logits drawn from its hash (a
/// sigmoid for one label, as vLLM's classifier activation).
pub(super) fn class_probs(hash: u64, labels: u32) -> Vec<f32> {
    let logit = |i: u64| (mix64(hash ^ mix64(i ^ 0xc1a5)) >> 40) as f32 / (1u64 << 22) as f32 - 2.0;
    if labels == 1 {
        return vec![1.0 / (1.0 + (-logit(0)).exp())];
    }
    let logits: Vec<f32> = (0..u64::from(labels)).map(logit).collect();
    let max = logits.iter().copied().fold(f32::MIN, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// f32 results printed as vLLM prints them: the f32 widened to a Python float.
pub(super) fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().copied().map(f64::from).collect()
}

pub(super) fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// One bit a dimension (non-negative → 1), most significant first, as numpy's `packbits`.
pub(super) fn pack_bits(v: &[f32]) -> Vec<u8> {
    v.chunks(8)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u8, |b, (i, x)| if *x >= 0.0 { b | (0x80 >> i) } else { b })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::text_prompt;
    use super::*;

    #[test]
    fn embeddings_are_unit_length_and_a_function_of_the_input() {
        let p = text_prompt(3, "hello there");
        let a = embedding(p, 64);
        assert_eq!(a.len(), 64);
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert_eq!(a, embedding(text_prompt(3, "hello there"), 64));
        assert_ne!(
            a,
            embedding(text_prompt(4, "hello there"), 64),
            "the seed counts"
        );
        assert_ne!(
            a,
            embedding(text_prompt(3, "hello therE"), 64),
            "the text counts"
        );
    }

    #[test]
    fn base64_is_little_endian_f32() {
        let v = [1.0f32, -2.5];
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(base64_f32(&v))
            .unwrap();
        assert_eq!(bytes, [0, 0, 0x80, 0x3f, 0, 0, 0x20, 0xc0]);
    }

    #[test]
    fn packbits_is_most_significant_bit_first() {
        let v = [1.0f32, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.0];
        assert_eq!(pack_bits(&v), [0b1000_0001]);
    }

    #[test]
    fn class_probabilities_sum_to_one() {
        for labels in [2, 3, 7] {
            let p = class_probs(42, labels);
            assert_eq!(p.len(), labels as usize);
            assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        let one = class_probs(42, 1);
        assert!(one[0] > 0.0 && one[0] < 1.0);
    }
}
