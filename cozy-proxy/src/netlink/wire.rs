//! Encoding and decoding of netlink messages and attributes (TLVs), for
//! nfnetlink (nf_tables) and rtnetlink alike.
//!
//! nf_tables integers in attributes are big-endian; the netlink headers and
//! rtnetlink attributes are in host order.
//!
//! Constants come from `libc`; the few it lacks are from <linux/netlink.h>
//! (NLMSGERR_ATTR_MSG, the header length) and <linux/netfilter/nf_tables.h>
//! (NFTA_DATA_VALUE).

pub const NLA_F_NESTED: u16 = libc::NLA_F_NESTED as u16;
pub const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;
pub const NLM_F_MULTI: u16 = libc::NLM_F_MULTI as u16;
pub const NLM_F_ACK: u16 = libc::NLM_F_ACK as u16;
pub const NLM_F_DUMP: u16 = libc::NLM_F_DUMP as u16;
pub const NLM_F_CREATE: u16 = libc::NLM_F_CREATE as u16;
pub const NLM_F_EXCL: u16 = libc::NLM_F_EXCL as u16;
pub const NLM_F_APPEND: u16 = libc::NLM_F_APPEND as u16;
pub const NLM_F_CAPPED: u16 = libc::NLM_F_CAPPED as u16;
pub const NLM_F_ACK_TLVS: u16 = libc::NLM_F_ACK_TLVS as u16;
/// A dump's answer was interrupted by a change: its content may be
/// inconsistent.
pub const NLM_F_DUMP_INTR: u16 = libc::NLM_F_DUMP_INTR as u16;
pub const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
pub const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
pub const NLMSGERR_ATTR_MSG: u16 = 1;
/// nf_tables' data attribute inside value nests.
const NFTA_DATA_VALUE: u16 = 1;

pub const NLMSG_HDRLEN: usize = 16;

pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// An address as netlink carries it: 4 or 16 bytes, network order.
pub fn ip_bytes(ip: &std::net::IpAddr) -> Vec<u8> {
    match ip {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Writes netlink messages into one buffer (a batch, or one request).
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Writer::default()
    }

    pub fn with_capacity(bytes: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(bytes),
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Appends one message: nlmsghdr, the family header `header` (nfgenmsg,
    /// rtmsg, ...), then what `body` writes. `msg_type` is the full netlink
    /// type (for nfnetlink: subsystem << 8 | message).
    pub fn message(
        &mut self,
        msg_type: u16,
        flags: u16,
        seq: u32,
        header: &[u8],
        body: impl FnOnce(&mut Writer),
    ) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched below
        self.buf.extend_from_slice(&msg_type.to_ne_bytes());
        self.buf
            .extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
        self.buf.extend_from_slice(header);
        self.buf.resize(align4(self.buf.len()), 0);
        body(self);
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    pub fn put(&mut self, attr_type: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&attr_type.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// A big-endian u32 (nf_tables attributes).
    pub fn put_u32(&mut self, attr_type: u16, value: u32) {
        self.put(attr_type, &value.to_be_bytes());
    }

    /// A host-order u32 (rtnetlink attributes).
    pub fn put_u32_ne(&mut self, attr_type: u16, value: u32) {
        self.put(attr_type, &value.to_ne_bytes());
    }

    pub fn put_str(&mut self, attr_type: u16, value: &str) {
        let mut data = Vec::with_capacity(value.len() + 1);
        data.extend_from_slice(value.as_bytes());
        data.push(0);
        self.put(attr_type, &data);
    }

    /// A nested attribute holding what `body` writes.
    pub fn nest(&mut self, attr_type: u16, body: impl FnOnce(&mut Writer)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(attr_type | NLA_F_NESTED).to_ne_bytes());
        body(self);
        let len = self.buf.len() - start;
        self.buf[start..start + 2].copy_from_slice(&(len as u16).to_ne_bytes());
    }

    /// `NFTA_DATA_VALUE` inside a nest of type `attr_type`.
    pub fn put_data(&mut self, attr_type: u16, value: &[u8]) {
        self.nest(attr_type, |w| w.put(NFTA_DATA_VALUE, value));
    }
}

/// One decoded netlink message.
#[derive(Debug)]
pub struct Message<'a> {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    /// The port of the socket the message is from or about: in a
    /// notification, the port that made the change (0: the kernel).
    pub pid: u32,
    /// Everything after the nlmsghdr.
    pub payload: &'a [u8],
}

/// Splits a buffer received from the kernel into messages. Stops at the first
/// malformed header (never reads out of bounds).
pub fn messages(mut buf: &[u8]) -> impl Iterator<Item = Message<'_>> {
    std::iter::from_fn(move || {
        if buf.len() < NLMSG_HDRLEN {
            return None;
        }
        let len = u32::from_ne_bytes(buf[0..4].try_into().ok()?) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        let msg = Message {
            msg_type: u16::from_ne_bytes(buf[4..6].try_into().ok()?),
            flags: u16::from_ne_bytes(buf[6..8].try_into().ok()?),
            seq: u32::from_ne_bytes(buf[8..12].try_into().ok()?),
            pid: u32::from_ne_bytes(buf[12..16].try_into().ok()?),
            payload: &buf[NLMSG_HDRLEN..len],
        };
        buf = &buf[align4(len).min(buf.len())..];
        Some(msg)
    })
}

