//! Fuzzing both TC programs with BPF_PROG_TEST_RUN: random and mutated
//! frames (see `cozy_proxy_testkit::fuzz`) on every interface and
//! direction, checked against invariants:
//! 1. the program returns a TC verdict (pass or drop) and never changes a
//!    frame's length;
//! 2. a packet whose addresses are not ours is passed unchanged;
//! 3. a rewritten packet whose checksums were right has right checksums
//!    (and so has the packet an ICMP error quotes);
//! 4. nothing reaches the filtered pod on an unlisted port, and no echo
//!    request reaches it, unless from a peer the pod itself sent to.
//!
//! The regression cases in `tests/fuzz-corpus/` run first; a failure is
//! written to `target/fuzz/failures/` in the same format, to be kept there.
//! `COZY_FUZZ_CASES`, `COZY_FUZZ_SECONDS` and `COZY_FUZZ_SEED` size a run
//! (`cargo xtask fuzz` runs a long one).
use super::{nets, Ifaces, World, DROP, PASS};
use aya::maps::{HashMap as AyaHashMap, MapData};
use cozy_proxy_common::{maps as names, FlowKey, FlowState, FragKey, RevKey, RevValue};
use cozy_proxy_testkit::{
    packets::frames::{addresses, parse, ICMP, ICMPV6, TCP, UDP},
    packets::fuzz::{frame, from_hex, to_hex, Pools, Rng},
};
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

/// Where a frame is run: which program, on which interface, received on
/// which (0: sent by the node itself).
#[derive(Clone, Copy, Debug)]
pub struct Context {
    name: &'static str,
    prog: &'static str,
    ingress: u32,
    dev: u32,
}

fn contexts(i: &Ifaces) -> Vec<Context> {
    let c = |name, prog, ingress, dev| Context {
        name,
        prog,
        ingress,
        dev,
    };
    vec![
        c("ingress@uplink", "cozy_ingress", i.up, i.up),
        c("ingress@pod", "cozy_ingress", i.pod, i.pod),
        c("ingress@fpod", "cozy_ingress", i.fpod, i.fpod),
        c("ingress@peer", "cozy_ingress", i.peer, i.peer),
        c("ingress@client", "cozy_ingress", i.client, i.client),
        c("egress@pod<-uplink", "cozy_egress", i.up, i.pod),
        c("egress@fpod<-uplink", "cozy_egress", i.up, i.fpod),
        c("egress@fpod<-client", "cozy_egress", i.client, i.fpod),
        c("egress@fpod<-node", "cozy_egress", 0, i.fpod),
        c("egress@uplink<-pod", "cozy_egress", i.pod, i.up),
        c("egress@uplink<-node", "cozy_egress", 0, i.up),
        c("egress@peer<-uplink", "cozy_egress", i.up, i.peer),
    ]
}

/// Every address the programs know (mapped, remote, unmapped, guarded).
fn ours() -> BTreeSet<IpAddr> {
    nets()
        .iter()
        .flat_map(|n| {
            [
                n.lb, n.pod, n.flb, n.fpod, n.unmapped, n.rlb, n.rpod, n.slb, n.spod,
            ]
        })
        .collect()
}

fn pools() -> Pools {
    let [v4, v6] = nets();
    let of = |n: &super::Net| {
        vec![
            n.ext, n.node, n.lb, n.pod, n.flb, n.fpod, n.unmapped, n.rlb, n.rpod, n.slb, n.spod,
            n.allowed, n.client,
        ]
    };
    Pools {
        v4: of(&v4),
        v6: of(&v6),
        ports: vec![22, 53, 80, 443, 0, 65535],
        // The filtered pod and its LB IP: where invariant 4 is checked.
        targets: vec![v4.flb, v4.fpod, v6.flb, v6.fpod],
    }
}

/// What one run of the fuzzer saw.
#[derive(Debug, Default)]
pub struct Report {
    pub runs: u64,
    /// Frames the kernel's test runner refused (shorter than the IP
    /// header it reads itself).
    pub refused: u64,
    pub passed: u64,
    pub dropped: u64,
    pub rewritten: u64,
    /// Forwarded packets that reached the filtered pod (invariant 4).
    pub reached_filtered: u64,
    pub failures: Vec<String>,
}

