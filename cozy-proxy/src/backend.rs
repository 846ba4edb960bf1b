//! The datapath a node runs: chosen at start (flag, node label, or auto),
//! owned for the life of the controller, and the only way anything else
//! reaches a backend. Once the chosen backend has synced, the other
//! backend's state is removed, so switching a node's backend leaves nothing
//! behind and never leaves a gap (both translate the same way).
use crate::datapath::{
    BackendKind, Capacity, Counters, Datapath, DatapathState, Dump, ErrorKind, Paths, StateDiff,
    SyncReport, Synced,
};
use crate::ebpf::{EbpfConfig, EbpfError, EbpfKernel};
use crate::nft::{NftError, NftKernel};
use crate::steer::Steering;
use std::{collections::BTreeSet, net::IpAddr};
use tracing::{error, info, warn};

/// What the operator asks for (`--backend`, or the node label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    Nft,
    Ebpf,
    /// eBPF where the kernel loads it, nftables otherwise.
    Auto,
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        <Choice as clap::ValueEnum>::from_str(s, true)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("nft datapath: {0}")]
    Nft(#[from] NftError),
    #[error("eBPF datapath: {0}")]
    Ebpf(#[from] EbpfError),
    #[error("starting the datapath thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl ErrorKind for BackendError {
    fn kind(&self) -> &'static str {
        match self {
            BackendError::Nft(e) => e.kind(),
            BackendError::Ebpf(e) => e.kind(),
            BackendError::Thread(_) => "thread",
        }
    }
}

/// Where each backend keeps its state.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    pub ebpf: EbpfConfig,
    /// LB IPs per step of a fresh install ([`crate::datapath::PART_LBS`]).
    pub install_part_lbs: usize,
}

enum Running {
    Nft(Box<Synced<NftKernel>>),
    Ebpf(Box<Synced<EbpfKernel>>),
}

/// Calls `$body` with the running backend bound to `$d`.
macro_rules! running {
    ($self:expr, $d:ident => $body:expr) => {
        match $self {
            Running::Nft($d) => $body.map_err(BackendError::from),
            Running::Ebpf($d) => $body.map_err(BackendError::from),
        }
    };
}

/// The node's datapath.
pub struct NodeDatapath {
    running: Running,
    cfg: BackendConfig,
    /// The other backend, removed after our first successful sync.
    retire: Option<BackendKind>,
}

/// The backend this process runs, and why `auto` did not take eBPF (for
/// the metrics).
static CHOSEN: std::sync::Mutex<Option<(BackendKind, String)>> = std::sync::Mutex::new(None);

