//! Where the binaries under test are: the workspace, ours as cargo built
//! it, or one named by `COZY_PROXY_BIN`.
use std::path::PathBuf;

/// The workspace's root directory (the repository checked out).
pub fn workspace() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default()
}

/// The cozy-proxy binary under test: `COZY_PROXY_BIN` (xtask sets it for
/// the demo and the benchmarks), else the one cargo built beside the
/// running executable (`target/<profile>/` for a bin, its parent for a test
/// in `deps/`), else `cozy-proxy` on PATH.
pub fn bin() -> String {
    if let Ok(b) = std::env::var("COZY_PROXY_BIN") {
        return b;
    }
    built_beside("cozy-proxy")
        .unwrap_or_else(|| "cozy-proxy".into())
        .display()
        .to_string()
}

/// The workspace's binary `name` built beside the running one (a test's
/// `target/debug/deps/..`, a binary's `target/debug/..`), if any.
pub fn built_beside(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let found = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(name))
        .find(|candidate| candidate.is_file());
    found
}
