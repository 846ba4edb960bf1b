//! The container image without a daemon: `/cozy-proxy` and exactly the
//! libraries it loads on an empty base, built with buildah (vfs storage)
//! into an OCI archive a user can load or push. `cargo xtask image` builds
//! the release one; `cargo xtask image-of` builds one of any binary (the
//! container tests build theirs from the binary under test).
use anyhow::{bail, Context, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

/// Runs `args`, returning its standard output; fails with its standard
/// error on a non-zero exit.
fn ok(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("starting {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The shared libraries `binary` loads (the glibc build is dynamic; the
/// image carries exactly these), from `ldd`.
pub fn libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = ok(&["ldd", &binary.display().to_string()])?;
    let mut libs = Vec::new();
    for line in out.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
        // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no file.
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    if libs.is_empty() {
        bail!("ldd found no libraries for {}: {out}", binary.display());
    }
    Ok(libs)
}

fn buildah(args: &[&str]) -> Result<String> {
    let mut all = vec!["buildah", "--storage-driver", "vfs"];
    all.extend_from_slice(args);
    ok(&all).map(|o| o.trim().to_string())
}

/// Builds the image: `/cozy-proxy` and its libraries on an empty base,
/// entrypoint `/cozy-proxy`, command `run` (as the Dockerfile's), written
/// as an OCI archive to `archive` with reference name `tag`.
pub fn build(binary: &Path, archive: &Path, tag: &str) -> Result<()> {
    let staging = archive.with_extension("rootfs");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging)?;
    fs::copy(binary, staging.join("cozy-proxy"))
        .with_context(|| format!("copying {}", binary.display()))?;
    for lib in libraries(binary)? {
        let to = staging.join(lib.strip_prefix("/")?);
        fs::create_dir_all(to.parent().context("library path")?)?;
        // Follows symlinks: the image holds the files themselves.
        fs::copy(&lib, &to).with_context(|| format!("copying {}", lib.display()))?;
    }
    // Mount points (the root is read-only in the pod).
    for dir in ["proc", "sys/fs/bpf", "dev", "tmp"] {
        fs::create_dir_all(staging.join(dir))?;
    }
    let ctr = buildah(&["from", "scratch"])?;
    let result = (|| {
        buildah(&["copy", &ctr, &format!("{}/", staging.display()), "/"])?;
        buildah(&[
            "config",
            "--entrypoint",
            r#"["/cozy-proxy"]"#,
            "--cmd",
            "run",
            "--label",
            "org.opencontainers.image.title=cozy-proxy",
            &ctr,
        ])?;
        let _ = fs::remove_file(archive);
        buildah(&[
            "commit",
            "--quiet",
            "--format",
            "oci",
            &ctr,
            &format!("oci-archive:{}:{tag}", archive.display()),
        ])
    })();
    let _ = buildah(&["rm", &ctr]);
    let _ = fs::remove_dir_all(&staging);
    result.map(|_| ())
}
