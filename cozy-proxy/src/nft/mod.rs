//! The nftables datapath, spoken directly over netlink (NETLINK_NETFILTER).
//!
//! Why not through `rustables`' types: its message traits are crate-private,
//! so its `Batch` cannot carry what it lacks (maps, concatenated keys,
//! payload writes with checksum flags, inverted lookups, element dumps), and
//! one sync must be one atomic batch. The codec is small
//! ([`crate::netlink`]) and `nft -j list table` checks it independently in
//! the tests.
//!
//! - [`schema`]: the tables, sets, chains and rules;
//! - `read`: reading them back;
//! - `encode`: the pure "what to install + state diff -> batch" function;
//! - this file: the [`Kernel`] the sync layer drives.
mod batch;
#[cfg(test)]
mod describe;
mod encode;
mod error;
mod expr;
pub mod hairpin;
mod ports;
mod read;
pub mod schema;
mod sys;
#[cfg(test)]
mod trace;

use crate::datapath::{
    Applied, BackendKind, Capacity, DatapathState, Desired, Dump, Kernel, Paths, Routes, StateDiff,
};
pub use crate::netlink::NetlinkError;
use crate::netlink::NlSocket;
use crate::steer::Steering;
use encode::Install;
pub use error::{DecodeError, NftError};
use schema::{Table, LAYOUTS, TABLE};
use serde_json::json;
use std::{collections::BTreeSet, net::IpAddr};
use tracing::{debug, info, warn};

pub struct NftKernel {
    sock: NlSocket,
    /// `sock`'s netlink port: the notifications of our own commits carry
    /// it, anyone else's (`nft`, another agent) carry theirs.
    own_port: u32,
    steering: Steering,
    /// nf_tables notifications (NFNLGRP_NFTABLES): changes to our table
    /// by others (`nft flush ruleset`, an nftables.service restart, an
    /// element deleted by hand) are repaired within a second.
    events: NlSocket,
    /// Someone else may have committed while we were out of the group
    /// (see [`QUIET_BATCH`]): the next upkeep reads the table again.
    missed_news: bool,
    /// Where each guarded address was written (see `ports.rs`), as of the
    /// last read and the changes since.
    placed: ports::Placed,
    /// Our tables are kept dormant (a backend switch: the other backend
    /// still serves) until [`NftKernel::wake`].
    standby: bool,
}

/// From this many elements on, a batch is applied out of the notification
/// group: the kernel builds one notification per element for every
/// listener, ours included, which cost about 15% of the CPU of a full sync
/// of 50 000 Services (perf). What we miss meanwhile is told by the
/// ruleset's generation: anything but one commit (ours) between before and
/// after, and the table is read again.
const QUIET_BATCH: usize = 1000;

/// The nf_tables multicast group, as a bind(2) group mask.
const NFNLGRP_NFTABLES_MASK: u32 = 1 << (libc::NFNLGRP_NFTABLES as u32 - 1);

impl NftKernel {
    pub fn new() -> Result<Self, NftError> {
        let sock = NlSocket::open(libc::NETLINK_NETFILTER)?;
        Ok(NftKernel {
            own_port: sock.port()?,
            sock,
            steering: Steering::open()?,
            events: NlSocket::subscribe(libc::NETLINK_NETFILTER, NFNLGRP_NFTABLES_MASK)?,
            missed_news: false,
            placed: ports::Placed::new(),
            standby: false,
        })
    }

    /// A backend switch: from the next sync until [`NftKernel::wake`], our
    /// tables are installed and kept dormant (filled, off their hooks).
    pub fn stand_by(&mut self) {
        self.standby = true;
    }

    /// Standing by (see [`NftKernel::stand_by`])?
    pub fn standing_by(&self) -> bool {
        self.standby
    }

    /// Our tables go on their hooks, in one transaction.
    pub fn wake(&mut self) -> Result<(), NftError> {
        if !self.standby {
            return Ok(());
        }
        encode::wake_batch(&self.present()?).apply(&self.sock)?;
        self.standby = false;
        Ok(())
    }

    /// Is any of our tables there? One lookup per family, nothing read.
    pub fn is_installed(&self) -> Result<bool, NftError> {
        Ok(!self.present()?.is_empty())
    }

