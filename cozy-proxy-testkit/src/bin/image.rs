//! `image BINARY ARCHIVE TAG`: the cozy-proxy image from BINARY (and the
//! libraries it loads) as an OCI archive, with buildah and no daemon
//! (`cargo xtask image` runs it; tests/container.rs builds its own the
//! same way).
use anyhow::{Context, Result};
use std::path::PathBuf;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: image BINARY ARCHIVE TAG";
    let binary = PathBuf::from(args.next().context(usage)?);
    let archive = PathBuf::from(args.next().context(usage)?);
    let tag = args.next().context(usage)?;
    cozy_proxy_testkit::image::build(&binary, &archive, &tag)
}
