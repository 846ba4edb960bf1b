//! The per-packet benchmark (`cargo xtask bench per-packet`): each TC
//! program run by the kernel through BPF_PROG_TEST_RUN with a large repeat
//! count on fixed frames, reporting the kernel's mean time per run. Stable
//! on a shared machine: no scheduling between runs, no traffic, no other
//! process involved. An empty program (`cozy_pass`) on the same frame is
//! the reference: the figures that matter are the costs above it.
//!
//! A repeated run sees the frame the previous run left, so a rewrite would
//! only be measured once. The mapped cases therefore use a pair of
//! addresses that map to each other (A -> B and B -> A, both local, both
//! with the same policy): every run does the full rewrite, back and forth.
//!
//! `PERPACKET_OBJECT=path` runs another build of the programs (the object
//! `cozy-proxy-ebpf` builds, with the same maps) instead of the embedded
//! one: two variants of a program compared in one sitting.
use anyhow::{bail, Context, Result};
use aya::maps::{Array, DevMapHash, HashMap as AyaHashMap, MapData};
use cozy_proxy::datapath::{AllowedPort, DatapathState};
use cozy_proxy::model::IpRange;
use cozy_proxy_common::{addr, maps as names, AddrInfo, Config, IpKey, PortKey};
use cozy_proxy_testkit::{
    packets::bpf::{
        World, CLIENTS, DROP, PASS, PEER_CLIENTS, REDIRECT, XDP_DROP, XDP_EMPTY, XDP_PASS,
        XDP_PROGRAM, XDP_REDIRECT,
    },
    packets::frames::{Spec, TCP, UDP},
};
use serde_json::{json, Value};
use std::net::IpAddr;

const REPEAT: u32 = 1_000_000;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("constant")
}

/// One family's addresses: a passthrough pair and a filtered pair.
struct Addrs {
    ext: IpAddr,
    unrelated: IpAddr,
    pair: (IpAddr, IpAddr),
    filtered: (IpAddr, IpAddr),
    /// A mapping on another node, made symmetric as the pairs are.
    remote: (IpAddr, IpAddr),
    /// An in-cluster client (an unmapped pod of this node).
    client: IpAddr,
    /// An in-cluster client behind the hairpin interface.
    peer_client: IpAddr,
}

