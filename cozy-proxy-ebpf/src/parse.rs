//! Reading headers by direct packet access (`data`/`data_end`): every read
//! is bounds-checked against the linear data, so a truncated or malformed
//! packet yields `None`, never an out-of-bounds read.
use crate::hdr::*;
use crate::frame::{packet_offset, Frame};
use core::mem::size_of;
use cozy_proxy_common::{IpKey, FAMILY_V4, FAMILY_V6};

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

/// IPv6 extension headers walked at most (hop-by-hop, routing, fragment,
/// destination options): a bound the verifier can see. A chain longer than
/// this ends with an extension header as the "protocol", which no port
/// filter lists (a filtered pod does not get it), and its addresses are
/// still guarded. Headers beyond the linear data are read all the same
/// (see [`load`]).
const MAX_EXT_HEADERS: usize = 4;

/// Headers this deep are made linear before parsing (an skb may carry
/// them in paged data): Ethernet, a VLAN tag, IPv6 with extension headers,
/// an ICMP error quoting an IPv6 header and its ports.
const PULL: u32 = 256;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Packet {
    /// Offset of the IP header.
    pub l3: usize,
    pub v6: bool,
    /// The upper-layer protocol (after IPv6 extension headers).
    pub proto: u8,
    /// Offset of the upper-layer header.
    pub l4: usize,
    /// Part of a fragmented datagram (first or later fragment).
    pub fragment: bool,
    /// A later fragment: no upper-layer header in this packet.
    pub later_fragment: bool,
    /// Fragment identification (0 when not fragmented).
    pub frag_id: u32,
    pub src: IpKey,
    pub dst: IpKey,
}

/// Where a parsed packet's IP header can start: after Ethernet and at
/// most one VLAN tag.
pub const MAX_L3: usize = ETH_HLEN + VLAN_HLEN;
/// Where its upper-layer header can start, at most (IPv6 with four
/// extension headers of the largest size).
pub const MAX_L4: usize = 0x3fff;

impl Packet {
    /// Are its offsets within what a parse gives? (A global function
    /// cannot know what its caller passes.)
    #[inline(always)]
    pub fn in_bounds(&self) -> bool {
        self.l3 <= MAX_L3 && self.l4 <= MAX_L4
    }
}

