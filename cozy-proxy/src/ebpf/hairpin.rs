//! The masquerade the programs ask for with [`HAIRPIN_MARK`] (an
//! in-cluster client's flow translated here that leaves by the interface
//! it came in on: docs/traffic.md): the nft table `inet cozy_proxy`
//! (`nft/hairpin.rs`), put in place when the programs go live and kept
//! there (repaired within a second if someone removes it); removed with
//! the programs. Without it, only those hairpins lose their answers: the
//! programs go on serving everything else, and the node says why.
use crate::netlink::NlSocket;
use crate::nft::{hairpin, NftError};
#[cfg(doc)]
use cozy_proxy_common::HAIRPIN_MARK;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::{info, warn};

/// The table could not be put in place (the metric
/// `cozy_proxy_ebpf_hairpin_masquerade_missing`).
static MISSING: AtomicBool = AtomicBool::new(false);

pub fn missing() -> bool {
    MISSING.load(Ordering::Relaxed)
}

#[derive(Default)]
pub struct HairpinMasq {
    /// NETLINK_NETFILTER, opened on first use.
    sock: Option<NlSocket>,
    /// The last attempt failed (warned once until it works again).
    failing: bool,
}

impl HairpinMasq {
    /// Puts the table in place if it is not (as this version writes it).
    pub fn keep(&mut self) {
        match self.ensure() {
            Ok(installed) => {
                if installed || self.failing {
                    info!("the hairpin masquerade is in place (nft table inet cozy_proxy)");
                }
                self.failing = false;
            }
            Err(e) => {
                if !self.failing {
                    warn!(error = %e, "the hairpin masquerade (nft table inet cozy_proxy) cannot be put in place: in-cluster clients of an LB IP whose flows leave by the interface they came in on (Kube-OVN's ovn0) get no answer; retrying every second");
                }
                self.failing = true;
                self.sock = None;
            }
        }
        MISSING.store(self.failing, Ordering::Relaxed);
    }

    fn ensure(&mut self) -> Result<bool, NftError> {
        let sock = match self.sock.take() {
            Some(s) => s,
            None => NlSocket::open(libc::NETLINK_NETFILTER)?,
        };
        let installed = hairpin::ensure(&sock)?;
        self.sock = Some(sock);
        Ok(installed)
    }
}

/// Removes the table, if it is there.
pub fn remove() -> Result<(), NftError> {
    hairpin::remove(&NlSocket::open(libc::NETLINK_NETFILTER)?)
}

/// Is the table there?
pub fn present() -> bool {
    NlSocket::open(libc::NETLINK_NETFILTER)
        .ok()
        .is_some_and(|s| hairpin::present(&s).unwrap_or(false))
}
