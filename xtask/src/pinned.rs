//! Go commands from a module other than Kubernetes' (MetalLB, helm,
//! containerd, crictl), built with the machine's Go into a cache of their
//! own. Where they are clients of the API (MetalLB, helm), their
//! Kubernetes libraries are pinned to the release the control plane is
//! built from (xtask/src/k8s.rs): every component of the tests speaks the
//! same client code, and the Go build cache shares the libraries'
//! compiled packages between the builds.
use crate::gotool::{go, run_go};
use crate::k8s::pin_staging;
use anyhow::{Context, Result};
use std::{path::PathBuf, time::Instant};

/// What to build: `packages` of `module` at `version`.
pub struct GoCommands<'a> {
    pub module: &'a str,
    pub version: &'a str,
    pub packages: &'a [&'a str],
    pub ldflags: &'a str,
    /// Build tags (`-tags`), or empty.
    pub tags: &'a str,
    /// Pin the Kubernetes staging modules to the control plane's release;
    /// a module that is no API client keeps the versions it requires.
    pub pin_kubernetes: bool,
    /// Where the build goes: `bin/` (moved into place once built) and
    /// `src/` (the go.mod that pins the libraries).
    pub cache: PathBuf,
}

impl GoCommands<'_> {
    pub fn bin(&self) -> PathBuf {
        self.cache.join("bin")
    }

    /// Builds the commands into [`GoCommands::bin`]; returns the module's
    /// source directory (for files the caller takes from it).
    pub fn build(&self) -> Result<PathBuf> {
        let go = go()?;
        let src = self.cache.join("src");
        std::fs::create_dir_all(&src)?;
        let started = Instant::now();
        eprintln!(
            "xtask: building {} {} from its Go module into {}",
            self.module,
            self.version,
            self.cache.display()
        );
        let head = format!(
            "module cozy-proxy-tools\n\ngo 1.24.0\n\nrequire {} {}\n",
            self.module, self.version
        );
        if self.pin_kubernetes {
            pin_staging(&go, &src, &head)?;
        } else {
            std::fs::write(src.join("go.mod"), &head)?;
        }
        let out = run_go(
            &go,
            &src,
            &[
                "mod",
                "download",
                "-json",
                &format!("{}@{}", self.module, self.version),
            ],
        )?;
        let info: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("go mod download -json")?;
        let module = PathBuf::from(info["Dir"].as_str().context("the module's directory")?);
        let partial = self.cache.join("bin.partial");
        std::fs::create_dir_all(&partial)?;
        let out_arg = format!("{}/", partial.display());
        let mut args = vec![
            "build",
            "-trimpath",
            "-ldflags",
            self.ldflags,
            "-o",
            &out_arg,
        ];
        if !self.tags.is_empty() {
            args.extend(["-tags", self.tags]);
        }
        args.extend_from_slice(self.packages);
        run_go(&go, &src, &args)?;
        let bin = self.bin();
        let _ = std::fs::remove_dir_all(&bin);
        std::fs::rename(&partial, &bin)?;
        eprintln!(
            "xtask: {} built in {:.0?} ({})",
            self.module,
            started.elapsed(),
            bin.display()
        );
        Ok(module)
    }
}
