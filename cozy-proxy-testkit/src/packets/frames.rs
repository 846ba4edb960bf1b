//! Building and checking raw Ethernet frames: headers with correct
//! checksums in, an independent checksum check out. The packet tests run
//! them through BPF_PROG_TEST_RUN; the scenarios send them into the
//! namespaces ([`send`]).
use anyhow::{bail, Context, Result};
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;
pub const GRE: u8 = 47;

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    if let [last] = chunks.remainder() {
        acc += (*last as u32) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

pub fn octets(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn pseudo(src: &IpAddr, dst: &IpAddr, proto: u8, len: usize) -> u32 {
    let mut acc = sum16(&octets(src), 0);
    acc = sum16(&octets(dst), acc);
    acc + proto as u32 + len as u32
}

/// What to put in a frame.
#[derive(Clone, Debug)]
pub struct Spec {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    /// ICMP type (echo request by default).
    pub icmp_type: Option<u8>,
    /// TCP flags (SYN by default).
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// IPv4: 4 bytes of options (IHL 6). IPv6: a hop-by-hop header.
    pub options: bool,
    /// An 802.1Q tag in the frame, with `vlan_id` (100 by default).
    pub vlan: bool,
    pub vlan_id: u16,
    /// (identification, offset in bytes, more fragments)
    pub fragment: Option<(u32, u16, bool)>,
    /// IPv4 UDP sent without checksum (0).
    pub udp_no_checksum: bool,
    /// TCP or UDP as a sender with transmit checksum offload hands it to
    /// its veth (`CHECKSUM_PARTIAL`): the checksum field holds only the
    /// pseudo-header's sum, not complemented.
    pub checksum_left_to_offload: bool,
    /// TTL / hop limit.
    pub hop_limit: u8,
    /// Ethernet destination and source.
    pub macs: ([u8; 6], [u8; 6]),
    /// The transport segment as is (no header built, no checksum): for
    /// truncated and malformed headers.
    pub raw_l4: Option<Vec<u8>>,
    /// IPv6: destination options headers of these lengths (bytes, a
    /// multiple of 8), in order, before the upper-layer header; filled
    /// with options a host skips.
    pub dest_opts: Vec<usize>,
}

impl Spec {
    pub fn new(src: IpAddr, dst: IpAddr, proto: u8) -> Spec {
        Spec {
            src,
            dst,
            proto,
            sport: 40000,
            dport: 80,
            icmp_type: None,
            tcp_flags: 0x02,
            payload: b"cozy-proxy test payload".to_vec(),
            options: false,
            vlan: false,
            vlan_id: 100,
            fragment: None,
            udp_no_checksum: false,
            checksum_left_to_offload: false,
            hop_limit: 64,
            macs: ([0x02, 0, 0, 0, 0, 1], [0x02, 0, 0, 0, 0, 2]),
            raw_l4: None,
            dest_opts: Vec::new(),
        }
    }

    pub fn ports(mut self, sport: u16, dport: u16) -> Spec {
        self.sport = sport;
        self.dport = dport;
        self
    }

    fn v6(&self) -> bool {
        self.src.is_ipv6()
    }

    /// The upper-layer segment, checksummed over the real addresses.
    fn l4(&self) -> Vec<u8> {
        if let Some(raw) = &self.raw_l4 {
            return raw.clone();
        }
        let mut seg = match self.proto {
            TCP => {
                let mut h = vec![0u8; 20];
                h[0..2].copy_from_slice(&self.sport.to_be_bytes());
                h[2..4].copy_from_slice(&self.dport.to_be_bytes());
                h[4..8].copy_from_slice(&1u32.to_be_bytes());
                h[12] = 5 << 4;
                h[13] = self.tcp_flags;
                h[14..16].copy_from_slice(&64240u16.to_be_bytes());
                h
            }
            UDP => {
                let mut h = vec![0u8; 8];
                h[0..2].copy_from_slice(&self.sport.to_be_bytes());
                h[2..4].copy_from_slice(&self.dport.to_be_bytes());
                h[4..6].copy_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
                h
            }
            ICMP | ICMPV6 => {
                let default = if self.proto == ICMP { 8 } else { 128 };
                let mut h = vec![self.icmp_type.unwrap_or(default), 0, 0, 0, 0, 0, 0, 1];
                h[4..6].copy_from_slice(&self.sport.to_be_bytes()); // identifier
                h
            }
            _ => Vec::new(),
        };
        seg.extend_from_slice(&self.payload);
        let csum_at = match self.proto {
            TCP => Some(16),
            UDP if !self.udp_no_checksum || self.v6() => Some(6),
            ICMP | ICMPV6 => Some(2),
            _ => None,
        };
        if let Some(at) = csum_at {
            let acc = if self.proto == ICMP {
                sum16(&seg, 0)
            } else {
                sum16(&seg, pseudo(&self.src, &self.dst, self.proto, seg.len()))
            };
            let mut c = fold(acc);
            if self.proto == UDP && c == 0 {
                c = 0xffff;
            }
            if self.checksum_left_to_offload && matches!(self.proto, TCP | UDP) {
                c = !fold(pseudo(&self.src, &self.dst, self.proto, seg.len()));
            }
            seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
        }
        seg
    }

    pub fn build(&self) -> Vec<u8> {
        let mut seg = self.l4();
        if let Some((_, offset, _)) = self.fragment {
            // A later fragment carries payload only.
            if offset > 0 {
                seg = self.payload.clone();
            }
        }
        let mut f = self.macs.0.to_vec();
        f.extend_from_slice(&self.macs.1);
        if self.vlan {
            f.extend_from_slice(&[0x81, 0x00]);
            f.extend_from_slice(&(self.vlan_id & 0x0fff).to_be_bytes());
        }
        if !self.v6() {
            f.extend_from_slice(&[0x08, 0x00]);
            let ihl = if self.options { 6 } else { 5 };
            let mut ip = vec![0u8; ihl * 4];
            ip[0] = 0x40 | ihl as u8;
            ip[2..4].copy_from_slice(&((ihl * 4 + seg.len()) as u16).to_be_bytes());
            if let Some((id, offset, more)) = self.fragment {
                ip[4..6].copy_from_slice(&(id as u16).to_be_bytes());
                let field = (offset / 8) | if more { 0x2000 } else { 0 };
                ip[6..8].copy_from_slice(&field.to_be_bytes());
            }
            ip[8] = self.hop_limit;
            ip[9] = self.proto;
            ip[12..16].copy_from_slice(&octets(&self.src));
            ip[16..20].copy_from_slice(&octets(&self.dst));
            if self.options {
                ip[20..24].copy_from_slice(&[0x01, 0x01, 0x01, 0x00]); // NOPs, EOL
            }
            let c = fold(sum16(&ip, 0));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend_from_slice(&ip);
        } else {
            f.extend_from_slice(&[0x86, 0xdd]);
            let mut ext = Vec::new();
            let mut next = self.proto;
            for len in self.dest_opts.iter().rev() {
                let mut h = dest_options(next, *len);
                h.extend_from_slice(&ext);
                ext = h;
                next = 60;
            }
            if let Some((id, offset, more)) = self.fragment {
                let field = offset | u16::from(more);
                let mut h = vec![next, 0];
                h.extend_from_slice(&field.to_be_bytes());
                h.extend_from_slice(&id.to_be_bytes());
                ext.splice(0..0, h);
                next = 44;
            }
            if self.options {
                let mut h = vec![next, 0, 1, 4, 0, 0, 0, 0]; // PadN
                h.extend_from_slice(&ext);
                ext = h;
                next = 0;
            }
            let mut ip = vec![0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&((ext.len() + seg.len()) as u16).to_be_bytes());
            ip[6] = next;
            ip[7] = self.hop_limit;
            ip[8..24].copy_from_slice(&octets(&self.src));
            ip[24..40].copy_from_slice(&octets(&self.dst));
            f.extend_from_slice(&ip);
            f.extend_from_slice(&ext);
        }
        f.extend_from_slice(&seg);
        f
    }
}

/// A destination options header of `len` bytes (a multiple of 8, at least
/// 8) before `next`: options of an unknown type a host skips (type 0x1e:
/// the two high bits 00), at most 255 bytes each, and padding (the kernel
/// refuses more than 7 bytes of it in a row).
fn dest_options(next: u8, len: usize) -> Vec<u8> {
    let len = len.max(8) / 8 * 8;
    let mut h = vec![next, (len / 8 - 1) as u8];
    let mut left = len - 2;
    while left > 0 {
        match left {
            1 => {
                h.push(0); // Pad1
                left = 0;
            }
            2..=257 => {
                h.extend_from_slice(&[0x1e, (left - 2) as u8]);
                h.resize(h.len() + left - 2, 0xab);
                left = 0;
            }
            _ => {
                // Never leave a single byte behind (that needs Pad1).
                let data = if left - 257 == 1 { 254 } else { 255 };
                h.extend_from_slice(&[0x1e, data as u8]);
                h.resize(h.len() + data, 0xab);
                left -= data + 2;
            }
        }
    }
    h
}

/// A parsed frame: addresses and whether every checksum is right.
#[derive(Debug)]
pub struct Seen {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// The upper-layer protocol (after IPv6 extension headers).
    pub proto: u8,
    /// Part of a fragmented datagram (first or later fragment): its
    /// identification and whether it is a later fragment.
    pub fragment: bool,
    pub frag_id: u32,
    pub later_fragment: bool,
    /// TCP/UDP ports, when the (first) segment holds them.
    pub ports: Option<(u16, u16)>,
    /// ICMP/ICMPv6 type.
    pub icmp_type: Option<u8>,
    /// The IPv4 TTL or the IPv6 hop limit, as received.
    pub hop_limit: u8,
    pub ip_checksum_ok: bool,
    /// None where the packet has no L4 checksum to check (later fragment,
    /// protocol without one, IPv4 UDP without checksum).
    pub l4_checksum_ok: Option<bool>,
    /// The raw L4 checksum field, if any.
    pub l4_checksum: Option<u16>,
    /// An ICMP error's quoted packet (when the quote holds its IP header).
    pub quoted: Option<Quoted>,
}

/// The packet an ICMP error quotes, as far as the quote goes.
#[derive(Debug)]
pub struct Quoted {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// TCP/UDP ports, when the quote holds them.
    pub ports: Option<(u16, u16)>,
    /// The quoted IPv4 header's own checksum (true for IPv6: none).
    pub ip_checksum_ok: bool,
    /// The quoted TCP/UDP checksum over the quoted addresses, if the quote
    /// holds the whole segment (a quote of a short datagram does).
    pub l4_checksum_ok: Option<bool>,
}

/// The quoted packet of an ICMP(v6) error segment `seg`.
fn quoted(seg: &[u8], v6: bool) -> Option<Quoted> {
    let t = *seg.first()?;
    let is_error = if v6 {
        (1..=4).contains(&t)
    } else {
        matches!(t, 3..=5 | 11 | 12)
    };
    if !is_error {
        return None;
    }
    let inner = seg.get(8..)?;
    if !v6 {
        let ihl = ((inner.first()? & 0x0f) as usize) * 4;
        if ihl < 20 {
            return None;
        }
        let ip = inner.get(..ihl)?;
        let src = IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?);
        let dst = IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?);
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        let l4 = &inner[ihl..];
        let whole = total == inner.len();
        Some(Quoted {
            src,
            dst,
            proto: ip[9],
            ports: ports(ip[9], l4, false),
            ip_checksum_ok: fold(sum16(ip, 0)) == 0,
            l4_checksum_ok: whole
                .then(|| l4_check(ip[9], &src, &dst, l4, false).0)
                .flatten(),
        })
    } else {
        let ip = inner.get(..40)?;
        let src = IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
        let dst = IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?);
        let l4 = &inner[40..];
        let whole = u16::from_be_bytes([ip[4], ip[5]]) as usize == l4.len();
        Some(Quoted {
            src,
            dst,
            proto: ip[6],
            ports: ports(ip[6], l4, false),
            ip_checksum_ok: true,
            l4_checksum_ok: whole
                .then(|| l4_check(ip[6], &src, &dst, l4, false).0)
                .flatten(),
        })
    }
}

