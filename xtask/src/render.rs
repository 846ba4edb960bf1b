//! BENCHMARKS.md from the benchmark results (target/bench/*.json): every
//! figure with its ratio to the baseline of the same run where there is one.
use serde_json::Value;
use std::fmt::Write;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

pub fn benchmarks_md(control: Option<Value>, datapath: Option<Value>, machine: &str) -> String {
    let (control_ref, datapath_ref) = (control.clone(), datapath.clone());
    let mut md = String::from("# Benchmarks\n\n");
    let _ = writeln!(md, "Machine: {machine}.\n");
    if let Some(d) = datapath {
        let reps = &d["repetitions"];
        let secs = d["seconds_per_run"].as_str().unwrap_or("?");
        let _ = writeln!(
            md,
            "## Datapath\n\n`cargo xtask bench datapath` — one run, the same path ext -> node -> pod1 (ingress) and \
             pod1 -> ext (egress) in the scenario topology (without the CNI masquerade), through: the **baseline** \
             (plain routing to the pod IP, no NAT), the **nft** backend, the **ebpf** backend, and the peer \
             **conntrack_dnat** (kube-proxy-style `dnat to`/`snat to`). Each measure repeated {reps} times \
             ({secs} s each): median, with [min-max], and the ratio of the median to the baseline's.\n"
        );
        let metrics = [
            ("tcp_gbps", "TCP throughput (Gbit/s, iperf3)", true),
            (
                "udp64_pps",
                "UDP 64-byte packets/s received (iperf3 -b 0)",
                true,
            ),
            ("tcp_conn_per_s", "new TCP connections/s", true),
            ("rtt_p50_us", "UDP round trip p50 (us, sockperf)", false),
            ("rtt_p99_us", "UDP round trip p99 (us, sockperf)", false),
        ];
        let _ = writeln!(md, "![datapath ratios](docs/bench/datapath.png)\n");
        for dir in ["ingress", "egress"] {
            let _ = writeln!(md, "### {dir}\n");
            let _ = writeln!(
                md,
                "| measure | baseline | nft | ebpf | conntrack_dnat |\n|---|---|---|---|---|"
            );
            for (key, label, _) in metrics {
                let base = f(&d["datapath"]["baseline"][dir][key]["median"]);
                let mut row = format!("| {label} |");
                for case in ["baseline", "nft", "ebpf", "conntrack_dnat"] {
                    let m = &d["datapath"][case][dir][key];
                    let (med, min, max) = (f(&m["median"]), f(&m["min"]), f(&m["max"]));
                    let ratio = if case == "baseline" {
                        String::new()
                    } else {
                        format!(" **{:.2}x**", med / base)
                    };
                    let _ = write!(row, " {med:.2} [{min:.2}-{max:.2}]{ratio} |");
                }
                let _ = writeln!(md, "{row}");
            }
            md.push('\n');
        }
    }
    if let Some(c) = control {
        let _ = writeln!(
            md,
            "## Control plane\n\n`cargo xtask bench control-plane` — N managed Services (IPv4 for the first 250, \
             IPv6 after; every third port-filtered with 2 ports), in a network namespace of its own. *plan*: \
             computing the plan from the objects (median of 5). *initial sync*: an empty datapath filled. *one \
             change*: one Service moved to another pod, applied incrementally (median / p99 over 100-200 \
             changes). *rebuild*: the peer strategy for the same change, empty the datapath then fill it \
             (median); the last column is rebuild / incremental. *RSS*: peak RSS (VmHWM) of `cozy-proxy run` \
             on the same Services given as manifests.\n"
        );
        let _ = writeln!(md, "![control plane](docs/bench/control-plane.png)\n");
        let _ = writeln!(
            md,
            "| Services | plan (ms) | backend | initial sync (ms) | one change median / p99 (ms) | rebuild median (ms) | rebuild / incremental | controller peak RSS (MiB) |\n|---|---|---|---|---|---|---|---|"
        );
        for row in c["control_plane"].as_array().into_iter().flatten() {
            for backend in ["nft", "ebpf"] {
                let a = &row[backend]["apply"];
                let _ = writeln!(
                    md,
                    "| {} | {:.1} | {backend} | {:.1} | {:.3} / {:.3} | {:.1} | {:.0}x | {:.1} |",
                    row["services"],
                    f(&row["plan_median_ms"]),
                    f(&a["initial_sync_ms"]),
                    f(&a["one_change_median_ms"]),
                    f(&a["one_change_p99_ms"]),
                    f(&a["rebuild_median_ms"]),
                    f(&a["rebuild_over_incremental"]),
                    f(&row[backend]["controller_peak_rss_mib"]),
                );
            }
        }
        md.push('\n');
    }
    md.push_str(&targets(&control_ref, &datapath_ref));
    if datapath_ref.is_some() {
        md.push_str(
            "## Known weaknesses of these numbers\n\n\
             - *new TCP connections/s* is not trustworthy yet: within one case the runs spread over more than \
             10x (a connect that loses its SYN waits for a retransmission); read its ratios as noise.\n\
             - Everything runs on one 2-core machine: client, server and node share the CPUs, so the baseline \
             is the limit of this machine's veth path, not of a NIC.\n",
        );
    }
    md
}

/// The targets, checked against this run's numbers.
fn targets(control: &Option<Value>, datapath: &Option<Value>) -> String {
    let mut rows = Vec::new();
    let verdict = |ok: bool| if ok { "met" } else { "**not met**" };
    if let Some(d) = datapath {
        let med = |case: &str, dir: &str, key: &str| f(&d["datapath"][case][dir][key]["median"]);
        for dir in ["ingress", "egress"] {
            for key in ["udp64_pps", "tcp_gbps"] {
                let base = med("baseline", dir, key);
                let (e, n, p) = (
                    med("ebpf", dir, key) / base,
                    med("nft", dir, key) / base,
                    med("conntrack_dnat", dir, key) / base,
                );
                rows.push(format!(
                    "| ebpf {key} {dir} >= 0.95x baseline | {e:.2}x | {} |",
                    verdict(e >= 0.95)
                ));
                rows.push(format!(
                    "| nft {key} {dir} >= 0.85x baseline | {n:.2}x | {} |",
                    verdict(n >= 0.85)
                ));
                rows.push(format!(
                    "| both ahead of conntrack DNAT ({key} {dir}) | ebpf {e:.2}x, nft {n:.2}x, peer {p:.2}x | {} |",
                    verdict(e > p && n > p)
                ));
            }
        }
    }
    if let Some(c) = control {
        if let Some(row) = c["control_plane"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["services"] == 50_000))
        {
            for backend in ["nft", "ebpf"] {
                let a = &row[backend]["apply"];
                let one = f(&a["one_change_median_ms"]);
                let full = f(&a["initial_sync_ms"]);
                let rss = f(&row[backend]["controller_peak_rss_mib"]);
                rows.push(format!(
                    "| {backend}: one change < 5 ms at 50 000 | {one:.1} ms | {} |",
                    verdict(one < 5.0)
                ));
                rows.push(format!(
                    "| {backend}: full sync < 2 s at 50 000 | {:.2} s | {} |",
                    full / 1000.0,
                    verdict(full < 2000.0)
                ));
                rows.push(format!(
                    "| {backend}: controller RSS < 100 MiB at 50 000 | {rss:.0} MiB | {} |",
                    verdict(rss < 100.0)
                ));
            }
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "## Targets\n\nChecked against the numbers above, by the same command.\n\n| target | this run | |\n|---|---|---|\n{}\n",
        rows.join("\n")
    )
}
