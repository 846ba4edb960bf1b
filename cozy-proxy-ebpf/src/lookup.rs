//! The maps as both hooks ask them: the settings, the prefilter's bits,
//! an address's entry, the in-cluster ranges and the source ranges. Each
//! answer that can be known without a hash lookup is (see
//! docs/ebpf-datapath.md, What a packet costs).
use crate::maps::{ADDRS, CLUSTER, CONFIG, PREFILTER, SRC_RANGES};
use aya_ebpf::btf_maps::lpm_trie::Key;
use cozy_proxy_common::{prefilter, AddrInfo, IpKey, LbSource, Prefilter, FAMILY_BITS, FAMILY_V4, IP_KEY_BITS};

/// The other backend still serves (`Config::standby`): translate, filter
/// and count nothing.
#[inline(always)]
pub fn standing_by() -> bool {
    // SAFETY: a map value, read whole.
    CONFIG.get_ptr(0).is_some_and(|c| unsafe { (*c).standby } != 0)
}

/// The prefilter (`None` only if the map has no entry, which an array
/// always has).
#[inline(always)]
pub fn prefilter() -> Option<&'static Prefilter> {
    // SAFETY: a map value; userspace replaces it whole, and it lives as
    // long as the map, which the program holds.
    PREFILTER.get_ptr(0).map(|f| unsafe { &*f })
}

/// The prefilter's word and bit of an address.
#[inline(always)]
pub fn slot(k: &IpKey) -> (usize, u64) {
    prefilter::slot(k.fold())
}

/// Is the bit `(word, bit)` set in `bitmap`? `false` is certain.
#[inline(always)]
pub fn set_in(bitmap: &[u64; prefilter::WORDS], (word, bit): (usize, u64)) -> bool {
    bitmap.get(word).is_none_or(|w| w & bit != 0)
}

/// `addrs`' entry for `ip`, if the prefilter (`maybe`) does not rule it out.
#[inline(always)]
pub fn addr_info(ip: &IpKey, maybe: bool) -> Option<AddrInfo> {
    if !maybe {
        return None;
    }
    // SAFETY: a map value; userspace replaces values whole.
    ADDRS.get_ptr(ip).map(|v| unsafe { *v })
}

#[inline(always)]
pub fn addr_bits(ip: &IpKey) -> u32 {
    if ip.family == FAMILY_V4 {
        32
    } else {
        128
    }
}

/// Might `ip` be in the cluster? `false` is certain (the hint in
/// `Prefilter`): most traffic from outside skips the trie lookup.
#[inline(always)]
pub fn maybe_in_cluster(ip: &IpKey) -> bool {
    prefilter().is_none_or(|f| f.maybe_in_cluster(ip))
}

#[inline(never)]
pub fn in_cluster(ip: &IpKey) -> bool {
    maybe_in_cluster(ip)
        && CLUSTER
            .get(&Key::new(FAMILY_BITS + addr_bits(ip), *ip))
            .is_some()
}

#[inline(never)]
pub fn source_allowed(lb: &IpKey, src: &IpKey) -> bool {
    let key = LbSource { lb: *lb, src: *src };
    SRC_RANGES
        .get(&Key::new(IP_KEY_BITS + FAMILY_BITS + addr_bits(src), key))
        .is_some()
}
