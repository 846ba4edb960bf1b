//! BENCHMARKS.md from the benchmark results (target/bench/*.json): every
//! figure with its ratio to the baseline of the same run where there is one.
use serde_json::Value;
use std::fmt::Write;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The metrics of the datapath benchmark: key, label, higher is better.
const METRICS: [(&str, &str, bool); 6] = [
    (
        "pps_one_flow",
        "64-byte UDP packets/s, one flow (trafgen)",
        true,
    ),
    (
        "pps_many_flows",
        "64-byte UDP packets/s, many flows (trafgen)",
        true,
    ),
    ("tcp_gbps", "TCP throughput, Gbit/s (iperf3)", true),
    ("rtt_p50_us", "UDP round trip p50, us (sockperf)", false),
    ("rtt_p99_us", "UDP round trip p99, us (sockperf)", false),
    (
        "conn_per_s",
        "new TCP connections/s (1 / median connect time; client and server on one CPU)",
        true,
    ),
];

/// The cases of a datapath run, in the order the benchmark measured them
/// (its `cases`; an older result without it: its keys, baseline first).
fn cases(d: &Value, r: &Value) -> Vec<String> {
    if let Some(list) = d["cases"].as_array() {
        return list
            .iter()
            .filter_map(|c| c.as_str().map(String::from))
            .collect();
    }
    let mut keys: Vec<String> = r
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k.clone())
        .collect();
    keys.sort_by_key(|k| (!k.starts_with("baseline"), k.clone()));
    keys
}

/// A case's ratio to the baseline, and whether it is within the A/A
/// spread (no difference).
fn ratio(r: &Value, case: &str, dir: &str, key: &str) -> (f64, bool) {
    let med = |c: &str| f(&r[c][dir][key]["median"]);
    let base = med("baseline");
    let aa = (med("baseline_again") / base - 1.0).abs();
    let x = med(case) / base;
    (x, (x - 1.0).abs() <= aa)
}

