//! The XDP program (`cozy_xdp`, on the uplink) on crafted and fuzzed frames
//! through BPF_PROG_TEST_RUN, held to the TC programs' decisions:
//! 1. what it drops, the stack path would drop too (TC ingress at the
//!    uplink, or TC egress toward the mapping's pod), counted under the same
//!    reason;
//! 2. what it passes, it passes untouched;
//! 3. with the fast path on, what it redirects leaves exactly as the TC
//!    fast path's redirect would leave it (the same bytes: addresses,
//!    checksums, TTL, Ethernet addresses), and only into an interface of
//!    `xdp_targets`.
use super::{icmp_error, nets, with_world, Net, World, DROP, PASS, REDIRECT};
use aya::maps::{DevMapHash, MapData, PerCpuArray};
use cozy_proxy_common::{maps as names, Counter, DropReason};
use cozy_proxy_testkit::{
    packets::bpf::{XDP_DROP, XDP_PASS, XDP_REDIRECT},
    packets::frames::{Spec, TCP, UDP},
    packets::fuzz::{frame, to_hex, Pools, Rng},
};
use std::net::IpAddr;

/// The interface toward `dst`'s pod, if `dst` is a local LB IP of the
/// world (where TC egress decides what the stack path forwards to it).
fn pod_dev(w: &World, n: &Net, dst: IpAddr) -> Option<u32> {
    if dst == n.lb || dst == n.slb {
        Some(w.ifs.pod)
    } else if dst == n.flb {
        Some(w.ifs.fpod)
    } else {
        None
    }
}

/// What the stack path does with a frame from the uplink: TC ingress
/// there, then (if it passes and is bound for a local LB IP) TC egress
/// toward the pod; `true` if either drops it.
fn stack_path_drops(w: &World, f: &[u8]) -> bool {
    let up = w.ifs.up;
    let (verdict, out) = w.run("cozy_ingress", f, up, up).expect("TC ingress");
    if verdict == DROP {
        return true;
    }
    let Some(dst) = destination(&out) else {
        return false;
    };
    let dev = nets().iter().find_map(|n| pod_dev(w, n, dst));
    let forwarded = forwarded(out);
    dev.is_some_and(|dev| {
        w.run("cozy_egress", &forwarded, up, dev)
            .expect("TC egress")
            .0
            == DROP
    })
}

/// The frame as the node forwards it, its hop limit one less (what TC
/// egress sees: neighbour discovery at hop limit 255 is the pod's link's
/// only, and never arrives forwarded).
fn forwarded(mut f: Vec<u8>) -> Vec<u8> {
    let at = match f.get(12..14) {
        Some([0x86, 0xdd]) => 14 + 7,
        Some([0x08, 0x00]) => 14 + 8,
        _ => return f,
    };
    if let Some(hl) = f.get_mut(at) {
        *hl = hl.saturating_sub(1);
    }
    f
}

/// The destination address of an untagged IPv4 or IPv6 frame, however
/// malformed the rest.
fn destination(f: &[u8]) -> Option<IpAddr> {
    match f.get(12..14)? {
        [0x08, 0x00] => Some(IpAddr::from(<[u8; 4]>::try_from(f.get(30..34)?).ok()?)),
        [0x86, 0xdd] => Some(IpAddr::from(<[u8; 16]>::try_from(f.get(38..54)?).ok()?)),
        _ => None,
    }
}

fn drops(w: &mut World) -> Vec<u64> {
    let stats: PerCpuArray<&mut MapData, Counter> =
        PerCpuArray::try_from(w.ebpf.map_mut(names::DROP_STATS).expect("drop_stats"))
            .expect("drop_stats");
    DropReason::ALL
        .iter()
        .map(|r| {
            stats
                .get(&(*r as u32), 0)
                .map(|v| v.iter().map(|c| c.packets).sum())
                .unwrap_or(0)
        })
        .collect()
}

/// The reason counted between `before` and `after`, if one was.
fn counted(before: &[u64], after: &[u64]) -> Vec<&'static str> {
    DropReason::ALL
        .iter()
        .zip(before.iter().zip(after))
        .filter(|(_, (b, a))| a > b)
        .map(|(r, _)| r.name())
        .collect()
}

