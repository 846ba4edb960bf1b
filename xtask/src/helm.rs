//! helm 3 for the tests, from the `helm.sh/helm/v3` Go module
//! (xtask/src/pinned.rs), into `~/.cache/cozy-proxy/helm-<version>` (or
//! `$COZY_PROXY_HELM_CACHE`), linked as /usr/local/bin/helm. v3.19 is the
//! helm 3 release built on Kubernetes 1.34's libraries, the control
//! plane's.
use crate::gotool::cache_dir;
use crate::k8s::STAGING;
use crate::pinned::GoCommands;
use anyhow::Result;
use std::path::PathBuf;

pub const HELM: &str = "v3.19.5";

/// The binary, built if the cache lacks it; returns its path.
pub fn ensure() -> Result<PathBuf> {
    // As helm's Makefile sets them: its version, and the Kubernetes
    // version `helm template` assumes (the client libraries' release).
    let minor = STAGING.split('.').nth(1).unwrap_or("34");
    let mut ldflags = format!(
        "-s -w -X helm.sh/helm/v3/internal/version.version={HELM} -X helm.sh/helm/v3/internal/version.metadata="
    );
    for package in ["pkg/lint/rules", "pkg/chartutil"] {
        ldflags += &format!(
            " -X helm.sh/helm/v3/{package}.k8sVersionMajor=1 -X helm.sh/helm/v3/{package}.k8sVersionMinor={minor}"
        );
    }
    let build = GoCommands {
        module: "helm.sh/helm/v3",
        version: HELM,
        packages: &["helm.sh/helm/v3/cmd/helm"],
        ldflags: &ldflags,
        tags: "",
        pin_kubernetes: true,
        cache: cache_dir("COZY_PROXY_HELM_CACHE", &format!("helm-{HELM}")),
    };
    let helm = build.bin().join("helm");
    if !helm.is_file() {
        build.build()?;
    }
    Ok(helm)
}
