//! Reading headers with bounds-checked loads (`bpf_skb_load_bytes`): a
//! truncated or malformed packet yields `None`, never an out-of-bounds read.
use crate::hdr::*;
use aya_ebpf::programs::TcContext;
use cozy_proxy_common::IpKey;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

/// IPv6 extension headers walked at most (hop-by-hop, routing, fragment,
/// destination options): a bound the verifier can see.
const MAX_EXT_HEADERS: usize = 4;

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

#[inline(always)]
fn be16(ctx: &TcContext, off: usize) -> Option<u16> {
    ctx.load::<u16>(off).ok().map(u16::from_be)
}

#[inline(always)]
pub fn byte(ctx: &TcContext, off: usize) -> Option<u8> {
    ctx.load::<u8>(off).ok()
}

/// Port (or ICMP identifier) at `off`, host order.
#[inline(always)]
pub fn port(ctx: &TcContext, off: usize) -> Option<u16> {
    be16(ctx, off)
}

#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Packet> {
    let mut l3 = ETH_HLEN;
    let mut ether = be16(ctx, ETH_TYPE)?;
    // One VLAN tag in the frame (when not offloaded to skb metadata).
    if ether == ETH_P_8021Q || ether == ETH_P_8021AD {
        ether = be16(ctx, VLAN_INNER_TYPE)?;
        l3 += VLAN_HLEN;
    }
    match ether {
        ETH_P_IP => parse_v4(ctx, l3),
        ETH_P_IPV6 => parse_v6(ctx, l3),
        _ => None,
    }
}

#[inline(always)]
fn parse_v4(ctx: &TcContext, l3: usize) -> Option<Packet> {
    let ver_ihl = byte(ctx, l3 + IP4_VER_IHL)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < IP4_MIN_HLEN {
        return None;
    }
    let frag = be16(ctx, l3 + IP4_FRAG)?;
    let more = frag & IP4_MF != 0;
    let offset = frag & IP4_OFFSET;
    let src: [u8; 4] = ctx.load(l3 + IP4_SADDR).ok()?;
    let dst: [u8; 4] = ctx.load(l3 + IP4_DADDR).ok()?;
    Some(Packet {
        l3,
        v6: false,
        proto: byte(ctx, l3 + IP4_PROTO)?,
        l4: l3 + ihl,
        fragment: more || offset != 0,
        later_fragment: offset != 0,
        frag_id: be16(ctx, l3 + IP4_ID)? as u32,
        src: IpKey::v4(src),
        dst: IpKey::v4(dst),
    })
}

#[inline(always)]
fn parse_v6(ctx: &TcContext, l3: usize) -> Option<Packet> {
    if byte(ctx, l3)? >> 4 != 6 {
        return None;
    }
    let src: [u8; 16] = ctx.load(l3 + IP6_SADDR).ok()?;
    let dst: [u8; 16] = ctx.load(l3 + IP6_DADDR).ok()?;
    let mut next = byte(ctx, l3 + IP6_NEXT)?;
    let mut off = l3 + IP6_HLEN;
    let mut fragment = false;
    let mut later_fragment = false;
    let mut frag_id = 0u32;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            NEXT_HOP_BY_HOP | NEXT_ROUTING | NEXT_DEST_OPTS => {
                let len = (byte(ctx, off + EXT_LEN)? as usize + 1) * EXT_UNIT;
                next = byte(ctx, off + EXT_NEXT)?;
                off += len;
            }
            NEXT_FRAGMENT => {
                let field = be16(ctx, off + FRAG6_OFFSET)?;
                fragment = true;
                later_fragment = field & FRAG6_OFFSET_MASK != 0;
                frag_id = u32::from_be(ctx.load::<u32>(off + FRAG6_ID).ok()?);
                next = byte(ctx, off + EXT_NEXT)?;
                off += FRAG6_HLEN;
            }
            _ => break,
        }
    }
    Some(Packet {
        l3,
        v6: true,
        proto: next,
        l4: off,
        fragment,
        later_fragment,
        frag_id,
        src: IpKey::v6(src),
        dst: IpKey::v6(dst),
    })
}

/// ICMPv6 neighbour discovery (133-137): never translated.
#[inline(always)]
pub fn is_neighbour_discovery(ctx: &TcContext, p: &Packet) -> bool {
    p.v6 && p.proto == PROTO_ICMPV6
        && !p.later_fragment
        && matches!(byte(ctx, p.l4 + ICMP_TYPE), Some(133..=137))
}
