//! The images the real nodes run (nodes/kubelet.rs), built here because no
//! registry is reachable: the pod sandbox's pause, from Kubernetes' own
//! `build/pause/linux/pause.c` in the module cache `cargo xtask setup`
//! fills, compiled static; the tenant workload, Debian's static busybox on
//! an empty base; and cozy-proxy's, the test image of the binary under
//! test (`controller::image::test_image`, built as `cargo xtask image`
//! builds the release one). Each is an OCI archive a node imports with
//! `ctr`.
use crate::controller::image::{test_image, TEST_TAG};
use crate::sh::ok;
use anyhow::{anyhow, Context, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    sync::OnceLock,
};

/// The sandbox image containerd asks for (its configuration names it).
pub const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
/// The tenant workload's image: `/bin/busybox`, its applets linked.
pub const WORKLOAD: &str = "cozy-proxy-tests.local/workload:1";
/// The repository the cozy-proxy test image is imported under (the chart's
/// `image.repository`), with tag [`TEST_TAG`].
pub const COZY_PROXY_REPOSITORY: &str = "ghcr.io/cozystack/cozy-proxy";

/// An image archive and the reference a node imports it under.
pub struct Archive {
    pub path: PathBuf,
    /// The reference name inside the archive.
    pub ref_name: String,
    /// The image's name once imported.
    pub image: String,
}

fn buildah(args: &[&str]) -> Result<String> {
    let mut all = vec!["buildah", "--storage-driver", "vfs"];
    all.extend_from_slice(args);
    ok(&all).map(|o| o.trim().to_string())
}

/// An image of `rootfs` on an empty base, with `entrypoint`, written to
/// `archive` as `reference`.
fn from_rootfs(rootfs: &Path, entrypoint: &str, reference: &str, archive: &Path) -> Result<()> {
    let ctr = buildah(&["from", "scratch"])?;
    let built = (|| {
        buildah(&["copy", &ctr, &format!("{}/", rootfs.display()), "/"])?;
        buildah(&["config", "--entrypoint", entrypoint, &ctr])?;
        let id = buildah(&["commit", "--rm", &ctr, reference])?;
        let _ = fs::remove_file(archive);
        buildah(&[
            "push",
            &id,
            &format!("oci-archive:{}:{reference}", archive.display()),
        ])?;
        buildah(&["rmi", &id]).map(|_| ())
    })();
    if built.is_err() {
        let _ = buildah(&["rm", &ctr]);
    }
    built
}

/// `k8s.io/kubernetes`'s source of the pause program, in the Go module
/// cache.
fn pause_source() -> Result<PathBuf> {
    let out = ok(&["go", "env", "GOMODCACHE"])
        .or_else(|_| ok(&["/usr/local/go/bin/go", "env", "GOMODCACHE"]))?;
    let version = crate::control_plane::k8s::KUBERNETES;
    let source = PathBuf::from(out.trim()).join(format!(
        "k8s.io/kubernetes@{version}/build/pause/linux/pause.c"
    ));
    if !source.is_file() {
        anyhow::bail!(
            "{} is missing (cargo xtask setup downloads the module)",
            source.display()
        );
    }
    Ok(source)
}

fn build_pause(dir: &Path) -> Result<Archive> {
    let rootfs = dir.join("pause-rootfs");
    fs::create_dir_all(&rootfs)?;
    let source = pause_source()?.display().to_string();
    let binary = rootfs.join("pause").display().to_string();
    ok(&[
        "gcc",
        "-Os",
        "-static",
        "-o",
        &binary,
        &source,
        "-DVERSION=tests",
    ])?;
    let path = dir.join("pause.oci.tar");
    from_rootfs(&rootfs, r#"["/pause"]"#, PAUSE, &path)?;
    Ok(Archive {
        path,
        ref_name: PAUSE.into(),
        image: PAUSE.into(),
    })
}

fn build_workload(dir: &Path) -> Result<Archive> {
    let rootfs = dir.join("workload-rootfs");
    fs::create_dir_all(rootfs.join("bin"))?;
    fs::create_dir_all(rootfs.join("tmp"))?;
    fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
        .context("/bin/busybox (Debian's busybox-static)")?;
    for applet in [
        "sh", "sleep", "httpd", "nc", "ip", "cat", "echo", "wget", "rm", "touch",
    ] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    let path = dir.join("workload.oci.tar");
    from_rootfs(&rootfs, r#"["/bin/busybox"]"#, WORKLOAD, &path)?;
    Ok(Archive {
        path,
        ref_name: WORKLOAD.into(),
        image: WORKLOAD.into(),
    })
}

/// The three archives, built once per test process.
pub fn archives() -> Result<&'static [Archive; 3]> {
    static BUILT: OnceLock<std::result::Result<[Archive; 3], String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            (|| -> Result<[Archive; 3]> {
                let dir = std::env::temp_dir().join("cozy-proxy-node-images");
                let _ = fs::remove_dir_all(&dir);
                fs::create_dir_all(&dir)?;
                let cozy = Archive {
                    path: test_image()?,
                    ref_name: TEST_TAG.into(),
                    image: format!("{COZY_PROXY_REPOSITORY}:{TEST_TAG}"),
                };
                Ok([build_pause(&dir)?, build_workload(&dir)?, cozy])
            })()
            .map_err(|e| format!("{e:#}"))
        })
        .as_ref()
        .map_err(|e| anyhow!("building the nodes' images: {e}"))
}
