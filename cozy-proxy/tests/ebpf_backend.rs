//! The eBPF backend's kernel state, as the real `bpftool` and `ip` show it:
//! readable pinned maps, tcx links that survive a restart (re-pointed, not
//! re-created), new interfaces followed, and cleanup. Needs root.
use cozy_proxy_testkit as harness;

use anyhow::{bail, ensure, Context, Result};
use cozy_proxy::ebpf::layouts::pin_path;
use harness::{
    controller::manifests::{slice, Slice, Svc},
    controller::refuse,
    nodes::net::Fam,
    sh::{ok, ok_in},
    traffic::{answer, eventually, tcp_request, Server, SETTLE},
    Backend, Env,
};
use serde_json::Value;
use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    time::Duration,
};

fn bpftool(args: &[&str]) -> Result<Value> {
    let mut all = vec!["bpftool", "-j"];
    all.extend_from_slice(args);
    Ok(serde_json::from_str(&ok(&all)?)?)
}

/// `(link id, program id)` of every pinned link.
fn pinned_links(pin_dir: &Path) -> Result<Vec<(u64, u64, String)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(pin_dir.join("links"))? {
        let path = entry?.path();
        let v = bpftool(&["link", "show", "pinned", &path.display().to_string()])?;
        out.push((
            v["id"].as_u64().context("link id")?,
            v["prog_id"].as_u64().context("prog id")?,
            // bpftool 7.1 (Debian 12) predates tcx and prints the number.
            match &v["type"] {
                Value::String(t) => t.clone(),
                other => format!("type {other}"),
            },
        ));
    }
    out.sort();
    Ok(out)
}

fn setup() -> Result<Env> {
    setup_with(Backend::Ebpf)
}

fn setup_with(backend: Backend) -> Result<Env> {
    let mut env = Env::new(backend, Fam::V4)?;
    let svc = Svc::new("vm1", env.net.lbs[0]).filter(&[("TCP", 22)]);
    env.dir.put("vm1", &svc.yaml())?;
    env.dir.put(
        "vm1-eps",
        &slice("vm1", "IPv4", &[(env.net.pods[0].to_string(), None)]),
    )?;
    env.settle()?;
    if backend == Backend::Nft {
        return Ok(env);
    }
    // Four interfaces (uplink, pod1..3), two tcx links each: the last ones
    // may still be attaching when the maps are already in place.
    eventually(SETTLE, || {
        let links = pinned_links(&env.ctl.pin_dir)?;
        ensure!(links.len() == 8, "links: {links:?}");
        Ok(())
    })?;
    Ok(env)
}

/// [`setup`], then restarted with `--namespace-share PERCENT`.
fn setup_sharing(percent: u8) -> Result<Env> {
    let mut env = setup()?;
    env.ctl
        .extra_args
        .extend(["--namespace-share".into(), percent.to_string()]);
    env.ctl.restart()?;
    Ok(env)
}

#[test]
fn bpftool_shows_readable_maps_and_tcx_links() -> Result<()> {
    let mut env = setup()?;
    let pins = &env.ctl.pin_dir.clone();
    let dump = bpftool(&[
        "map",
        "dump",
        "pinned",
        &pin_path(pins, "addrs").display().to_string(),
    ])?;
    // BTF-typed: bpftool prints the fields of our structs, not hex bytes.
    let v4 = |v: &Value| v["addr"].as_array().map(|a| a[..4].to_vec());
    let octets = |a: [u64; 4]| Some(a.iter().map(|o| Value::from(*o)).collect::<Vec<_>>());
    let entry = dump
        .as_array()
        .context("array")?
        .iter()
        .find(|e| v4(&e["formatted"]["key"]) == octets([203, 0, 113, 10]))
        .with_context(|| format!("no entry for the LB IP: {dump}"))?;
    let (key, value) = (&entry["formatted"]["key"], &entry["formatted"]["value"]);
    ensure!(key["family"] == 4, "key: {entry}");
    ensure!(
        v4(&value["peer"]) == octets([192, 0, 2, 11]),
        "value: {value}"
    );
    // LB | LOCAL | FILTERED | PATH_PEER (cozy_proxy_common::addr): the
    // pod sits behind a veth whose peer is its own end.
    ensure!(value["flags"] == 2 | 4 | 16 | 128, "flags: {value}");
    let ports = bpftool(&[
        "map",
        "dump",
        "pinned",
        &pins.join("allowed_ports").display().to_string(),
    ])?;
    ensure!(
        ports.to_string().contains("\"port\":22"),
        "allowed_ports: {ports}"
    );
    let links = pinned_links(pins)?;
    ensure!(links.len() == 8, "links: {links:?}");
    // BPF_LINK_TYPE_TCX is 11.
    ensure!(
        links.iter().all(|(_, _, t)| t == "tcx" || t == "type 11"),
        "links: {links:?}"
    );
    // Per-service and drop counters (per-CPU maps), summed by `dump`;
    // a second Service, without traffic, counts none of the first's.
    env.put_service(&Svc::new("vm2", env.net.lbs[1]), &[env.net.pods[1]])?;
    env.settle()?;
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    ensure!(
        tcp_request(&env.topo.ext(), env.net.lbs[0], 8080).is_err(),
        "8080 must be filtered"
    );
    let dump = env.dump_json()?;
    let counters = &dump["counters"];
    let svc = &counters["services"]["203.0.113.10"];
    ensure!(
        svc["ingress"]["packets"].as_u64() > Some(0),
        "ingress counter: {counters}"
    );
    ensure!(
        svc["egress"]["packets"].as_u64() > Some(0),
        "egress counter: {counters}"
    );
    ensure!(
        counters["drops"]["filtered_port"]["packets"].as_u64() > Some(0),
        "drop counter: {counters}"
    );
    let quiet = &counters["services"][env.net.lbs[1].to_string()];
    ensure!(
        quiet["ingress"]["packets"].as_u64() == Some(0)
            && quiet["egress"]["packets"].as_u64() == Some(0),
        "a Service without traffic: {counters}"
    );
    // The host route that steers the LB IP to its pod.
    let routes = ok_in(&env.topo.node(), &["ip", "route", "show", "proto", "249"])?;
    ensure!(
        routes.contains("203.0.113.10 via 192.0.2.11"),
        "routes: {routes}"
    );
    Ok(())
}

