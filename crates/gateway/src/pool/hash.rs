//! The hash functions the pools share: the same values in every replica, so that replicas that
//! never talk agree on where a key or a prompt prefix goes.

/// splitmix64's finaliser: a well-mixed 64-bit hash of `x`.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A hash of `bytes` chained from `h`, eight bytes at a time (a 100 kB text is ~12k
/// multiplications), then mixed so that every byte moves every bit. The same in every replica.
pub(crate) fn words64_from(mut h: u64, bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(word))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
    for b in words.remainder() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// `words64_from` FNV's offset basis.
pub(crate) fn words64(bytes: &[u8]) -> u64 {
    words64_from(0xcbf2_9ce4_8422_2325, bytes)
}

/// FNV-1a over `bytes`: the same value in every replica (affinity keys).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
