//! Project tasks: `cargo xtask setup | build | test | demo`.
//!
//! - setup: installs, idempotently, what a fresh Debian 12 machine needs
//!   (Debian packages, bpf-linker, rustfmt and clippy).
//! - build: the release binary, with the eBPF object built and embedded.
//! - test: setup, then format, lint and every test (unit, property, nft
//!   ruleset, eBPF load, the datapath scenario suite).
//! - test --unit: the rootless tier, without setup: the unit and property
//!   tests of every crate (no namespace, no kernel state, no root).
//! - fuzz [SECONDS]: a long fuzz run of the packet paths with a fresh seed.
//! - release check | X.Y.Z: the version agrees in every file; cut a
//!   release (see release.rs).
//! - image [TAG]: the container image (TAG: the version by default).
//! - image-of BINARY ARCHIVE TAG: an image of any binary, without a
//!   container engine (the container tests build theirs so).
//! - demo: setup, then the local demo (network namespaces as node, pod and
//!   outside client, with real traffic).
mod cilium;
mod gotool;
mod helm;
mod image;
mod k8s;
#[cfg(test)]
mod layers;
mod metallb;
mod node_runtime;
mod pinned;
mod plot;
mod release;
mod render;
mod testing;

use anyhow::{bail, Context, Result};
use std::{
    env,
    path::PathBuf,
    process::{Command, Stdio},
};

/// Debian packages the demo needs: the eBPF toolchain (Debian's rustc with
/// its std source, LLVM 22 for bpf-linker) and the tools it runs.
const DEMO_PACKAGES: &[&str] = &[
    "rustc-web",
    "rust-web-src",
    "cargo-web",
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "nftables",
    "bpftool",
    "iproute2",
    "iputils-ping",
    "socat",
    "ethtool",
    "procps",
];

/// And the tests, benchmarks and image beside them.
const TEST_PACKAGES: &[&str] = &[
    "conntrack",
    "iperf3",
    "netsniff-ng",
    "ncat",
    "tcpdump",
    "sockperf",
    "curl",
    // The order of a controller's syscalls (tests/ebpf_backend.rs).
    "strace",
    "fonts-dejavu-core",
    // The real control plane's certificates (cozy-proxy-testkit/src/control_plane/k8s.rs).
    "openssl",
    // The image without a daemon, and the container under the chart's
    // settings (cargo xtask image, tests/container.rs); buildah brings
    // containers-common's default seccomp profile.
    "buildah",
    "umoci",
    "runc",
    // The real Cilium agent compiles its datapath with the LLVM its own
    // image carries (xtask/src/cilium.rs), and installs iptables rules.
    "clang-19",
    "llvm-19",
    "iptables",
    // The real nodes: runc under containerd, the CNI plugins, and the
    // pause and workload images (nodes/kubelet.rs): pause.c built static,
    // busybox for the workload.
    "containernetworking-plugins",
    "gcc",
    "libc6-dev",
    "busybox-static",
];

/// What a setup is for: the demo needs the toolchain and a few tools;
/// everything else (the tests) also needs helm, kubectl and the real
/// Kubernetes components built from source (minutes on a bare machine).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Demo,
    Everything,
}

const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

fn main() -> Result<()> {
    let args: Vec<String> = env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("setup") => setup(Purpose::Everything),
        Some("build") => {
            setup(Purpose::Everything)?;
            build()
        }
        Some("test") if args.get(1).is_some_and(|a| a == "--unit") => testing::unit(),
        Some("test") => {
            setup(Purpose::Everything)?;
            testing::test(&args[1..])
        }
        Some("demo") => {
            setup(Purpose::Demo)?;
            demo()
        }
        Some("image") => match args.get(1) {
            Some(tag) => release_image(tag),
            None => release_image(&release::version(&root())?),
        },
        Some("image-of") => match &args[1..] {
            [binary, archive, tag] => {
                image::build(&PathBuf::from(binary), &PathBuf::from(archive), tag)
            }
            _ => bail!("usage: cargo xtask image-of BINARY ARCHIVE TAG"),
        },
        Some("release") => release::cli(&args[1..]),
        Some("bench") => {
            setup(Purpose::Everything)?;
            bench(&args[1..])
        }
        Some("fuzz") => {
            setup(Purpose::Everything)?;
            fuzz(args.get(1).map(String::as_str))
        }
        _ => {
            eprintln!("usage: cargo xtask <setup|build|test [--unit | cargo test args]|demo|image [TAG]|image-of BINARY ARCHIVE TAG|release <check|X.Y.Z>|bench control-plane|datapath|per-packet|render|fuzz [SECONDS]>");
            std::process::exit(2);
        }
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo_home_bin() -> PathBuf {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cargo")
        })
        .join("bin")
}