/// Iterates the attributes in `buf`, yielding `(type without flags, data)`.
pub fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let attr_type = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let data = &buf[4..len];
        buf = &buf[align4(len).min(buf.len())..];
        Some((attr_type, data))
    })
}

/// The first attribute of `attr_type` in `buf`.
pub fn attr(buf: &[u8], attr_type: u16) -> Option<&[u8]> {
    attrs(buf).find(|(t, _)| *t == attr_type).map(|(_, d)| d)
}

pub fn attr_u32(buf: &[u8], attr_type: u16) -> Option<u32> {
    attr(buf, attr_type)
        .and_then(|d| d.try_into().ok())
        .map(u32::from_be_bytes)
}

pub fn attr_u64(buf: &[u8], attr_type: u16) -> Option<u64> {
    attr(buf, attr_type)
        .and_then(|d| d.try_into().ok())
        .map(u64::from_be_bytes)
}

pub fn attr_str(buf: &[u8], attr_type: u16) -> Option<String> {
    attr(buf, attr_type).map(|d| {
        let end = d.iter().position(|&b| b == 0).unwrap_or(d.len());
        String::from_utf8_lossy(&d[..end]).into_owned()
    })
}

/// The bytes of `NFTA_DATA_VALUE` inside the nest `attr_type`.
pub fn attr_data(buf: &[u8], attr_type: u16) -> Option<&[u8]> {
    attr(buf, attr_type).and_then(|nest| attr(nest, NFTA_DATA_VALUE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_round_trip() {
        let mut w = Writer::new();
        w.message(0x0a00 | 3, 0, 7, &[2, 0, 0, 0], |w| {
            w.put_str(1, "cozy_proxy");
            w.nest(2, |w| {
                w.put_u32(1, 0xdead_beef);
                w.put_data(3, &[1, 2, 3]);
            });
        });
        let bytes = w.into_bytes();
        let msgs: Vec<_> = messages(&bytes).collect();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].seq, 7);
        let body = &msgs[0].payload[4..];
        assert_eq!(attr_str(body, 1).as_deref(), Some("cozy_proxy"));
        let nest = attr(body, 2).expect("nest");
        assert_eq!(attr_u32(nest, 1), Some(0xdead_beef));
        assert_eq!(attr_data(nest, 3), Some(&[1u8, 2, 3][..]));
    }

    #[test]
    fn truncated_input_is_not_read_past_its_end() {
        let mut w = Writer::new();
        w.message(1, 0, 1, &[2, 0, 0, 0], |w| w.put_str(1, "abcdef"));
        let bytes = w.into_bytes();
        for cut in 0..bytes.len() {
            // Must not panic; a cut message is simply not yielded.
            let n = messages(&bytes[..cut]).count();
            assert_eq!(n, 0, "cut at {cut}");
        }
        // A lying attribute length inside a message stops the attribute walk.
        let bad = [8u8, 0, 1, 0, b'a', b'b'];
        assert_eq!(attrs(&bad).count(), 0);
    }
}
