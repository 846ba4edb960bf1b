//! MetalLB's controller and speaker for the tests, from the
//! `go.universe.tf/metallb` Go module, built once per machine into a cache
//! (`~/.cache/cozy-proxy/metallb-<version>`, or
//! `$COZY_PROXY_METALLB_CACHE`) beside its CRDs (`crds/`, the module's
//! `config/crd/bases`), its Kubernetes libraries pinned to the release
//! the control plane is built from (xtask/src/k8s.rs).
//!
//! The release is v0.16.1: v0.16.2 requires `github.com/metallb/frr-k8s`
//! v0.0.27, which the module proxy here does not serve (v0.16.1 requires
//! v0.0.25, which it does). The layer 2 code the tests exercise is the
//! same in both.
use crate::k8s::{go, run_go, STAGING};
use anyhow::{Context, Result};
use std::{env, path::PathBuf, time::Instant};

pub const METALLB: &str = "v0.16.1";

/// The Kubernetes staging modules MetalLB requires.
const SHARED_STAGING: [&str; 6] = [
    "k8s.io/api",
    "k8s.io/apimachinery",
    "k8s.io/client-go",
    "k8s.io/apiextensions-apiserver",
    "k8s.io/apiserver",
    "k8s.io/component-base",
];

pub fn cache_dir() -> PathBuf {
    if let Ok(dir) = env::var("COZY_PROXY_METALLB_CACHE") {
        return PathBuf::from(dir);
    }
    let home = env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(format!(".cache/cozy-proxy/metallb-{METALLB}"))
}

/// The binaries and CRDs, built and copied if the cache lacks them;
/// returns the cache directory (`bin/`, `crds/`).
pub fn ensure() -> Result<PathBuf> {
    let cache = cache_dir();
    let done = ["bin/controller", "bin/speaker", "crds"]
        .iter()
        .all(|p| cache.join(p).exists());
    if done {
        return Ok(cache);
    }
    let go = go()?;
    let src = cache.join("src");
    std::fs::create_dir_all(&src)?;
    let started = Instant::now();
    eprintln!(
        "xtask: building MetalLB {METALLB} from its Go module into {}",
        cache.display()
    );
    // The Kubernetes libraries at the release the control plane is built
    // from: the tests' components speak the same client code, and their
    // compiled packages are shared with that build (the Go build cache).
    let mut gomod = format!(
        "module cozy-proxy-metallb\n\ngo 1.25.0\n\nrequire go.universe.tf/metallb {METALLB}\n\nreplace (\n"
    );
    for m in SHARED_STAGING {
        gomod.push_str(&format!("\t{m} => {m} {STAGING}\n"));
    }
    gomod.push_str(")\n");
    std::fs::write(src.join("go.mod"), gomod)?;
    let out = run_go(
        &go,
        &src,
        &[
            "mod",
            "download",
            "-json",
            &format!("go.universe.tf/metallb@{METALLB}"),
        ],
    )?;
    let info: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("go mod download -json")?;
    let module = PathBuf::from(info["Dir"].as_str().context("the module's directory")?);
    let out_dir = cache.join("bin.partial");
    std::fs::create_dir_all(&out_dir)?;
    let out_arg = format!("{}/", out_dir.display());
    run_go(
        &go,
        &src,
        &[
            "build",
            "-trimpath",
            "-ldflags",
            "-s -w",
            "-o",
            &out_arg,
            "go.universe.tf/metallb/controller",
            "go.universe.tf/metallb/speaker",
        ],
    )?;
    let crds = cache.join("crds");
    std::fs::create_dir_all(&crds)?;
    for entry in std::fs::read_dir(module.join("config/crd/bases"))? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, crds.join(name))?;
        }
    }
    let bin = cache.join("bin");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::rename(&out_dir, &bin)?;
    eprintln!(
        "xtask: MetalLB built in {:.0?} ({})",
        started.elapsed(),
        bin.display()
    );
    Ok(cache)
}