/// `size_of::<T>()` bytes at `off`, if they are in the linear data.
#[inline(always)]
pub fn load<T: Copy>(ctx: &impl Frame, off: usize) -> Option<T> {
    if size_of::<T>() == 1 {
        // SAFETY: one byte, of a type any byte is a value of (u8).
        return byte(ctx, off).map(|b| unsafe { core::mem::transmute_copy(&b) });
    }
    let off = packet_offset(off);
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked against data_end just above.
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// `size_of::<T>()` bytes at `off`: from the linear data, or, where they lie
/// beyond it (a long extension header chain in paged data), copied out by
/// the kernel. `None` only past the packet's end.
#[inline(always)]
pub fn load_any<T: Copy>(ctx: &impl Frame, off: usize) -> Option<T> {
    load(ctx, off).or_else(|| copy(ctx, off))
}

/// `bpf_skb_load_bytes`, out of line: inlined, LLVM kept pointers into
/// the context across the call, which the verifier refuses.
#[inline(never)]
fn copy<T: Copy>(ctx: &impl Frame, off: usize) -> Option<T> {
    ctx.copy::<T>(off)
}

/// `size_of::<T>()` bytes at `off` read as whole 32-bit words (`T` is made
/// of `u32`s): one load per word. `load` of a byte array costs a load per
/// byte, as LLVM's BPF backend assumes no unaligned access; but packet
/// data is read unaligned on the CPUs whose kernels let BPF do it (the
/// verifier checks packet alignment only where the CPU needs it), as C
/// programs do through `struct iphdr *`. BPF is little-endian here
/// (bpfel): a word holds its bytes lowest first.
#[inline(always)]
pub fn load_words<T: Copy>(ctx: &impl Frame, off: usize) -> Option<T> {
    let off = packet_offset(off);
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked against data_end just above; alignment: see
    // above (the JIT emits plain loads, which the CPU allows unaligned).
    Some(unsafe { core::ptr::read((start + off) as *const T) })
}

/// Byte `i` (0: lowest address) of a word read by [`load_words`].
#[inline(always)]
pub const fn byte_of(w: u32, i: u32) -> u8 {
    (w >> (8 * i)) as u8
}

/// The big-endian 16-bit field at bytes `i`, `i + 1` of a word.
#[inline(always)]
pub const fn be16_of(w: u32, i: u32) -> u16 {
    u16::from_be((w >> (8 * i)) as u16)
}

/// Writes `v` (made of `u32`s) at `off` with word-sized stores, if that
/// is in the linear data (see [`load_words`] on alignment).
#[inline(always)]
pub fn put_words<T: Copy>(ctx: &impl Frame, off: usize, v: T) -> Option<()> {
    let off = packet_offset(off);
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked just above; alignment as in load_words.
    unsafe { core::ptr::write((start + off) as *mut T, v) };
    Some(())
}

/// Writes `v` at `off`, if that is in the linear data (direct packet
/// access: no helper call).
#[inline(always)]
pub fn put<T: Copy>(ctx: &impl Frame, off: usize, v: T) -> Option<()> {
    if size_of::<T>() == 1 {
        // As the second of two bytes (see [`byte`]).
        let at = off.checked_sub(1)?;
        let [first, _] = load::<[u8; 2]>(ctx, at)?;
        // SAFETY: a one-byte value as its byte.
        return put(ctx, at, [first, unsafe { core::mem::transmute_copy::<T, u8>(&v) }]);
    }
    let off = packet_offset(off);
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked against data_end just above; the verifier
    // makes the skb writable (unclones it) for programs that write.
    unsafe { core::ptr::write_unaligned((start + off) as *mut T, v) };
    Some(())
}

#[inline(always)]
pub fn byte<C: Frame>(ctx: &C, off: usize) -> Option<u8> {
    // Read as the second of two bytes (every header field is past the
    // frame's first byte): the same bound, `off` within the data, but a
    // check LLVM does not fold into `start + off >= end`, from which the
    // verifier learns no range when `off` is not a constant.
    let pair = load::<[u8; 2]>(ctx, off.checked_sub(1)?)?;
    Some(pair[1])
}

/// A 16-bit field (port, ICMP identifier, checksum) at `off`, host order.
#[inline(always)]
pub fn be16<C: Frame>(ctx: &C, off: usize) -> Option<u16> {
    load::<u16>(ctx, off).map(u16::from_be)
}

#[inline(always)]
pub fn has_ports(proto: u8) -> bool {
    matches!(proto, PROTO_TCP | PROTO_UDP | PROTO_SCTP)
}

/// The packet's IP headers, or `None` for anything else.
#[inline(always)]
pub fn parse<C: Frame>(ctx: &C, out: &mut Packet) -> bool {
    let linear = ctx.data_end() - ctx.data();
    let len = ctx.len();
    if (linear as u32) < PULL && (linear as u32) < len {
        // Best effort: what stays paged is simply not read.
        ctx.pull(if len < PULL { len } else { PULL });
    }
    let mut l3 = ETH_HLEN;
    let Some(mut ether) = be16(ctx, ETH_TYPE) else { return false };
    // One VLAN tag in the frame (when not offloaded to skb metadata).
    if ether == ETH_P_8021Q || ether == ETH_P_8021AD {
        let Some(inner) = be16(ctx, VLAN_INNER_TYPE) else { return false };
        ether = inner;
        l3 += VLAN_HLEN;
    }
    match ether {
        ETH_P_IP => parse_v4(ctx, l3, out).is_some(),
        ETH_P_IPV6 => parse_v6(ctx, l3, out).is_some(),
        _ => false,
    }
}

#[inline(always)]
fn parse_v4<C: Frame>(ctx: &C, l3: usize, out: &mut Packet) -> Option<()> {
    // The fixed header in one read (one bounds check), as five words:
    // version/IHL, ..; identification, flags/offset; TTL, protocol, ..;
    // source; destination.
    let h: [u32; IP4_MIN_HLEN / 4] = load_words(ctx, l3)?;
    let ver_ihl = byte_of(h[IP4_VER_IHL / 4], 0);
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < IP4_MIN_HLEN {
        return None;
    }
    let frag = be16_of(h[IP4_FRAG / 4], 2);
    let offset = frag & IP4_OFFSET;
    *out = Packet {
        l3,
        v6: false,
        proto: byte_of(h[IP4_PROTO / 4], 1),
        l4: l3 + ihl,
        fragment: frag & IP4_MF != 0 || offset != 0,
        later_fragment: offset != 0,
        frag_id: be16_of(h[IP4_ID / 4], 0) as u32,
        src: IpKey::from_words(FAMILY_V4, [h[IP4_SADDR / 4], 0, 0, 0]),
        dst: IpKey::from_words(FAMILY_V4, [h[IP4_DADDR / 4], 0, 0, 0]),
    };
    Some(())
}

#[inline(always)]
fn parse_v6<C: Frame>(ctx: &C, l3: usize, out: &mut Packet) -> Option<()> {
    // Ten words: version/class/label; length, next header, hop limit;
    // source (4); destination (4).
    let h: [u32; IP6_HLEN / 4] = load_words(ctx, l3)?;
    if byte_of(h[0], 0) >> 4 != 6 {
        return None;
    }
    let (s, d) = (IP6_SADDR / 4, IP6_DADDR / 4);
    let src = [h[s], h[s + 1], h[s + 2], h[s + 3]];
    let dst = [h[d], h[d + 1], h[d + 2], h[d + 3]];
    let mut next = byte_of(h[IP6_NEXT / 4], 2);
    let mut off = l3 + IP6_HLEN;
    let mut fragment = false;
    let mut later_fragment = false;
    let mut frag_id = 0u32;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            NEXT_HOP_BY_HOP | NEXT_ROUTING | NEXT_DEST_OPTS => {
                // Next header and length in one read (one bounds check the
                // verifier can tie to the offset). Past the packet's end:
                // the header's own type stays the "protocol" (no filter
                // lists it; the addresses are still guarded).
                let Some(e) = load_any::<[u8; 2]>(ctx, off) else { break };
                next = e[EXT_NEXT];
                off += (e[EXT_LEN] as usize + 1) * EXT_UNIT;
            }
            NEXT_FRAGMENT => {
                let Some(f) = load_any::<[u8; FRAG6_HLEN]>(ctx, off) else { break };
                let field = u16::from_be_bytes([f[FRAG6_OFFSET], f[FRAG6_OFFSET + 1]]);
                fragment = true;
                later_fragment = field & FRAG6_OFFSET_MASK != 0;
                frag_id = u32::from_be_bytes([f[FRAG6_ID], f[FRAG6_ID + 1], f[FRAG6_ID + 2], f[FRAG6_ID + 3]]);
                next = f[EXT_NEXT];
                off += FRAG6_HLEN;
                // What follows a later fragment's header is payload, not
                // headers: stop here.
                if later_fragment {
                    break;
                }
            }
            _ => break,
        }
    }
    *out = Packet {
        l3,
        v6: true,
        proto: next,
        l4: off,
        fragment,
        later_fragment,
        frag_id,
        src: IpKey::from_words(FAMILY_V6, src),
        dst: IpKey::from_words(FAMILY_V6, dst),
    };
    Some(())
}

