//! The scenario topology (../shared/reference/scenarios.md): namespaces
//! `ext`, `node`, `pod1`..`pod3`, created per test with unique names and
//! removed when dropped.
use super::sh::{feed_in, ok, ok_in};
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A prefix for namespaces and files unique to this process and call.
pub fn unique_prefix(kind: &str) -> String {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{kind}{}x{id}", std::process::id())
}

/// Pods every topology starts with.
pub const POD_COUNT: usize = 3;

pub struct Topology {
    pub prefix: String,
    /// Pods created so far (pod1..=podN).
    pub pods: usize,
}

/// Runs a command given as one line (words split on spaces) in `ns`.
pub fn cmd(ns: &str, line: &str) -> Result<()> {
    let words: Vec<&str> = line.split_whitespace().collect();
    ok_in(ns, &words).map(|_| ())
}

/// A namespace with loopback up and the sysctls every host shares: no
/// duplicate address detection (addresses usable at once), no reverse-path
/// filter (a mapped pod's packets arrive carrying the LB IP as source, which
/// a strict or loose check drops).
pub fn new_ns(ns: &str) -> Result<()> {
    ok(&["ip", "netns", "add", ns])?;
    cmd(ns, "ip link set lo up")?;
    cmd(
        ns,
        "sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0 \
         net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0",
    )
}

/// With transmit checksum offload on, veth passes packets with a partial
/// checksum and a missing L4 fix-up would go unnoticed.
pub fn no_offload(ns: &str, dev: &str) -> Result<()> {
    cmd(ns, &format!("ethtool -K {dev} tx off"))
}

/// A veth pair `a` (in `ns_a`) <-> `b` (in `ns_b`).
pub fn veth(a: &str, ns_a: &str, b: &str, ns_b: &str) -> Result<()> {
    ok(&[
        "ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", b, "netns", ns_b,
    ])
    .map(|_| ())
}

const MASQUERADE: &str = "\
table ip cni {
  chain post {
    type nat hook postrouting priority srcnat;
    ip saddr 192.0.2.0/24 oifname \"uplink\" masquerade
  }
}
table ip6 cni {
  chain post {
    type nat hook postrouting priority srcnat;
    ip6 saddr 2001:db8:2::/64 oifname \"uplink\" masquerade
  }
}
";

impl Topology {
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    pub fn ext(&self) -> String {
        self.ns("ext")
    }

    pub fn node(&self) -> String {
        self.ns("node")
    }

    /// `i` counts from 1.
    pub fn pod(&self, i: usize) -> String {
        self.ns(&format!("pod{i}"))
    }

    pub fn new() -> Result<Topology> {
        let mut t = Topology {
            prefix: unique_prefix("cpt"),
            pods: 0,
        };
        let (ext, node) = (t.ext(), t.node());
        new_ns(&ext)?;
        new_ns(&node)?;
        veth("uplink", &node, "uplink", &ext)?;
        for (ns, v4, v6) in [
            (&ext, "198.51.100.1/24", "2001:db8:100::1/64"),
            (&node, "198.51.100.2/24", "2001:db8:100::2/64"),
        ] {
            cmd(ns, &format!("ip addr add {v4} dev uplink"))?;
            cmd(ns, &format!("ip addr add {v6} dev uplink nodad"))?;
            no_offload(ns, "uplink")?;
            cmd(ns, "ip link set uplink up")?;
        }
        // ext routes the LoadBalancer ranges (and the pod network, to reach
        // an unmanaged pod directly) via the node.
        cmd(&ext, "ip route add 203.0.113.0/24 via 198.51.100.2")?;
        cmd(&ext, "ip route add 192.0.2.0/24 via 198.51.100.2")?;
        cmd(
            &ext,
            "ip -6 route add 2001:db8:203::/64 via 2001:db8:100::2",
        )?;
        cmd(&ext, "ip -6 route add 2001:db8:2::/64 via 2001:db8:100::2")?;
        cmd(&node, "ip route add default via 198.51.100.1")?;
        cmd(&node, "ip -6 route add default via 2001:db8:100::1")?;
        cmd(
            &node,
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
        )?;
        for _ in 0..POD_COUNT {
            t.add_pod()?;
        }
        // The CNI's masquerade for pod traffic leaving the uplink.
        let out = feed_in(&node, &["nft", "-f", "-"], MASQUERADE.as_bytes(), 5)?;
        if !out.status.success() {
            bail!("masquerade rules: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(t)
    }

    /// A new pod (pod{N+1}) as a typical CNI wires it: a veth, /32 and /128
    /// routes on the node, the node side as the pod's gateway; addresses
    /// 192.0.2.1N and 2001:db8:2::1N.
    pub fn add_pod(&mut self) -> Result<usize> {
        self.pods += 1;
        let i = self.pods;
        new_ns(&self.pod(i))?;
        self.wire_pod(i)?;
        Ok(i)
    }

    /// Pod `i`'s veth deleted and created again with the same names and
    /// addresses (a CNI re-creating a pod's interface): a new ifindex
    /// behind the same pod IP.
    pub fn rewire_pod(&self, i: usize) -> Result<()> {
        cmd(&self.node(), &format!("ip link del pod{i}"))?;
        self.wire_pod(i)
    }

    fn wire_pod(&self, i: usize) -> Result<()> {
        let (node, pod) = (self.node(), self.pod(i));
        let host_if = format!("pod{i}");
        veth(&host_if, &node, "eth0", &pod)?;
        cmd(&node, &format!("ip addr add 192.0.2.1/32 dev {host_if}"))?;
        cmd(
            &node,
            &format!("ip addr add 2001:db8:2::1/128 dev {host_if} nodad"),
        )?;
        cmd(&pod, &format!("ip addr add 192.0.2.1{i}/32 dev eth0"))?;
        cmd(
            &pod,
            &format!("ip addr add 2001:db8:2::1{i}/128 dev eth0 nodad"),
        )?;
        for (ns, dev) in [(&node, host_if.as_str()), (&pod, "eth0")] {
            no_offload(ns, dev)?;
            cmd(ns, &format!("ip link set {dev} up"))?;
        }
        cmd(
            &node,
            &format!("ip route add 192.0.2.1{i}/32 dev {host_if}"),
        )?;
        cmd(
            &node,
            &format!("ip -6 route add 2001:db8:2::1{i}/128 dev {host_if}"),
        )?;
        cmd(&pod, "ip route add 192.0.2.1 dev eth0")?;
        cmd(&pod, "ip route add default via 192.0.2.1")?;
        cmd(&pod, "ip -6 route add 2001:db8:2::1 dev eth0")?;
        cmd(&pod, "ip -6 route add default via 2001:db8:2::1")?;
        Ok(())
    }
}

/// Kills what runs in the namespaces and removes them.
pub fn remove_namespaces(all: &[String]) {
    for ns in all {
        if let Ok(out) = ok(&["ip", "netns", "pids", ns]) {
            for pid in out.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                // SAFETY: kill(2) on processes left in our own namespace.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        let _ = ok(&["ip", "netns", "del", ns]);
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut all = vec![self.ext(), self.node()];
        all.extend((1..=self.pods).map(|i| self.pod(i)));
        remove_namespaces(&all);
    }
}