#[test]
fn a_restart_re_points_the_same_links_and_keeps_the_maps() -> Result<()> {
    let mut env = setup()?;
    let before_state = env.dump()?;
    let before = pinned_links(&env.ctl.pin_dir)?;
    env.ctl.restart()?;
    env.wait_log("backend=ebpf elements=")?;
    env.wait_log("adopting the datapath")?;
    env.settle()?;
    let after = pinned_links(&env.ctl.pin_dir)?;
    let ids = |l: &[(u64, u64, String)]| l.iter().map(|x| x.0).collect::<Vec<_>>();
    ensure!(
        ids(&before) == ids(&after),
        "links re-created: {before:?} -> {after:?}"
    );
    ensure!(
        before.iter().zip(&after).all(|(b, a)| b.1 != a.1),
        "programs not replaced: {before:?} -> {after:?}"
    );
    ensure!(
        env.dump()? == before_state,
        "state changed across the restart"
    );
    Ok(())
}

/// A restart whose kernel refuses both the update of the pinned links and
/// new links (EPERM): the links of the process before stay pinned and keep
/// translating with the maps the new process keeps, while it retries.
#[test]
fn a_refused_link_update_keeps_the_working_links() -> Result<()> {
    let mut env = setup()?;
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    let (ext, lb) = (env.topo.ext(), env.net.lbs[0]);
    eventually(SETTLE, || tcp_request(&ext, lb, 22))?;
    let before = pinned_links(&env.ctl.pin_dir)?;
    env.ctl.refused_bpf = vec![refuse::BPF_LINK_UPDATE, refuse::BPF_LINK_CREATE];
    env.ctl.restart()?;
    env.wait_log("attaching failed; retrying every second")?;
    env.settle()?;
    let after = pinned_links(&env.ctl.pin_dir)?;
    ensure!(before == after, "links changed: {before:?} -> {after:?}");
    let got = tcp_request(&ext, lb, 22).context("the LB IP after the refused attach")?;
    ensure!(
        got.contains(&answer("pod1", env.net.ext)),
        "answered {got:?}"
    );
    // Allowed again, the next attempt re-points the same links.
    env.ctl.refused_bpf.clear();
    env.ctl.restart()?;
    env.settle()?;
    eventually(SETTLE, || {
        let now = pinned_links(&env.ctl.pin_dir)?;
        let ids = |l: &[(u64, u64, String)]| l.iter().map(|x| x.0).collect::<Vec<_>>();
        ensure!(
            ids(&now) == ids(&before),
            "links re-created: {before:?} -> {now:?}"
        );
        ensure!(now != before, "programs not replaced: {now:?}");
        Ok(())
    })?;
    tcp_request(&ext, lb, 22).map(|_| ())
}

/// The id of the map pinned at `path`.
fn map_id(path: &Path) -> Result<u64> {
    let v = bpftool(&["map", "show", "pinned", &path.display().to_string()])?;
    v["id"].as_u64().context("map id")
}