/// The source and destination ports of a first fragment (or unfragmented
/// packet) of TCP, UDP or SCTP.
#[inline(always)]
pub fn ports<C: Frame>(ctx: &C, p: &Packet) -> Option<(u16, u16)> {
    if p.later_fragment || !has_ports(p.proto) {
        return None;
    }
    // Beyond the linear data after a long extension header chain: copied.
    let w: u32 = load_words(ctx, p.l4).or_else(|| copy(ctx, p.l4))?;
    Some((be16_of(w, L4_SPORT as u32), be16_of(w, L4_DPORT as u32)))
}

#[inline(always)]
pub fn is_icmp(p: &Packet) -> bool {
    !p.later_fragment
        && ((p.v6 && p.proto == PROTO_ICMPV6) || (!p.v6 && p.proto == PROTO_ICMP))
}

/// IPv6 neighbour discovery (ICMPv6 router and neighbour solicitations and
/// advertisements, redirects: 133-137) to a link-scoped destination
/// (link-local, or link-local multicast): link-local control, as ARP is,
/// never forwarded.
#[inline(always)]
pub fn is_neighbour_discovery<C: Frame>(ctx: &C, p: &Packet) -> bool {
    let d = &p.dst.addr;
    let link_scoped = (d[0] == 0xfe && d[1] & 0xc0 == 0x80) || (d[0] == 0xff && d[1] == 0x02);
    p.v6 && link_scoped && is_icmp(p) && matches!(load_any::<u8>(ctx, p.l4), Some(ND_FIRST..=ND_LAST))
}

