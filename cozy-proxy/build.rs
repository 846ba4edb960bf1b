//! Builds the eBPF object (`cozy-proxy-ebpf`) and hands its path to the crate
//! as `COZY_PROXY_EBPF_OBJ`, so one `cargo build` yields a binary with the
//! programs embedded.
//!
//! The eBPF crate needs `-Z build-std=core`, which rustup's toolchains here
//! cannot do (no rust-src). What it needs, all installed by `cargo xtask
//! setup`:
//! - Debian's rustc (`/usr/bin/rustc`, packages rustc-web and
//!   rust-web-src for its std source) and cargo (`/usr/bin/cargo`,
//!   cargo-web), run with `RUSTC_BOOTSTRAP=1`;
//! - `bpf-linker` (crates.io, feature llvm-22) on PATH or in ~/.cargo/bin.
//!
//! Modes (as aya's template has `AYA_BUILD_EBPF`):
//! - `COZY_PROXY_EBPF_OBJ=PATH`: embed a prebuilt object;
//! - `COZY_PROXY_BUILD_EBPF=0`: embed nothing, for `cargo check`/`clippy`
//!   on a machine without the toolchain; the eBPF backend then refuses to
//!   start ("built without its eBPF programs") and `auto` uses nftables;
//! - otherwise: build it, and fail naming what is missing.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

const EBPF_RUSTC: &str = "/usr/bin/rustc";
const EBPF_CARGO: &str = "/usr/bin/cargo";
const EBPF_STD_SOURCE: &str = "/usr/lib/rustlib/src/rust/library/core";

fn main() {
    println!("cargo:rerun-if-env-changed=COZY_PROXY_EBPF_OBJ");
    println!("cargo:rerun-if-env-changed=COZY_PROXY_BUILD_EBPF");
    if let Ok(prebuilt) = env::var("COZY_PROXY_EBPF_OBJ") {
        println!("cargo:rustc-env=COZY_PROXY_EBPF_OBJ={prebuilt}");
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("set by cargo"));
    if env::var("COZY_PROXY_BUILD_EBPF").as_deref() == Ok("0") {
        let empty = out_dir.join("no-ebpf.o");
        fs::write(&empty, b"").expect("writing an empty object");
        println!("cargo:warning=COZY_PROXY_BUILD_EBPF=0: building without the eBPF programs");
        println!("cargo:rustc-env=COZY_PROXY_EBPF_OBJ={}", empty.display());
        return;
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir.parent().expect("crate lives in the workspace");
    let ebpf_dir = root.join("cozy-proxy-ebpf");
    let common_dir = root.join("cozy-proxy-common");
    for dir in [&ebpf_dir, &common_dir] {
        println!("cargo:rerun-if-changed={}", dir.join("src").display());
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("Cargo.toml").display()
        );
    }
    let target_dir = out_dir.join("ebpf");
    build_ebpf(&ebpf_dir, &target_dir);
    let object = target_dir.join("bpfel-unknown-none/release/cozy-proxy-ebpf");
    println!("cargo:rustc-env=COZY_PROXY_EBPF_OBJ={}", object.display());
}

/// What the eBPF build needs and is not there.
fn missing_toolchain(home: &str) -> Vec<String> {
    let mut missing = Vec::new();
    for (path, what) in [
        (EBPF_RUSTC, "Debian's rustc (package rustc-web)"),
        (EBPF_CARGO, "Debian's cargo (package cargo-web)"),
        (EBPF_STD_SOURCE, "its std source (package rust-web-src)"),
    ] {
        if !Path::new(path).exists() {
            missing.push(format!("{what} at {path}"));
        }
    }
    let on_path = env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain([format!("{home}/.cargo/bin").as_str()])
        .any(|d| Path::new(d).join("bpf-linker").is_file());
    if !on_path {
        missing.push("bpf-linker (cargo install bpf-linker --features llvm-22)".into());
    }
    missing
}

fn build_ebpf(ebpf_dir: &Path, target_dir: &Path) {
    let home = env::var("HOME").unwrap_or_else(|_| "/root".into());
    let missing = missing_toolchain(&home);
    if !missing.is_empty() {
        panic!(
            "the eBPF programs cannot be built: missing {}.\n\
             Run `cargo xtask setup` (as root), or build without them with COZY_PROXY_BUILD_EBPF=0.",
            missing.join(", ")
        );
    }
    let mut cmd = Command::new(EBPF_CARGO);
    // The outer cargo (or clippy) leaks its own compiler, wrappers and flags
    // into our environment; none of them may reach the eBPF build.
    for (key, _) in env::vars() {
        if key.starts_with("CARGO") || key.starts_with("RUSTC") || key == "RUSTFLAGS" {
            cmd.env_remove(key);
        }
    }
    let path = env::var("PATH").unwrap_or_default();
    cmd.current_dir(ebpf_dir)
        .env("RUSTC", EBPF_RUSTC)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf")
        .env("CARGO_TARGET_DIR", target_dir)
        .env("PATH", format!("{home}/.cargo/bin:{path}"))
        .args([
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--ignore-rust-version",
        ]);
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {EBPF_CARGO} for the eBPF crate: {e}"));
    if !status.success() {
        panic!("building cozy-proxy-ebpf with {EBPF_CARGO} failed ({status})");
    }
}
