//! The previous release's `cozy-proxy`, built from its git tag, for the
//! upgrade test.
//!
//! The previous release is the newest tag `vX.Y.Z` in HEAD's history
//! whose version differs from this build's; where the tags were not
//! carried (a clone that took the branch alone), the newest commit whose
//! subject is `Release vX.Y.Z` (what `cargo xtask release` writes). Its
//! tree is exported under `target/previous-release/X.Y.Z/` and built there
//! with a target directory of its own: a shared one would have the two
//! builds overwrite each other's binaries. Tests in several processes
//! wait for one build (a file lock).
use crate::workspace;
use anyhow::{bail, Context, Result};
use std::{
    fs,
    os::fd::AsRawFd,
    path::PathBuf,
    process::{Command, Stdio},
};

/// A release: its version and the commit it was cut from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub version: String,
    pub commit: String,
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(workspace())
        .args(args)
        .output()
        .context("running git")?;
    if !out.status.success() {
        bail!(
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The newest release before this build's version.
pub fn previous() -> Result<Release> {
    let current = env!("CARGO_PKG_VERSION");
    let tags = git(&[
        "tag",
        "--list",
        "v*",
        "--merged",
        "HEAD",
        "--sort=-v:refname",
    ])?;
    for tag in tags.lines() {
        let version = tag.trim_start_matches('v');
        if version != current {
            let commit = git(&["rev-parse", &format!("{tag}^{{commit}}")])?;
            return Ok(Release {
                version: version.to_string(),
                commit,
            });
        }
    }
    let subjects = git(&["log", "--format=%H %s", "--grep=^Release v", "HEAD"])?;
    for line in subjects.lines() {
        let Some((commit, subject)) = line.split_once(' ') else {
            continue;
        };
        let Some(version) = subject.strip_prefix("Release v") else {
            continue;
        };
        if version != current {
            return Ok(Release {
                version: version.to_string(),
                commit: commit.to_string(),
            });
        }
    }
    bail!(
        "no release before {current} in HEAD's history (no tag vX.Y.Z, no commit \
         'Release vX.Y.Z'): the upgrade test needs a clone with the history"
    )
}

/// The previous release's binary, built once (minutes the first time).
/// `COZY_PROXY_PREVIOUS_BIN` names another build to upgrade from instead
/// (this one, for an A/A control).
pub fn previous_binary() -> Result<(Release, PathBuf)> {
    if let Ok(bin) = std::env::var("COZY_PROXY_PREVIOUS_BIN") {
        let release = Release {
            version: format!("COZY_PROXY_PREVIOUS_BIN={bin}"),
            commit: String::new(),
        };
        return Ok((release, PathBuf::from(bin)));
    }
    let release = previous()?;
    let dir = workspace()
        .join("target/previous-release")
        .join(&release.version);
    fs::create_dir_all(&dir)?;
    let lock = fs::File::create(dir.join("lock"))?;
    // SAFETY: flock on a descriptor this function owns; released when
    // `lock` is dropped.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!("locking {}", dir.display());
    }
    let src = dir.join("src");
    let exported = dir.join("exported");
    if fs::read_to_string(&exported).ok().as_deref() != Some(release.commit.as_str()) {
        let _ = fs::remove_dir_all(&src);
        fs::create_dir_all(&src)?;
        let archive = Command::new("git")
            .current_dir(workspace())
            .args(["archive", &release.commit])
            .stdout(Stdio::piped())
            .spawn()
            .context("git archive")?;
        let status = Command::new("tar")
            .arg("-x")
            .arg("-C")
            .arg(&src)
            .stdin(archive.stdout.context("git archive's output")?)
            .status()?;
        if !status.success() {
            bail!("exporting {} into {}", release.commit, src.display());
        }
        fs::write(&exported, &release.commit)?;
    }
    let target = dir.join("target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&src)
        .args([
            "build",
            "-q",
            "--locked",
            "-p",
            "cozy-proxy",
            "--bin",
            "cozy-proxy",
        ])
        .arg("--target-dir")
        .arg(&target);
    // What cargo set for this test (its package's variables, and the
    // build script's: COZY_PROXY_EBPF_OBJ would embed this build's
    // programs in the older binary) stays out of the older build.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if (key.starts_with("CARGO_") && key != "CARGO_HOME") || key.starts_with("COZY_PROXY_") {
            build.env_remove(key.as_ref());
        }
    }
    let out = build.output().context("building the previous release")?;
    if !out.status.success() {
        bail!(
            "building release {} ({}): {}",
            release.version,
            release.commit,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((release, target.join("debug/cozy-proxy")))
}