/// A restart finds a pin of `flows` at another layout version (a release
/// that changed its meaning) and one at this build's: the other is
/// unpinned, this build's map is kept (its flow memory carried over), and
/// a map whose sizes differ under this build's name is created anew.
#[test]
fn pins_of_another_layout_are_replaced_and_the_rest_kept() -> Result<()> {
    let mut env = setup()?;
    let pins = env.ctl.pin_dir.clone();
    let flows = pin_path(&pins, "flows");
    let flows_id = map_id(&flows)?;
    env.ctl.stop()?;
    let other = pins.join("flows_v9");
    let frags = pin_path(&pins, "frags");
    std::fs::remove_file(&frags)?;
    for (path, key) in [(&other, "48"), (&frags, "4")] {
        let path = path.display().to_string();
        ok(&[
            "bpftool", "map", "create", &path, "type", "hash", "key", key, "value", "8", "entries",
            "1", "name", "stale",
        ])?;
    }
    let old_frags = map_id(&frags)?;
    env.ctl.restart()?;
    env.wait_log("adopting the datapath")?;
    env.settle()?;
    ensure!(!other.exists(), "flows_v9 still pinned");
    ensure!(map_id(&flows)? == flows_id, "flows re-created");
    ensure!(map_id(&frags)? != old_frags, "frags of other sizes kept");
    env.wait_log("unpinned a map of another layout")
}

#[test]
fn interfaces_that_appear_later_are_followed() -> Result<()> {
    let mut env = setup()?;
    let i = env.topo.add_pod()?;
    let pod_ip: std::net::IpAddr = format!("192.0.2.1{i}").parse()?;
    let lb = env.net.lbs[3];
    env.dir.put("vm4", &Svc::new("vm4", lb).yaml())?;
    env.dir.put(
        "vm4-eps",
        &slice("vm4", "IPv4", &[(pod_ip.to_string(), None)]),
    )?;
    env.settle()?;
    env.wait_log(&format!("interface=pod{i}"))?;
    let ext = env.topo.ext();
    let _srv = Server::tcp(&ext, Fam::V4, 7000, "ext")?;
    let got = eventually(SETTLE, || tcp_request(&env.topo.pod(i), env.net.ext, 7000))?;
    ensure!(got == answer("ext", lb), "pod{i} egress: {got}");
    Ok(())
}

#[test]
fn cleanup_removes_links_maps_and_routes() -> Result<()> {
    let mut env = setup()?;
    let pins = env.ctl.pin_dir.clone();
    let links = pinned_links(&pins)?;
    env.ctl.stop()?;
    // Stopped: everything still in place (and still translating).
    ensure!(pinned_links(&pins)? == links, "stopping changed the links");
    let node = env.topo.node();
    cleanup(&env)?;
    ensure!(!pins.exists(), "pin directory left: {}", pins.display());
    for (id, _, _) in links {
        let shown = std::process::Command::new("bpftool")
            .args(["link", "show", "id", &id.to_string()])
            .output()?;
        ensure!(!shown.status.success(), "link {id} still exists");
    }
    let routes = ok_in(&node, &["ip", "route", "show", "proto", "249"])?;
    ensure!(routes.trim().is_empty(), "routes left: {routes}");
    Ok(())
}

/// Someone detaches our links (here: `bpftool link detach` on every one):
/// the next resync (2 s here) checks the attachments and attaches them
/// again; traffic to the LB IP flows again.
#[test]
fn links_detached_by_others_come_back_at_the_resync() -> Result<()> {
    let env = setup()?;
    let pins = env.ctl.pin_dir.clone();
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    let before = pinned_links(&pins)?;
    for (id, _, _) in &before {
        ok(&["bpftool", "link", "detach", "id", &id.to_string()])?;
    }
    let after = eventually(std::time::Duration::from_secs(6), || {
        let now = pinned_links(&pins)?;
        let ids = |l: &[(u64, u64, String)]| l.iter().map(|x| x.0).collect::<Vec<_>>();
        ensure!(
            now.len() == 8 && ids(&now).iter().all(|i| !ids(&before).contains(i)),
            "not re-attached yet: {now:?}"
        );
        Ok(now)
    })
    .with_context(|| env.ctl.log_text())?;
    ensure!(after.len() == 8, "{after:?}");
    let got = eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    ensure!(got == answer("pod1", env.net.ext), "{got}");
    Ok(())
}

/// `tc filter show` in the node namespace: the bpf filters on `dev`'s
/// `hook` (ingress or egress).
fn tc_filter_show(env: &Env, dev: &str, hook: &str) -> Result<String> {
    ok_in(
        &env.topo.node(),
        &["tc", "filter", "show", "dev", dev, hook],
    )
}

/// How many bpf filters `dev`'s `hook` holds.
fn tc_filters(env: &Env, dev: &str, hook: &str) -> Result<usize> {
    // One line per filter carries its handle and program.
    Ok(tc_filter_show(env, dev, hook)?
        .lines()
        .filter(|l| l.contains(" bpf ") && l.contains(" handle "))
        .count())
}