/// The dynamic state the programs keep (flows, fragments, reverse
/// translations): emptied before and after a fuzz run, so that the run's
/// model of "flows the pod started" is exact and other tests are not
/// disturbed.
pub fn forget_dynamic_state(w: &mut World) {
    let mut flows: AyaHashMap<&mut MapData, FlowKey, FlowState> =
        AyaHashMap::try_from(w.ebpf.map_mut(names::FLOWS).expect("flows")).expect("flows");
    let keys: Vec<FlowKey> = flows.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = flows.remove(&k);
    }
    w.kernel.count_flows().expect("recount");
    let mut frags: AyaHashMap<&mut MapData, FragKey, u64> =
        AyaHashMap::try_from(w.ebpf.map_mut(names::FRAGS).expect("frags")).expect("frags");
    let keys: Vec<FragKey> = frags.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = frags.remove(&k);
    }
    let mut rev: AyaHashMap<&mut MapData, RevKey, RevValue> =
        AyaHashMap::try_from(w.ebpf.map_mut(names::REV_NAT).expect("rev_nat")).expect("rev_nat");
    let keys: Vec<RevKey> = rev.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = rev.remove(&k);
    }
}

/// The model of invariant 4: peers the filtered pod sent to.
#[derive(Default)]
struct Model {
    opened: BTreeSet<IpAddr>,
}

fn listed(proto: u8, port: u16) -> bool {
    matches!((proto, port), (TCP, 22) | (UDP, 53))
}

/// Runs `f` in `ctx` and checks the invariants; `Err` says which failed.
fn check(
    w: &World,
    ctx: &Context,
    f: &[u8],
    model: &mut Model,
    report: &mut Report,
) -> Result<(), String> {
    let ours = ours();
    let i = w.ifs;
    let (verdict, out) = match w.run(ctx.prog, f, ctx.ingress, ctx.dev) {
        Ok(r) => r,
        // The runner reads the IP header itself and refuses a frame that
        // cuts it: not a run of the program.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && f.len() < 18 + 40 => {
            report.refused += 1;
            return Ok(());
        }
        Err(e) => return Err(format!("the test runner failed: {e}")),
    };
    report.runs += 1;
    match verdict {
        PASS => report.passed += 1,
        DROP => report.dropped += 1,
        v => return Err(format!("verdict {v} is neither pass nor drop")),
    }
    if out.len() != f.len() {
        return Err(format!("length {} -> {}", f.len(), out.len()));
    }
    let seen_in = parse(f);
    let theirs = addresses(f).iter().all(|a| !ours.contains(a));
    if theirs && (verdict != PASS || out != f) {
        return Err(format!(
            "not ours, yet verdict {verdict} and changed: {}",
            out != f
        ));
    }
    if verdict != PASS {
        return Ok(());
    }
    if out != f {
        report.rewritten += 1;
        // A frame cut inside its headers (IPv4 options, IPv6 extension
        // headers) still has its fixed header rewritten; the stack drops
        // it after us (ip_rcv checks the lengths). Only frames readable
        // before are held to their checksums.
        let Some(a) = seen_in.as_ref() else {
            return Ok(());
        };
        let Some(b) = parse(&out) else {
            return Err("a readable frame rewritten into an unreadable one".into());
        };
        if a.ip_checksum_ok && !b.ip_checksum_ok {
            return Err("IPv4 header checksum broken".into());
        }
        if a.l4_checksum_ok == Some(true) && b.l4_checksum_ok != Some(true) {
            return Err(format!("L4 checksum broken: {:?}", b.l4_checksum_ok));
        }
        if let (Some(qa), Some(qb)) = (&a.quoted, &b.quoted) {
            if qa.ip_checksum_ok && !qb.ip_checksum_ok {
                return Err("quoted IPv4 header checksum broken".into());
            }
            if qa.l4_checksum_ok == Some(true) && qb.l4_checksum_ok != Some(true) {
                return Err("quoted L4 checksum broken".into());
            }
        }
    }
    let fpods: Vec<IpAddr> = nets().iter().map(|n| n.fpod).collect();
    if ctx.prog == "cozy_ingress" && ctx.dev == i.fpod {
        if let Some(s) = seen_in.as_ref().filter(|s| fpods.contains(&s.src)) {
            model.opened.insert(s.dst);
        }
    }
    if ctx.prog == "cozy_egress" && ctx.dev == i.fpod && ctx.ingress != 0 {
        let Some(s) = parse(&out).filter(|s| fpods.contains(&s.dst)) else {
            return Ok(());
        };
        report.reached_filtered += 1;
        if model.opened.contains(&s.src) {
            return Ok(());
        }
        if let Some((_, dport)) = s.ports {
            if !listed(s.proto, dport) {
                return Err(format!("{} port {dport} reached the filtered pod", s.proto));
            }
        }
        let echo_request = matches!(
            (s.proto, s.icmp_type),
            (ICMP, Some(8)) | (ICMPV6, Some(128))
        );
        if echo_request {
            return Err("an echo request reached the filtered pod".into());
        }
    }
    Ok(())
}

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus")
}