fn fmt_value(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub fn benchmarks_md(
    control: Option<Value>,
    datapath: Option<Value>,
    per_packet: Option<Value>,
    machine: &str,
) -> String {
    let (control_ref, datapath_ref, packet_ref) =
        (control.clone(), datapath.clone(), per_packet.clone());
    let mut md = String::from("# Benchmarks\n\n");
    let _ = writeln!(md, "Machine: {machine}.\n");
    if let Some(d) = datapath {
        let reps = &d["repetitions"];
        let secs = &d["seconds_per_run"];
        let _ = writeln!(
            md,
            "## Datapath\n\n`cargo xtask bench datapath` — one run: the same path ext -> node -> pod1 (ingress) and \
             pod1 -> ext (egress) in the scenario topology (without the CNI masquerade), every case set up side by \
             side and measured in turns, {reps} repetitions of {secs} s per measure: the **baseline** (plain routing \
             to the pod IP, no NAT), measured twice (**baseline_again**: the A/A control), where the run has it \
             **baseline_conntrack** (the same routing with conntrack on, as on a node with kube-proxy), the **nft** backend, the \
             **ebpf** backend (stack path), its fast path (**ebpf_fast**) and its XDP path (**ebpf_xdp**: the fast \
             path from the XDP program on the uplink, `--xdp=auto`), the peer **conntrack_dnat** \
             (kube-proxy-style `dnat to`/`snat to`) and, where the run has it, the real **kube_proxy** (nftables \
             mode, with a real API server: the LB IP as an unlabelled LoadBalancer Service, `externalTrafficPolicy: \
             Local`, on the meters' ports; its egress is the pod's own traffic through its chains, leaving with the \
             pod IP, as kube-proxy has no source-IP preservation). Cells: median [min-max] and the ratio of the median to the \
             baseline's; a ratio within the A/A spread (|baseline_again / baseline - 1|) is marked `≈` (no \
             difference). Packet rates count what the receiver's interface got. Every case's pod has GRO on at its \
             end of its veth (what the XDP path needs to redirect into it), so the topologies are the same.\n"
        );
        let _ = writeln!(md, "![datapath ratios](docs/bench/datapath.png)\n");
        for (setting, title) in [
            (
                "offloads_on",
                "veth offloads on (checksum offload, TSO/GSO: as on a real node)",
            ),
            ("offloads_off", "veth offloads off"),
        ] {
            let r = &d["datapath"][setting];
            if r.is_null() {
                continue;
            }
            for dir in ["ingress", "egress"] {
                let _ = writeln!(md, "### {title}: {dir}\n");
                let cases = cases(&d, r);
                let _ = writeln!(
                    md,
                    "| measure | {} |\n|---|{}",
                    cases.join(" | "),
                    "---|".repeat(cases.len())
                );
                for (key, label, _) in METRICS {
                    let mut row = format!("| {label} |");
                    for case in &cases {
                        let m = &r[case][dir][key];
                        let (med, min, max) = (f(&m["median"]), f(&m["min"]), f(&m["max"]));
                        let note = if case == "baseline" {
                            String::new()
                        } else {
                            let (x, same) = ratio(r, case, dir, key);
                            format!(" **{}{x:.2}x**", if same { "≈" } else { "" })
                        };
                        let _ = write!(
                            row,
                            " {} [{}-{}]{note} |",
                            fmt_value(med),
                            fmt_value(min),
                            fmt_value(max)
                        );
                    }
                    let _ = writeln!(md, "{row}");
                }
                md.push('\n');
            }
        }
    }
    if let Some(d) = datapath_ref.as_ref().filter(|d| d["flood"].is_object()) {
        md.push_str(&flood_section(d));
    }
    if let Some(p) = per_packet {
        let _ = writeln!(
            md,
            "## Per packet\n\n`cargo xtask bench per-packet` — each TC program run by the kernel through \
             BPF_PROG_TEST_RUN on a fixed frame ({} runs per sample, {} samples, interleaved): the kernel's mean time \
             per run, and the cost above an empty program (`cozy_pass`) run the same way. The mapped cases use two \
             addresses that map to each other, so that every repeated run does the whole rewrite. The fast path \
             decrements the TTL, so it is sampled one run at a time (the timer's own cost is in those samples and in \
             the empty program's alike). The XDP cases run the XDP program (`cozy_xdp`) on the uplink, above an \
             empty XDP program (`cozy_xdp_pass`): a test run of each program type costs its own.\n",
            p["repeat"], p["rounds"]
        );
        for family in ["ipv4", "ipv6"] {
            let _ = writeln!(md, "### {family}\n\n| case | program | ns per run, median [min-max] | above the empty program |\n|---|---|---|---|");
            for row in p["per_packet"][family].as_array().into_iter().flatten() {
                let ns = &row["ns"];
                let _ = writeln!(
                    md,
                    "| {} | `{}` | {:.0} [{:.0}-{:.0}] | {:.0} ns |",
                    row["case"].as_str().unwrap_or("?"),
                    row["program"].as_str().unwrap_or("?"),
                    f(&ns["median"]),
                    f(&ns["min"]),
                    f(&ns["max"]),
                    f(&row["above_empty_ns"])
                );
            }
            md.push('\n');
        }
    }
    if let Some(c) = control {
        let _ = writeln!(
            md,
            "## Control plane\n\n`cargo xtask bench control-plane` — N managed Services (IPv4 for the first 250, \
             IPv6 after; every third port-filtered with 2 ports), each in a network namespace of its own.\n\n\
             **The controller's rounds**, in-process (the reconciler and a real backend, as the loop runs them): \
             *plan*: computing the plan from every object with `compute_plan` (median of 5). *initial sync*: a \
             full round into an empty datapath. *one change*: one Service's EndpointSlice moved to a new pod, \
             an incremental round (median / p99 over 100-200 changes). *resync*: a full round from a fresh read \
             of the kernel (what the periodic resync costs). *rebuild*: the peer strategy, empty the datapath \
             then a full round (median); rebuild / incremental.\n"
        );
        let _ = writeln!(md, "![control plane](docs/bench/control-plane.png)\n");
        let _ = writeln!(
            md,
            "| Services | plan (ms) | backend | initial sync (ms) | one change median / p99 (ms) | resync (ms) | rebuild median (ms) | rebuild / incremental |\n|---|---|---|---|---|---|---|---|"
        );
        let rows: Vec<&Value> = c["control_plane"]
            .as_array()
            .into_iter()
            .flatten()
            .collect();
        for row in &rows {
            for backend in ["nft", "ebpf"] {
                let a = &row[backend]["apply"];
                let _ = writeln!(
                    md,
                    "| {} | {:.1} | {backend} | {:.1} | {:.3} / {:.3} | {:.1} | {:.1} | {:.0}x |",
                    row["services"],
                    f(&row["plan_median_ms"]),
                    f(&a["initial_sync_ms"]),
                    f(&a["one_change_median_ms"]),
                    f(&a["one_change_p99_ms"]),
                    f(&a["resync_median_ms"]),
                    f(&a["rebuild_median_ms"]),
                    f(&a["rebuild_over_incremental"]),
                );
            }
        }
        let _ = writeln!(
            md,
            "\n**Through the API**: the real controller (`cozy-proxy run --kubeconfig`, the real kube-rs client) \
             against the API stand-in (`cozy-proxy-testkit/src/standin.rs`: paged lists, watches, TCP_NODELAY as \
             the API server), serving the N managed Services and as many unmanaged ones (ClusterIP, 2 ports, \
             labels, annotations), each with its EndpointSlice as the EndpointSlice controller writes it (its \
             managed-by label, the Service its owner, each endpoint naming a Pod: the slices a controller reading \
             the API trusts by default). *write -> kernel*: from the write of one moved \
             EndpointSlice (`POST /control/apply`, answered after the watch event is queued) to the LB IP's host \
             route pointing at the new pod (read with a route lookup every 0.1 ms; the route is the last thing \
             a sync changes), 100 writes one at a time with `--debounce 0ms`, 40 with the default 50 ms. \
             *first sync*: start to the first `datapath synced`. *RSS*: VmRSS after the first sync and the peak \
             (VmHWM) at the end; in brackets, the part that is the program's code (RssFile); *manifests*: peak RSS of `cozy-proxy run --manifests` on the N managed Services \
             alone. *burst*: then, with the default debounce, the EndpointSlices of up to 10 000 Services moved \
             in one write, to every LB IP's route at its new pod (the write itself, the stand-in's queueing of \
             the watch events, is in brackets).\n\n\
             | Services (+ unmanaged) | backend | write -> kernel, debounce 0: median / p99 / max (ms) | debounce 50 ms: median / p99 (ms) | burst: changes, to all in the kernel (s) | first sync (s) | RSS / peak (code) (MiB) | manifests peak RSS (MiB) |\n|---|---|---|---|---|---|---|---|"
        );
        for row in &rows {
            for backend in ["nft", "ebpf"] {
                let r = &row[backend];
                let d0 = &r["api_debounce_0ms"];
                let d50 = &r["api_debounce_50ms"];
                if d0.is_null() {
                    continue;
                }
                let l0 = &d0["api_to_kernel_ms"];
                let l50 = &d50["api_to_kernel_ms"];
                let b = &d50["burst"];
                let burst = match b.is_null() {
                    true => "-".to_string(),
                    false => format!(
                        "{}, {:.2} ({:.2})",
                        b["changes"],
                        f(&b["api_to_kernel_ms"]) / 1000.0,
                        f(&b["write_ms"]) / 1000.0
                    ),
                };
                let _ = writeln!(
                    md,
                    "| {n} (+{n}) | {backend} | {:.2} / {:.2} / {:.1} | {:.1} / {:.1} | {burst} | {:.1} | {:.0} / {:.0} ({:.0}) | {:.0} |",
                    f(&l0["median"]),
                    f(&l0["p99"]),
                    f(&l0["max"]),
                    f(&l50["median"]),
                    f(&l50["p99"]),
                    f(&d0["first_sync_s"]),
                    f(&d0["rss_mib"]),
                    f(&d0["peak_rss_after_changes_mib"]).max(f(&d0["peak_rss_mib"])),
                    f(&d0["rss_file_mib"]),
                    f(&r["controller_peak_rss_mib"]),
                    n = row["services"],
                );
            }
        }
        md.push_str(
            "\nAnchors (kube-proxy, nftables mode, from the issue): about 141 ms to add one Service among 10 000 \
             after its partial-sync work (kubernetes PR #126013); minutes for a full sync at 44 000 Services \
             (kubernetes#139513); 260 MiB at 10 000 Services.\n\n",
        );
    }
    md.push_str(&targets(&control_ref, &datapath_ref, &packet_ref));
    if datapath_ref.is_some() || control_ref.is_some() {
        md.push_str("## Known weaknesses of these numbers\n\n");
    }
    if datapath_ref.is_some() {
        md.push_str(
            "- Everything runs on one 2-core machine: sender, node and receiver share the CPUs (trafgen's \
             packets are forwarded in its own softirq), so the baseline is the limit of this machine's veth \
             path, not of a NIC, and a cheaper datapath shows as a higher rate only as far as the sender leaves \
             CPU to it.\n\
             - The fast path hands packets to the pod's namespace directly (`bpf_redirect_peer`); the baseline \
             goes through the host's routing and the veth. Its gain is what the host stack costs here.\n\
             - The XDP path runs here on a veth, the one driver of this machine with native XDP, where the \
             frame is an skb before XDP sees it (the sender built it): veth copies it into a page for XDP \
             (`skb_pp_cow_data`), moves to NAPI on both ends and builds a new skb at the pod's end, work the \
             TC fast path's `bpf_redirect_peer` does not do (profile in \
             docs/notes/2026-12-xdp-path-cost.md). What XDP saves on a NIC (the skb's allocation before the \
             drop or the redirect) does not exist on a veth, so its 2x target is not measurable here; the \
             kernel's live XDP frames (`BPF_F_TEST_XDP_LIVE_FRAMES`), which would stand in for a NIC's \
             receive path, are refused by the locked-down kernel of the machines measured so far (same \
             note). A veth \
             whose peer has an XDP program also loses its software segmentation offload: TCP into the node \
             is segmented by the sender (the TCP row of ebpf_xdp, ingress).\n\
             - The per-packet comparison of the fast path's run with the stack path's charges the fast path \
             for its FIB lookup (`bpf_skb_fib_lookup`, 45% of its IPv4 run's samples and 56% of its IPv6 \
             run's), which the stack path also pays, after its program, in the kernel's forwarding. Without \
             it the run is 1.4x (IPv4) and 1.5x (IPv6) the stack path's (docs/notes/2026-12-fast-path-run-cost.md).\n\
             - The stack path's packets pass conntrack in the node: the eBPF backend's hairpin masquerade is \
             a `nat` chain, which turns conntrack's hooks on. The baseline's node runs none, unlike a node \
             with kube-proxy, Kube-OVN, Flannel or Calico's iptables mode. Without that table (an experiment build), the stack \
             path's many-flows rate went from 0.76x to 0.87x of the baseline \
             (docs/notes/2026-12-stack-path-and-conntrack.md). Against the baseline with conntrack, what \
             remains on new flows is the programs' own work and conntrack's NAT binding for each new flow \
             (that table's `nat` chain; a node whose CNI masquerades pays it anyway): profiled per packet \
             in the same note.\n\
             - The flood's sender is one CPU's trafgen, which reaches about the baseline's forwarding rate: \
             the drops per second cannot reach 5x it on this machine, and on a veth with XDP the frames the \
             NAPI ring cannot take are dropped by veth before XDP (not in the datapath's counter).\n\
             - nft behind the conntrack peer: its rewrite is stateless by design (no NAT binding per flow), \
             so every packet runs rules where the peer's later packets are rewritten from the binding \
             conntrack stored. Per packet, nf_tables' interpreter, lookups and checksummed write are most \
             of the gap, and a restructured ruleset could win about 1.5% of it \
             (docs/notes/2026-12-nft-against-the-peer.md).\n\
             - IPv6's mapped rewrite toward the pod against IPv4's: the two differ by 10-30 ns above the \
             empty program in the runs measured, about what one case's samples spread in one run; the \
             profile of what remains (the `addrs` hash, the checksum helper) is in \
             docs/notes/2026-12-ipv6-cluster-hint.md.\n\
             - Per packet, the limits of 20 and 50 ns above the empty program were set on machines whose \
             empty TC program ran in 8-22 ns. Where calls cost more, as on a VM with retpolines on every \
             indirect call (`spectre_v2` in /sys/devices/system/cpu/vulnerabilities), the empty program and \
             every helper and map call above it cost more alike: read the cases against this run's empty \
             program.\n",
        );
        if let Some(d) = &datapath_ref {
            md.push_str(&repetition_spread(d));
        }
    }
    if control_ref.is_some() {
        md.push_str(
            "- Control plane, through the API: the API server is the stand-in, in the benchmark's own \
             process, not kube-apiserver and etcd (a real write adds their commit and watch fan-out). The \
             first sync through it at 50 000 + 50 000 (~30 s) is mostly listing and decoding 200 000 \
             objects over its HTTP. A change that arrives during a full round (start, the 60 s resync) \
             waits for it: 1.3-1.6 s at 50 000; the p99 of 100 writes does not show that wait unless one \
             falls into it.\n",
        );
    }
    md
}

/// How far the repetitions of one measure spread in this run (max / min
/// over a cell's runs), per metric: the median cell and the range over
/// every case, direction and offload setting.
fn repetition_spread(d: &Value) -> String {
    let mut parts = Vec::new();
    for (key, label, _) in METRICS {
        let mut spreads: Vec<f64> = d["datapath"]
            .as_object()
            .into_iter()
            .flat_map(|settings| settings.values())
            .filter_map(Value::as_object)
            .flat_map(|cases| cases.values())
            .filter_map(Value::as_object)
            .flat_map(|dirs| dirs.values())
            // The benchmark's own summary of the cell's runs.
            .map(|m| f(&m[key]["max"]) / f(&m[key]["min"]))
            .filter(|x| x.is_finite())
            .collect();
        if spreads.is_empty() {
            continue;
        }
        spreads.sort_by(|a, b| a.total_cmp(b));
        parts.push(format!(
            "{label}: {:.2} ({:.2}-{:.2})",
            spreads[spreads.len() / 2],
            spreads[0],
            spreads[spreads.len() - 1]
        ));
    }
    if parts.is_empty() {
        return String::new();
    }
    format!(
        "- The repetitions of one measure spread, max / min, median cell (range): {}. The tables compare \
         medians of cases measured in turns, and the A/A control shows which differences are noise; a single \
         repetition says little on this machine.\n",
        parts.join("; ")
    )
}

/// The baseline's 64-byte packet rate into the pod, one flow (offloads on):
/// what the flood's drop rate is held to.
fn baseline_pps(d: &Value) -> f64 {
    f(&d["datapath"]["offloads_on"]["baseline"]["ingress"]["pps_one_flow"]["median"])
}

/// "One VM under a flood": each case's drops and the listed port's service.
fn flood_section(d: &Value) -> String {
    let base = baseline_pps(d);
    let mut md = format!(
        "## One VM under a flood\n\n`cargo xtask bench datapath` — pod1 port-filtered (its listed port: the \
         connection meter's), 64-byte UDP datagrams from many source ports at an unlisted port (trafgen, one CPU) \
         while the connection meter (client and server on the other CPU) opens connections to the listed port \
         through the LB IP; the datapath's drops per second (its `filtered_port` counter) against the baseline's \
         packet rate into the pod ({base:.0}/s, one flow, offloads on), and the connections per second during the \
         flood against the same meter's without it, in the same repetition.\n\n\
         | case | dropped/s, median [min-max] | / baseline's forwarding rate | connections/s without the flood | during it | during / without |\n|---|---|---|---|---|---|\n"
    );
    for (case, m) in d["flood"].as_object().into_iter().flatten() {
        let med = |k: &str| f(&m[k]["median"]);
        let _ = writeln!(
            md,
            "| {case} | {} [{}-{}] | **{:.2}x** | {} | {} | **{:.2}x** |",
            fmt_value(med("dropped_per_s")),
            fmt_value(f(&m["dropped_per_s"]["min"])),
            fmt_value(f(&m["dropped_per_s"]["max"])),
            med("dropped_per_s") / base,
            fmt_value(med("conn_per_s_without")),
            fmt_value(med("conn_per_s_during")),
            med("conn_per_s_during") / med("conn_per_s_without"),
        );
    }
    md.push('\n');
    md
}

/// Issue 44's datapath targets: the XDP path, the flood, the stack path
/// and nft on every metric.
fn edge_targets(d: &Value, against: &dyn Fn(f64, f64, f64) -> String) -> Vec<String> {
    let mut rows = Vec::new();
    let r = &d["datapath"]["offloads_on"];
    for key in ["pps_one_flow", "pps_many_flows"] {
        let (xdp, _) = ratio(r, "ebpf_xdp", "ingress", key);
        let (aa, _) = ratio(r, "baseline_again", "ingress", key);
        rows.push(format!(
            "| XDP path >= 2x baseline, {key} ingress (offloads on; A/A {aa:.2}x) | {xdp:.2}x | {} |",
            against(xdp, 2.0, (aa - 1.0).abs())
        ));
    }
    if let Some(x) = d["flood"]["ebpf_xdp"].as_object() {
        let med = |k: &str| f(&x[k]["median"]);
        let dropped = med("dropped_per_s") / baseline_pps(d);
        rows.push(format!(
            "| one VM under a flood: dropped >= 5x the baseline's forwarding rate (XDP path) | {dropped:.2}x | {} |",
            against(dropped, 5.0, 0.0)
        ));
        let served = med("conn_per_s_during") / med("conn_per_s_without");
        rows.push(format!(
            "| one VM under a flood: the listed port served >= 0.9x its flood-free rate (XDP path) | {served:.2}x | {} |",
            against(served, 0.9, 0.0)
        ));
    }
    for dir in ["ingress", "egress"] {
        for (key, _, higher) in METRICS {
            let (aa_ratio, _) = ratio(r, "baseline_again", dir, key);
            let aa = (aa_ratio - 1.0).abs();
            // Higher is better, or (latency) lower: compared the same way.
            let better = |x: f64| if higher { x } else { 1.0 / x };
            let (stack, _) = ratio(r, "ebpf", dir, key);
            rows.push(format!(
                "| stack path >= 0.95x baseline, {key} {dir} (A/A {aa_ratio:.2}x) | {stack:.2}x | {} |",
                against(better(stack), 0.95, aa)
            ));
            // Against the baseline with conntrack on, which the stack path
            // also passes, where the run has it.
            let (with_ct, _) = ratio(r, "baseline_conntrack", dir, key);
            if with_ct.is_finite() {
                let x = stack / with_ct;
                rows.push(format!(
                    "| stack path >= 0.95x the baseline with conntrack, {key} {dir} (A/A {aa_ratio:.2}x) | {x:.2}x | {} |",
                    against(better(x), 0.95, aa)
                ));
            }
            let (nft, _) = ratio(r, "nft", dir, key);
            let (peer, _) = ratio(r, "conntrack_dnat", dir, key);
            rows.push(format!(
                "| nft at or above the conntrack peer, {key} {dir} (A/A {aa_ratio:.2}x) | {nft:.2}x (peer {peer:.2}x) | {} |",
                against(better(nft) / better(peer), 1.0, aa)
            ));
        }
    }
    rows
}

/// Issue 44's per-packet targets: IPv6's rewrite within 1.2x of IPv4's,
/// the fast paths' runs within 2x of the stack path's.
fn per_packet_targets(p: &Value, verdict: &dyn Fn(bool) -> &'static str) -> Vec<String> {
    let above = |family: &str, case: &str| {
        (p["per_packet"][family].as_array().into_iter().flatten())
            .find(|r| r["case"] == case)
            .map_or(f64::NAN, |r| f(&r["above_empty_ns"]))
    };
    let mut rows = Vec::new();
    for case in [
        "mapped, toward the pod (LB -> pod)",
        "mapped, from the pod (pod -> LB)",
    ] {
        let x = above("ipv6", case) / above("ipv4", case);
        rows.push(format!(
            "| per packet, {case}: IPv6 within 1.2x of IPv4 | {x:.2}x | {} |",
            verdict(x <= 1.2)
        ));
    }
    for family in ["ipv4", "ipv6"] {
        let stack = above(family, "stack path, toward the pod (single runs)");
        for case in [
            "fast path, toward the pod (single runs)",
            "XDP fast path, redirected to the pod (single runs)",
        ] {
            let x = above(family, case) / stack;
            rows.push(format!(
                "| per packet, {family} {case}: within 2x of the stack path's run | {x:.2}x | {} |",
                verdict(x <= 2.0)
            ));
        }
    }
    rows
}

/// The issues' targets, checked against this run's numbers.
fn targets(
    control: &Option<Value>,
    datapath: &Option<Value>,
    per_packet: &Option<Value>,
) -> String {
    let mut rows = Vec::new();
    let verdict = |ok: bool| if ok { "met" } else { "**not met**" };
    // A ratio short of its target by less than the A/A spread cannot be
    // told from meeting it: said so rather than counted either way.
    let against = |x: f64, target: f64, aa: f64| {
        if x >= target {
            "met".to_string()
        } else if target - x <= aa {
            format!("within the A/A spread ({aa:.2}): no difference measurable")
        } else {
            "**not met**".to_string()
        }
    };
    if let Some(d) = datapath {
        let r = &d["datapath"]["offloads_on"];
        for dir in ["ingress", "egress"] {
            for key in ["pps_one_flow", "pps_many_flows", "tcp_gbps"] {
                let (fast, _) = ratio(r, "ebpf_fast", dir, key);
                let (nft, _) = ratio(r, "nft", dir, key);
                let (peer, _) = ratio(r, "conntrack_dnat", dir, key);
                let (aa_ratio, _) = ratio(r, "baseline_again", dir, key);
                let aa = (aa_ratio - 1.0).abs();
                let what = format!("{key} {dir} (offloads on; A/A {aa_ratio:.2}x)");
                rows.push(format!(
                    "| ebpf fast path >= 1.0x baseline, {what} | {fast:.2}x | {} |",
                    against(fast, 1.0, aa)
                ));
                rows.push(format!(
                    "| ebpf fast path >= 1.15x conntrack DNAT, {what} | {:.2}x | {} |",
                    fast / peer,
                    against(fast / peer, 1.15, aa)
                ));
                // The real kube-proxy does the same job only inward: its
                // egress keeps the pod IP (no row for it).
                let (kube_proxy, _) = ratio(r, "kube_proxy", dir, key);
                if dir == "ingress" && kube_proxy.is_finite() {
                    rows.push(format!(
                        "| ebpf fast path >= 1.15x the real kube-proxy, {what} | {:.2}x | {} |",
                        fast / kube_proxy,
                        against(fast / kube_proxy, 1.15, aa)
                    ));
                    rows.push(format!(
                        "| nft not behind the real kube-proxy, {what} | {nft:.2}x (kube-proxy {kube_proxy:.2}x) | {} |",
                        against(nft, kube_proxy, aa)
                    ));
                }
            }
        }
    }
    if let Some(d) = datapath {
        rows.extend(edge_targets(d, &against));
    }
    if let Some(p) = per_packet {
        rows.extend(per_packet_targets(p, &verdict));
        for family in ["ipv4", "ipv6"] {
            for row in p["per_packet"][family].as_array().into_iter().flatten() {
                let case = row["case"].as_str().unwrap_or("");
                let above = f(&row["above_empty_ns"]);
                let limit = if case.starts_with("not ours") {
                    20.0
                } else if case.starts_with("mapped") {
                    50.0
                } else {
                    continue;
                };
                rows.push(format!(
                    "| per packet, {family} {case}: < {limit:.0} ns above the empty program | {above:.0} ns | {} |",
                    verdict(above < limit)
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
                let r = &row[backend];
                let p99 = f(&r["api_debounce_0ms"]["api_to_kernel_ms"]["p99"]);
                let own = f(&r["apply"]["one_change_p99_ms"]);
                let full_sync = &r["apply"]["full_sync_ms"];
                let full = f(&full_sync["median"]);
                let rss = f(&r["api_debounce_0ms"]["peak_rss_after_changes_mib"]);
                rows.push(format!(
                    "| {backend}: one change, API write to kernel, p99 < 5 ms at 50 000 (debounce 0) | {p99:.2} ms | {} |",
                    verdict(p99 < 5.0)
                ));
                rows.push(format!(
                    "| {backend}: stretch, the controller's own part (incremental round) p99 < 1 ms at 50 000 | {own:.3} ms | {} |",
                    verdict(own < 1.0)
                ));
                rows.push(format!(
                    "| {backend}: full sync of 50 000 < 1 s (median of the initial one and the rebuilds' onto an emptied datapath; range) | {:.2} s ({:.2}-{:.2}) | {} |",
                    full / 1000.0,
                    f(&full_sync["min"]) / 1000.0,
                    f(&full_sync["max"]) / 1000.0,
                    verdict(full < 1000.0)
                ));
                rows.push(format!(
                    "| {backend}: RSS < 100 MiB at 50 000 managed + 50 000 unmanaged (peak, through the API) | {rss:.0} MiB | {} |",
                    verdict(rss < 100.0)
                ));
            }
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "## Targets\n\nChecked against the numbers above, by the same command.\n\n| target | this run | |\n|---|---|---|\n{}\n\n",
        rows.join("\n")
    )
}