#[test]
fn xdp_drops_what_the_filter_refuses_and_passes_the_rest_untouched() {
    with_world(|w| {
        let up = w.ifs.up;
        for n in nets() {
            let udp = |dst, dport| Spec::new(n.ext, dst, UDP).ports(40000, dport);
            let tcp = |src, dst, dport| Spec::new(src, dst, TCP).ports(40000, dport);
            let mut tagged = udp(n.flb, 80);
            tagged.vlan = true;
            let mut later = udp(n.flb, 53);
            later.fragment = Some((77, 64, false));
            let cases: Vec<(&str, Vec<u8>, u32, Option<&str>)> = vec![
                (
                    "unlisted UDP port",
                    udp(n.flb, 80).build(),
                    XDP_DROP,
                    Some("filtered_port"),
                ),
                (
                    "unlisted TCP port",
                    tcp(n.ext, n.flb, 8080).build(),
                    XDP_DROP,
                    Some("filtered_port"),
                ),
                (
                    "unmapped LB IP",
                    udp(n.unmapped, 80).build(),
                    XDP_DROP,
                    Some("unmapped_lb"),
                ),
                (
                    "outside the source ranges",
                    udp(n.slb, 80).build(),
                    XDP_DROP,
                    Some("source_range"),
                ),
                (
                    "a later fragment, its first not seen",
                    later.build(),
                    XDP_DROP,
                    Some("filtered_fragment"),
                ),
                ("listed UDP port", udp(n.flb, 53).build(), XDP_PASS, None),
                (
                    "listed TCP port",
                    tcp(n.ext, n.flb, 22).build(),
                    XDP_PASS,
                    None,
                ),
                ("passthrough", udp(n.lb, 80).build(), XDP_PASS, None),
                (
                    "inside the source ranges",
                    Spec::new(n.allowed, n.slb, UDP).build(),
                    XDP_PASS,
                    None,
                ),
                // Judged at TC: the VLAN's interface, the guard, the
                // in-cluster clients' translation.
                ("VLAN-tagged", tagged.build(), XDP_PASS, None),
                (
                    "a guarded source",
                    tcp(n.pod, n.flb, 8080).build(),
                    XDP_PASS,
                    None,
                ),
                (
                    "an in-cluster client",
                    tcp(n.client, n.flb, 8080).build(),
                    XDP_PASS,
                    None,
                ),
                (
                    "another node's mapping",
                    udp(n.rlb, 80).build(),
                    XDP_PASS,
                    None,
                ),
                ("not ours", udp(n.node, 80).build(), XDP_PASS, None),
            ];
            for (what, f, want, reason) in cases {
                let before = drops(w);
                let (verdict, out) = w.run_xdp(&f, up).expect("XDP test run");
                let after = drops(w);
                assert_eq!(verdict, want, "{what} ({})", n.ext);
                if want == XDP_PASS {
                    assert_eq!(out, f, "{what}: passed untouched");
                    assert!(
                        counted(&before, &after).is_empty(),
                        "{what}: no drop counted"
                    );
                } else {
                    assert_eq!(
                        counted(&before, &after),
                        reason.into_iter().collect::<Vec<_>>(),
                        "{what}"
                    );
                    assert!(
                        stack_path_drops(w, &f),
                        "{what}: the stack path drops it too"
                    );
                }
            }
            // An ICMP error about the filtered pod's own flow passes (path
            // MTU discovery); one about no flow of its is dropped.
            let opened = Spec::new(n.fpod, n.ext, UDP).ports(42000, 4444).build();
            assert_eq!(
                w.run("cozy_ingress", &opened, w.ifs.fpod, w.ifs.fpod)
                    .expect("out")
                    .0,
                PASS
            );
            let about_own = icmp_error(n.ext, n.flb, n.flb, n.ext, 42000, 4444, None);
            assert_eq!(
                w.run_xdp(&about_own, up).expect("run").0,
                XDP_PASS,
                "error about its flow"
            );
            let about_none = icmp_error(n.ext, n.flb, n.flb, n.ext, 42001, 4444, None);
            assert_eq!(
                w.run_xdp(&about_none, up).expect("run").0,
                XDP_DROP,
                "error about no flow"
            );
        }
    });
}

/// Routes, neighbours and `xdp_targets` for the fast path; returns the
/// interfaces made targets.
fn fast_path_on(w: &mut World) -> Vec<u32> {
    for n in nets() {
        for (addr, dev) in [
            (n.pod, "v-pod"),
            (n.fpod, "v-fpod"),
            (n.spod, "v-pod"),
            (n.ext, "uplink"),
        ] {
            w.reachable(addr, dev, "02:00:00:00:00:0b")
                .expect("route and neighbour");
        }
    }
    let targets = vec![w.ifs.pod, w.ifs.fpod];
    let mut map: DevMapHash<&mut MapData> =
        DevMapHash::try_from(w.ebpf.map_mut(names::XDP_TARGETS).expect("xdp_targets"))
            .expect("xdp_targets");
    for t in &targets {
        map.insert(*t, *t, None, 0).expect("target");
    }
    w.kernel.set_fast_path(true).expect("fast path on");
    targets
}

fn fast_path_off(w: &mut World, targets: &[u32]) {
    w.kernel.set_fast_path(false).expect("fast path off");
    let mut map: DevMapHash<&mut MapData> =
        DevMapHash::try_from(w.ebpf.map_mut(names::XDP_TARGETS).expect("xdp_targets"))
            .expect("xdp_targets");
    for t in targets {
        let _ = map.remove(*t);
    }
}

