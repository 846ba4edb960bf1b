//! The `netdev` generic-netlink family (Linux 6.3 and later): what each
//! interface's driver offers XDP, as `ip`/`ethtool` cannot tell.
//! `NETDEV_A_DEV_XDP_FEATURES` is the kernel's own answer, kept current by
//! the driver: a veth, for one, takes XDP frames (`NDO_XMIT`) only while
//! its peer has an XDP program or GRO on. Constants from
//! <linux/genetlink.h> and <linux/netdev.h>.
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, attrs, Writer, NLM_F_DUMP};
use std::collections::BTreeMap;

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const GENL_HDRLEN: usize = 4;

const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;

/// `NETDEV_XDP_ACT_*`: what a driver offers XDP.
pub mod act {
    /// Native XDP: the driver runs a program on what it receives.
    pub const BASIC: u64 = 1 << 0;
    /// `XDP_REDIRECT` from its own program.
    pub const REDIRECT: u64 = 1 << 1;
    /// It takes frames other interfaces' programs redirect to it.
    pub const NDO_XMIT: u64 = 1 << 2;
}

/// The family id of the `netdev` family.
fn family_id(sock: &NlSocket) -> Result<u16, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    w.message(
        GENL_ID_CTRL,
        NLM_F_DUMP,
        seq,
        &[CTRL_CMD_GETFAMILY, 1, 0, 0],
        |_| {},
    );
    let answers = sock.dump(&w.into_bytes(), seq, "generic netlink families")?;
    answers
        .iter()
        .filter_map(|a| a.get(GENL_HDRLEN..))
        .find(|body| attr(body, CTRL_ATTR_FAMILY_NAME) == Some(b"netdev\0".as_slice()))
        .and_then(|body| attr(body, CTRL_ATTR_FAMILY_ID))
        .and_then(|id| <[u8; 2]>::try_from(id).ok())
        .map(u16::from_ne_bytes)
        .ok_or_else(|| NetlinkError::Missing("the netdev generic netlink family".into()))
}

/// Every interface's XDP features (`act` bits), by interface index. On a
/// kernel without the family, an error.
pub fn xdp_features(sock: &NlSocket) -> Result<BTreeMap<u32, u64>, NetlinkError> {
    let family = family_id(sock)?;
    let seq = next_seq();
    let mut w = Writer::new();
    w.message(
        family,
        NLM_F_DUMP,
        seq,
        &[NETDEV_CMD_DEV_GET, 1, 0, 0],
        |_| {},
    );
    let answers = sock.dump(&w.into_bytes(), seq, "netdev devices")?;
    let mut out = BTreeMap::new();
    for body in answers.iter().filter_map(|a| a.get(GENL_HDRLEN..)) {
        let mut index = None;
        let mut features = 0;
        for (t, data) in attrs(body) {
            match t {
                NETDEV_A_DEV_IFINDEX => {
                    index = <[u8; 4]>::try_from(data).ok().map(u32::from_ne_bytes)
                }
                NETDEV_A_DEV_XDP_FEATURES => {
                    features = <[u8; 8]>::try_from(data).ok().map_or(0, u64::from_ne_bytes)
                }
                _ => {}
            }
        }
        if let Some(index) = index {
            out.insert(index, features);
        }
    }
    Ok(out)
}