/// `cozy-proxy cleanup` of the test's pin directory, in the node namespace.
fn cleanup(env: &Env) -> Result<()> {
    let pins = env.ctl.pin_dir.display().to_string();
    ok_in(
        &env.topo.node(),
        &[&harness::bin(), "cleanup", "--bpf-pin-dir", &pins],
    )
    .map(|_| ())
}

/// The path of kernels before 6.6 (no tcx), forced with
/// `--tc-attach netlink`: the programs are tc filters; three restarts
/// replace their programs in place (exactly one filter per hook, traffic
/// through), and cleanup deletes them.
#[test]
fn legacy_tc_filters_are_replaced_on_restart_and_removed_on_cleanup() -> Result<()> {
    let mut env = setup()?;
    // Start over on the legacy path (the setup attached tcx links).
    env.ctl.stop()?;
    cleanup(&env)?;
    env.ctl.extra_args = vec!["--tc-attach".into(), "netlink".into()];
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    // The program id in the uplink's ingress filter: a new one each start.
    let program_id = |env: &Env| -> Result<String> {
        let out = tc_filter_show(env, "uplink", "ingress")?;
        out.split_whitespace()
            .skip_while(|w| *w != "id")
            .nth(1)
            .map(str::to_string)
            .with_context(|| format!("no program id: {out}"))
    };
    let mut ids = Vec::new();
    for round in 0..4 {
        env.ctl.restart()?;
        env.settle()?;
        eventually(SETTLE, || {
            for dev in ["uplink", "pod1"] {
                for hook in ["ingress", "egress"] {
                    let n = tc_filters(&env, dev, hook)?;
                    ensure!(
                        n == 1,
                        "round {round}: {n} bpf filters on {dev} {hook}: {}",
                        tc_filter_show(&env, dev, hook)?
                    );
                }
            }
            Ok(())
        })
        .with_context(|| env.ctl.log_text())?;
        let got = eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
        ensure!(got == answer("pod1", env.net.ext), "round {round}: {got}");
        ids.push(program_id(&env)?);
    }
    ids.dedup();
    ensure!(
        ids.len() == 4,
        "the filter's program was not replaced at each start: {ids:?}"
    );
    ensure!(
        pinned_links(&env.ctl.pin_dir)?.is_empty(),
        "tcx links on the legacy path"
    );
    env.ctl.stop()?;
    cleanup(&env)?;
    for dev in ["uplink", "pod1", "pod2", "pod3"] {
        for hook in ["ingress", "egress"] {
            let n = tc_filters(&env, dev, hook)?;
            ensure!(n == 0, "{n} bpf filters left on {dev} {hook} after cleanup");
        }
    }
    Ok(())
}

/// The pod's veth is deleted and created again with the same IP (a new
/// ifindex): the LB IP's route, the anti-spoofing path and the programs'
/// attachment follow it within seconds; traffic flows again, both ways.
fn a_recreated_pod_link_is_followed(backend: Backend) -> Result<()> {
    let mut env = Env::new(backend, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.net.lbs[0]), &[env.net.pods[0]])?;
    env.settle()?;
    env.topo.rewire_pod(1)?;
    let _web = Server::tcp(&env.topo.pod(1), Fam::V4, 8080, "pod1")?;
    env.settle()?;
    let got = eventually(SETTLE, || {
        tcp_request(&env.topo.ext(), env.net.lbs[0], 8080)
    })?;
    ensure!(got == answer("pod1", env.net.ext), "{got}");
    env.egress_seen_as(1, env.net.lbs[0])
}

#[test]
fn a_recreated_pod_link_is_followed_ebpf() -> Result<()> {
    a_recreated_pod_link_is_followed(Backend::Ebpf)
}

#[test]
fn a_recreated_pod_link_is_followed_nft() -> Result<()> {
    a_recreated_pod_link_is_followed(Backend::Nft)
}