fn families() -> [(&'static str, Addrs); 2] {
    [
        (
            "ipv4",
            Addrs {
                // Outside the node's /16 (its uplink is 198.51.100.2): the
                // in-cluster hint excludes it without a trie lookup.
                ext: ip("203.0.113.200"),
                unrelated: ip("203.0.113.201"),
                pair: (ip("203.0.113.10"), ip("192.0.2.11")),
                filtered: (ip("203.0.113.20"), ip("192.0.2.12")),
                remote: (ip("203.0.113.30"), ip("192.0.2.75")),
                client: ip(CLIENTS[0]),
                peer_client: ip(PEER_CLIENTS[0]),
            },
        ),
        (
            "ipv6",
            Addrs {
                // Outside the node's /48 (its uplink is 2001:db8:100::2/64),
                // as a client from outside is: the hint excludes it too.
                ext: ip("2001:db8:300::200"),
                unrelated: ip("2001:db8:203::200"),
                pair: (ip("2001:db8:203::10"), ip("2001:db8:2::11")),
                filtered: (ip("2001:db8:203::20"), ip("2001:db8:2::12")),
                remote: (ip("2001:db8:203::30"), ip("2001:db8:2::75")),
                client: ip(CLIENTS[1]),
                peer_client: ip(PEER_CLIENTS[1]),
            },
        ),
    ]
}

/// The state the production code writes (creating every map, and the
/// filtered pods' flow maps); the pairs are made symmetric afterwards.
fn state() -> DatapathState {
    let mut s = DatapathState::default();
    for (_, a) in families() {
        for (lb, pod) in [a.pair, a.filtered] {
            s.svc_pod.insert(lb, pod);
            s.pod_svc.insert(pod, lb);
        }
        // Each of the remote pair is the other's LB IP: every repeated run
        // translates (as the local pairs do).
        s.remote.insert(a.remote.0, a.remote.1);
        s.remote.insert(a.remote.1, a.remote.0);
        for client in [a.client, a.peer_client] {
            s.cluster.insert(IpRange {
                first: client,
                last: client,
            });
        }
        s.filtered_pods.insert(a.filtered.1);
        // The link-local ranges every node's in-cluster ranges hold.
        for c in cozy_proxy::model::cluster::link_local() {
            s.cluster.insert(IpRange::of(&c));
        }
        s.allowed_ports.insert(AllowedPort {
            pod: a.filtered.1,
            proto: TCP,
            port: 22,
        });
    }
    s
}

/// Makes `peer` where in-cluster clients' hairpins may leave (again after
/// the fast path's cases, whose writes of `config` take it back).
fn hairpin_on_peer(w: &mut World) -> Result<()> {
    let peer = w.ifs.peer;
    let mut config: Array<&mut MapData, Config> =
        Array::try_from(w.ebpf.map_mut(names::CONFIG).context("config")?)?;
    let c = config.get(&0, 0)?;
    let hairpin = Config {
        hairpin_iface: peer,
        ..c
    };
    config.set(0, hairpin, 0)?;
    Ok(())
}

/// Makes each pair map to each other: both addresses local LB and pod.
fn symmetric_pairs(w: &mut World) -> Result<()> {
    let (pod_if, fpod_if) = (w.ifs.pod, w.ifs.fpod);
    let mut addrs: AyaHashMap<&mut MapData, IpKey, AddrInfo> =
        AyaHashMap::try_from(w.ebpf.map_mut(names::ADDRS).context("addrs")?)?;
    for (_, a) in families() {
        for ((x, y), dev, policy) in [(a.pair, pod_if, 0), (a.filtered, fpod_if, addr::FILTERED)] {
            for (from, to) in [(x, y), (y, x)] {
                let info = AddrInfo {
                    peer: IpKey::from(to),
                    src_ifindex: dev,
                    path_ifindex: dev,
                    flags: addr::LB | addr::POD | addr::LOCAL | policy,
                    slot: 0,
                };
                addrs.insert(IpKey::from(from), info, 0)?;
            }
        }
    }
    let mut ports: AyaHashMap<&mut MapData, PortKey, u8> =
        AyaHashMap::try_from(w.ebpf.map_mut(names::ALLOWED_PORTS).context("ports")?)?;
    for (_, a) in families() {
        let key = PortKey {
            pod: IpKey::from(a.filtered.0),
            proto: TCP,
            _pad: 0,
            port: 22,
        };
        ports.insert(key, 1, 0)?;
    }
    Ok(())
}

struct Case {
    name: &'static str,
    /// A TC program, or [`XDP_PROGRAM`] (run on `ingress`).
    prog: &'static str,
    frame: Vec<u8>,
    ingress: u32,
    dev: u32,
    verdict: u32,
}

impl Case {
    fn new(
        name: &'static str,
        prog: &'static str,
        frame: Vec<u8>,
        ingress: u32,
        dev: u32,
        verdict: u32,
    ) -> Case {
        Case {
            name,
            prog,
            frame,
            ingress,
            dev,
            verdict,
        }
    }

    /// `repeat` runs on build `variant`: the verdict and the mean time;
    /// `None` where that build has no such program.
    fn run(
        &self,
        w: &World,
        variant: usize,
        repeat: u32,
    ) -> Result<Option<(u32, std::time::Duration)>> {
        if self.xdp() {
            return Ok(w.run_xdp_repeated(
                variant,
                self.prog,
                &self.frame,
                self.ingress,
                repeat,
            )?);
        }
        Ok(Some(w.run_repeated_in(
            variant,
            self.prog,
            &self.frame,
            (self.ingress, self.dev),
            repeat,
        )?))
    }

    fn xdp(&self) -> bool {
        self.prog == XDP_PROGRAM || self.prog == XDP_EMPTY
    }

    fn expects(&self, verdict: u32) -> bool {
        verdict == self.verdict || (verdict == REDIRECT && self.verdict == PASS)
    }
}

fn cases(w: &World, a: &Addrs) -> Vec<Case> {
    let i = w.ifs;
    let tcp = |src, dst, dport| Spec::new(src, dst, TCP).ports(40000, dport).build();
    let case = Case::new;
    vec![
        case(
            "empty program",
            "cozy_pass",
            tcp(a.ext, a.unrelated, 80),
            i.up,
            i.up,
            PASS,
        ),
        case(
            "not ours, TC ingress",
            "cozy_ingress",
            tcp(a.ext, a.unrelated, 80),
            i.up,
            i.up,
            PASS,
        ),
        case(
            "not ours, TC egress",
            "cozy_egress",
            tcp(a.ext, a.unrelated, 80),
            i.client,
            i.up,
            PASS,
        ),
        // The uplink's TC ingress on the stack path: nothing to translate
        // there (TC egress toward the pod does it), one lookup to see so.
        case(
            "to an LB IP, uplink's TC ingress (stack path)",
            "cozy_ingress",
            tcp(a.ext, a.pair.0, 80),
            i.up,
            i.up,
            PASS,
        ),
        // A packet the pod's TC ingress translated, leaving by the uplink:
        // its source (the LB IP) is no pod, so not looked up.
        case(
            "translated, leaving by the uplink's TC egress",
            "cozy_egress",
            tcp(a.pair.0, a.ext, 80),
            i.pod,
            i.up,
            PASS,
        ),
        case(
            "mapped, toward the pod (LB -> pod)",
            "cozy_egress",
            tcp(a.ext, a.pair.0, 80),
            i.up,
            i.pod,
            PASS,
        ),
        // The node's own socket to a local LB IP (ingress 0: local out):
        // translated here, with a reverse entry written.
        case(
            "the node's own, to a local LB IP (reverse entry)",
            "cozy_egress",
            tcp(a.ext, a.pair.0, 80),
            0,
            i.pod,
            PASS,
        ),
        case(
            "mapped, from the pod (pod -> LB)",
            "cozy_ingress",
            tcp(a.pair.1, a.ext, 80),
            i.pod,
            i.pod,
            PASS,
        ),
        // An in-cluster client of another node's mapping: translated at
        // its own interface's TC ingress, a reverse entry written (and,
        // where the programs mark hairpins, the route looked up).
        case(
            "in-cluster client to another node's LB IP",
            "cozy_ingress",
            tcp(a.client, a.remote.0, 80),
            i.client,
            i.client,
            PASS,
        ),
        // The same on the interface where hairpins may leave (`peer` here:
        // `Config::hairpin_iface`), where the route is looked up too.
        case(
            "in-cluster client to another node's LB IP, on the hairpin interface",
            "cozy_ingress",
            tcp(a.peer_client, a.remote.0, 80),
            i.peer,
            i.peer,
            PASS,
        ),
        case(
            "filtered, listed port",
            "cozy_egress",
            tcp(a.ext, a.filtered.0, 22),
            i.up,
            i.fpod,
            PASS,
        ),
        case(
            "filtered, unlisted port",
            "cozy_egress",
            Spec::new(a.ext, a.filtered.0, UDP).ports(40000, 80).build(),
            i.up,
            i.fpod,
            DROP,
        ),
        // The XDP program on the uplink: what it passes to the stack, and
        // a flood's packet at a filtered pod's unlisted port, dropped.
        case(
            "XDP: empty program",
            XDP_EMPTY,
            tcp(a.ext, a.unrelated, 80),
            i.up,
            i.up,
            XDP_PASS,
        ),
        case(
            "XDP: not ours",
            XDP_PROGRAM,
            tcp(a.ext, a.unrelated, 80),
            i.up,
            i.up,
            XDP_PASS,
        ),
        case(
            "XDP: to an LB IP, passed on (fast path off)",
            XDP_PROGRAM,
            tcp(a.ext, a.pair.0, 80),
            i.up,
            i.up,
            XDP_PASS,
        ),
        case(
            "XDP: filtered, listed port, passed on",
            XDP_PROGRAM,
            tcp(a.ext, a.filtered.0, 22),
            i.up,
            i.up,
            XDP_PASS,
        ),
        case(
            "XDP: filtered, unlisted port, dropped",
            XDP_PROGRAM,
            Spec::new(a.ext, a.filtered.0, UDP).ports(40000, 80).build(),
            i.up,
            i.up,
            XDP_DROP,
        ),
    ]
}

/// Single runs per sample for the fast path: it decrements the TTL, so a
/// repeated run would soon leave it for the stack path. Each sample is the
/// kernel's time of one run (with the timer's own cost in it, as in the
/// empty program's single runs it is compared with).
const SINGLE_RUNS: usize = 20_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn fast_path_cases(w: &mut World, a: &Addrs) -> Result<Vec<Case>> {
    let i = w.ifs;
    // Routes and neighbours for the FIB, as a CNI and neighbour discovery
    // leave them.
    for (addr, dev) in [(a.pair.0, "v-pod"), (a.pair.1, "v-pod"), (a.ext, "uplink")] {
        w.reachable(addr, dev, "02:00:00:00:00:0b")?;
    }
    // The pod's interface takes XDP frames (its peer would have GRO on).
    if let Some(map) = w.ebpf.map_mut(names::XDP_TARGETS) {
        let mut targets: DevMapHash<&mut MapData> = DevMapHash::try_from(map)?;
        targets.insert(i.pod, i.pod, None, 0)?;
    }
    let tcp = |src, dst| Spec::new(src, dst, TCP).ports(40000, 80).build();
    let case = Case::new;
    Ok(vec![
        case(
            "empty program (single runs)",
            "cozy_pass",
            tcp(a.ext, a.unrelated),
            i.up,
            i.up,
            PASS,
        ),
        case(
            "stack path, toward the pod (single runs)",
            "cozy_egress",
            tcp(a.ext, a.pair.0),
            i.up,
            i.pod,
            PASS,
        ),
        case(
            "fast path, toward the pod (single runs)",
            "cozy_ingress",
            tcp(a.ext, a.pair.0),
            i.up,
            i.up,
            REDIRECT,
        ),
        case(
            "fast path, from the pod (single runs)",
            "cozy_ingress",
            tcp(a.pair.1, a.ext),
            i.pod,
            i.pod,
            REDIRECT,
        ),
        case(
            "XDP: empty program (single runs)",
            XDP_EMPTY,
            tcp(a.ext, a.unrelated),
            i.up,
            i.up,
            XDP_PASS,
        ),
        case(
            "XDP fast path, redirected to the pod (single runs)",
            XDP_PROGRAM,
            tcp(a.ext, a.pair.0),
            i.up,
            i.up,
            XDP_REDIRECT,
        ),
    ])
}

/// Runs `cases` on every build of `w`, interleaved (a slow moment of the
/// machine spreads over every case and build instead of landing on one):
/// `rounds` samples of `repeat` runs each, or, with `single`, of single
/// runs (each sample then holds `SINGLE_RUNS / rounds` of them). Returns
/// each build's rows, its cases' costs above its own empty program's.
fn measure(
    w: &World,
    family: &str,
    cases: &[Case],
    rounds: usize,
    single: bool,
) -> Result<Vec<Vec<Value>>> {
    let builds = 1 + w.others.len();
    // times[build][case]
    let mut times: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); cases.len()]; builds];
    for _ in 0..rounds {
        for (b, build_times) in times.iter_mut().enumerate() {
            for (c, t) in cases.iter().zip(build_times.iter_mut()) {
                let (runs, repeat) = if single {
                    (SINGLE_RUNS / rounds, 1)
                } else {
                    (1, REPEAT)
                };
                for _ in 0..runs {
                    let Some((verdict, took)) = c.run(w, b, repeat)? else {
                        break;
                    };
                    if !c.expects(verdict) {
                        bail!(
                            "{family} {} (build {b}): verdict {verdict}, expected {}",
                            c.name,
                            c.verdict
                        );
                    }
                    t.push(took.as_nanos() as f64);
                }
            }
        }
    }
    let mut out = Vec::new();
    for build_times in times {
        // The empty programs' medians: the TC cases' reference, the XDP
        // cases' (a test run of each kind costs its own).
        let empty_of = |xdp: bool| {
            (cases.iter().zip(&build_times))
                .find(|(c, t)| {
                    (c.prog == "cozy_pass" || c.prog == XDP_EMPTY)
                        && c.xdp() == xdp
                        && !t.is_empty()
                })
                .map_or(f64::NAN, |(_, t)| median(t.clone()))
        };
        let (tc_empty, xdp_empty) = (empty_of(false), empty_of(true));
        let mut rows = Vec::new();
        for (c, t) in cases.iter().zip(build_times.iter().cloned()) {
            if t.is_empty() {
                continue;
            }
            let s = summary(t);
            let empty = if c.xdp() { xdp_empty } else { tc_empty };
            let above = s["median"].as_f64().unwrap_or(f64::NAN) - empty;
            rows.push(json!({"case": c.name, "program": c.prog, "ns": s, "above_empty_ns": above}));
        }
        out.push(rows);
    }
    Ok(out)
}

