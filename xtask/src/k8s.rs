//! The real Kubernetes components the tests run: kube-apiserver,
//! kube-controller-manager, kube-scheduler, kubelet, kube-proxy and
//! kubectl from the `k8s.io/kubernetes` Go module, etcd from
//! `go.etcd.io/etcd/server/v3`, built with Go and its module proxy (both
//! on these machines) once per machine into a cache
//! (`~/.cache/cozy-proxy/k8s-<version>`, or `$COZY_PROXY_K8S_CACHE`).
//! Importing `k8s.io/kubernetes` as a module needs its staging modules
//! (`k8s.io/api`, `k8s.io/client-go`, ...) pinned with `replace` lines to
//! the matching `v0.x` release: they are read from its own go.mod.
use crate::gotool::{go, run_go};
use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    time::Instant,
};

pub const KUBERNETES: &str = "v1.34.4";
/// The staging modules' release for KUBERNETES.
pub const STAGING: &str = "v0.34.4";
/// The etcd release KUBERNETES's go.mod requires.
pub const ETCD: &str = "v3.6.4";

pub const BINARIES: [&str; 7] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "kubectl",
    "etcd",
];

pub fn cache_dir() -> PathBuf {
    crate::gotool::cache_dir("COZY_PROXY_K8S_CACHE", &format!("k8s-{KUBERNETES}"))
}

/// The staging modules `k8s.io/kubernetes` requires as `v0.0.0`.
fn staging_modules(go: &Path, dir: &Path) -> Result<Vec<String>> {
    let out = run_go(
        go,
        dir,
        &[
            "mod",
            "download",
            "-json",
            &format!("k8s.io/kubernetes@{KUBERNETES}"),
        ],
    )?;
    let info: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("go mod download -json")?;
    let gomod = info["GoMod"].as_str().context("GoMod path")?;
    let text = std::fs::read_to_string(gomod)?;
    let modules: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_suffix(" v0.0.0"))
        .filter(|m| m.starts_with("k8s.io/"))
        .map(str::to_string)
        .collect();
    if modules.is_empty() {
        bail!("no staging modules found in {gomod}");
    }
    Ok(modules)
}

/// Writes `dir/go.mod`: `head` (the module and its requirements), then
/// every staging module pinned to [`STAGING`].
pub fn pin_staging(go: &Path, dir: &Path, head: &str) -> Result<()> {
    std::fs::write(dir.join("go.mod"), head)?;
    let mut gomod = format!("{head}\nreplace (\n");
    for m in staging_modules(go, dir)? {
        gomod.push_str(&format!("\t{m} => {m} {STAGING}\n"));
    }
    gomod.push_str(")\n");
    std::fs::write(dir.join("go.mod"), gomod)?;
    Ok(())
}

/// The binaries, built if the cache lacks them; returns their directory.
pub fn ensure() -> Result<PathBuf> {
    let cache = cache_dir();
    let bin = cache.join("bin");
    if BINARIES.iter().all(|b| bin.join(b).is_file()) {
        return Ok(bin);
    }
    let go = go()?;
    let src = cache.join("src");
    std::fs::create_dir_all(src.join("etcd"))?;
    let started = Instant::now();
    eprintln!(
        "xtask: building Kubernetes {KUBERNETES} and etcd {ETCD} from their Go modules into {}",
        cache.display()
    );
    pin_staging(
        &go,
        &src,
        &format!(
            "module cozy-proxy-k8s\n\ngo 1.24.0\n\nrequire (\n\tk8s.io/kubernetes {KUBERNETES}\n\tgo.etcd.io/etcd/server/v3 {ETCD}\n)\n"
        ),
    )?;
    std::fs::write(
        src.join("etcd/main.go"),
        "// etcd, as its own binary's main does.\npackage main\n\nimport (\n\t\"os\"\n\n\t\"go.etcd.io/etcd/server/v3/etcdmain\"\n)\n\nfunc main() {\n\tetcdmain.Main(os.Args)\n}\n",
    )?;
    let version = KUBERNETES.trim_start_matches('v');
    let mut parts = version.split('.');
    let (major, minor) = (parts.next().unwrap_or("1"), parts.next().unwrap_or("0"));
    let ldflags = format!(
        "-s -w -X k8s.io/component-base/version.gitVersion={KUBERNETES} -X k8s.io/component-base/version.gitMajor={major} -X k8s.io/component-base/version.gitMinor={minor} -X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES}"
    );
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
            &ldflags,
            "-o",
            &out_arg,
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubelet",
            "k8s.io/kubernetes/cmd/kube-proxy",
            "k8s.io/kubernetes/cmd/kubectl",
            "./etcd",
        ],
    )?;
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::rename(&out_dir, &bin)?;
    eprintln!(
        "xtask: Kubernetes components built in {:.0?} ({})",
        started.elapsed(),
        bin.display()
    );
    Ok(bin)
}