/// The map of allowed ports (262 144 entries) filled by 65 Services of
/// 4 096 ports each, after a working one: the working Service keeps its
/// place and its traffic, the LB IPs that do not fit are left out whole
/// (dropped as unmapped, reported per Service), everything else is
/// applied; when two leave, the two left out take their room.
#[test]
fn a_full_map_leaves_out_whole_services_reports_them_and_applies_the_rest() -> Result<()> {
    use cozy_proxy_common::limits;
    use std::net::IpAddr;
    // Every Service in one namespace: no per-namespace bound here.
    let env = setup_sharing(100)?;
    let ports: Vec<(&str, u16)> = (1..=4096).map(|p| ("TCP", p)).collect();
    let big = |i: usize| -> Result<(String, IpAddr, IpAddr)> {
        Ok((
            format!("big{i}"),
            format!("203.0.113.{}", 100 + i).parse()?,
            format!("192.0.2.{}", 100 + i).parse()?,
        ))
    };
    for i in 0..65 {
        let (name, lb, pod) = big(i)?;
        env.dir
            .put(&name, &Svc::new(&name, lb).filter(&ports).yaml())?;
        env.dir.put(
            &format!("{name}-eps"),
            &slice(&name, "IPv4", &[(pod.to_string(), None)]),
        )?;
    }
    // vm1's port and 63 big Services fill the map: 1 + 63 * 4096 <= 262 144.
    let fitting = (limits::PORTS - 1) / 4096;
    ensure!(fitting == 63, "limits changed: {fitting}");
    let left_out: Vec<IpAddr> = (fitting..65)
        .map(|i| big(i).map(|b| b.1))
        .collect::<Result<_>>()?;
    let long = std::time::Duration::from_secs(60);
    // The controller syncs while the files arrive: a sync that has seen
    // only the first 63 big Services maps as many as the final one does,
    // so the wait is for the whole final state, the left-out LB IPs
    // dropped as unmapped included.
    let state = eventually(long, || {
        let s = env.dump()?;
        ensure!(
            s.svc_pod.len() == 1 + fitting,
            "mapped: {}",
            s.svc_pod.len()
        );
        for lb in &left_out {
            ensure!(s.unmapped_lbs.contains(lb), "{lb} not dropped");
        }
        Ok(s)
    })
    .with_context(|| env.ctl.log_text())?;
    ensure!(state.allowed_ports.len() == 1 + fitting * 4096);
    ensure!(
        state.svc_pod.contains_key(&env.net.lbs[0]),
        "vm1 lost its place"
    );
    for lb in &left_out {
        ensure!(!state.svc_pod.contains_key(lb), "{lb} mapped");
    }
    env.wait_log("the datapath's tables are full")?;
    env.wait_log(&format!(
        "{} is not translated on node1: the datapath's tables are full (allowed_ports); \
         the other Services are applied service=default/big64 reason=DatapathFull",
        left_out[1]
    ))?;
    // vm1 still works, and is still filtered.
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    ensure!(
        tcp_request(&env.topo.ext(), env.net.lbs[0], 8080).is_err(),
        "8080 must be filtered"
    );
    // Two leave: the two left out take their room.
    for i in 0..2 {
        env.delete_service_files(&big(i)?.0)?;
    }
    let state = eventually(long, || {
        let s = env.dump()?;
        for lb in &left_out {
            ensure!(s.svc_pod.contains_key(lb), "{lb} not mapped yet");
        }
        Ok(s)
    })
    .with_context(|| env.ctl.log_text())?;
    ensure!(state.allowed_ports.len() == 1 + fitting * 4096);
    env.wait_log("resolved: 203.0.113.164 is not translated")?;
    Ok(())
}

/// `--namespace-share 1`: a namespace takes at most 1% of each map here
/// (2 621 of the 262 144 allowed ports). A Service of namespace `greedy`
/// listing 4 096 ports is not translated (dropped, a NamespaceShare
/// warning); a smaller one of the same namespace is, and so is vm1 of
/// `default`, which keeps its traffic.
#[test]
fn a_namespace_past_its_share_is_left_out_and_the_others_are_not() -> Result<()> {
    use std::net::IpAddr;
    let env = setup_sharing(1)?;
    let greedy = |name: &str, lb: &str, pod: &str, ports: u16| -> Result<IpAddr> {
        let list: Vec<(&str, u16)> = (1..=ports).map(|p| ("TCP", p)).collect();
        let lb: IpAddr = lb.parse()?;
        let yaml = Svc::new(name, lb).in_namespace("greedy").filter(&list);
        let eps = Slice::new(name, "IPv4", &[(pod, None)]).in_namespace("greedy");
        env.dir.put(name, &yaml.yaml())?;
        env.dir.put(&format!("{name}-eps"), &eps.yaml())?;
        Ok(lb)
    };
    let big = greedy("big", "203.0.113.100", "192.0.2.100", 4096)?;
    let small = greedy("small", "203.0.113.101", "192.0.2.101", 100)?;
    let state = eventually(SETTLE, || {
        let s = env.dump()?;
        ensure!(s.svc_pod.contains_key(&small), "small not mapped: {s:?}");
        Ok(s)
    })
    .with_context(|| env.ctl.log_text())?;
    ensure!(!state.svc_pod.contains_key(&big), "big mapped");
    ensure!(state.unmapped_lbs.contains(&big), "big not dropped");
    ensure!(
        state.allowed_ports.len() == 1 + 100,
        "ports: {}",
        state.allowed_ports.len()
    );
    ensure!(
        state.svc_pod.contains_key(&env.net.lbs[0]),
        "vm1 lost its place"
    );
    env.wait_log(&format!(
        "{big} is not translated on node1: namespace greedy holds its share"
    ))?;
    env.wait_log("reason=NamespaceShare")?;
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    // The small one goes: the big one still does not fit its share.
    env.delete_service_files("small")?;
    eventually(SETTLE, || {
        let s = env.dump()?;
        ensure!(!s.svc_pod.contains_key(&small) && !s.svc_pod.contains_key(&big));
        Ok(())
    })?;
    Ok(())
}

