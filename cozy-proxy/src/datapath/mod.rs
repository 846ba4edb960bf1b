//! What a datapath is, independent of nftables or BPF:
//!
//! - [`DatapathState`]: the tables a plan becomes, the same for every backend;
//! - [`Kernel`]: what a backend supplies (read the live state, apply a diff,
//!   install its schema, upkeep, dump, cleanup);
//! - [`Synced`]: the one sync layer over any [`Kernel`] (what the kernel holds
//!   as of the last change, adoption at start, the diff, the retry policy);
//! - [`Datapath`]: what the reconciler drives ([`Synced`] implements it);
//! - [`worker`]: runs a datapath on a thread of its own, so that netlink and
//!   BPF syscalls never block the async runtime.
mod builder;
mod capacity;
mod counters;
#[cfg(test)]
pub mod fake;
mod hosting;
mod placement;
mod render;
mod state;
mod sync;
mod tables;
pub mod worker;

pub use builder::StateBuilder;
pub use capacity::{Capacity, Entries, Overflow, Table};
pub use counters::{Count, Counters, ServiceCount};
pub use hosting::{SharedMapping, Sharing};
pub use placement::{placements, ControllerWord, Placement};
pub use render::render_text;
pub use state::{
    away, away_via, repack, shared_pods, AllowedPort, DatapathState, Desired, Elsewhere, NextHop,
    NodeView, Path, PathOf, Paths, RemotePods, StateDiff, NONE_AWAY,
};
pub use sync::{Synced, PART_LBS};
pub use tables::Change;

use serde::Serialize;
use std::{collections::BTreeSet, fmt, net::IpAddr};

/// Which datapath a node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Nft,
    Ebpf,
}

impl BackendKind {
    pub const ALL: [BackendKind; 2] = [BackendKind::Nft, BackendKind::Ebpf];
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Nft => "nft",
            BackendKind::Ebpf => "ebpf",
        })
    }
}

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SyncReport {
    /// Elements removed plus elements added in the kernel (map and set
    /// elements, and whatever else the backend changed, such as routes).
    pub changed_elements: usize,
    /// True when the sync (re)installed tables, chains, rules or programs.
    pub installed_schema: bool,
    /// What the backend's tables could not hold (see [`Capacity`]): the
    /// rest was applied.
    pub overflow: Overflow,
    /// Elements the kernel holds now (guards and host routes included).
    pub elements: usize,
}

/// The live state of a datapath, read back from the kernel.
#[derive(Clone, Debug, Serialize)]
pub struct Dump {
    pub backend: BackendKind,
    /// False when nothing of ours is installed.
    pub installed: bool,
    pub state: DatapathState,
    /// The datapath's own traffic counters (empty where it keeps none).
    pub counters: Counters,
    /// Backend-specific detail for people: chains and rule counters, TC
    /// attachments, routes. Not a contract: nothing reads it back.
    pub details: serde_json::Value,
    /// What this node does with each LB IP, and why ([`placements`]).
    pub placement: Vec<Placement>,
}

/// What a backend's [`Kernel::apply`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Changes beyond the state's elements (e.g. routes).
    pub extra_changes: usize,
    pub installed_schema: bool,
}

/// When an apply's host routes change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routes {
    /// Before the apply returns.
    Now,
    /// Meanwhile, on another thread, until [`Kernel::settle`] or the next
    /// apply: a fresh install's step has the kernel change its routes while
    /// the next step writes its tables.
    Overlapped,
}

/// The kernel side of a backend: everything [`Synced`] needs to keep the
/// kernel equal to a [`DatapathState`], and nothing of the policy around it.
pub trait Kernel {
    type Error: std::error::Error + ErrorKind + Send + Sync + 'static;
    /// What a read learned besides the elements (which parts of the schema
    /// are missing or stale), for the apply that follows it.
    type Found;

    fn kind(&self) -> BackendKind;

    /// What the backend's tables hold at most: the sync layer never asks
    /// for more (a full table would fail the whole apply).
    fn capacity(&self) -> Capacity {
        Capacity::UNLIMITED
    }

    /// The kernel's paths toward `pods` (each of them is in the answer,
    /// `None` if the kernel has no specific route to it; other pods may be
    /// too): they decide which interface each guarded address may arrive
    /// on, and where each LB IP is steered.
    fn paths(&mut self, pods: &BTreeSet<IpAddr>) -> Result<&Paths, Self::Error>;

    /// Reads the elements the kernel holds now (empty where nothing of ours
    /// is installed) and what the schema needs. Drops any cache the backend
    /// keeps of its own: after a read, the kernel is the truth.
    fn read(&mut self) -> Result<(DatapathState, Self::Found), Self::Error>;

