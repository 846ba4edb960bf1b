//! `cargo xtask release`: one version for the crates, the chart and the
//! image, and a CHANGELOG that names it.
//!
//! - `release check`: the versions agree (every crate, Chart.yaml's
//!   `version` and `appVersion`, the lock files), and CHANGELOG.md's first
//!   section is `## Unreleased` on a `-dev` version, `## X.Y.Z - date` on a
//!   release. The image's tag is the chart's `appVersion` (the DaemonSet's
//!   default) and `cargo xtask image`'s default, so it agrees by
//!   construction. A test runs the check on the repository.
//! - `release X.Y.Z`: on a clean tree, sets X.Y.Z everywhere, dates the
//!   Unreleased section, commits `Release vX.Y.Z` and tags `vX.Y.Z`; then
//!   starts the next minor version as `X.(Y+1).0-dev` with an empty
//!   Unreleased section, in a second commit. The upgrade test finds the
//!   previous release by its tag (or, where tags were not carried, by the
//!   `Release vX.Y.Z` commit subject).
use crate::{root, run};
use anyhow::{bail, Context, Result};
use std::{fs, path::Path, process::Command};

/// Files holding our version, relative to the root.
const WORKSPACE: &str = "Cargo.toml";
const EBPF_CRATE: &str = "cozy-proxy-ebpf/Cargo.toml";
const CHART: &str = "charts/cozy-proxy/Chart.yaml";
const LOCKS: [&str; 2] = ["Cargo.lock", "cozy-proxy-ebpf/Cargo.lock"];
const CHANGELOG: &str = "CHANGELOG.md";
/// Our packages, as the lock files name them.
const PACKAGES: [&str; 6] = [
    "cozy-proxy",
    "cozy-proxy-bench",
    "cozy-proxy-common",
    "cozy-proxy-testkit",
    "cozy-proxy-ebpf",
    "xtask",
];
const UNRELEASED: &str = "Unreleased";

pub fn cli(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("check") => {
            let problems = check(&root())?;
            if !problems.is_empty() {
                bail!("the release files disagree:\n- {}", problems.join("\n- "));
            }
            println!("xtask: version {} agrees everywhere", version(&root())?);
            Ok(())
        }
        Some(v) if parse(v).is_some() => release(v),
        _ => bail!("usage: cargo xtask release <check | X.Y.Z>"),
    }
}

/// `X.Y.Z` or `X.Y.Z-pre` as numbers and the pre-release part.
fn parse(v: &str) -> Option<([u64; 3], Option<&str>)> {
    let (core, pre) = match v.split_once('-') {
        Some((core, pre)) if !pre.is_empty() => (core, Some(pre)),
        Some(_) => return None,
        None => (v, None),
    };
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let out = [parts.next()??, parts.next()??, parts.next()??];
    parts.next().is_none().then_some((out, pre))
}

/// The workspace's version (`[workspace.package]`).
pub fn version(root: &Path) -> Result<String> {
    let text = read(root, WORKSPACE)?;
    section_value(&text, "[workspace.package]", "version")
        .context("no version in [workspace.package] of Cargo.toml")
}

fn read(root: &Path, file: &str) -> Result<String> {
    fs::read_to_string(root.join(file)).with_context(|| format!("reading {file}"))
}

/// `key = "value"` in the TOML section `header` (up to the next section).
fn section_value(text: &str, header: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == header;
        } else if inside {
            if let Some((k, v)) = line.split_once('=') {
                if k.trim() == key {
                    return Some(v.trim().trim_matches('"').to_string());
                }
            }
        }
    }
    None
}

/// `key: value` at the top level of a YAML file.
fn yaml_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().trim_matches('"').to_string())
}

/// The versions a lock file gives our packages.
fn locked(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            if PACKAGES.contains(&n.as_str()) {
                out.push((n, v.trim_matches('"').to_string()));
            }
        }
    }
    out
}

