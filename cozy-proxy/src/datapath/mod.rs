//! What a datapath is: the trait both backends implement, and the tables
//! they hold ([`DatapathState`]).
mod render;
mod state;

pub use render::render_text;

pub use state::{AllowedPort, Change, DatapathState, StateDiff};

use serde::Serialize;
use std::fmt;

/// Which datapath a node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Nft,
    Ebpf,
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
    /// Elements removed plus elements added in the kernel.
    pub changed_elements: usize,
    /// True when the sync (re)installed tables, chains or rules.
    pub installed_schema: bool,
}

/// The live state of a datapath, read back from the kernel.
#[derive(Clone, Debug, Serialize)]
pub struct Dump {
    pub backend: BackendKind,
    /// False when nothing of ours is installed.
    pub installed: bool,
    pub state: DatapathState,
    /// Backend-specific detail (chains and counters, attachments, ...).
    pub details: serde_json::Value,
}

/// The state a datapath found in the kernel at its first sync: what a
/// previous instance left, taken over as is (reported when not empty).
pub fn adopt(kind: BackendKind, live: DatapathState) -> DatapathState {
    if !live.is_empty() {
        tracing::info!(backend = %kind, elements = live.len(), "adopting the datapath left by a previous instance");
    }
    live
}

/// A datapath keeps the kernel equal to a [`DatapathState`].
pub trait Datapath {
    type Error: std::error::Error + Send + Sync + 'static;

    fn kind(&self) -> BackendKind;

    /// Makes the kernel hold exactly `desired`. The first call adopts what a
    /// previous instance left, without a moment where traffic is not
    /// translated; later calls change only the elements that differ.
    fn sync(&mut self, desired: &DatapathState) -> Result<SyncReport, Self::Error>;

    /// Forgets what it believes the kernel holds: the next sync reads the
    /// kernel again and repairs any drift (elements, chains, tables or
    /// routes removed by hand).
    fn forget(&mut self);

    /// Periodic upkeep between syncs (e.g. following interfaces that come
    /// and go).
    fn tick(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Reads the live state back from the kernel.
    fn dump(&self) -> Result<Dump, Self::Error>;

    /// The datapath's own traffic counters, as in `Dump::details`
    /// (`{"services": {...}, "drops": {...}}`); null where it keeps none.
    fn counters(&self) -> Result<serde_json::Value, Self::Error> {
        Ok(serde_json::Value::Null)
    }

    /// Removes everything this datapath installed.
    fn cleanup(&mut self) -> Result<(), Self::Error>;
}
