//! Scenario 32: fuzzed frames through the real node. The frames of the
//! packet fuzzer (random and mutated, see `cozy_proxy_testkit::fuzz`) are
//! sent raw from the outside client and from an unmanaged pod into the
//! node, with a filtered and a passthrough mapping in place; what reaches
//! the two pods is captured and checked against the fuzzer's invariants,
//! here for whichever backend runs (the nft backend's only fuzzing):
//! - nothing reaches the filtered pod on an unlisted port, no echo request,
//!   no other protocol, no ICMP error but about its own (listed) flows, no
//!   later fragment whose first fragment did not reach it;
//! - no pod receives a packet still addressed to an LB IP;
//! - a packet sent with right checksums arrives with right checksums;
//! - afterwards the node still serves both mappings.
use anyhow::{ensure, Result};
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    nodes::net::Fam,
    nodes::topology::Shape,
    packets::frames::{mac, parse, send_all, Seen, ICMP, ICMPV6, TCP, UDP},
    packets::fuzz::{frame, Pools, Rng},
    scenario::WEB,
    traffic::Capture,
    Env,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

/// Frames sent from outside and from the unmanaged pod.
const FROM_OUTSIDE: usize = 1500;
const FROM_POD: usize = 500;

fn listed(proto: u8, port: u16) -> bool {
    matches!((proto, port), (TCP, 22) | (UDP, 53))
}

/// The end of a frame, which no hop rewrites: finds the frame as sent.
fn signature(f: &[u8]) -> Vec<u8> {
    f[f.len().saturating_sub(12)..].to_vec()
}

/// Right checksums, as far as they can be checked.
fn checksums_right(s: &Seen) -> bool {
    s.ip_checksum_ok && s.l4_checksum_ok == Some(true)
}

/// What pod1 (filtered, TCP 22 and UDP 53) may receive; `None` if fine.
fn filter_violation(
    s: &Seen,
    pod1: IpAddr,
    first_fragments: &BTreeSet<(IpAddr, u32)>,
) -> Option<String> {
    if s.later_fragment {
        return (!first_fragments.contains(&(s.src, s.frag_id)))
            .then(|| format!("a later fragment (id {}) without its first", s.frag_id));
    }
    let icmp = (s.src.is_ipv4() && s.proto == ICMP) || (s.src.is_ipv6() && s.proto == ICMPV6);
    match (s.proto, s.ports, s.icmp_type) {
        (TCP | UDP, Some((_, dport)), _) if listed(s.proto, dport) => None,
        (TCP | UDP, Some((_, dport)), _) => Some(format!("{} to unlisted port {dport}", s.proto)),
        // Neighbour discovery from the node (link-local source), or from
        // a neighbour on pod1's own link (hop limit 255: never routed).
        (_, _, Some(133..=137))
            if icmp && s.src.is_ipv6() && (is_link_local(&s.src) || s.hop_limit == 255) =>
        {
            None
        }
        (_, _, Some(t)) if icmp && is_error(t, s.src.is_ipv6()) => {
            let about_own = s.quoted.as_ref().is_some_and(|q| {
                q.src == pod1 && q.ports.is_some_and(|(sport, _)| listed(q.proto, sport))
            });
            (!about_own).then(|| format!("an ICMP error not about pod1's flows: {:?}", s.quoted))
        }
        _ => Some(format!(
            "protocol {} (ICMP type {:?})",
            s.proto, s.icmp_type
        )),
    }
}

fn is_link_local(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.is_unicast_link_local(),
    }
}

fn is_error(t: u8, v6: bool) -> bool {
    if v6 {
        (1..=4).contains(&t)
    } else {
        matches!(t, 3..=5 | 11 | 12)
    }
}

/// `count` frames of the env's family, from `src_mac` to `dst_mac`.
fn frames(env: &Env, rng: &mut Rng, count: usize, macs: ([u8; 6], [u8; 6])) -> Vec<Vec<u8>> {
    let ours = vec![
        env.net.ext,
        env.net.node,
        env.lb(0),
        env.lb(1),
        env.lb(2),
        env.pod_ip(1),
        env.pod_ip(2),
        env.pod_ip(3),
    ];
    // The other family's pool only feeds frames that are thrown away.
    let (v4, v6) = match env.fam() {
        Fam::V4 => (ours, vec!["2001:db8:ffff::1".parse().expect("v6")]),
        Fam::V6 => (vec!["203.0.113.250".parse().expect("v4")], ours),
    };
    let pools = Pools {
        v4,
        v6,
        ports: vec![22, 53, 80, 443, WEB],
        targets: vec![env.lb(0), env.lb(1), env.pod_ip(1), env.pod_ip(3)],
    };
    let ether: [u8; 2] = match env.fam() {
        Fam::V4 => [0x08, 0x00],
        Fam::V6 => [0x86, 0xdd],
    };
    let mut out = Vec::new();
    while out.len() < count {
        let (mut f, _) = frame(rng, &pools, 14);
        let tagged = f.get(12..14) == Some(&[0x81, 0x00][..]);
        let at = if tagged { 16 } else { 12 };
        if f.get(at..at + 2) != Some(&ether[..]) {
            continue;
        }
        f[..6].copy_from_slice(&macs.0);
        f[6..12].copy_from_slice(&macs.1);
        out.push(f);
    }
    out
}

