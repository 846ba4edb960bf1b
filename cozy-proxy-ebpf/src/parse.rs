//! Reading headers with bounds-checked loads (`bpf_skb_load_bytes`): a
//! truncated or malformed packet yields `None`, never an out-of-bounds read.
use aya_ebpf::programs::TcContext;
use cozy_proxy_common::IpKey;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const ETH_HLEN: usize = 14;

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
    let mut ether = be16(ctx, 12)?;
    // One VLAN tag in the frame (when not offloaded to skb metadata).
    if ether == ETH_P_8021Q || ether == ETH_P_8021AD {
        ether = be16(ctx, 16)?;
        l3 += 4;
    }
    match ether {
        ETH_P_IP => parse_v4(ctx, l3),
        ETH_P_IPV6 => parse_v6(ctx, l3),
        _ => None,
    }
}

#[inline(always)]
fn parse_v4(ctx: &TcContext, l3: usize) -> Option<Packet> {
    let ver_ihl = byte(ctx, l3)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < 20 {
        return None;
    }
    let frag = be16(ctx, l3 + 6)?;
    let more = frag & 0x2000 != 0;
    let offset = frag & 0x1fff;
    let src: [u8; 4] = ctx.load(l3 + 12).ok()?;
    let dst: [u8; 4] = ctx.load(l3 + 16).ok()?;
    Some(Packet {
        l3,
        v6: false,
        proto: byte(ctx, l3 + 9)?,
        l4: l3 + ihl,
        fragment: more || offset != 0,
        later_fragment: offset != 0,
        frag_id: be16(ctx, l3 + 4)? as u32,
        src: IpKey::v4(src),
        dst: IpKey::v4(dst),
    })
}

#[inline(always)]
fn parse_v6(ctx: &TcContext, l3: usize) -> Option<Packet> {
    if byte(ctx, l3)? >> 4 != 6 {
        return None;
    }
    let src: [u8; 16] = ctx.load(l3 + 8).ok()?;
    let dst: [u8; 16] = ctx.load(l3 + 24).ok()?;
    let mut next = byte(ctx, l3 + 6)?;
    let mut off = l3 + 40;
    let mut fragment = false;
    let mut later_fragment = false;
    let mut frag_id = 0u32;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            // Hop-by-hop, routing, destination options: length in 8-byte
            // units, not counting the first 8 bytes.
            0 | 43 | 60 => {
                let len = (byte(ctx, off + 1)? as usize + 1) * 8;
                next = byte(ctx, off)?;
                off += len;
            }
            44 => {
                let field = be16(ctx, off + 2)?;
                fragment = true;
                later_fragment = field & 0xfff8 != 0;
                frag_id = u32::from_be(ctx.load::<u32>(off + 4).ok()?);
                next = byte(ctx, off)?;
                off += 8;
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
        && matches!(byte(ctx, p.l4), Some(133..=137))
}