/// ICMP echo (request, reply) types of the packet's family.
#[inline(always)]
pub fn echo_types(p: &Packet) -> (u8, u8) {
    if p.v6 {
        (128, 129)
    } else {
        (8, 0)
    }
}

/// An ICMP error (which quotes the packet it is about).
#[inline(always)]
pub fn is_icmp_error(p: &Packet, icmp_type: u8) -> bool {
    if p.v6 {
        (1..=4).contains(&icmp_type)
    } else {
        matches!(icmp_type, 3..=5 | 11 | 12)
    }
}

/// The flow an ICMP error quotes, as its packet was sent: the protocol,
/// the quoted destination and both ports. Only flows with ports. (Toward
/// a pod, the pod's own packet: `sport` the pod's port, `dst` its peer;
/// from a pod, a client's packet to it: `sport` the client's port.)
pub struct Quoted {
    pub proto: u8,
    pub dst: IpKey,
    pub sport: u16,
    pub dport: u16,
}

/// The flow the ICMP error `p` quotes (`p.l4` its ICMP header).
#[inline(always)]
pub fn quoted_flow<C: Frame>(ctx: &C, p: &Packet) -> Option<Quoted> {
    let inner = p.l4 + ICMP_HLEN;
    let (proto, dst, ports_at) = if p.v6 {
        let dst = load::<[u8; 16]>(ctx, inner + IP6_DADDR)?;
        (byte(ctx, inner + IP6_NEXT)?, IpKey::v6(dst), inner + IP6_HLEN)
    } else {
        let ver_ihl = byte(ctx, inner + IP4_VER_IHL)?;
        let dst = load::<[u8; 4]>(ctx, inner + IP4_DADDR)?;
        (
            byte(ctx, inner + IP4_PROTO)?,
            IpKey::v4(dst),
            inner + ((ver_ihl & 0x0f) as usize) * 4,
        )
    };
    if !has_ports(proto) {
        return None;
    }
    Some(Quoted {
        proto,
        dst,
        sport: be16(ctx, ports_at + L4_SPORT)?,
        dport: be16(ctx, ports_at + L4_DPORT)?,
    })
}

/// The "ports" a flow is known by: TCP/UDP/SCTP ports, or for ICMP echo the
/// identifier as the local end and 0. `None` when there is nothing to key on.
#[inline(always)]
pub fn flow_ports<C: Frame>(ctx: &C, p: &Packet, request: bool) -> Option<(u16, u16)> {
    if let Some(ports) = ports(ctx, p) {
        return Some(ports);
    }
    if is_icmp(p) {
        let (req, reply) = echo_types(p);
        let h: [u8; ICMP_HLEN] = load(ctx, p.l4)?;
        if h[ICMP_TYPE] == if request { req } else { reply } {
            let id = u16::from_be_bytes([h[ICMP_ECHO_ID], h[ICMP_ECHO_ID + 1]]);
            return Some(if request { (id, 0) } else { (0, id) });
        }
    }
    None
}

/// Multicast, broadcast or link-local: never routed on, so never a reason
/// to translate (neighbour discovery, DHCP, mDNS).
#[inline(always)]
pub fn is_link_scope(ip: &IpKey) -> bool {
    let w = ip.words()[0];
    let (a0, a1) = (byte_of(w, 0), byte_of(w, 1));
    if ip.family == cozy_proxy_common::FAMILY_V4 {
        (a0 & 0xf0) == 0xe0 || (a0 == 169 && a1 == 254) || w == u32::MAX
    } else {
        a0 == 0xff || cozy_proxy_common::prefilter::v6_link_local(w)
    }
}