/// The prefilter's address bits, as the real `bpftool` reads them, are
/// exactly those of the addresses `addrs` holds, in each bitmap those of
/// the entries of its role (every address, the pods, the LB IPs mapped
/// elsewhere or unmapped): set for each one as it enters, cleared when the
/// last address setting a bit leaves (a bit left set would cost every
/// packet to that address the full lookup; one missing, on the stack path,
/// would skip an LB IP's drop or translation).
fn prefilter_matches_addrs(pins: &Path) -> Result<()> {
    use cozy_proxy_common::{prefilter, IpKey};
    let dump = |name: &str| {
        bpftool(&[
            "map",
            "dump",
            "pinned",
            &pin_path(pins, name).display().to_string(),
        ])
    };
    let bitmaps = [
        ("words", prefilter::ALL),
        ("pods", prefilter::PODS),
        ("foreign_lbs", prefilter::FOREIGN_LBS),
    ];
    let mut want = vec![vec![0u64; prefilter::WORDS]; bitmaps.len()];
    let addrs = dump("addrs")?;
    for e in addrs.as_array().context("addrs")? {
        let key = &e["formatted"]["key"];
        let bytes: Vec<u8> = key["addr"]
            .as_array()
            .context("addr")?
            .iter()
            .map(|b| {
                b.as_u64()
                    .and_then(|b| u8::try_from(b).ok())
                    .context("byte")
            })
            .collect::<Result<_>>()?;
        let k = IpKey {
            family: key["family"].as_u64().context("family")? as u32,
            addr: bytes.try_into().ok().context("16 bytes")?,
        };
        let flags = e["formatted"]["value"]["flags"]
            .as_u64()
            .and_then(|f| u16::try_from(f).ok())
            .context("flags")?;
        let roles = prefilter::roles(flags);
        let (word, bit) = prefilter::slot(k.fold());
        for ((_, role), w) in bitmaps.iter().zip(want.iter_mut()) {
            if roles & role != 0 {
                w[word] |= bit;
            }
        }
    }
    let filter = dump("prefilter")?;
    for ((name, _), want) in bitmaps.iter().zip(&want) {
        let words: Vec<u64> = filter[0]["formatted"]["value"][name]
            .as_array()
            .with_context(|| format!("prefilter {name}"))?
            .iter()
            .map(|w| w.as_u64().context("word"))
            .collect::<Result<_>>()?;
        let differ: Vec<usize> = (0..want.len())
            .filter(|i| words.get(*i) != Some(&want[*i]))
            .collect();
        ensure!(
            differ.is_empty() && words.len() == want.len(),
            "prefilter {name} differs from the bits of addrs ({} entries) at {differ:?}",
            addrs.as_array().map_or(0, Vec::len)
        );
    }
    Ok(())
}

#[test]
fn the_prefilter_holds_the_bits_of_the_addresses_mapped_and_no_other() -> Result<()> {
    let mut env = setup()?;
    // No resync within the test: a resync reads the maps again and
    // rewrites the prefilter whole; the bits kept change by change are
    // what is checked here.
    env.ctl.extra_args = vec!["--resync".into(), "600s".into()];
    env.ctl.restart()?;
    let name = |i: usize| format!("many{i}");
    for i in 0..24 {
        let lb: std::net::IpAddr = format!("203.0.113.{}", 100 + i).parse()?;
        env.dir.put(&name(i), &Svc::new(&name(i), lb).yaml())?;
        env.dir.put(
            &format!("{}-eps", name(i)),
            &slice(&name(i), "IPv4", &[(format!("192.0.2.{}", 100 + i), None)]),
        )?;
    }
    let mapped = |n: usize, unmapped: usize| {
        eventually(SETTLE, || {
            let s = env.dump()?;
            ensure!(s.svc_pod.len() == n, "mapped: {}", s.svc_pod.len());
            ensure!(
                s.unmapped_lbs.len() == unmapped,
                "unmapped: {}",
                s.unmapped_lbs.len()
            );
            prefilter_matches_addrs(&env.ctl.pin_dir)
        })
        .with_context(|| env.ctl.log_text())
    };
    mapped(25, 0)?;
    // Roles change with the address staying: a mapping's LB IP left
    // without its pod (unmapped: a foreign LB IP now), and back.
    for i in 20..24 {
        env.dir.remove(&format!("{}-eps", name(i)))?;
    }
    mapped(21, 4)?;
    for i in 20..22 {
        env.dir.put(
            &format!("{}-eps", name(i)),
            &slice(&name(i), "IPv4", &[(format!("192.0.2.{}", 100 + i), None)]),
        )?;
    }
    mapped(23, 2)?;
    for i in 0..22 {
        env.delete_service_files(&name(i))?;
    }
    for i in 22..24 {
        env.dir.remove(&name(i))?;
    }
    mapped(1, 0)?;
    Ok(())
}

