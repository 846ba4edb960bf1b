//! What the eBPF datapath's calls fail with.
use crate::netlink::NetlinkError;
use aya::maps::MapError;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("this binary was built without its eBPF programs (COZY_PROXY_BUILD_EBPF=0)")]
    NotBuilt,
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {0} missing from the object")]
    Missing(String),
    #[error("program {name}: {source}")]
    Program {
        name: String,
        source: aya::programs::ProgramError,
    },
    #[error("attaching to {interface}: {source}")]
    Attach {
        interface: String,
        source: aya::programs::ProgramError,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {map} is full")]
    Full { map: &'static str },
    #[error(
        "{path} is not on a bpffs and mounting one failed ({source}): the pinned maps and links \
         must outlive the process; mount one on the node (`mount -t bpf bpf /sys/fs/bpf`; \
         systemd's sys-fs-bpf.mount does at boot) and the pin directory into the container \
         (the chart mounts the host's `bpfPinDir` at /bpf-pins)"
    )]
    NoBpffs {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("pinning {path}: {source}")]
    PinLink {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("the hairpin masquerade table: {0}")]
    Hairpin(#[from] crate::nft::NftError),
    /// Another agent's program holds the place ours must run from.
    #[error("our programs cannot run first: {0}")]
    Blocked(String),
    /// A node shape the programs cannot serve (`shape.rs`).
    #[error("this node's shape: {0}")]
    Unserved(String),
}

impl crate::datapath::ErrorKind for EbpfError {
    fn kind(&self) -> &'static str {
        match self {
            EbpfError::NotBuilt => "not_built",
            EbpfError::Load(_) | EbpfError::Missing(_) | EbpfError::Program { .. } => "load",
            EbpfError::Attach { .. } | EbpfError::PinLink { .. } => "attach",
            EbpfError::Map { .. } => "map",
            EbpfError::Full { .. } => "full",
            EbpfError::NoBpffs { .. } => "bpffs",
            EbpfError::Io { .. } => "io",
            EbpfError::Netlink(e) => crate::datapath::ErrorKind::kind(e),
            EbpfError::Hairpin(e) => crate::datapath::ErrorKind::kind(e),
            EbpfError::Blocked(_) => "blocked",
            EbpfError::Unserved(_) => "unserved",
        }
    }
}

/// An I/O error on `path`, as an [`EbpfError`].
pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EbpfError + '_ {
    move |source| EbpfError::Io {
        path: path.to_path_buf(),
        source,
    }
}
