//! FNV-1a: a small hash every build computes alike (the standard library's
//! hasher may change between Rust releases), for values that nodes or
//! versions compare with each other.

/// FNV-1a over `parts`, each followed by a 0 byte (so that ("ab", "c")
/// and ("a", "bc") differ).
pub fn fnv1a<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.iter().copied().chain(std::iter::once(0)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    #[test]
    fn known_values_and_part_boundaries() {
        // FNV-1a of the single byte 0 (the empty part's separator).
        assert_eq!(super::fnv1a([&b""[..]]), 0xaf63_bd4c_8601_b7df);
        assert_ne!(
            super::fnv1a([&b"ab"[..], b"c"]),
            super::fnv1a([&b"a"[..], b"bc"])
        );
    }
}