/// Parses a frame built by [`Spec`] (or one the programs rewrote).
/// Panics on a frame it cannot read: for tests that built it.
pub fn inspect(f: &[u8]) -> Seen {
    parse(f).expect("a readable IPv4 or IPv6 frame")
}

/// Parses any frame, `None` where it is not a readable IPv4/IPv6 packet
/// (for the fuzzer, which feeds the programs anything).
pub fn parse(f: &[u8]) -> Option<Seen> {
    let mut l3 = 14;
    if f.get(12..14)? == [0x81, 0x00] {
        l3 += 4;
    }
    let ether = u16::from_be_bytes([*f.get(l3 - 2)?, *f.get(l3 - 1)?]);
    if ether == 0x0800 {
        let ihl = ((f.get(l3)? & 0x0f) as usize) * 4;
        if ihl < 20 || f[l3] >> 4 != 4 {
            return None;
        }
        let ip = f.get(l3..l3 + ihl)?;
        let src = IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?);
        let dst = IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?);
        let frag = u16::from_be_bytes([ip[6], ip[7]]);
        let later = frag & 0x1fff != 0;
        let proto = ip[9];
        let seg = &f[l3 + ihl..];
        let (ok, raw) = l4_check(proto, &src, &dst, seg, later);
        Some(Seen {
            src,
            dst,
            proto,
            fragment: frag & 0x3fff != 0,
            frag_id: u16::from_be_bytes([ip[4], ip[5]]) as u32,
            later_fragment: later,
            ports: ports(proto, seg, later),
            icmp_type: icmp_type(proto, seg, later),
            hop_limit: ip[8],
            ip_checksum_ok: fold(sum16(ip, 0)) == 0,
            l4_checksum_ok: ok,
            l4_checksum: raw,
            quoted: (proto == ICMP && !later)
                .then(|| quoted(seg, false))
                .flatten(),
        })
    } else if ether == 0x86dd {
        let ip = f.get(l3..l3 + 40)?;
        if ip[0] >> 4 != 6 {
            return None;
        }
        let src = IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
        let dst = IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?);
        let mut next = ip[6];
        let mut off = l3 + 40;
        let (mut later, mut fragment, mut frag_id) = (false, false, 0);
        loop {
            match next {
                0 | 43 | 60 => {
                    next = *f.get(off)?;
                    off += (*f.get(off + 1)? as usize + 1) * 8;
                }
                44 => {
                    let field = u16::from_be_bytes([*f.get(off + 2)?, *f.get(off + 3)?]);
                    later = field & 0xfff8 != 0;
                    fragment = true;
                    let id = f.get(off + 4..off + 8)?;
                    frag_id = u32::from_be_bytes([id[0], id[1], id[2], id[3]]);
                    next = *f.get(off)?;
                    off += 8;
                }
                _ => break,
            }
        }
        let seg = f.get(off..)?;
        let (ok, raw) = l4_check(next, &src, &dst, seg, later);
        Some(Seen {
            src,
            dst,
            proto: next,
            fragment,
            frag_id,
            later_fragment: later,
            ports: ports(next, seg, later),
            icmp_type: icmp_type(next, seg, later),
            hop_limit: ip[7],
            ip_checksum_ok: true,
            l4_checksum_ok: ok,
            l4_checksum: raw,
            quoted: (next == ICMPV6 && !later)
                .then(|| quoted(seg, true))
                .flatten(),
        })
    } else {
        None
    }
}

