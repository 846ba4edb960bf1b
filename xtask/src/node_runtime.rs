//! The container runtime of the tests' real nodes (kubelets in network
//! namespaces, cozy-proxy-testkit/src/nodes/kubelet.rs): containerd, its
//! runc shim and `ctr` from `github.com/containerd/containerd/v2`, and
//! `crictl` from `sigs.k8s.io/cri-tools`, each into a cache of its own
//! (`~/.cache/cozy-proxy/<name>-<version>`). runc and the CNI plugins are
//! Debian's (the setup's packages).
//!
//! containerd is built without cgo and without the snapshotters that need
//! it (btrfs, devmapper, zfs): the nodes use overlayfs.
use crate::gotool::cache_dir;
use crate::pinned::GoCommands;
use anyhow::Result;
use std::path::PathBuf;

pub const CONTAINERD: &str = "v2.4.2";
pub const CRI_TOOLS: &str = "v1.37.0";

fn containerd() -> GoCommands<'static> {
    GoCommands {
        module: "github.com/containerd/containerd/v2",
        version: CONTAINERD,
        packages: &[
            "github.com/containerd/containerd/v2/cmd/containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr",
        ],
        ldflags: "-s -w",
        tags: "no_btrfs no_devmapper no_zfs",
        pin_kubernetes: false,
        cache: cache_dir(
            "COZY_PROXY_CONTAINERD_CACHE",
            &format!("containerd-{CONTAINERD}"),
        ),
    }
}

fn crictl() -> GoCommands<'static> {
    GoCommands {
        module: "sigs.k8s.io/cri-tools",
        version: CRI_TOOLS,
        packages: &["sigs.k8s.io/cri-tools/cmd/crictl"],
        ldflags: "-s -w",
        tags: "",
        pin_kubernetes: false,
        cache: cache_dir("COZY_PROXY_CRICTL_CACHE", &format!("crictl-{CRI_TOOLS}")),
    }
}

/// The binaries, built where the caches lack them; returns the
/// directories that hold them (containerd's, then crictl's).
pub fn ensure() -> Result<[PathBuf; 2]> {
    let (runtime, cli) = (containerd(), crictl());
    let built = |b: &GoCommands, names: &[&str]| names.iter().all(|n| b.bin().join(n).is_file());
    if !built(&runtime, &["containerd", "containerd-shim-runc-v2", "ctr"]) {
        runtime.build()?;
    }
    if !built(&cli, &["crictl"]) {
        cli.build()?;
    }
    Ok([runtime.bin(), cli.bin()])
}
