//! The machine's Go toolchain, and the caches the components built with
//! it are kept in.
use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The `go` command: on PATH, or where Debian and the upstream tarball put
/// it.
pub fn go() -> Result<PathBuf> {
    for candidate in ["go", "/usr/local/go/bin/go", "/usr/lib/go/bin/go"] {
        if Command::new(candidate)
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(PathBuf::from(candidate));
        }
    }
    bail!("Go not found (PATH, /usr/local/go/bin): the real Kubernetes components are built from their Go modules")
}

pub fn run_go(go: &Path, dir: &Path, args: &[&str]) -> Result<std::process::Output> {
    let out = Command::new(go)
        .args(args)
        .current_dir(dir)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-mod=mod")
        .output()
        .with_context(|| format!("go {args:?}"))?;
    if !out.status.success() {
        bail!(
            "go {} failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// The cache directory `~/.cache/cozy-proxy/<name>`, or `$<var>`.
pub fn cache_dir(var: &str, name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var(var) {
        return PathBuf::from(dir);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/cozy-proxy").join(name)
}
