//! The embedded eBPF object passes the kernel's verifier (needs root).
use std::process::Command;

#[test]
fn embedded_programs_load_into_the_kernel() {
    let out = Command::new(env!("CARGO_BIN_EXE_cozy-proxy"))
        .arg("check-ebpf")
        .output()
        .expect("run cozy-proxy check-ebpf");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check-ebpf failed: {}{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        ["cozy_egress", "cozy_ingress", "cozy_xdp"]
            .iter()
            .all(|p| stdout.contains(p)),
        "{stdout}"
    );
}
