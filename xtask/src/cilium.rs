//! The real Cilium agent the Cilium lane runs beside cozy-proxy
//! (`tests/cilium.rs`): `cilium-agent`, its CNI plugin `cilium-cni` and
//! `cilium-dbg`, built from the `github.com/cilium/cilium` Go module with
//! the machine's Go into a cache (`~/.cache/cozy-proxy/cilium-<version>`,
//! or `$COZY_PROXY_CILIUM_CACHE`), with what the agent reads at run time
//! from the same module: the datapath's C sources (`lib/bpf`, compiled by
//! the agent with clang at start), its Helm chart (`chart`, which the
//! lane renders with Cozystack's values into the agent's configuration)
//! and its CRDs (`crds`, which its operator would register).
//!
//! Cilium builds from its own go.mod, not from the Kubernetes release the
//! control plane is built from (its libraries are its own). Two module
//! versions it names are not served by this machine's module proxy; each
//! is replaced by the nearest one served ([`REPLACES`], [`DROPPED`]).
use crate::gotool::{go, run_go};
use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

pub const CILIUM: &str = "v1.20.2";
const MODULE: &str = "github.com/cilium/cilium";

/// Command -> its package in the module.
pub const BINARIES: [(&str, &str); 3] = [
    ("cilium-agent", "./daemon"),
    ("cilium-cni", "./plugins/cilium-cni"),
    ("cilium-dbg", "./cilium-dbg"),
];

/// Requirements whose version the module proxy here refuses, and the
/// served version each is replaced by: gobgp is the BGP control plane's
/// library (a pseudo-version after v4.6.1 in Cilium's go.mod; v4.7.0 is
/// the next release).
const REPLACES: [(&str, &str); 1] = [("github.com/osrg/gobgp/v4", "v4.7.0")];
/// Replace lines of Cilium's go.mod dropped: a fork of a code generator
/// none of the commands built here imports.
const DROPPED: [&str; 1] = ["sigs.k8s.io/controller-tools"];

/// The LLVM release whose clang and llc Cilium's own image carries (its
/// `images/runtime/Dockerfile`), from Debian.
pub const LLVM: &str = "19";

pub fn cache_dir() -> PathBuf {
    crate::gotool::cache_dir("COZY_PROXY_CILIUM_CACHE", &format!("cilium-{CILIUM}"))
}

/// Everything the lane needs is in the cache.
fn complete(cache: &Path) -> bool {
    BINARIES
        .iter()
        .all(|(b, _)| cache.join("bin").join(b).is_file())
        && ["lib/bpf/bpf_lxc.c", "chart/Chart.yaml", "crds/v2"]
            .iter()
            .all(|p| cache.join(p).exists())
        && cache.join("llvm/clang").exists()
}

/// The agent, its files and its compiler, built or linked if the cache
/// lacks them; returns the cache.
pub fn ensure() -> Result<PathBuf> {
    let cache = cache_dir();
    if complete(&cache) {
        return Ok(cache);
    }
    let go = go()?;
    let started = Instant::now();
    eprintln!(
        "xtask: building Cilium {CILIUM} from its Go module into {}",
        cache.display()
    );
    std::fs::create_dir_all(&cache)?;
    let out = run_go(
        &go,
        &cache,
        &["mod", "download", "-json", &format!("{MODULE}@{CILIUM}")],
    )?;
    let info: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("go mod download -json")?;
    let module = PathBuf::from(info["Dir"].as_str().context("the module's directory")?);
    // A writable copy: its go.mod gets the replacements.
    let src = cache.join("src");
    let _ = std::fs::remove_dir_all(&src);
    copy_tree(&module, &src)?;
    for (path, version) in REPLACES {
        run_go(
            &go,
            &src,
            &["mod", "edit", &format!("-replace={path}={path}@{version}")],
        )?;
    }
    for path in DROPPED {
        run_go(&go, &src, &["mod", "edit", &format!("-dropreplace={path}")])?;
    }
    let version = CILIUM.trim_start_matches('v');
    let ldflags = format!("-s -w -X github.com/cilium/cilium/pkg/version.ciliumVersion={version}");
    let partial = cache.join("bin.partial");
    std::fs::create_dir_all(&partial)?;
    for (name, package) in BINARIES {
        let out = partial.join(name).display().to_string();
        run_go(
            &go,
            &src,
            &[
                "build",
                "-trimpath",
                "-tags",
                "osusergo",
                "-ldflags",
                &ldflags,
                "-o",
                &out,
                package,
            ],
        )?;
    }
    for (from, to) in [
        ("bpf", "lib/bpf"),
        ("install/kubernetes/cilium", "chart"),
        ("pkg/k8s/apis/cilium.io/client/crds", "crds"),
    ] {
        let to = cache.join(to);
        let _ = std::fs::remove_dir_all(&to);
        copy_tree(&src.join(from), &to)?;
    }
    link_llvm(&cache.join("llvm"))?;
    let bin = cache.join("bin");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::rename(&partial, &bin)?;
    // The copy's build is done; the files the lane reads are in place.
    std::fs::remove_dir_all(&src)?;
    eprintln!(
        "xtask: Cilium built in {:.0?} ({})",
        started.elapsed(),
        bin.display()
    );
    Ok(cache)
}

/// `dir/clang` and `dir/llc`: the names the agent calls, for Debian's
/// LLVM [`LLVM`] (put first on the agent's PATH).
fn link_llvm(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, target) in [
        ("clang", format!("/usr/bin/clang-{LLVM}")),
        ("llc", format!("/usr/lib/llvm-{LLVM}/bin/llc")),
    ] {
        if !Path::new(&target).exists() {
            bail!("{target} missing: `cargo xtask setup` installs clang-{LLVM} and llvm-{LLVM}");
        }
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)?;
    }
    Ok(())
}

/// `cp -a` of a directory tree, made writable.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    crate::run(Command::new("cp").arg("-a").arg(from).arg(to))?;
    crate::run(Command::new("chmod").args(["-R", "u+w"]).arg(to))
}