/// The source and destination addresses a frame's fixed IP header holds,
/// as far as the frame goes (whatever the rest of it).
pub fn addresses(f: &[u8]) -> Vec<IpAddr> {
    let l3 = if f.get(12..14) == Some(&[0x81, 0x00][..]) {
        18
    } else {
        14
    };
    let (at, len) = match f.get(l3 - 2..l3) {
        Some([0x08, 0x00]) => (l3 + 12, 4),
        Some([0x86, 0xdd]) => (l3 + 8, 16),
        _ => return Vec::new(),
    };
    [at, at + len]
        .iter()
        .filter_map(|&a| f.get(a..a + len))
        .filter_map(|b| match len {
            4 => <[u8; 4]>::try_from(b).ok().map(IpAddr::from),
            _ => <[u8; 16]>::try_from(b).ok().map(IpAddr::from),
        })
        .collect()
}

/// TCP/UDP (source, destination) ports, where the segment holds them.
fn ports(proto: u8, seg: &[u8], later: bool) -> Option<(u16, u16)> {
    if later || !matches!(proto, TCP | UDP) {
        return None;
    }
    let p = seg.get(..4)?;
    Some((
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    ))
}

fn icmp_type(proto: u8, seg: &[u8], later: bool) -> Option<u8> {
    if later || !matches!(proto, ICMP | ICMPV6) {
        return None;
    }
    seg.first().copied()
}