    /// Our tables that exist.
    fn present(&self) -> Result<Vec<Table>, NftError> {
        let mut present = Vec::new();
        for t in LAYOUTS.iter().map(|l| l.table()).chain([ports::table()]) {
            if read::our_table(&self.sock, t.nfproto)?.is_some() {
                present.push(t);
            }
        }
        Ok(present)
    }
}

impl NftKernel {
    /// Applies `batch` out of the notification group ([`QUIET_BATCH`]).
    fn apply_quietly(&mut self, batch: batch::Batch) -> Result<(), NftError> {
        let group = libc::NFNLGRP_NFTABLES as u32;
        let before = batch::generation(&self.sock)?;
        self.events.set_membership(group, false)?;
        let applied = batch.apply(&self.sock);
        // Back in the group before anything else can fail.
        let joined = self.events.set_membership(group, true);
        let after = batch::generation(&self.sock);
        let alone = matches!(after, Ok(a) if a == before.wrapping_add(1));
        self.missed_news |= !alone;
        info!(
            alone,
            "a large batch applied out of the nf_tables notification group"
        );
        applied?;
        joined?;
        Ok(())
    }
}

/// Is this nf_tables notification about one of our tables? The table's
/// name is attribute 1 of table, chain, rule, set and element messages
/// alike (NFTA_TABLE_NAME, NFTA_CHAIN_TABLE, NFTA_RULE_TABLE, ...), after
/// the 4-byte nfgenmsg, whose first byte is the family: `inet cozy_proxy`
/// is the eBPF backend's (`hairpin`), which this backend never reads.
fn about_our_table(msg_type: u16, payload: &[u8]) -> bool {
    if msg_type >> 8 != libc::NFNL_SUBSYS_NFTABLES as u16 {
        return false;
    }
    if payload.first() == Some(&sys::NFPROTO_INET) {
        return false;
    }
    crate::netlink::wire::attrs(payload.get(4..).unwrap_or(&[])).any(|(kind, value)| {
        kind & 0x3fff == 1 && value.split(|b| *b == 0).next() == Some(schema::TABLE.as_bytes())
    })
}

/// How a sync installs table `t` found as `found` (`None`: absent):
/// `(current, chains intact)`.
pub(super) fn install_of(t: &Table, found: Option<(bool, bool)>) -> Install {
    match found {
        None => Install::Create,
        Some((false, _)) => {
            warn!(
                family = t.family,
                "table {TABLE} is of another schema version; replacing it atomically"
            );
            Install::Replace
        }
        Some((true, true)) => Install::Nothing,
        Some((true, false)) => {
            warn!(
                family = t.family,
                "chains of {TABLE} were changed; restoring them"
            );
            Install::Rules
        }
    }
}

impl Kernel for NftKernel {
    type Error = NftError;
    /// Per table, what it needs before its elements.
    type Found = Vec<(Table, Install)>;

    fn kind(&self) -> BackendKind {
        BackendKind::Nft
    }

    /// The sizes of the hashed sets (fixed when the table is created).
    fn capacity(&self) -> Capacity {
        schema::set_capacity()
    }

    fn paths(&mut self, pods: &BTreeSet<IpAddr>) -> Result<&Paths, NftError> {
        Ok(self.steering.paths(pods)?)
    }

    fn read(&mut self) -> Result<(DatapathState, Self::Found), NftError> {
        let mut live = DatapathState {
            routes: self.steering.routes()?,
            ..Default::default()
        };
        let mut installs = Vec::new();
        for l in LAYOUTS {
            let t = l.table();
            let found = read::read_table(&self.sock, &l)?;
            let how = install_of(&t, found.as_ref().map(|f| (f.current, f.chains_intact)));
            if let Some(f) = found.filter(|f| f.current) {
                live.merge(f.state);
            }
            installs.push((t, how));
        }
        let bridge = ports::table();
        let how = install_of(&bridge, read::check_table(&self.sock, &bridge)?);
        installs.push((bridge, how));
        self.placed = ports::read_places(&self.sock, &mut live.guard)?;
        Ok((live, installs))
    }

