//! The local demo: network namespaces as node, pods and an outside client,
//! the real `cozy-proxy run` on the manifests of `examples/demo/`, and real
//! traffic showing the 1:1 NAT. Run with `cargo xtask demo` (needs root).
use cozy_proxy_testkit as harness;

use anyhow::{Context, Result};
use harness::{
    nodes::net::{Fam, Net},
    sh::ok_in,
    traffic::{eventually, ping, tcp_request, Server, SETTLE},
    Backend, Env,
};
use std::fs;

fn step(text: &str) {
    println!("\n==> {text}");
}

fn main() -> Result<()> {
    for backend in [Backend::Nft, Backend::Ebpf] {
        println!("\n########## backend: {} ##########", backend.arg());
        demo(backend)?;
    }
    Ok(())
}

fn demo(backend: Backend) -> Result<()> {
    step("Creating namespaces: ext (outside client/server), node (forwarding, CNI masquerade), pod1..pod3");
    let mut env = Env::new(backend, Fam::V4)?;
    let examples = cozy_proxy_testkit::workspace().join("examples/demo");
    step(&format!(
        "Starting `cozy-proxy run --backend {} --manifests DIR` in node with {}",
        backend.arg(),
        examples.display()
    ));
    for file in harness::controller::manifests::files_in(&examples)? {
        let name = file
            .file_stem()
            .and_then(|s| s.to_str())
            .context("file name")?;
        env.dir.put(name, &fs::read_to_string(&file)?)?;
        println!("    {}", file.display());
    }
    env.settle()?;
    step("`cozy-proxy dump` (read back from the kernel)");
    let pins = env.ctl.pin_dir.display().to_string();
    print!(
        "{}",
        ok_in(
            &env.topo.node(),
            &[
                &harness::bin(),
                "dump",
                "--backend",
                backend.arg(),
                "--bpf-pin-dir",
                &pins
            ]
        )?
    );

    let ext = env.topo.ext();
    for fam in [Fam::V4, Fam::V6] {
        env.net = Net::new(fam);
        let (lb, pod1) = (env.lb(0), env.pod_ip(1));
        step(&format!(
            "{fam:?}: vm1 = LoadBalancer {lb} <-> pod1 {pod1} (wholeIP)"
        ));
        let from = eventually(SETTLE, || ping(&ext, lb))?;
        println!("    ping {lb} from ext: reply from {from}");
        let _web = env.serve_tcp(1, 8080)?;
        let got = eventually(SETTLE, || tcp_request(&ext, lb, 8080))?;
        println!("    TCP {lb}:8080 from ext: pod answered \"{got}\" (pod1 sees the real client)");
        let _srv = Server::tcp(&ext, fam, 7000, "ext")?;
        let got = eventually(SETTLE, || tcp_request(&env.pod_ns(1), env.net.ext, 7000))?;
        println!(
            "    pod1 -> ext server: server answered \"{got}\" (source is the LoadBalancer IP)"
        );
        let got = eventually(SETTLE, || tcp_request(&env.pod_ns(2), env.net.ext, 7000))?;
        println!("    pod2 (unmanaged) -> ext server: \"{got}\" (plain masquerade to the node)");
    }
    env.net = Net::new(Fam::V4);
    let lb3 = env.lb(2);
    step(&format!(
        "vm3 = {lb3} <-> pod3, port filter: TCP 22 only, ICMP allowed"
    ));
    let _ssh = env.serve_tcp(3, 22)?;
    let _web = env.serve_tcp(3, 8080)?;
    let got = eventually(SETTLE, || tcp_request(&ext, lb3, 22))?;
    println!("    TCP {lb3}:22: \"{got}\"");
    match tcp_request(&ext, lb3, 8080) {
        Ok(got) => println!("    TCP {lb3}:8080: unexpectedly answered \"{got}\""),
        Err(_) => println!("    TCP {lb3}:8080: dropped at the node (no answer, no RST)"),
    }
    let from = eventually(SETTLE, || ping(&ext, lb3))?;
    println!("    ping {lb3}: reply from {from}");
    match backend {
        Backend::Nft => {
            step("nft list table ip cozy_proxy (the real nft tool)");
            let table = ok_in(
                &env.topo.node(),
                &["nft", "list", "table", "ip", "cozy_proxy"],
            )?;
            print!("{table}");
        }
        Backend::Ebpf | Backend::EbpfFast | Backend::EbpfXdp => {
            let map = cozy_proxy::ebpf::layouts::pin_path(&env.ctl.pin_dir, "addrs");
            let map = map.display().to_string();
            step(&format!("bpftool map dump pinned {map}"));
            print!(
                "{}",
                harness::sh::ok(&["bpftool", "map", "dump", "pinned", &map])?
            );
            step("ip route show proto 249 (LB IP -> pod routes)");
            print!(
                "{}",
                ok_in(&env.topo.node(), &["ip", "route", "show", "proto", "249"])?
            );
        }
    }
    step("Done; removing the namespaces");
    Ok(())
}