fn failures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz/failures")
}

/// A case as kept on disk: `<context> <hex>` per line.
fn case_line(ctx: &Context, f: &[u8]) -> String {
    format!("{} {}", ctx.name, to_hex(f))
}

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// The regression cases, then `cases` generated ones (or until `seconds`).
pub fn run(world: &mut World) -> Report {
    forget_dynamic_state(world);
    let report = run_cases(world);
    forget_dynamic_state(world);
    report
}

fn run_cases(w: &World) -> Report {
    let ctxs = contexts(&w.ifs);
    let mut report = Report::default();
    let mut model = Model::default();
    let fail = |ctx: &Context, f: &[u8], why: String, report: &mut Report| {
        let line = case_line(ctx, f);
        let dir = failures_dir();
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("{}.case", &to_hex(&f[f.len().saturating_sub(8)..])));
        let _ = std::fs::write(&file, format!("{line}\n"));
        report.failures.push(format!(
            "{why}\n    {line}\n    (kept in {})",
            file.display()
        ));
    };
    // Regression cases first.
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for line in text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        {
            let Some((name, hex)) = line.split_once(' ') else {
                report
                    .failures
                    .push(format!("{}: unreadable line {line:?}", file.display()));
                continue;
            };
            let (Some(ctx), Some(f)) = (ctxs.iter().find(|c| c.name == name), from_hex(hex)) else {
                report
                    .failures
                    .push(format!("{}: unreadable line {line:?}", file.display()));
                continue;
            };
            if let Err(why) = check(w, ctx, &f, &mut model, &mut report) {
                fail(
                    ctx,
                    &f,
                    format!("regression case {}: {why}", file.display()),
                    &mut report,
                );
            }
        }
    }
    let cases = env_num("COZY_FUZZ_CASES").unwrap_or(200_000);
    let until = env_num("COZY_FUZZ_SECONDS").map(|s| Instant::now() + Duration::from_secs(s));
    let seed = env_num("COZY_FUZZ_SEED").unwrap_or(0xc0_2a);
    let mut rng = Rng::new(seed);
    let toward_filtered: Vec<Context> = ctxs
        .iter()
        .copied()
        .filter(|c| c.name.starts_with("egress@fpod"))
        .collect();
    let pools = pools();
    let started = Instant::now();
    for n in 0..cases {
        if until.is_some_and(|t| Instant::now() >= t) || report.failures.len() >= 20 {
            break;
        }
        let (f, mutation) = frame(&mut rng, &pools, 14);
        // A third of the runs on the filtered pod's interface.
        let ctx = if rng.chance(33) {
            *rng.pick(&toward_filtered)
        } else {
            *rng.pick(&ctxs)
        };
        if let Err(why) = check(w, &ctx, &f, &mut model, &mut report) {
            fail(
                &ctx,
                &f,
                format!("case {n} (seed {seed}, {mutation:?}): {why}"),
                &mut report,
            );
        }
    }
    eprintln!(
        "fuzz: seed {seed}: {} runs in {:.1?} ({} refused by the runner), {} passed ({} rewritten, {} reached the filtered pod), {} dropped, {} failures",
        report.runs,
        started.elapsed(),
        report.refused,
        report.passed,
        report.rewritten,
        report.reached_filtered,
        report.dropped,
        report.failures.len()
    );
    report
}