fn summary(mut v: Vec<f64>) -> Value {
    v.sort_by(|a, b| a.total_cmp(b));
    json!({"min": v[0], "median": v[v.len() / 2], "max": v[v.len() - 1]})
}

fn main() -> Result<()> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(7);
    let mut w = World::new(|_| state())?;
    symmetric_pairs(&mut w)?;
    // PER_PACKET_ONLY=<part of a case name>: only those cases (for a
    // profiler attached meanwhile).
    let only = std::env::var("PER_PACKET_ONLY").ok();
    let keep = |cases: &mut Vec<Case>| {
        if let Some(o) = &only {
            cases.retain(|c| {
                c.name.contains(o.as_str()) || c.prog == "cozy_pass" || c.prog == XDP_EMPTY
            });
        }
    };
    let builds = 1 + w.others.len();
    let mut out: Vec<serde_json::Map<String, Value>> = vec![serde_json::Map::new(); builds];
    for (family, a) in families() {
        hairpin_on_peer(&mut w)?;
        let mut cases = cases(&w, &a);
        keep(&mut cases);
        let mut rows = measure(&w, family, &cases, rounds, false)?;
        let mut fast = fast_path_cases(&mut w, &a)?;
        keep(&mut fast);
        w.kernel.set_fast_path(true)?;
        let fast_rows = measure(&w, family, &fast, rounds, true);
        w.kernel.set_fast_path(false)?;
        for (r, f) in rows.iter_mut().zip(fast_rows?) {
            r.extend(f);
        }
        for (b, r) in rows.into_iter().enumerate() {
            out[b].insert(family.into(), Value::Array(r));
        }
    }
    for (b, o) in out.iter().enumerate() {
        let label = match b {
            0 => "this build",
            i => w.others[i - 1].0.as_str(),
        };
        for (family, rows) in o {
            for r in rows.as_array().into_iter().flatten() {
                eprintln!(
                    "per-packet [{label}] {family} {}: {} ({:.0} ns above empty)",
                    r["case"],
                    r["ns"],
                    r["above_empty_ns"].as_f64().unwrap_or(f64::NAN)
                );
            }
        }
    }
    let compared: serde_json::Map<String, Value> = (w.others.iter())
        .zip(out.iter().skip(1))
        .map(|((label, _), o)| (label.clone(), Value::Object(o.clone())))
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "per_packet": out[0], "compared": compared, "repeat": REPEAT, "rounds": rounds
        }))?
    );
    Ok(())
}
