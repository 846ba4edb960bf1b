//! The seccomp profile for the eBPF backend's container. Container
//! runtimes' default profiles allow bpf(2) and perf_event_open(2) only with
//! CAP_SYS_ADMIN (containers-common's, used by CRI-O and podman; containerd
//! before its default learnt CAP_BPF and CAP_PERFMON), which cozy-proxy
//! does not ask for: the chart ships this profile, the runtime default for
//! the chart's capabilities plus those two calls, and installs it on each
//! node as a kubelet `Localhost` profile (tests/container.rs proves both
//! halves with runc).
use std::{io, path::Path};

/// The profile (runtime-spec format), as the chart ships it.
pub const EBPF_PROFILE: &str = include_str!("../../charts/cozy-proxy/files/cozy-proxy-ebpf.json");

/// Writes the profile to `path` (atomically; its directory is created):
/// a container starting meanwhile reads the old file or the new one.
pub fn install(path: &Path) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, EBPF_PROFILE)?;
    std::fs::rename(&tmp, path)
}