/// The first `## ` heading of the changelog.
fn changelog_top(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|l| l.strip_prefix("## "))
        .map(str::trim)
}

/// What disagrees, in words (empty: all agree).
pub fn check(root: &Path) -> Result<Vec<String>> {
    let v = version(root)?;
    let mut problems = Vec::new();
    let Some((_, pre)) = parse(&v) else {
        return Ok(vec![format!("version {v:?} is not X.Y.Z or X.Y.Z-pre")]);
    };
    let mut expect = |what: String, found: Option<String>| {
        if found.as_deref() != Some(v.as_str()) {
            problems.push(format!("{what} is {found:?}, the workspace {v}"));
        }
    };
    let ebpf = read(root, EBPF_CRATE)?;
    expect(
        format!("{EBPF_CRATE} version"),
        section_value(&ebpf, "[package]", "version"),
    );
    let chart = read(root, CHART)?;
    for key in ["version", "appVersion"] {
        expect(format!("{CHART} {key}"), yaml_value(&chart, key));
    }
    for lock in LOCKS {
        for (name, locked) in locked(&read(root, lock)?) {
            expect(format!("{lock}'s {name}"), Some(locked));
        }
    }
    let changelog = read(root, CHANGELOG)?;
    let top = changelog_top(&changelog).unwrap_or("");
    match pre {
        Some(_) if top != UNRELEASED => problems.push(format!(
            "{CHANGELOG} starts with {top:?}: a pre-release ({v}) starts with ## {UNRELEASED}"
        )),
        None if !top.starts_with(&format!("{v} - ")) => problems.push(format!(
            "{CHANGELOG} starts with {top:?}: release {v} starts with ## {v} - YYYY-MM-DD"
        )),
        _ => {}
    }
    Ok(problems)
}

/// Sets `v` in every file that holds our version.
fn set_version(root: &Path, v: &str) -> Result<()> {
    let old = version(root)?;
    let edit = |file: &str, f: &dyn Fn(&str) -> String| -> Result<()> {
        let text = read(root, file)?;
        fs::write(root.join(file), f(&text)).with_context(|| format!("writing {file}"))
    };
    let line = |from: String, to: String| move |text: &str| text.replacen(&from, &to, 1);
    edit(
        WORKSPACE,
        &line(format!("version = \"{old}\""), format!("version = \"{v}\"")),
    )?;
    edit(
        EBPF_CRATE,
        &line(format!("version = \"{old}\""), format!("version = \"{v}\"")),
    )?;
    edit(CHART, &|text: &str| {
        text.replacen(&format!("version: {old}"), &format!("version: {v}"), 1)
            .replacen(
                &format!("appVersion: \"{old}\""),
                &format!("appVersion: \"{v}\""),
                1,
            )
    })?;
    for lock in LOCKS {
        edit(lock, &|text: &str| {
            let mut out = String::with_capacity(text.len());
            let mut ours = false;
            for l in text.lines() {
                if let Some(n) = l.strip_prefix("name = ") {
                    ours = PACKAGES.contains(&n.trim_matches('"'));
                    out.push_str(l);
                } else if ours && l.starts_with("version = ") {
                    out.push_str(&format!("version = \"{v}\""));
                    ours = false;
                } else {
                    out.push_str(l);
                }
                out.push('\n');
            }
            out
        })?;
    }
    Ok(())
}

