//! The scenario topology (../shared/reference/scenarios.md): namespaces
//! `ext`, `node`, `pod1`..`pod3`, created per test with unique names and
//! removed when dropped.
use super::sh::{feed_in, ok, ok_in};
use anyhow::bail;
use anyhow::Result;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

pub struct Topology {
    pub prefix: String,
}

/// Interface names: `uplink` on both ends of ext<->node, `pod{i}` on the
/// node side of each pod veth, `eth0` inside the pod.
pub const POD_COUNT: usize = 3;

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
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let t = Topology {
            prefix: format!("cpt{}x{id}", std::process::id()),
        };
        let mut all = vec![t.ext(), t.node()];
        all.extend((1..=POD_COUNT).map(|i| t.pod(i)));
        for ns in &all {
            ok(&["ip", "netns", "add", ns])?;
            ok_in(ns, &["ip", "link", "set", "lo", "up"])?;
            // No duplicate address detection (addresses usable at once), no
            // reverse-path filter: a mapped pod's packets arrive carrying
            // the LB IP as source, which a strict or loose check drops.
            ok_in(
                ns,
                &[
                    "sysctl",
                    "-qw",
                    "net.ipv6.conf.all.accept_dad=0",
                    "net.ipv6.conf.default.accept_dad=0",
                    "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.default.rp_filter=0",
                ],
            )?;
        }
        let (ext, node) = (t.ext(), t.node());
        ok(&[
            "ip", "link", "add", "uplink", "netns", &node, "type", "veth", "peer", "uplink",
            "netns", &ext,
        ])?;
        for (ns, v4, v6) in [
            (&ext, "198.51.100.1/24", "2001:db8:100::1/64"),
            (&node, "198.51.100.2/24", "2001:db8:100::2/64"),
        ] {
            ok_in(ns, &["ip", "addr", "add", v4, "dev", "uplink"])?;
            ok_in(ns, &["ip", "addr", "add", v6, "dev", "uplink", "nodad"])?;
            no_offload(ns, "uplink")?;
            ok_in(ns, &["ip", "link", "set", "uplink", "up"])?;
        }
        // ext routes the LoadBalancer ranges (and the pod network, to reach
        // an unmanaged pod directly) via the node.
        for dst in ["203.0.113.0/24", "192.0.2.0/24"] {
            ok_in(&ext, &["ip", "route", "add", dst, "via", "198.51.100.2"])?;
        }
        for dst in ["2001:db8:203::/64", "2001:db8:2::/64"] {
            ok_in(
                &ext,
                &["ip", "-6", "route", "add", dst, "via", "2001:db8:100::2"],
            )?;
        }
        ok_in(
            &node,
            &["ip", "route", "add", "default", "via", "198.51.100.1"],
        )?;
        ok_in(
            &node,
            &[
                "ip",
                "-6",
                "route",
                "add",
                "default",
                "via",
                "2001:db8:100::1",
            ],
        )?;
        ok_in(
            &node,
            &[
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
            ],
        )?;
        for i in 1..=POD_COUNT {
            t.add_pod(i)?;
        }
        // The CNI's masquerade for pod traffic leaving the uplink.
        let masquerade = "table ip cni {\n chain post {\n  type nat hook postrouting priority srcnat;\n  ip saddr 192.0.2.0/24 oifname \"uplink\" masquerade\n }\n}\n\
            table ip6 cni {\n chain post {\n  type nat hook postrouting priority srcnat;\n  ip6 saddr 2001:db8:2::/64 oifname \"uplink\" masquerade\n }\n}\n";
        let out = feed_in(&node, &["nft", "-f", "-"], masquerade.as_bytes(), 5)?;
        if !out.status.success() {
            bail!("masquerade rules: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(t)
    }

    /// A pod as a typical CNI wires it: a veth, /32 and /128 routes on the
    /// node, the node side as the pod's gateway.
    fn add_pod(&self, i: usize) -> Result<()> {
        let (node, pod) = (self.node(), self.pod(i));
        let host_if = format!("pod{i}");
        ok(&[
            "ip", "link", "add", &host_if, "netns", &node, "type", "veth", "peer", "eth0", "netns",
            &pod,
        ])?;
        let v4 = format!("192.0.2.1{i}");
        let v6 = format!("2001:db8:2::1{i}");
        ok_in(
            &node,
            &["ip", "addr", "add", "192.0.2.1/32", "dev", &host_if],
        )?;
        ok_in(
            &node,
            &[
                "ip",
                "addr",
                "add",
                "2001:db8:2::1/128",
                "dev",
                &host_if,
                "nodad",
            ],
        )?;
        ok_in(
            &pod,
            &["ip", "addr", "add", &format!("{v4}/32"), "dev", "eth0"],
        )?;
        ok_in(
            &pod,
            &[
                "ip",
                "addr",
                "add",
                &format!("{v6}/128"),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        for (ns, dev) in [(&node, host_if.as_str()), (&pod, "eth0")] {
            no_offload(ns, dev)?;
            ok_in(ns, &["ip", "link", "set", dev, "up"])?;
        }
        ok_in(
            &node,
            &["ip", "route", "add", &format!("{v4}/32"), "dev", &host_if],
        )?;
        ok_in(
            &node,
            &[
                "ip",
                "-6",
                "route",
                "add",
                &format!("{v6}/128"),
                "dev",
                &host_if,
            ],
        )?;
        ok_in(&pod, &["ip", "route", "add", "192.0.2.1", "dev", "eth0"])?;
        ok_in(&pod, &["ip", "route", "add", "default", "via", "192.0.2.1"])?;
        ok_in(
            &pod,
            &["ip", "-6", "route", "add", "2001:db8:2::1", "dev", "eth0"],
        )?;
        ok_in(
            &pod,
            &[
                "ip",
                "-6",
                "route",
                "add",
                "default",
                "via",
                "2001:db8:2::1",
            ],
        )?;
        Ok(())
    }
}

/// With transmit checksum offload on, veth passes packets with a partial
/// checksum and a missing L4 fix-up would go unnoticed.
fn no_offload(ns: &str, dev: &str) -> Result<()> {
    ok_in(ns, &["ethtool", "-K", dev, "tx", "off"]).map(|_| ())
}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut all = vec![self.ext(), self.node()];
        all.extend((1..=POD_COUNT).map(|i| self.pod(i)));
        for ns in &all {
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
}
