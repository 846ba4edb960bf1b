//! The nft backend's ruleset as the real `nft` tool decodes it (`nft -j
//! list table`), adoption, drift repair and cleanup. Needs root.
use cozy_proxy_testkit as harness;

use anyhow::{ensure, Context, Result};
use cozy_proxy::datapath::DatapathState;
use harness::traffic::eventually;
use harness::{
    bin,
    controller::manifests::{slice, Svc},
    nodes::net::Fam,
    sh::ok_in,
    Backend, Env,
};
use serde_json::Value;
use std::time::{Duration, Instant};

fn nft_json(env: &Env, family: &str) -> Result<Vec<Value>> {
    let out = ok_in(
        &env.topo.node(),
        &["nft", "-j", "list", "table", family, "cozy_proxy"],
    )?;
    let v: Value = serde_json::from_str(&out)?;
    Ok(v["nftables"].as_array().context("nftables array")?.clone())
}

fn objects<'a>(items: &'a [Value], kind: &str) -> Vec<&'a Value> {
    items.iter().filter_map(|i| i.get(kind)).collect()
}

fn setup() -> Result<Env> {
    let mut env = Env::new(Backend::Nft, Fam::V4)?;
    let filtered = Svc::new("vm1", env.net.lbs[0]).filter(&[("TCP", 22), ("UDP", 53)]);
    env.dir.put("vm1", &filtered.yaml())?;
    env.dir.put(
        "vm1-eps",
        &slice("vm1", "IPv4", &[(env.net.pods[0].to_string(), None)]),
    )?;
    let mut dual = Svc::new("vm2", env.net.lbs[1]);
    dual.lb_ips.push("2001:db8:203::20".into());
    env.dir.put("vm2", &dual.yaml())?;
    env.dir.put(
        "vm2-v4",
        &slice("vm2", "IPv4", &[(env.net.pods[1].to_string(), None)]),
    )?;
    env.dir.put(
        "vm2-v6",
        &slice("vm2", "IPv6", &[("2001:db8:2::12".into(), None)]),
    )?;
    env.settle()?;
    Ok(env)
}

