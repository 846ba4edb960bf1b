//! One's-complement checksum arithmetic (RFC 1071, RFC 1624), on 16-bit
//! words in memory order: the sums do not depend on byte order, so words
//! are taken as loaded and written back as computed.

/// The two 16-bit halves of a word, added (one's-complement terms).
#[inline(always)]
pub fn halves(w: u32) -> u32 {
    (w & 0xffff) + (w >> 16)
}

/// The complements of the two halves, added: the terms that take a word out
/// of a sum.
#[inline(always)]
pub fn halves_neg(w: u32) -> u32 {
    (!w & 0xffff) + (!w >> 16)
}

/// The one's-complement sum folded to 16 bits.
#[inline(always)]
pub fn fold(mut s: u32) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// A checksum after the data it covers changed by `delta` (the terms of
/// the words taken out and put in), RFC 1624 eqn. 3: `~(~csum + delta)`.
#[inline(always)]
pub fn replace(csum: u16, delta: u32) -> u16 {
    !fold((!csum as u32 & 0xffff) + delta)
}
