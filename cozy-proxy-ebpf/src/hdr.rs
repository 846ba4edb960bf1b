//! Header layouts the programs read and write, as named offsets (Cilium's
//! `offsetof(struct iphdr, saddr)`, the `network-types` crate's fields):
//! each from the start of its own header. Values are the wire formats of
//! RFC 791 (IPv4), RFC 8200 (IPv6), RFC 793/768 (TCP/UDP), RFC 792/4443
//! (ICMP/ICMPv6) and IEEE 802.1Q.

/// Ethernet: destination, source, EtherType.
pub const ETH_HLEN: usize = 14;
pub const ETH_DST: usize = 0;
pub const ETH_SRC: usize = 6;
pub const ETH_TYPE: usize = 12;
/// An 802.1Q/802.1ad tag: 4 bytes after the addresses; the inner EtherType
/// follows its TCI.
pub const VLAN_HLEN: usize = 4;
pub const VLAN_INNER_TYPE: usize = ETH_TYPE + VLAN_HLEN;

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;

/// IPv4 header fields.
pub const IP4_VER_IHL: usize = 0;
pub const IP4_ID: usize = 4;
pub const IP4_FRAG: usize = 6;
pub const IP4_TTL: usize = 8;
pub const IP4_PROTO: usize = 9;
pub const IP4_CSUM: usize = 10;
pub const IP4_SADDR: usize = 12;
pub const IP4_DADDR: usize = 16;
pub const IP4_MIN_HLEN: usize = 20;
/// Flags and offset in IP4_FRAG: more fragments, and the offset bits.
pub const IP4_MF: u16 = 0x2000;
pub const IP4_OFFSET: u16 = 0x1fff;

/// IPv6 header fields.
pub const IP6_NEXT: usize = 6;
pub const IP6_HOP_LIMIT: usize = 7;
pub const IP6_SADDR: usize = 8;
pub const IP6_DADDR: usize = 24;
pub const IP6_HLEN: usize = 40;
/// IPv6 extension headers: next header and length (in 8-byte units, not
/// counting the first 8) of hop-by-hop, routing and destination options.
pub const EXT_NEXT: usize = 0;
pub const EXT_LEN: usize = 1;
pub const EXT_UNIT: usize = 8;
pub const NEXT_HOP_BY_HOP: u8 = 0;
pub const NEXT_ROUTING: u8 = 43;
pub const NEXT_FRAGMENT: u8 = 44;
pub const NEXT_DEST_OPTS: u8 = 60;
/// The fragment header: offset (13 bits) and flags, identification.
pub const FRAG6_OFFSET: usize = 2;
pub const FRAG6_ID: usize = 4;
pub const FRAG6_HLEN: usize = 8;
pub const FRAG6_OFFSET_MASK: u16 = 0xfff8;

/// Ports (TCP, UDP, SCTP alike), and the checksums the pseudo-header feeds.
pub const L4_SPORT: usize = 0;
pub const L4_DPORT: usize = 2;
pub const TCP_CSUM: usize = 16;
pub const TCP_FLAGS: usize = 13;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;
pub const UDP_CSUM: usize = 6;

/// ICMP and ICMPv6: type, checksum, echo identifier; an error quotes the
/// offending packet after its 8-byte header.
pub const ICMP_TYPE: usize = 0;
pub const ICMP_CSUM: usize = 2;
pub const ICMP_ECHO_ID: usize = 4;
pub const ICMP_HLEN: usize = 8;
/// ICMPv6 neighbour discovery: router solicitation .. redirect.
pub const ND_FIRST: u8 = 133;
pub const ND_LAST: u8 = 137;
/// A neighbour advertisement, and the address it claims (its target).
pub const ND_ADVERT: u8 = 136;
pub const ND_TARGET: usize = 8;

/// ARP (RFC 826) for IPv4 over Ethernet: hardware type 1, protocol type
/// 0x0800, address lengths 6 and 4 (its first six bytes); the sender's
/// IPv4 address, the one it claims, at 14.
pub const ARP_ETHERNET_IPV4: [u8; 6] = [0, 1, 8, 0, 6, 4];
pub const ARP_SENDER_ADDR: usize = 14;
