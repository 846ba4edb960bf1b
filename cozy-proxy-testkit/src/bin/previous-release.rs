//! Builds the previous release's `cozy-proxy` for the upgrade test (see
//! `controller::release`), and prints its version and path. `cargo xtask
//! test` runs it before the whole suite's test binaries, so that the
//! build (about a minute and a half on 2 cores, nothing when it is there)
//! is not part of the upgrade test's time.
fn main() -> anyhow::Result<()> {
    let (release, bin) = cozy_proxy_testkit::controller::release::previous_binary()?;
    println!("{} {}", release.version, bin.display());
    Ok(())
}
