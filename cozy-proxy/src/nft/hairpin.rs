//! The one nftables rule a node the eBPF programs serve needs: the
//! masquerade of in-cluster clients' hairpins (docs/traffic.md). The
//! programs translate such a flow statelessly and mark it
//! ([`HAIRPIN_MARK`]) where it leaves by the interface it came in on
//! (Kube-OVN's `ovn0`); the kernel's source NAT, which keeps the port
//! bindings of every masqueraded flow in conntrack, does the rest. Table
//! `inet cozy_proxy`, chain `hairpin_masq`: the eBPF backend's own, which
//! the nft backend (tables `ip`, `ip6` and `bridge cozy_proxy`) never
//! touches.
use super::encode::{cleanup_batch, sync_batch};
use super::error::NftError;
use super::schema::{hairpin_masq, Table};
use super::sys::NFPROTO_INET;
use super::{install_of, read};
use crate::datapath::{Change, StateDiff};
use crate::netlink::NlSocket;
pub use cozy_proxy_common::HAIRPIN_MARK;

const MARK: &[u8] = b"cozy-proxy ebpf hairpin 1";

pub fn table() -> Table {
    Table {
        nfproto: NFPROTO_INET,
        family: "inet",
        mark: MARK,
        sets: Vec::new(),
        chains: vec![hairpin_masq()],
    }
}

/// Installs the table, or repairs it (another version, its rule changed
/// by hand); `true` if it had to.
pub fn ensure(sock: &NlSocket) -> Result<bool, NftError> {
    let t = table();
    let how = install_of(&t, read::check_table(sock, &t)?);
    if how == super::encode::Install::Nothing {
        return Ok(false);
    }
    sync_batch(
        &[(t, how)],
        &StateDiff::default(),
        &Change::default(),
        false,
    )
    .apply(sock)?;
    Ok(true)
}

/// Is the table there?
pub fn present(sock: &NlSocket) -> Result<bool, NftError> {
    Ok(read::our_table(sock, NFPROTO_INET)?.is_some())
}

/// Removes the table, if it is there.
pub fn remove(sock: &NlSocket) -> Result<(), NftError> {
    if present(sock)? {
        cleanup_batch(&[table()]).apply(sock)?;
    }
    Ok(())
}