#[test]
fn ruleset_decoded_by_nft_matches_the_reference_layout() -> Result<()> {
    let env = setup()?;
    for (family, addr) in [("ip", "ipv4_addr"), ("ip6", "ipv6_addr")] {
        let items = nft_json(&env, family)?;
        let chains = objects(&items, "chain");
        let chain = |name: &str| chains.iter().find(|c| c["name"] == name).copied();
        for (name, prio) in [
            ("egress_snat", -300),
            ("ingress_dnat", -150),
            ("port_filter", 0),
        ] {
            let c = chain(name).with_context(|| format!("{family}: chain {name} missing"))?;
            ensure!(
                c["type"] == "filter" && c["hook"] == "prerouting",
                "{family} {name}: {c}"
            );
            ensure!(c["prio"] == prio, "{family} {name}: priority {}", c["prio"]);
        }
        let sets = objects(&items, "set");
        let set = |name: &str| sets.iter().find(|s| s["name"] == name).copied();
        let maps = objects(&items, "map");
        for map in ["pod_svc", "svc_pod"] {
            let m = maps
                .iter()
                .find(|m| m["name"] == map)
                .with_context(|| format!("{family}: map {map} missing"))?;
            ensure!(m["type"] == addr && m["map"] == addr, "{family} {map}: {m}");
        }
        for name in ["filtered_pods", "icmp_allowed_pods", "unmapped_lbs"] {
            let s = set(name).with_context(|| format!("{family}: set {name} missing"))?;
            ensure!(s["type"] == addr, "{family} {name}: {s}");
        }
        let ports = set("allowed_ports").context("allowed_ports")?;
        ensure!(
            ports["type"] == serde_json::json!([addr, "inet_proto", "inet_service"]),
            "{family} allowed_ports type: {}",
            ports["type"]
        );
        // The sets that grow with every mapping have the sizes the backend
        // reports as its capacity (the kernel then keeps them in its
        // fixed-size hash); the others grow as needed.
        use cozy_proxy::datapath::Table;
        let capacity = cozy_proxy::nft::schema::set_capacity();
        for m in maps.iter().chain(sets.iter()) {
            let want = match m["name"].as_str() {
                Some("pod_svc" | "svc_pod") => Some(capacity.get(Table::LocalMappings)),
                Some("guarded" | "guard_paths") => Some(capacity.get(Table::Addresses)),
                _ => None,
            };
            match want {
                Some(want) => ensure!(
                    m["size"] == want,
                    "{family} {}: size {} (want {want})",
                    m["name"],
                    m["size"]
                ),
                None => ensure!(
                    m.get("size").is_none(),
                    "{family} {} is sized: {m}",
                    m["name"]
                ),
            }
        }
        // The egress rewrite: `ip saddr set ip saddr map @pod_svc`.
        let rules = objects(&items, "rule");
        let egress: Vec<&&Value> = rules
            .iter()
            .filter(|r| r["chain"] == "egress_snat")
            .collect();
        let text = serde_json::to_string(&egress)?;
        ensure!(
            text.contains("\"mangle\"") && text.contains("\"saddr\"") && text.contains("@pod_svc"),
            "{family} egress_snat rules: {text}"
        );
        let filter = serde_json::to_string(
            &rules
                .iter()
                .filter(|r| r["chain"] == "port_filter")
                .collect::<Vec<_>>(),
        )?;
        ensure!(
            filter.contains("established")
                && filter.contains("related")
                && filter.contains("@allowed_ports")
                && filter.contains("\"!=\""),
            "{family} port_filter rules: {filter}"
        );
    }
    // Elements, as nft sees them.
    let v4 = serde_json::to_string(&nft_json(&env, "ip")?)?;
    for needle in ["203.0.113.10", "192.0.2.11", "203.0.113.20", "192.0.2.12"] {
        ensure!(v4.contains(needle), "ip table lacks {needle}");
    }
    ensure!(
        v4.contains("\"tcp\"") && v4.contains("22") && v4.contains("\"udp\"") && v4.contains("53")
    );
    let v6 = serde_json::to_string(&nft_json(&env, "ip6")?)?;
    ensure!(
        v6.contains("2001:db8:203::20") && v6.contains("2001:db8:2::12"),
        "ip6 elements: {v6}"
    );
    // The check at bridge ports: one chain at the bridge family's
    // prerouting, before br_netfilter, a rule per family; only addresses
    // whose route names a bridge are checked there (here none: the pods'
    // own veths, and the LB IPs, are judged by the IP tables).
    let bridge = nft_json(&env, "bridge")?;
    let chains = objects(&bridge, "chain");
    ensure!(
        chains.len() == 1
            && chains[0]["name"] == "ports"
            && chains[0]["hook"] == "prerouting"
            && chains[0]["prio"] == -300,
        "bridge chains: {chains:?}"
    );
    let rules = serde_json::to_string(&objects(&bridge, "rule"))?;
    for needle in [
        "@guarded4",
        "@guard_ports4",
        "@guarded6",
        "@guard_ports6",
        "\"iif\"",
    ] {
        ensure!(
            rules.contains(needle),
            "bridge rules lack {needle}: {rules}"
        );
    }
    let sets = objects(&bridge, "set");
    let set = |name: &str| sets.iter().find(|s| s["name"] == name).copied();
    ensure!(
        set("guard_ports4").context("guard_ports4")?["type"]
            == serde_json::json!(["ipv4_addr", "iface_index"]),
        "guard_ports4: {sets:?}"
    );
    let elements = &set("guarded4").context("guarded4")?["elem"];
    ensure!(
        elements.is_null(),
        "guarded4 holds addresses whose route names no bridge: {elements}"
    );
    Ok(())
}