/// The backend this process runs and why (empty: as asked), once started.
pub fn chosen() -> Option<(BackendKind, String)> {
    CHOSEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Why the eBPF programs cannot serve this node's shape, if so
/// (`ebpf::shape`).
pub fn ebpf_unserved(cfg: &EbpfConfig) -> Option<String> {
    crate::ebpf::shape::unserved(&node_links()?, &cfg.interfaces)
}

fn node_links() -> Option<Vec<crate::netlink::route::Link>> {
    let sock = crate::netlink::NlSocket::open(libc::NETLINK_ROUTE).ok()?;
    crate::netlink::route::links(&sock).ok()
}

impl NodeDatapath {
    /// Starts the backend `choice` names. `auto` falls back to nftables
    /// (with a warning naming why) where the eBPF programs cannot be loaded
    /// or cannot serve the node's shape.
    pub fn start(choice: Choice, cfg: BackendConfig) -> Result<Self, BackendError> {
        let mut why = String::new();
        let ebpf = match choice {
            Choice::Nft => None,
            Choice::Ebpf => Some(EbpfKernel::start(cfg.ebpf.clone())?),
            Choice::Auto => match EbpfKernel::start(cfg.ebpf.clone()) {
                Ok(k) => Some(k),
                Err(e) => {
                    warn!(error = %e, "eBPF datapath unavailable on this node; using nftables");
                    why = e.to_string();
                    None
                }
            },
        };
        let part = cfg.install_part_lbs;
        let running = match ebpf {
            Some(k) => Running::Ebpf(Box::new(Synced::new(k).with_part_lbs(part))),
            None => Running::Nft(Box::new(Synced::new(NftKernel::new()?).with_part_lbs(part))),
        };
        let kind = match &running {
            Running::Nft(_) => BackendKind::Nft,
            Running::Ebpf(_) => BackendKind::Ebpf,
        };
        info!(backend = %kind, "datapath chosen");
        *CHOSEN.lock().unwrap_or_else(|e| e.into_inner()) = Some((kind, why));
        Ok(NodeDatapath {
            running,
            cfg,
            retire: BackendKind::ALL.into_iter().find(|k| *k != kind),
        })
    }
}

impl NodeDatapath {
    /// Leaves the other backend's state in place (it is not retired after
    /// the first sync).
    pub fn keep_other(&mut self) {
        if let Some(other) = self.retire.take() {
            info!(backend = %other, "the other backend's state is kept (the node's label could not be read)");
        }
    }
}

/// A backend's installed state, opened without running it: what `cozy-proxy
/// dump` and `cleanup` (and an uninstall) work on.
pub struct Installed(Running);

pub fn installed(kind: BackendKind, cfg: &BackendConfig) -> Result<Installed, BackendError> {
    Ok(Installed(match kind {
        BackendKind::Nft => Running::Nft(Box::new(Synced::new(NftKernel::new()?))),
        BackendKind::Ebpf => {
            Running::Ebpf(Box::new(Synced::new(EbpfKernel::open(cfg.ebpf.clone())?)))
        }
    }))
}

/// Is backend `kind`'s state installed on this node?
pub fn is_installed(kind: BackendKind, cfg: &BackendConfig) -> bool {
    match kind {
        BackendKind::Ebpf => crate::ebpf::is_installed(&cfg.ebpf),
        BackendKind::Nft => NftKernel::new().is_ok_and(|k| k.is_installed().unwrap_or(false)),
    }
}

/// The backends whose state is installed on this node.
pub fn installed_kinds(cfg: &BackendConfig) -> Vec<BackendKind> {
    (BackendKind::ALL.into_iter())
        .filter(|k| is_installed(*k, cfg))
        .collect()
}

/// The backend `dump` reads without `--backend`: the one whose datapath
/// is installed, eBPF's while both are (a switch, either way, holds both
/// for a moment), nft where none is (a node cozy-proxy does not serve:
/// the dump says "not installed").
pub fn dumped_by_default(cfg: &BackendConfig) -> BackendKind {
    match installed_kinds(cfg).as_slice() {
        [] => BackendKind::Nft,
        kinds if kinds.contains(&BackendKind::Ebpf) => BackendKind::Ebpf,
        _ => BackendKind::Nft,
    }
}

impl Installed {
    pub fn dump(&self) -> Result<Dump, BackendError> {
        running!(&self.0, d => d.dump())
    }

    pub fn cleanup(&mut self) -> Result<(), BackendError> {
        running!(&mut self.0, d => d.cleanup())
    }
}

/// Removes every named backend's state (an uninstall, `cozy-proxy cleanup`).
/// The LB IPs' host routes serve whichever backend runs: they go only when
/// every backend does.
pub fn remove(kinds: &[BackendKind], cfg: &BackendConfig) -> Result<(), BackendError> {
    for kind in kinds {
        match kind {
            // Without opening its maps: the nft pod may not call bpf(2).
            BackendKind::Ebpf => crate::ebpf::remove_installed(&cfg.ebpf)?,
            BackendKind::Nft => installed(*kind, cfg)?.cleanup()?,
        }
        info!(backend = %kind, "removed the datapath");
    }
    if BackendKind::ALL.iter().all(|k| kinds.contains(k)) {
        Steering::open()
            .and_then(|s| s.remove_all())
            .map_err(NftError::from)?;
    }
    Ok(())
}

impl Datapath for NodeDatapath {
    type Error = BackendError;

    fn kind(&self) -> BackendKind {
        match &self.running {
            Running::Nft(_) => BackendKind::Nft,
            Running::Ebpf(_) => BackendKind::Ebpf,
        }
    }

    fn capacity(&self) -> Capacity {
        match &self.running {
            Running::Nft(d) => d.capacity(),
            Running::Ebpf(d) => d.capacity(),
        }
    }

    fn sync(&mut self, desired: DatapathState) -> Result<SyncReport, BackendError> {
        self.stand_by_for_switch()?;
        let report = running!(&mut self.running, d => d.sync(desired))?;
        self.retire_other();
        Ok(report)
    }

    fn sync_change(&mut self, change: &StateDiff) -> Result<Option<SyncReport>, BackendError> {
        self.stand_by_for_switch()?;
        let report = running!(&mut self.running, d => d.sync_change(change))?;
        self.retire_other();
        Ok(report)
    }

    fn forget(&mut self) {
        match &mut self.running {
            Running::Nft(d) => d.forget(),
            Running::Ebpf(d) => d.forget(),
        }
    }

    fn upkeep(&mut self) -> Result<bool, BackendError> {
        running!(&mut self.running, d => d.upkeep())
    }

    fn paths_news(&mut self) -> Result<bool, BackendError> {
        running!(&mut self.running, d => d.paths_news())
    }

    fn paths_of(&mut self, pods: &BTreeSet<IpAddr>) -> Result<Paths, BackendError> {
        running!(&mut self.running, d => d.paths_of(pods))
    }

    fn dump(&self) -> Result<Dump, BackendError> {
        running!(&self.running, d => d.dump())
    }

    fn counters(&self) -> Result<Counters, BackendError> {
        running!(&self.running, d => d.counters())
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        running!(&mut self.running, d => d.cleanup())
    }
}

impl NodeDatapath {
    /// Before the first sync, where the other backend's state is installed
    /// (a switch): ours is filled but stands by, passing every packet, so
    /// the two act on the same packets only for the instant of the switch
    /// ([`NodeDatapath::retire_other`]).
    /// Ours stands by (the kernel's own flag: an eBPF datapath may have
    /// been left so by a process before this one).
    fn standing_by(&self) -> bool {
        match &self.running {
            Running::Nft(d) => d.kernel().standing_by(),
            Running::Ebpf(d) => d.kernel().standing_by(),
        }
    }

    fn stand_by_for_switch(&mut self) -> Result<(), BackendError> {
        // Asked only until ours stands by: reading the other backend's
        // state (an nft dump) is not repeated on every retried first sync.
        if self.standing_by() || !(self.retire).is_some_and(|k| is_installed(k, &self.cfg)) {
            return Ok(());
        }
        match &mut self.running {
            Running::Nft(d) => d.kernel_mut().stand_by(),
            Running::Ebpf(d) => d.kernel_mut().stand_by()?,
        }
        info!("standing by until the first sync; the other backend's datapath serves until then");
        Ok(())
    }

    /// After the first successful sync: ours wakes (one transaction or
    /// one map write), then the other backend's state goes. In that order:
    /// for the instant both act, a packet one translated passes the other
    /// untouched (a pod's LB IP is accepted from its pod's path); the
    /// other way round, the instant neither acts would send the pods'
    /// packets out untranslated (the CNI's masquerade), and the far end
    /// would reset their connections.
    /// Waking is tried again after every sync until it succeeds; the other
    /// backend goes only once ours serves. (Waking what does not stand by
    /// does nothing; programs a process before this one left standing by
    /// are woken here too.)
    fn retire_other(&mut self) {
        let woken = match &mut self.running {
            Running::Nft(d) => d.kernel_mut().wake().map_err(BackendError::from),
            Running::Ebpf(d) => d.kernel_mut().wake().map_err(BackendError::from),
        };
        if let Err(e) = woken {
            error!(error = %e, "waking our datapath failed; retried after the next sync");
            return;
        }
        // Only what is there: a node's first start has nothing to retire.
        if let Some(other) = self.retire.take().filter(|k| is_installed(*k, &self.cfg)) {
            if let Err(e) = remove(&[other], &self.cfg) {
                warn!(backend = %other, error = %e, "removing the other backend's datapath failed");
            }
        }
    }
}