/// Runs a command, streaming its output; fails on a non-zero exit.
fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn cargo() -> Command {
    let mut c = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn setup(purpose: Purpose) -> Result<()> {
    // SAFETY-free check of the effective user: apt and the tests need root.
    let uid = Command::new("id").arg("-u").output().context("id -u")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("cargo xtask setup must run as root (apt-get, network namespaces, nftables, BPF)");
    }
    let tests: &[&str] = match purpose {
        Purpose::Demo => &[],
        Purpose::Everything => TEST_PACKAGES,
    };
    let missing: Vec<&str> = (DEMO_PACKAGES.iter().chain(tests))
        .copied()
        .filter(|p| {
            let out = Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output();
            !out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if !missing.is_empty() {
        run(Command::new("apt-get").arg("update").arg("-q"))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    let linker = cargo_home_bin().join("bpf-linker");
    if !succeeds(Command::new(&linker).arg("--version")) {
        let path = format!("{LLVM_PREFIX}/bin:{}", env::var("PATH").unwrap_or_default());
        run(cargo()
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--no-default-features",
                "--features",
                "llvm-22",
            ])
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .env("PATH", path))?;
    }
    if purpose == Purpose::Everything {
        let bin = k8s::ensure()?;
        link_tool("kubectl", &bin.join("kubectl"))?;
        eprintln!(
            "xtask: Kubernetes {} components in {}",
            k8s::KUBERNETES,
            bin.display()
        );
        link_tool("helm", &helm::ensure()?)?;
        let metallb = metallb::ensure()?;
        eprintln!(
            "xtask: MetalLB {} in {}",
            metallb::METALLB,
            metallb.display()
        );
        let cilium = cilium::ensure()?;
        eprintln!("xtask: Cilium {} in {}", cilium::CILIUM, cilium.display());
        let [containerd, crictl] = node_runtime::ensure()?;
        eprintln!(
            "xtask: containerd {} in {}, crictl {} in {}",
            node_runtime::CONTAINERD,
            containerd.display(),
            node_runtime::CRI_TOOLS,
            crictl.display()
        );
    }
    for (tool, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        if !succeeds(cargo().args([tool, "--version"])) {
            run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    eprintln!("xtask: setup complete");
    Ok(())
}

/// Links `/usr/local/bin/<name>` to `target` (the tests run helm and
/// kubectl by name).
fn link_tool(name: &str, target: &std::path::Path) -> Result<()> {
    let link = PathBuf::from("/usr/local/bin").join(name);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(target, &link)
        .with_context(|| format!("linking {} to {}", link.display(), target.display()))
}

fn build() -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "cozy-proxy"]))?;
    eprintln!(
        "xtask: built {}",
        root().join("target/release/cozy-proxy").display()
    );
    Ok(())
}

