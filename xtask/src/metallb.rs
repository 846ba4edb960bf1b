//! MetalLB's controller and speaker for the tests, from the
//! `go.universe.tf/metallb` Go module (xtask/src/pinned.rs), into
//! `~/.cache/cozy-proxy/metallb-<version>` (or `$COZY_PROXY_METALLB_CACHE`)
//! beside its CRDs (`crds/`, the module's `config/crd/bases`).
//!
//! The release is v0.16.1: v0.16.2 requires `github.com/metallb/frr-k8s`
//! v0.0.27, which the module proxy here does not serve (v0.16.1 requires
//! v0.0.25, which it does).
use crate::gotool::cache_dir;
use crate::pinned::GoCommands;
use anyhow::Result;
use std::path::PathBuf;

pub const METALLB: &str = "v0.16.1";

/// The binaries and CRDs, built and copied if the cache lacks them;
/// returns the cache directory (`bin/`, `crds/`).
pub fn ensure() -> Result<PathBuf> {
    let build = GoCommands {
        module: "go.universe.tf/metallb",
        version: METALLB,
        packages: &[
            "go.universe.tf/metallb/controller",
            "go.universe.tf/metallb/speaker",
        ],
        ldflags: "-s -w",
        tags: "",
        pin_kubernetes: true,
        cache: cache_dir("COZY_PROXY_METALLB_CACHE", &format!("metallb-{METALLB}")),
    };
    let crds = build.cache.join("crds");
    let done = ["controller", "speaker"]
        .iter()
        .all(|b| build.bin().join(b).is_file())
        && crds.is_dir();
    if done {
        return Ok(build.cache);
    }
    let module = build.build()?;
    std::fs::create_dir_all(&crds)?;
    for entry in std::fs::read_dir(module.join("config/crd/bases"))? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, crds.join(name))?;
        }
    }
    Ok(build.cache)
}