pub fn s32_fuzzed_frames(env: &mut Env) -> Result<()> {
    env.put_service(
        &Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22), ("UDP", 53)]),
        &[env.pod_ip(1)],
    )?;
    env.put_service(&Svc::new("vm2", env.lb(1)), &[env.pod_ip(3)])?;
    env.settle()?;
    let _ssh = env.serve_tcp(1, 22)?;
    let _web = env.serve_tcp(3, WEB)?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.tcp_reaches(env.lb(1), WEB, 3)?;

    let (node, ext, pod2) = (env.topo.node(), env.topo.ext(), env.pod_ns(2));
    let seed = std::env::var("COZY_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5c3);
    let mut rng = Rng::new(seed);
    let mut sent = frames(
        env,
        &mut rng,
        FROM_OUTSIDE,
        (mac(&node, "uplink")?, mac(&ext, "uplink")?),
    );
    // Kube-OVN's shape: everything the pods send reaches the node through
    // the one gateway port, and pod-to-pod traffic never crosses it; the
    // node cannot tell one pod's frames from another's (docs/security.md:
    // the CNI's port security does), so the frames from a pod are left out.
    // With the segment in the node's namespace too: the router sends every
    // pod's address back into it by its own port, so the node judges a
    // pod's frames only where they enter its stack (`ovn0`), as here.
    let from_pod = match env.topo.shape.behind_router() {
        true => Vec::new(),
        false => frames(
            env,
            &mut rng,
            FROM_POD,
            (
                mac(&env.topo.pod_gateway(2).0, &env.topo.pod_gateway(2).1)?,
                mac(&pod2, "eth0")?,
            ),
        ),
    };
    // How each sent frame's checksums were (None: the end is not unique).
    let mut by_end: BTreeMap<Vec<u8>, Option<bool>> = BTreeMap::new();
    for f in sent.iter().chain(&from_pod) {
        let right = parse(f).is_some_and(|s| !s.fragment && checksums_right(&s));
        by_end
            .entry(signature(f))
            .and_modify(|v| *v = None)
            .or_insert(Some(right));
    }

    let caps = [1, 3].map(|i| {
        Capture::start_pcap(
            &env.pod_ns(i),
            "eth0",
            "ip or ip6",
            env.scratch(&format!("fuzz-pod{i}.pcap")),
        )
    });
    let [cap1, cap3] = caps;
    let (cap1, cap3) = (cap1?, cap3?);
    let n_out = send_all(&ext, "uplink", &sent)?;
    let n_pod = send_all(&pod2, "eth0", &from_pod)?;
    std::thread::sleep(Duration::from_secs(1));
    let at_pod1 = cap1.stop_frames()?;
    let at_pod3 = cap3.stop_frames()?;
    sent.extend(from_pod);

    let lbs = [env.lb(0), env.lb(1), env.lb(2)];
    let mut problems = Vec::new();
    let mut first_fragments = BTreeSet::new();
    let mut checked_checksums = 0;
    // In Kube-OVN's shape the pods' own segment carries their traffic to
    // each other (neighbour discovery, say) past the node: only what the
    // router hands on (its MAC as source) came through the node.
    let router = match env.topo.shape {
        Shape::Gateway | Shape::NodeSegment => Some(mac(&env.topo.ovn(), "ls")?),
        Shape::Routed | Shape::Bridge => None,
    };
    for (pod, frames) in [(1, &at_pod1), (3, &at_pod3)] {
        for f in frames.iter() {
            if router.is_some_and(|r| f.get(6..12) != Some(&r[..])) {
                continue;
            }
            let Some(s) = parse(f) else { continue };
            if lbs.contains(&s.dst) {
                problems.push(format!(
                    "pod{pod} received a packet to LB IP {}: {s:?}",
                    s.dst
                ));
            }
            if !s.fragment {
                if let Some(Some(true)) = by_end.get(&signature(f)) {
                    checked_checksums += 1;
                    if !checksums_right(&s) {
                        problems.push(format!("pod{pod}: checksums broken on the way: {s:?}"));
                    }
                }
            }
            if pod == 1 && s.dst == env.pod_ip(1) {
                if s.fragment && !s.later_fragment {
                    first_fragments.insert((s.src, s.frag_id));
                }
                if let Some(why) = filter_violation(&s, env.pod_ip(1), &first_fragments) {
                    problems.push(format!("pod1 (filtered): {why}: {s:?}"));
                }
            }
        }
    }
    eprintln!(
        "s32: seed {seed}: sent {n_out} frames from outside and {n_pod} from pod2; pod1 received {}, pod3 {}; {checked_checksums} checksums checked; {} problems",
        at_pod1.len(),
        at_pod3.len(),
        problems.len()
    );
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    ensure!(
        n_out + n_pod > (FROM_OUTSIDE + FROM_POD) / 2,
        "most frames were not sent"
    );
    ensure!(
        !at_pod3.is_empty() && checked_checksums > 0,
        "the fuzz reached nothing"
    );
    // The node still serves both mappings.
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.tcp_reaches(env.lb(1), WEB, 3)?;
    Ok(())
}