/// A node that holds nothing of ours gets its Services in steps of a few
/// LB IPs (`--install-part-lbs`, 4 096 by default): the kernel takes every
/// step, ends holding exactly the whole state (guards and routes
/// included), and traffic passes, filtered where it should be.
fn a_fresh_install_in_steps_holds_everything(backend: Backend) -> Result<()> {
    let mut env = Env::new(backend, Fam::V4)?;
    env.ctl.stop()?;
    cleanup(&env)?;
    env.put_service(
        &Svc::new("vm1", env.net.lbs[0]).filter(&[("TCP", 22)]),
        &[env.net.pods[0]],
    )?;
    for i in 0..10 {
        let name = format!("many{i}");
        let lb: std::net::IpAddr = format!("203.0.113.{}", 100 + i).parse()?;
        let svc = match i % 2 {
            0 => Svc::new(&name, lb),
            _ => Svc::new(&name, lb).filter(&[("TCP", 80), ("UDP", 53)]),
        };
        env.dir.put(&name, &svc.yaml())?;
        env.dir.put(
            &format!("{name}-eps"),
            &slice(&name, "IPv4", &[(format!("192.0.2.{}", 100 + i), None)]),
        )?;
    }
    env.ctl.extra_args = vec!["--install-part-lbs".into(), "3".into()];
    env.ctl.restart()?;
    env.wait_log(
        "installing onto a datapath that holds nothing of ours, in steps lb_ips=11 steps=4",
    )?;
    env.settle()?;
    let _ssh = Server::tcp(&env.topo.pod(1), Fam::V4, 22, "pod1")?;
    let got = eventually(SETTLE, || tcp_request(&env.topo.ext(), env.net.lbs[0], 22))?;
    ensure!(got == answer("pod1", env.net.ext), "{got}");
    ensure!(
        tcp_request(&env.topo.ext(), env.net.lbs[0], 8080).is_err(),
        "8080 must be filtered"
    );
    if backend == Backend::Ebpf {
        prefilter_matches_addrs(&env.ctl.pin_dir)?;
    }
    // Whole at once, not repaired by the resync that follows.
    ensure!(
        !env.ctl.log_text().contains("left elements out"),
        "{}",
        env.ctl.log_text()
    );
    Ok(())
}

#[test]
fn a_fresh_install_in_steps_holds_everything_ebpf() -> Result<()> {
    a_fresh_install_in_steps_holds_everything(Backend::Ebpf)
}

#[test]
fn a_fresh_install_in_steps_holds_everything_nft() -> Result<()> {
    a_fresh_install_in_steps_holds_everything(Backend::Nft)
}

/// Attaching through tcx touches no qdisc: adding clsact to an interface
/// that is up swaps its queue out and back, and the packets it sends
/// meanwhile are dropped.
#[test]
fn attaching_through_tcx_adds_no_qdisc() -> Result<()> {
    let env = setup()?;
    for dev in ["uplink", "pod1"] {
        let qdiscs = ok_in(&env.topo.node(), &["tc", "qdisc", "show", "dev", dev])?;
        ensure!(!qdiscs.contains("clsact"), "{dev}: {qdiscs}");
    }
    Ok(())
}

/// A TCP connection pod1 (mapped as `vm1`, port-filtered) opened to the
/// outside on port 8443, an unlisted one: the pod's end and the far end's,
/// after a first line from the pod, which the far end saw come from the
/// LB IP.
fn connection_pod1_opened(env: &Env) -> Result<(TcpStream, TcpStream)> {
    let far = SocketAddr::new(env.net.ext, 8443);
    let listener = harness::sh::in_netns(&env.topo.ext(), move || Ok(TcpListener::bind(far)?))?;
    let mut pod_end = harness::sh::in_netns(&env.topo.pod(1), move || {
        Ok(TcpStream::connect_timeout(&far, Duration::from_secs(3))?)
    })?;
    let (far_end, seen) = listener.accept()?;
    ensure!(seen.ip() == env.net.lbs[0], "the far end saw {seen}");
    pod_end.write_all(b"hello\n")?;
    let mut line = String::new();
    BufReader::new(&far_end).read_line(&mut line)?;
    ensure!(line == "hello\n", "the far end read {line:?}");
    Ok((pod_end, far_end))
}