#[test]
fn a_restart_adopts_without_changes_and_cleanup_removes_everything() -> Result<()> {
    let mut env = setup()?;
    let before = env.dump()?;
    env.ctl.restart()?;
    env.wait_log("adopting")?;
    env.wait_log("changed_elements=0")?;
    ensure!(env.dump()? == before, "state changed across a restart");
    // Stopping leaves the datapath in place; cleanup removes it.
    env.ctl.stop()?;
    ensure!(
        env.dump()? == before,
        "stopping the controller changed the datapath"
    );
    let node = env.topo.node();
    ok_in(&node, &[&bin(), "cleanup"])?;
    let ruleset = ok_in(&node, &["nft", "list", "ruleset"])?;
    ensure!(!ruleset.contains("cozy_proxy"), "left behind:\n{ruleset}");
    // Idempotent.
    ok_in(&node, &[&bin(), "cleanup"])?;
    Ok(())
}

/// [`setup`], with the resync at a minute: a repair within a second is the
/// nf_tables notifications' doing.
fn setup_with_slow_resync() -> Result<Env> {
    let mut env = setup()?;
    env.ctl.extra_args = vec!["--resync".into(), "60s".into()];
    env.ctl.restart()?;
    Ok(env)
}

/// Deletes our `svc_pod` element of `lb` by hand, as someone else would.
fn delete_svc_pod_element(env: &Env, family: &str, lb: &str) -> Result<()> {
    let element = format!("{{ {lb} }}");
    let cmd = [
        "nft",
        "delete",
        "element",
        family,
        "cozy_proxy",
        "svc_pod",
        &element,
    ];
    ok_in(&env.topo.node(), &cmd)?;
    Ok(())
}

/// Waits (1.5 s at most) until the datapath holds `want` again after
/// `what`; how long it took.
fn repaired(env: &Env, want: &DatapathState, what: &str) -> Result<Duration> {
    let started = Instant::now();
    eventually(Duration::from_millis(1500), || {
        ensure!(env.dump()? == *want, "{what}: not repaired yet");
        Ok(())
    })
    .with_context(|| env.ctl.log_text())?;
    Ok(started.elapsed())
}

/// A change by someone else just before one of our own syncs is still
/// repaired within the second: the upkeep reads the notifications once a
/// second, and the sync in between must not discard them with its own
/// (they are told apart by the netlink port that made the change). Three
/// times: an element deleted by hand, then at once a Service added.
#[test]
fn a_change_by_others_just_before_our_sync_is_not_lost() -> Result<()> {
    let mut env = setup_with_slow_resync()?;
    env.settle()?;
    for i in 1..=3u32 {
        delete_svc_pod_element(&env, "ip", "203.0.113.10")?;
        let name = format!("more{i}");
        let lb: std::net::IpAddr = format!("2001:db8:203::2:{i:x}").parse()?;
        let yaml = Svc::new(&name, lb).yaml()
            + "\n---\n"
            + &slice(&name, "IPv6", &[(format!("2001:db8:2::2:{i:x}"), None)]);
        env.dir.put(&name, &yaml)?;
        let want = env.expected()?;
        repaired(&env, &want, "an element deleted just before our sync")?;
    }
    env.wait_log("changed by someone else")?;
    Ok(())
}

/// Changes others make to our table are seen through nf_tables
/// notifications and repaired within a second, long before the resync
/// (set to a minute here): an element deleted by hand, the ip6 table
/// deleted, then `nft flush ruleset` (what an nftables.service restart
/// does).
#[test]
fn changes_by_others_are_repaired_within_a_second() -> Result<()> {
    let mut env = setup_with_slow_resync()?;
    let want = env.settle()?;
    let node = env.topo.node();
    delete_svc_pod_element(&env, "ip", "203.0.113.10")?;
    let element = repaired(&env, &want, "an element deleted")?;
    ok_in(&node, &["nft", "delete", "table", "ip6", "cozy_proxy"])?;
    let table = repaired(&env, &want, "the ip6 table deleted")?;
    ok_in(&node, &["nft", "flush", "ruleset"])?;
    let flush = repaired(&env, &want, "nft flush ruleset")?;
    ensure!(nft_json(&env, "ip6").is_ok(), "ip6 table not restored");
    env.wait_log("changed by someone else")?;
    eprintln!("repaired in {element:?} (element), {table:?} (table), {flush:?} (flush ruleset)");
    Ok(())
}

