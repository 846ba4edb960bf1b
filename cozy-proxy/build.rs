//! Builds the eBPF object (`cozy-proxy-ebpf`) and hands its path to the crate
//! as `COZY_PROXY_EBPF_OBJ`, so one `cargo build` yields a binary with the
//! programs embedded.
//!
//! The eBPF crate needs `-Z build-std=core`, which rustup's toolchains here
//! cannot do (no rust-src); Debian's rustc (`/usr/bin/rustc`, with its std
//! source) can, with `RUSTC_BOOTSTRAP=1`. `cargo xtask setup` installs it and
//! `bpf-linker`. Set `COZY_PROXY_EBPF_OBJ` to use a prebuilt object instead.
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const EBPF_RUSTC: &str = "/usr/bin/rustc";
const EBPF_CARGO: &str = "/usr/bin/cargo";

fn main() {
    println!("cargo:rerun-if-env-changed=COZY_PROXY_EBPF_OBJ");
    if let Ok(prebuilt) = env::var("COZY_PROXY_EBPF_OBJ") {
        println!("cargo:rustc-env=COZY_PROXY_EBPF_OBJ={prebuilt}");
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
    let target_dir = PathBuf::from(env::var("OUT_DIR").expect("set by cargo")).join("ebpf");
    build_ebpf(&ebpf_dir, &target_dir);
    let object = target_dir.join("bpfel-unknown-none/release/cozy-proxy-ebpf");
    println!("cargo:rustc-env=COZY_PROXY_EBPF_OBJ={}", object.display());
}

fn build_ebpf(ebpf_dir: &Path, target_dir: &Path) {
    let mut cmd = Command::new(EBPF_CARGO);
    // The outer cargo (or clippy) leaks its own compiler, wrappers and flags
    // into our environment; none of them may reach the eBPF build.
    for (key, _) in env::vars() {
        if key.starts_with("CARGO") || key.starts_with("RUSTC") || key == "RUSTFLAGS" {
            cmd.env_remove(key);
        }
    }
    let home = env::var("HOME").unwrap_or_else(|_| "/root".into());
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
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("cannot run {EBPF_CARGO} for the eBPF crate ({e}); run `cargo xtask setup` first")
    });
    if !status.success() {
        panic!("building cozy-proxy-ebpf failed ({status}); run `cargo xtask setup` first");
    }
}