/// Invariant 3 for one frame: `Err` says how it broke.
fn redirects_as_tc(w: &World, f: &[u8]) -> Result<bool, String> {
    let up = w.ifs.up;
    let (verdict, out) = w.run_xdp(f, up).map_err(|e| e.to_string())?;
    match verdict {
        XDP_REDIRECT => {
            let (tc, tc_out) = w
                .run("cozy_ingress", f, up, up)
                .map_err(|e| e.to_string())?;
            if tc != REDIRECT || tc_out != out {
                return Err(format!(
                    "XDP redirected, TC gave {tc} (same bytes: {})",
                    tc_out == out
                ));
            }
            Ok(true)
        }
        XDP_PASS if out != f => Err("passed, but changed".into()),
        XDP_DROP if !stack_path_drops(w, f) => Err("dropped, the stack path passes it".into()),
        XDP_PASS | XDP_DROP => Ok(false),
        other => Err(format!("verdict {other}")),
    }
}

#[test]
fn the_xdp_fast_path_redirects_as_the_tc_fast_path_does() {
    with_world(|w| {
        let targets = fast_path_on(w);
        for n in nets() {
            for (what, spec) in [
                ("TCP", Spec::new(n.ext, n.lb, TCP).ports(40000, 80)),
                ("UDP", Spec::new(n.ext, n.lb, UDP).ports(40000, 5353)),
                ("listed port", Spec::new(n.ext, n.flb, TCP).ports(40000, 22)),
                ("inside the source ranges", Spec::new(n.allowed, n.slb, UDP)),
            ] {
                let f = spec.build();
                assert_eq!(redirects_as_tc(w, &f), Ok(true), "{what} to {}", spec.dst);
            }
            let error = icmp_error(n.ext, n.lb, n.lb, n.ext, 42000, 53, None);
            assert_eq!(
                redirects_as_tc(w, &error),
                Ok(true),
                "ICMP error, quote rewritten"
            );
            // The stack path, untouched: a checksum a veth's peer left to
            // its offload (the skb that knows it is the stack's); a TTL
            // that expires here; a pod whose interface is no target.
            for (what, mut spec) in [
                ("TCP", Spec::new(n.ext, n.lb, TCP).ports(40000, 80)),
                ("UDP", Spec::new(n.ext, n.lb, UDP).ports(40000, 5353)),
            ] {
                spec.checksum_left_to_offload = true;
                let f = spec.build();
                assert_eq!(
                    w.run_xdp(&f, w.ifs.up).expect("run"),
                    (XDP_PASS, f.clone()),
                    "{what} checksum left to the offload, to {}",
                    spec.dst
                );
            }
            let mut last_hop = Spec::new(n.ext, n.lb, TCP);
            last_hop.hop_limit = 1;
            let f = last_hop.build();
            assert_eq!(
                w.run_xdp(&f, w.ifs.up).expect("run"),
                (XDP_PASS, f.clone()),
                "TTL 1"
            );
        }
        fast_path_off(w, &targets[..1]);
        w.kernel.set_fast_path(true).expect("fast path on");
        for n in nets() {
            let f = Spec::new(n.ext, n.lb, TCP).build();
            assert_eq!(
                w.run_xdp(&f, w.ifs.up).expect("run"),
                (XDP_PASS, f.clone()),
                "no target"
            );
        }
        fast_path_off(w, &targets);
    });
}

/// Fuzzed frames at the uplink, fast path off and on: invariants 1-3.
#[test]
fn fuzzed_frames_at_the_uplink_take_the_tc_programs_decisions() {
    with_world(|w| {
        super::fuzz::forget_dynamic_state(w);
        let [v4, v6] = nets();
        let of = |n: &Net| {
            vec![
                n.ext, n.node, n.lb, n.pod, n.flb, n.fpod, n.unmapped, n.rlb, n.slb, n.allowed,
                n.client,
            ]
        };
        let pools = Pools {
            v4: of(&v4),
            v6: of(&v6),
            ports: vec![22, 53, 80, 40000, 42000],
            targets: vec![
                v4.lb,
                v4.flb,
                v4.slb,
                v4.unmapped,
                v6.lb,
                v6.flb,
                v6.slb,
                v6.unmapped,
            ],
        };
        let cases = std::env::var("COZY_FUZZ_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(20_000u64);
        let mut rng = Rng::new(0x0d_9e);
        let (mut failures, mut redirected, mut dropped) = (Vec::new(), 0, 0);
        for fast in [false, true] {
            let targets = if fast { fast_path_on(w) } else { Vec::new() };
            for i in 0..cases {
                let (f, mutation) = frame(&mut rng, &pools, 14);
                let before = drops(w);
                match redirects_as_tc(w, &f) {
                    Ok(r) => redirected += r as u32,
                    Err(why) if failures.len() < 20 => failures.push(format!(
                        "case {i} (fast path {fast}, {mutation:?}): {why}\n    {}",
                        to_hex(&f)
                    )),
                    Err(_) => {}
                }
                dropped += (drops(w) != before) as u32;
            }
            if fast {
                fast_path_off(w, &targets);
            }
            super::fuzz::forget_dynamic_state(w);
        }
        assert!(
            failures.is_empty(),
            "{} failures:\n{}",
            failures.len(),
            failures.join("\n")
        );
        assert!(
            redirected > 0 && dropped > 0,
            "the fuzz missed a branch: {redirected} redirected, {dropped} dropped"
        );
    });
}