/// A rule replaced by someone else, the chain keeping its length: told
/// apart by the fingerprint stored with each of our rules, and restored.
#[test]
fn a_replaced_rule_is_restored() -> Result<()> {
    let mut env = setup()?;
    env.ctl.extra_args = vec!["--resync".into(), "60s".into()];
    env.ctl.restart()?;
    env.settle()?;
    let rules = |env: &Env| -> Result<Vec<Value>> {
        Ok(objects(&nft_json(env, "ip")?, "rule")
            .into_iter()
            .filter(|r| r["chain"] == "port_filter")
            .cloned()
            .collect())
    };
    let ours = rules(&env)?;
    let first = ours.first().context("a port_filter rule")?;
    let handle = first["handle"].to_string();
    ok_in(
        &env.topo.node(),
        &[
            "nft",
            "replace",
            "rule",
            "ip",
            "cozy_proxy",
            "port_filter",
            "handle",
            &handle,
            "counter",
            "accept",
        ],
    )?;
    let strip = |rs: &[Value]| -> Vec<Value> {
        rs.iter()
            .map(|r| {
                let mut r = r.clone();
                r.as_object_mut().map(|o| o.remove("handle"));
                r.to_string().replace(|c: char| c.is_ascii_digit(), "")
            })
            .map(Value::from)
            .collect()
    };
    ensure!(
        strip(&rules(&env)?) != strip(&ours),
        "the replacement did not happen"
    );
    eventually(Duration::from_millis(1500), || {
        ensure!(strip(&rules(&env)?) == strip(&ours), "not restored yet");
        Ok(())
    })
    .with_context(|| env.ctl.log_text())?;
    env.wait_log("were changed; restoring them")?;
    Ok(())
}

/// A sync of a thousand elements or more is applied out of the nf_tables
/// notification group (else the kernel builds a notification per element
/// for us): it is not taken for someone else's change (the ruleset's
/// generation went up by exactly our commit), and changes by others are
/// still seen and repaired afterwards (back in the group).
#[test]
fn a_large_sync_is_applied_quietly_and_changes_by_others_are_still_seen() -> Result<()> {
    let mut env = setup_with_slow_resync()?;
    env.settle()?;
    // 300 more Services (IPv6, their pods without a route: unreachable
    // host routes, read back as installed): about 1 500 elements in one
    // sync.
    let mut yaml = String::new();
    for i in 1..=300u32 {
        let name = format!("bulk{i}");
        let lb: std::net::IpAddr = format!("2001:db8:203::1:{i:x}").parse()?;
        yaml += "\n---\n";
        yaml += &Svc::new(&name, lb).yaml();
        yaml += "\n---\n";
        yaml += &slice(&name, "IPv6", &[(format!("2001:db8:2::1:{i:x}"), None)]);
    }
    env.dir.put("bulk", &yaml)?;
    let want = env.settle()?;
    env.wait_log("out of the nf_tables notification group alone=true")?;
    // An upkeep (once a second) reads what is queued: our own small
    // batches' notifications, none of the large one's.
    std::thread::sleep(Duration::from_millis(1200));
    ensure!(
        !env.ctl.log_text().contains("changed by someone else"),
        "our own batches were taken for someone else's change:\n{}",
        env.ctl.log_text()
    );
    delete_svc_pod_element(&env, "ip6", "2001:db8:203::1:7")?;
    repaired(&env, &want, "an element deleted after the large sync")?;
    Ok(())
}