fn git(root: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git").current_dir(root).args(args).output()?;
    if !out.status.success() {
        bail!(
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn release(v: &str) -> Result<()> {
    let root = root();
    let Some(([major, minor, _], None)) = parse(v) else {
        bail!("a release is X.Y.Z, without a pre-release part: {v}");
    };
    if !git(&root, &["status", "--porcelain"])?.is_empty() {
        bail!("the working tree has changes: commit or stash them first");
    }
    let changelog = read(&root, CHANGELOG)?;
    if changelog_top(&changelog) != Some(UNRELEASED) {
        bail!("{CHANGELOG} has no ## {UNRELEASED} section on top to release");
    }
    if changelog.contains(&format!("\n## {v} ")) {
        bail!("{CHANGELOG} already has a section for {v}");
    }
    let today = String::from_utf8(Command::new("date").arg("+%F").output()?.stdout)?;
    let today = today.trim();
    set_version(&root, v)?;
    fs::write(
        root.join(CHANGELOG),
        changelog.replacen(&format!("## {UNRELEASED}"), &format!("## {v} - {today}"), 1),
    )?;
    refuse_disagreement(&root)?;
    git_step(&root, &["commit", "-aq", "-m", &format!("Release v{v}")])?;
    git_step(
        &root,
        &[
            "tag",
            "-a",
            &format!("v{v}"),
            "-m",
            &format!("cozy-proxy {v}"),
        ],
    )?;
    let next = format!("{major}.{}.0-dev", minor + 1);
    set_version(&root, &next)?;
    let released = read(&root, CHANGELOG)?;
    fs::write(
        root.join(CHANGELOG),
        released.replacen(
            &format!("## {v} - "),
            &format!("## {UNRELEASED}\n\n## {v} - "),
            1,
        ),
    )?;
    refuse_disagreement(&root)?;
    git_step(&root, &["commit", "-aq", "-m", &format!("Start {next}")])?;
    println!("xtask: released v{v} (tagged); main is now {next}");
    Ok(())
}

/// A git command of the release, its output shown.
fn git_step(root: &Path, args: &[&str]) -> Result<()> {
    run(Command::new("git").current_dir(root).args(args))
}

fn refuse_disagreement(root: &Path) -> Result<()> {
    let problems = check(root)?;
    if !problems.is_empty() {
        bail!(
            "after the edit the files disagree:\n- {}",
            problems.join("\n- ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_as_semver_cores() {
        assert_eq!(parse("0.1.0"), Some(([0, 1, 0], None)));
        assert_eq!(parse("1.20.3-dev"), Some(([1, 20, 3], Some("dev"))));
        for bad in ["0.1", "0.1.0.1", "v0.1.0", "0.1.0-", "0.x.0"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_repository_agrees() {
        let problems = check(&root()).expect("release files readable");
        assert!(problems.is_empty(), "{problems:#?}");
    }

    /// A copy of the release files with one edit each must be refused.
    #[test]
    fn a_disagreeing_file_is_named() {
        let dir = std::env::temp_dir().join(format!("xtask-release-{}", std::process::id()));
        let copy = |edit: Option<(&str, &str, &str)>| -> Vec<String> {
            let _ = fs::remove_dir_all(&dir);
            for f in [WORKSPACE, EBPF_CRATE, CHART, LOCKS[0], LOCKS[1], CHANGELOG] {
                let to = dir.join(f);
                fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
                let mut text = fs::read_to_string(root().join(f)).expect("read");
                if let Some((file, from, into)) = edit {
                    if file == f {
                        assert!(text.contains(from), "{f} holds no {from:?}");
                        text = text.replacen(from, into, 1);
                    }
                }
                fs::write(to, text).expect("write");
            }
            check(&dir).expect("check")
        };
        assert!(copy(None).is_empty());
        let v = version(&root()).expect("version");
        let chart_app = format!("appVersion: \"{v}\"");
        for (file, from, into) in [
            (CHART, chart_app.as_str(), "appVersion: \"9.9.9\""),
            (
                EBPF_CRATE,
                &format!("version = \"{v}\"")[..],
                "version = \"9.9.9\"",
            ),
            (CHANGELOG, "\n## ", "\n## 9.9.9 - 2000-01-01\n\n## "),
        ] {
            let problems = copy(Some((file, from, into)));
            assert!(
                problems.iter().any(|p| p.contains(file)),
                "{file} edited, problems: {problems:?}"
            );
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