    /// One batch: the schema the read asked for, then the element changes.
    fn apply_routed(
        &mut self,
        diff: &StateDiff,
        _desired: Desired<'_>,
        found: Option<Self::Found>,
        routes: Routes,
    ) -> Result<Applied, NftError> {
        let installs = found.unwrap_or_default();
        let (bridge_of, bridges) = self.steering.bridges()?;
        let place = |entry: u32| ports::Place::of(entry, &bridge_of, &bridges);
        // Updated in place (no copy of every guarded address per change):
        // if the batch fails, the sync reads the kernel again, and with it
        // the places.
        let (ip_guard, at_ports) = ports::plan(&diff.guard, &mut self.placed, place);
        // Routes that go before the tables, those that come after: an LB
        // IP is steered only while its rules exist.
        self.steering.withdraw(&diff.routes)?;
        let mut batch = encode::sync_batch(&installs, diff, &ip_guard, self.standby);
        ports::write(&mut batch, &at_ports);
        debug!(
            messages = batch.message_count(),
            bytes = ?batch.bytes_len(),
            changed = diff.size(),
            "nft batch"
        );
        // Our own notifications stay queued: `foreign_changes` tells them
        // from others' by their port. Draining them here would discard
        // with them a change someone made since the last upkeep.
        if diff.size() >= QUIET_BATCH {
            self.apply_quietly(batch)?;
        } else {
            batch.apply(&self.sock)?;
        }
        self.steering.apply(&diff.routes, routes)?;
        Ok(Applied {
            extra_changes: 0,
            installed_schema: installs.iter().any(|(_, how)| *how != Install::Nothing),
        })
    }

    fn settle(&mut self) -> Result<(), NftError> {
        Ok(self.steering.settle()?)
    }

    fn upkeep(&mut self) -> Result<bool, NftError> {
        Ok(self.steering.changed()?)
    }

    fn paths_news(&mut self) -> Result<bool, NftError> {
        Ok(self.steering.changed()?)
    }

    fn foreign_changes(&mut self) -> Result<bool, NftError> {
        let missed = std::mem::take(&mut self.missed_news);
        let own = self.own_port;
        let foreign = self
            .events
            .pending_events(|m| m.pid != own && about_our_table(m.msg_type, m.payload))?;
        Ok(foreign > 0 || missed)
    }

    fn dump(&self) -> Result<Dump, NftError> {
        let mut state = DatapathState::default();
        let mut installed = false;
        let mut tables = Vec::new();
        for l in &LAYOUTS {
            if let Some(t) = read::read_table(&self.sock, l)? {
                installed = true;
                state.merge(t.state);
                tables.push(read::chain_details(&self.sock, &l.table())?);
            }
        }
        if installed {
            state.routes = self.steering.routes()?;
            ports::read_places(&self.sock, &mut state.guard)?;
            tables.push(read::chain_details(&self.sock, &ports::table())?);
        }
        Ok(Dump {
            backend: BackendKind::Nft,
            installed,
            state,
            counters: Default::default(),
            details: json!({ "tables": tables }),
            placement: Vec::new(),
        })
    }

    fn cleanup(&mut self) -> Result<(), NftError> {
        encode::cleanup_batch(&self.present()?).apply(&self.sock)?;
        Ok(())
    }
}

#[cfg(test)]
mod about_our_table_tests {
    use super::{about_our_table, schema::TABLE, sys};

    /// A NEWTABLE notification for `TABLE` in `family`.
    fn new_table(family: u8) -> (u16, Vec<u8>) {
        let name = [TABLE.as_bytes(), &[0]].concat();
        let len = 4 + name.len() as u16;
        let mut payload = vec![family, 0, 0, 0];
        payload.extend(len.to_ne_bytes());
        payload.extend(1u16.to_ne_bytes());
        payload.extend(&name);
        payload.resize(payload.len().next_multiple_of(4), 0);
        ((libc::NFNL_SUBSYS_NFTABLES as u16) << 8, payload)
    }

    #[test]
    fn the_ebpf_backends_inet_table_is_not_ours() {
        for family in [
            libc::NFPROTO_IPV4 as u8,
            libc::NFPROTO_IPV6 as u8,
            libc::NFPROTO_BRIDGE as u8,
        ] {
            let (kind, payload) = new_table(family);
            assert!(about_our_table(kind, &payload), "family {family}");
        }
        let (kind, payload) = new_table(sys::NFPROTO_INET);
        assert!(!about_our_table(kind, &payload));
    }
}