    /// Turns the kernel from what `diff` starts at into `desired`. `found`
    /// is set on the first apply after a [`Kernel::read`]: install or repair
    /// the schema it reports, in the same step where the kernel allows.
    /// `routes`: when the host routes change (an LB IP's route follows its
    /// tables either way).
    fn apply_routed(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
        found: Option<Self::Found>,
        routes: Routes,
    ) -> Result<Applied, Self::Error>;

    /// [`Kernel::apply_routed`], the routes changed before it returns.
    fn apply(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
        found: Option<Self::Found>,
    ) -> Result<Applied, Self::Error> {
        self.apply_routed(diff, desired, found, Routes::Now)
    }

    /// [`Kernel::apply_routed`] for one step of a fresh install: the host
    /// routes (slow, in the kernel) may still be in flight when it returns.
    /// [`Kernel::settle`] ends the install.
    fn apply_step(
        &mut self,
        diff: &StateDiff,
        desired: Desired<'_>,
        found: Option<Self::Found>,
    ) -> Result<Applied, Self::Error> {
        self.apply_routed(diff, desired, found, Routes::Overlapped)
    }

    /// Waits for the routes [`Kernel::apply_step`] left in flight: their
    /// error, if they failed.
    fn settle(&mut self) -> Result<(), Self::Error>;

    /// Upkeep between syncs (e.g. following interfaces that come and go).
    /// True when the kernel's paths may have changed: the caller syncs again.
    fn upkeep(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }

    /// Drains the kernel's notifications of changes to the paths toward the
    /// pods (routes, links, neighbours): true when a path may have changed
    /// and the caller syncs again. Called as soon as such news arrives.
    fn paths_news(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }

    /// Has someone else changed our state in the kernel since the last
    /// look (a notification the kernel sent)? Then what we believe of it is
    /// forgotten and the next sync reads it again and repairs it, without
    /// waiting for the resync.
    fn foreign_changes(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }

    /// The live state, read back from the kernel.
    fn dump(&self) -> Result<Dump, Self::Error>;

    /// The datapath's own traffic counters.
    fn counters(&self) -> Result<Counters, Self::Error> {
        Ok(Counters::default())
    }

    /// Removes everything this backend installed.
    fn cleanup(&mut self) -> Result<(), Self::Error>;
}

/// What kind of failure an error is, as a metric label (`sync_errors`'s
/// `kind`): a few stable words, not the message.
pub trait ErrorKind {
    fn kind(&self) -> &'static str;
}

/// A datapath as the reconciler drives it.
pub trait Datapath {
    type Error: std::error::Error + ErrorKind + Send + Sync + 'static;

    fn kind(&self) -> BackendKind;

    /// What the kernel's tables hold at most.
    fn capacity(&self) -> Capacity;

    /// Makes the kernel hold exactly `desired` (kept: the datapath holds
    /// the one copy of it). The first call adopts what a previous instance
    /// left, without a moment where traffic is not translated; later calls
    /// change only the elements that differ.
    fn sync(&mut self, desired: DatapathState) -> Result<SyncReport, Self::Error>;

    /// As [`Datapath::sync`] of the state of the last sync changed by
    /// `change`: work in proportion to the change. `None` where `change`
    /// does not fit that state (it removes what is not there): the caller
    /// gives the whole state to [`Datapath::sync`].
    fn sync_change(&mut self, change: &StateDiff) -> Result<Option<SyncReport>, Self::Error>;

    /// Forgets what it believes the kernel holds: the next sync reads the
    /// kernel again and repairs any drift.
    fn forget(&mut self);

    /// Periodic upkeep between syncs; true when a sync should follow (the
    /// kernel's paths toward the pods may have changed).
    fn upkeep(&mut self) -> Result<bool, Self::Error>;

    /// The kernel announced a change of the paths toward the pods: true
    /// when one may have changed and a sync should follow (the next sync
    /// resolves every address again).
    fn paths_news(&mut self) -> Result<bool, Self::Error>;

    /// The kernel's paths toward `pods` (each of them in the answer).
    fn paths_of(&mut self, pods: &BTreeSet<IpAddr>) -> Result<Paths, Self::Error>;

    /// Reads the live state back from the kernel.
    fn dump(&self) -> Result<Dump, Self::Error>;

    fn counters(&self) -> Result<Counters, Self::Error>;

    /// Removes everything this datapath installed.
    fn cleanup(&mut self) -> Result<(), Self::Error>;
}