/// A long fuzz run with a fresh seed: the TC programs through
/// BPF_PROG_TEST_RUN for `seconds` (default 300), then the scenario-level
/// fuzz (scenario 32) on both backends and families. Failures are kept in
/// target/fuzz/failures/ (move them to cozy-proxy/tests/fuzz-corpus/ to
/// keep them as regression cases).
fn fuzz(seconds: Option<&str>) -> Result<()> {
    let seconds: u64 = match seconds {
        Some(s) => s.parse().context("cargo xtask fuzz [SECONDS]")?,
        None => 300,
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    eprintln!("xtask: fuzzing for {seconds} s with seed {seed}");
    let fuzz_env = |cmd: &mut Command| {
        cmd.env("COZY_FUZZ_SEED", seed.to_string());
    };
    let mut programs = cargo();
    programs
        .args([
            "test",
            "-p",
            "cozy-proxy",
            "--test",
            "bpf_packets",
            "fuzzed_frames",
        ])
        .args(["--", "--nocapture"])
        .env("COZY_FUZZ_SECONDS", seconds.to_string())
        .env("COZY_FUZZ_CASES", u64::MAX.to_string());
    fuzz_env(&mut programs);
    run(&mut programs)?;
    let mut scenarios = cargo();
    scenarios
        .args([
            "test",
            "-p",
            "cozy-proxy",
            "--test",
            "scenarios",
            "s32_fuzzed_frames",
        ])
        .args(["--", "--nocapture", "--test-threads", "1"]);
    fuzz_env(&mut scenarios);
    run(&mut scenarios)
}

/// Runs a benchmark (release build) into target/bench/KIND.json, then
/// renders BENCHMARKS.md from every result there.
fn bench(args: &[String]) -> Result<()> {
    let kind = args.first().map(String::as_str).unwrap_or("render");
    let out_dir = root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    if kind != "render" {
        if !matches!(kind, "control-plane" | "datapath" | "per-packet") {
            bail!("cargo xtask bench control-plane|datapath|per-packet|render");
        }
        run(cargo().args([
            "build",
            "--release",
            "-p",
            "cozy-proxy",
            "-p",
            "cozy-proxy-bench",
            "--bins",
        ]))?;
        let out = Command::new(root().join(format!("target/release/bench-{kind}")))
            .args(&args[1..])
            .env("COZY_PROXY_BIN", root().join("target/release/cozy-proxy"))
            .stderr(Stdio::inherit())
            .output()
            .context("running the benchmark")?;
        if !out.status.success() {
            bail!("benchmark {kind} failed: {}", out.status);
        }
        std::fs::write(out_dir.join(format!("{kind}.json")), &out.stdout)?;
    }
    let read = |k: &str| -> Option<serde_json::Value> {
        serde_json::from_slice(&std::fs::read(out_dir.join(format!("{k}.json"))).ok()?).ok()
    };
    let plots = root().join("docs/bench");
    std::fs::create_dir_all(&plots)?;
    if let Some(d) = read("datapath") {
        plot::datapath(&d, &plots.join("datapath.png"))?;
    }
    if let Some(c) = read("control-plane") {
        plot::control_plane(&c, &plots.join("control-plane.png"))?;
    }
    let md = render::benchmarks_md(
        read("control-plane"),
        read("datapath"),
        read("per-packet"),
        &machine(),
    );
    std::fs::write(root().join("BENCHMARKS.md"), md)?;
    eprintln!("xtask: wrote BENCHMARKS.md");
    Ok(())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_string())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(String::new(), |kb| format!("{} GiB", kb / 1024 / 1024));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores ({cpu}), {mem} memory, Linux {kernel}; namespaces and veths on one machine (checksum offload off)")
}

/// Builds the container image: with the first container engine that
/// answers, from the Dockerfile; without one (these machines), with
/// buildah from the release binary and exactly the libraries it loads,
/// into an OCI archive (`target/image/cozy-proxy-TAG.oci.tar`) that
/// `podman load`, `skopeo copy oci-archive:... docker://...` or `ctr
/// images import` take.
fn release_image(tag: &str) -> Result<()> {
    if let Some(engine) = ["docker", "podman", "nerdctl"]
        .into_iter()
        .find(|e| succeeds(Command::new(e).arg("info")))
    {
        return run(Command::new(engine)
            .args(["build", "-t", &format!("cozy-proxy:{tag}"), "."])
            .current_dir(root()));
    }
    setup(Purpose::Everything)?;
    build()?;
    let dir = root().join("target/image");
    std::fs::create_dir_all(&dir)?;
    let archive = dir.join(format!("cozy-proxy-{tag}.oci.tar"));
    image::build(&root().join("target/release/cozy-proxy"), &archive, tag)?;
    eprintln!(
        "xtask: image {} (OCI archive, reference {tag})",
        archive.display()
    );
    Ok(())
}

fn demo() -> Result<()> {
    run(cargo().args(["build", "-q", "-p", "cozy-proxy", "--bins"]))?;
    run(cargo()
        .args(["run", "-q", "-p", "cozy-proxy-testkit", "--bin", "demo"])
        .env("COZY_PROXY_BIN", root().join("target/debug/cozy-proxy")))
}