/// A switch from nftables to eBPF keeps the flows a filtered pod started:
/// a connection the pod opened to an unlisted port while nftables served
/// (which lets the replies in by conntrack), on which the far end speaks
/// next, reaches the pod once the programs act, though the pod sends
/// nothing after the switch (the programs take the flow from conntrack).
#[test]
fn a_switch_from_nft_keeps_the_connections_a_filtered_pod_opened() -> Result<()> {
    let mut env = setup_with(Backend::Nft)?;
    let (pod_end, mut far_end) = connection_pod1_opened(&env)?;
    env.ctl.restart_as(Backend::Ebpf)?;
    env.wait_log("remembered the flows filtered pods started before the switch")?;
    env.wait_log("removed the datapath backend=nft")?;
    far_end.write_all(b"after the switch\n")?;
    pod_end.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(&pod_end)
        .read_line(&mut line)
        .context("the far end's data after the switch")?;
    ensure!(line == "after the switch\n", "the pod read {line:?}");
    Ok(())
}

/// A switch from the fast path to nftables costs a filtered pod's flow the
/// fast path carried its replies until the pod sends on it again: its
/// packets never passed conntrack, which is what lets nftables admit a
/// reply to an unlisted port, and the nft pod cannot read the programs'
/// flow memory (no BPF capability). Once the pod sends, conntrack picks
/// the connection up and the far end's retransmission reaches the pod.
/// (Without the fast path conntrack sees every flow: the switch keeps
/// them, `tests/container.rs`.)
#[test]
fn a_switch_from_the_fast_path_to_nft_holds_a_filtered_flow_until_the_pod_sends() -> Result<()> {
    let mut env = setup_with(Backend::EbpfFast)?;
    let node = env.topo.node();
    // The node knows the far end's link-layer address: the flow rides the
    // fast path from its first packet.
    ok_in(&node, &["ping", "-c1", "-W1", &env.net.ext.to_string()])?;
    let (mut pod_end, mut far_end) = connection_pod1_opened(&env)?;
    // Either direction: the pod's (to port 8443) or the far end's (from it).
    let tracked = || -> Result<Vec<String>> {
        let mut all = Vec::new();
        for dir in ["--dport", "--sport"] {
            all.extend(harness::traffic::conntrack(
                &node,
                Fam::V4,
                &["-p", "tcp", dir, "8443"],
            )?);
        }
        Ok(all)
    };
    let before = tracked()?;
    ensure!(
        before.is_empty(),
        "conntrack saw the fast path's flow: {before:#?}"
    );
    let ours: Vec<u64> = pinned_links(&env.ctl.pin_dir)?
        .iter()
        .map(|l| l.0)
        .collect();
    env.ctl.restart_as(Backend::Nft)?;
    env.wait_log("removed the datapath backend=ebpf")?;
    // The pins are gone; the kernel releases the links they held a moment
    // later (after an RCU grace period), and until then the programs still
    // carry the flow. From then on nothing but nft does.
    eventually(SETTLE, || {
        let links = bpftool(&["link", "show"])?;
        let left: Vec<u64> = links
            .as_array()
            .map(|all| all.iter().filter_map(|l| l["id"].as_u64()).collect())
            .unwrap_or_default();
        let held: Vec<&u64> = ours.iter().filter(|id| left.contains(id)).collect();
        ensure!(held.is_empty(), "links still held: {held:?}");
        Ok(())
    })?;
    far_end.write_all(b"after the switch\n")?;
    pod_end.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut reader = BufReader::new(pod_end.try_clone()?);
    let mut line = String::new();
    if reader.read_line(&mut line).is_ok() {
        bail!(
            "the far end's data reached the pod before it sent: {line:?}; conntrack: {:#?}",
            tracked()?
        );
    }
    pod_end.write_all(b"again\n")?;
    let mut line = String::new();
    BufReader::new(&far_end).read_line(&mut line)?;
    ensure!(line == "again\n", "the far end read {line:?}");
    pod_end.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .context("the far end's retransmission once the pod sent")?;
    ensure!(line == "after the switch\n", "the pod read {line:?}");
    Ok(())
}

/// A node's first start retires nothing, and says nothing of it: the
/// other backend was never installed there. (A switch, which does retire
/// one, is `container`'s `switch_*`.)
fn a_first_start_retires_nothing(backend: Backend) -> Result<()> {
    let mut env = Env::new(backend, Fam::V4)?;
    env.put_service(&Svc::new("vm1", env.net.lbs[0]), &[env.net.pods[0]])?;
    env.settle()?;
    env.wait_log("datapath synced")?;
    let log = env.ctl.log_text();
    ensure!(
        !log.contains("removed the datapath"),
        "a first start removed a datapath:\n{log}"
    );
    Ok(())
}

#[test]
fn a_first_start_retires_nothing_ebpf() -> Result<()> {
    a_first_start_retires_nothing(Backend::Ebpf)
}

#[test]
fn a_first_start_retires_nothing_nft() -> Result<()> {
    a_first_start_retires_nothing(Backend::Nft)
}