fn l4_check(
    proto: u8,
    src: &IpAddr,
    dst: &IpAddr,
    seg: &[u8],
    later: bool,
) -> (Option<bool>, Option<u16>) {
    if later {
        return (None, None);
    }
    // ICMP belongs to IPv4 and ICMPv6 to IPv6: either in the other family
    // is an unknown protocol, with nothing a translator must keep.
    let at = match proto {
        TCP => 16,
        UDP => 6,
        ICMP if src.is_ipv4() => 2,
        ICMPV6 if src.is_ipv6() => 2,
        _ => return (None, None),
    };
    let Some(b) = seg.get(at..at + 2) else {
        return (None, None);
    };
    let raw = u16::from_be_bytes([b[0], b[1]]);
    if proto == UDP && src.is_ipv4() && raw == 0 {
        return (None, Some(0));
    }
    let acc = if proto == ICMP {
        sum16(seg, 0)
    } else {
        sum16(seg, pseudo(src, dst, proto, seg.len()))
    };
    (Some(fold(acc) == 0), Some(raw))
}

/// A broadcast ARP request (Ethernet, IPv4) from `mac`, naming `sender` as
/// its own address and asking for `target`: whoever hears it takes
/// `sender` to be at `mac`.
pub fn arp_request(mac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend(mac);
    f.extend([0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend(mac);
    f.extend(sender.octets());
    f.extend([0; 6]);
    f.extend(target.octets());
    f
}

/// An ICMPv6 neighbour solicitation (`icmp_type` 135, its link-layer
/// option the source's) or advertisement (136, the target's; `flags` e.g.
/// 0x2000, override) about `target`, from `src` at `mac` to all nodes.
pub fn neighbour_message(
    mac: [u8; 6],
    src: IpAddr,
    icmp_type: u8,
    flags: u16,
    target: Ipv6Addr,
) -> Vec<u8> {
    let mut spec = Spec::new(
        src,
        IpAddr::V6(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)),
        ICMPV6,
    );
    spec.icmp_type = Some(icmp_type);
    // The flags, where the builder puts its identifier.
    spec.sport = flags;
    spec.hop_limit = 255;
    spec.payload = target.octets().to_vec();
    let option = if icmp_type == 136 { 2 } else { 1 };
    spec.payload.extend([option, 1]);
    spec.payload.extend(mac);
    spec.macs = ([0x33, 0x33, 0, 0, 0, 1], mac);
    spec.build()
}

/// The MAC address of `dev` in namespace `ns`.
pub fn mac(ns: &str, dev: &str) -> Result<[u8; 6]> {
    let out = crate::sh::ok_in(ns, &["cat", &format!("/sys/class/net/{dev}/address")])?;
    let bytes: Vec<u8> = out
        .trim()
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC of {dev} in {ns}: {out:?}"))?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("MAC of {dev} in {ns}: {out:?}"))
}

/// Sends `frame` as is out of `dev` in namespace `ns` (an AF_PACKET raw
/// socket: any source, any header, as a forger would).
pub fn send(ns: &str, dev: &str, frame: &[u8]) -> Result<()> {
    send_all(ns, dev, &[frame.to_vec()]).map(|_| ())
}

/// Runs `send` on a thread in namespace `ns` with an AF_PACKET socket
/// bound to nothing (`vnet_hdr`: with PACKET_VNET_HDR) and `dev`'s index.
fn with_packet_socket<T: Send + 'static>(
    ns: &str,
    dev: &str,
    vnet_hdr: bool,
    send: impl FnOnce(libc::c_int, i32) -> Result<T> + Send + 'static,
) -> Result<T> {
    const PACKET_VNET_HDR: libc::c_int = 15;
    let ns_file = std::fs::File::open(format!("/var/run/netns/{ns}"))?;
    let dev = std::ffi::CString::new(dev)?;
    std::thread::spawn(move || -> Result<T> {
        // SAFETY: setns on this short-lived thread only.
        if unsafe { libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        // SAFETY: plain syscalls on a socket we own and close.
        unsafe {
            let index = libc::if_nametoindex(dev.as_ptr());
            if index == 0 {
                bail!("no interface {dev:?}");
            }
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
            if fd < 0 {
                bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
            }
            let on: libc::c_int = 1;
            if vnet_hdr
                && libc::setsockopt(
                    fd,
                    libc::SOL_PACKET,
                    PACKET_VNET_HDR,
                    &on as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                ) != 0
            {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                bail!("PACKET_VNET_HDR: {e}");
            }
            let out = send(fd, index as i32);
            libc::close(fd);
            out
        }
    })
    .join()
    .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

/// Sends `bytes` on packet socket `fd` out of interface `index`, to the
/// destination MAC `dst`.
fn send_on(fd: libc::c_int, index: i32, dst: &[u8], bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: a zeroed sockaddr_ll, then the fields we set; a buffer valid
    // for its length.
    unsafe {
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = index;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&dst[..6]);
        let n = libc::sendto(
            fd,
            bytes.as_ptr() as *const libc::c_void,
            bytes.len(),
            0,
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Sends every frame of `frames` out of `dev` in `ns`, through one socket;
/// returns how many the kernel took (a frame it refuses, such as one
/// shorter than an Ethernet header, is skipped, not an error).
pub fn send_all(ns: &str, dev: &str, frames: &[Vec<u8>]) -> Result<usize> {
    let frames = frames.to_vec();
    with_packet_socket(ns, dev, false, move |fd, index| {
        let mut sent = 0;
        let mut last_err = None;
        for frame in frames.iter().filter(|f| f.len() >= 14) {
            match send_on(fd, index, frame, frame) {
                Ok(()) => sent += 1,
                Err(e) => last_err = Some(e),
            }
        }
        match last_err {
            Some(e) if sent == 0 => bail!("sendto: {e}"),
            _ => Ok(sent),
        }
    })
}

/// Sends `frame` out of `dev` in `ns` as an skb whose first `linear` bytes
/// only are in its linear data (the rest in pages, as a NIC's receive path
/// or GRO leaves large packets): an AF_PACKET socket with a virtio-net
/// header (PACKET_VNET_HDR) whose `hdr_len` says so. The kernel keeps a
/// packet under a page linear whatever it is asked: `frame` must be larger
/// (and the interface's MTU take it).
pub fn send_paged(ns: &str, dev: &str, frame: &[u8], linear: u16) -> Result<()> {
    // struct virtio_net_hdr: flags, gso_type (none), hdr_len, gso_size,
    // csum_start, csum_offset; little-endian (a packet socket's virtio is
    // the legacy, host-endian one).
    let mut buf = vec![0u8; 10];
    buf[2..4].copy_from_slice(&linear.to_le_bytes());
    buf.extend_from_slice(frame);
    let dst: [u8; 6] = frame.get(..6).context("frame")?.try_into()?;
    with_packet_socket(ns, dev, true, move |fd, index| {
        send_on(fd, index, &dst, &buf).map_err(|e| anyhow::anyhow!("sending a paged frame: {e}"))
    })
}

/// The frames of a pcap file (as `tcpdump -w` writes it, Ethernet).
pub fn read_pcap(path: &std::path::Path) -> Result<Vec<Vec<u8>>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let magic = data.get(..4).context("pcap: no header")?;
    let swap = match magic {
        [0xd4, 0xc3, 0xb2, 0xa1] | [0x4d, 0x3c, 0xb2, 0xa1] => false,
        [0xa1, 0xb2, 0xc3, 0xd4] | [0xa1, 0xb2, 0x3c, 0x4d] => true,
        _ => bail!("{}: not a pcap file", path.display()),
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = data.get(at..at + 4)?.try_into().ok()?;
        Some(if swap {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        })
    };
    let mut frames = Vec::new();
    let mut at = 24;
    while at + 16 <= data.len() {
        let captured = u32_at(at + 8).context("pcap record")? as usize;
        let frame = data
            .get(at + 16..at + 16 + captured)
            .context("pcap: record cut")?;
        frames.push(frame.to_vec());
        at += 16 + captured;
    }
    Ok(frames)
}
