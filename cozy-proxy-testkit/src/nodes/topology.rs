//! The scenario topology (cozy-proxy/tests/cases/README.md): namespaces
//! `ext`, `node`, `pod1`..`pod3`, created per test with unique names and
//! removed when dropped; the node wires its pods in one of the [`Shape`]s
//! the common CNIs build.
use crate::sh::{feed_in, in_netns, ok, ok_in};
use anyhow::{bail, Context, Result};
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A prefix for namespaces and files unique to this process and call.
pub fn unique_prefix(kind: &str) -> String {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{kind}{}x{id}", std::process::id())
}

/// Pods every topology starts with.
pub const POD_COUNT: usize = 3;

/// How a node reaches its pods, as the common CNIs wire it (the node
/// shapes of cozy-proxy/tests/cases/README.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One veth per pod, the node side the pod's gateway, a /32 and /128
    /// route per pod (Calico, Cilium native routing).
    Routed,
    /// A Linux bridge (`cni0`) holds the pods' gateway and the pods' veths
    /// are its ports; br_netfilter on, as kubeadm nodes have it (the bridge
    /// plugin, Flannel, kindnet).
    Bridge,
    /// Kube-OVN's shape: the pods on an L2 segment of their own, a router
    /// joining it to a join network where the node's `ovn0` sits, the pod
    /// subnet routed via that router; pod-to-pod traffic never crosses the
    /// node. Built from Linux bridges, veths and a router namespace (`ovn`:
    /// the segment `ls`, the join network `join`), where Kube-OVN has Open
    /// vSwitch: there the pods' veths are OVS ports in the node's
    /// namespace, here they are ports in the router's.
    Gateway,
    /// Kube-OVN's shape with the pods' segment a Linux bridge (`seg`) in
    /// the node's own namespace, as Kube-OVN's pod ports are in the node's
    /// (there on Open vSwitch): the router's leg `ls` a port of it, the pod
    /// subnet routed via the router on the join network, `ovn0` the node's
    /// way to the pods, bridge-nf-call-iptables off. The pods' frames pass
    /// the node's bridge ports, and enter the node's IP stack at `ovn0`.
    NodeSegment,
}

impl Shape {
    pub const ALL: [Shape; 4] = [
        Shape::Routed,
        Shape::Bridge,
        Shape::Gateway,
        Shape::NodeSegment,
    ];

    /// Behind a router the node reaches through `ovn0` (Kube-OVN's).
    pub fn behind_router(self) -> bool {
        matches!(self, Shape::Gateway | Shape::NodeSegment)
    }
}

/// The Gateway shape's join network and the router's address on it.
pub const JOIN_V4: (&str, &str) = ("192.0.2.192/26", "192.0.2.193");
pub const JOIN_V6: (&str, &str) = ("2001:db8:64::/64", "2001:db8:64::1");

pub struct Topology {
    pub prefix: String,
    /// Pods created so far (pod1..=podN).
    pub pods: usize,
    pub shape: Shape,
    /// Pod `i`'s port where [`Topology::move_pod`] renamed it (else
    /// `pod{i}`).
    port_names: Vec<Option<String>>,
    /// [`Topology::add_far_client`] made `far`.
    far: bool,
}

/// The client beyond ext that [`Topology::add_far_client`] makes, and
/// ext's address on the narrow link (the router that reports it).
pub const FAR_V4: (&str, &str) = ("203.0.113.200", "203.0.113.201");
pub const FAR_V6: (&str, &str) = ("2001:db8:f0::2", "2001:db8:f0::1");

/// Runs a command given as one line (words split on spaces) in `ns`.
pub fn cmd(ns: &str, line: &str) -> Result<()> {
    let words: Vec<&str> = line.split_whitespace().collect();
    ok_in(ns, &words).map(|_| ())
}

/// Runs `lines` in `ns` in order, as [`cmd`] runs one, stopping at the
/// first that fails. Consecutive `ip` lines go to one `ip -batch -`: one
/// process where each was one, and `ip` is most of the processes a
/// topology starts. In a batch a line's leading `-6` is dropped (a batch
/// line takes no options): each such line names an IPv6 address, which
/// gives the family.
pub fn cmds<S: AsRef<str>>(ns: &str, lines: &[S]) -> Result<()> {
    let mut batch: Vec<&str> = Vec::new();
    for line in lines.iter().map(AsRef::as_ref) {
        match line.strip_prefix("ip ") {
            Some(rest) => batch.push(rest.strip_prefix("-6 ").unwrap_or(rest)),
            None => {
                ip_batch(ns, &std::mem::take(&mut batch))?;
                cmd(ns, line)?;
            }
        }
    }
    ip_batch(ns, &batch)
}

/// `ip -batch` of `lines` (each an `ip` command without its `ip`) in
/// namespace `ns`, one process; nothing to do for no lines.
pub fn ip_batch<S: AsRef<str>>(ns: &str, lines: &[S]) -> Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let input: String = lines.iter().map(|l| format!("{}\n", l.as_ref())).collect();
    let out = feed_in(ns, &["ip", "-batch", "-"], input.as_bytes(), 5)?;
    if !out.status.success() {
        bail!(
            "ip -batch in {ns} failed ({}): {}\n{input}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Writes sysctls `(name, value)` of namespace `ns` (dotted names, as
/// sysctl(8) takes them) to /proc/sys from a thread in `ns`: /proc/sys/net
/// is the network namespace of whoever opens it. No process.
pub fn sysctls(ns: &str, settings: &[(&str, &str)]) -> Result<()> {
    let settings: Vec<(String, String)> = settings
        .iter()
        .map(|(k, v)| (format!("/proc/sys/{}", k.replace('.', "/")), v.to_string()))
        .collect();
    in_netns(ns, move || {
        for (path, value) in &settings {
            std::fs::write(path, value).with_context(|| format!("writing {value} to {path}"))?;
        }
        Ok(())
    })
    .with_context(|| format!("sysctls in {ns}"))
}

/// IPv4 and IPv6 forwarding on.
pub fn forwarding(ns: &str) -> Result<()> {
    sysctls(
        ns,
        &[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
        ],
    )
}

/// A namespace with loopback up and the sysctls every host shares: no
/// duplicate address detection (addresses usable at once), no reverse-path
/// filter (a mapped pod's packets arrive carrying the LB IP as source, which
/// a strict or loose check drops).
pub fn new_ns(ns: &str) -> Result<()> {
    ok(&["ip", "netns", "add", ns])?;
    cmd(ns, "ip link set lo up")?;
    sysctls(
        ns,
        &[
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ],
    )
}

/// With transmit checksum offload on, veth passes packets with a partial
/// checksum and a missing L4 fix-up would go unnoticed.
pub fn no_offload(ns: &str, dev: &str) -> Result<()> {
    cmd(ns, &offload_off(dev))
}

/// [`no_offload`]'s command, for a line of [`cmds`].
pub fn offload_off(dev: &str) -> String {
    format!("ethtool -K {dev} tx off")
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

    /// The client [`Topology::add_far_client`] makes.
    pub fn far(&self) -> String {
        self.ns("far")
    }

    /// The router's namespace of the Gateway shape.
    pub fn ovn(&self) -> String {
        self.ns("ovn")
    }

    /// Where pod `i`'s own veth ends outside the pod: namespace and
    /// interface (the node's, or the router's in the Gateway shape).
    pub fn pod_port(&self, i: usize) -> (String, String) {
        let port = self.port_names.get(i).cloned().flatten();
        let port = port.unwrap_or_else(|| format!("pod{i}"));
        match self.shape {
            Shape::Gateway => (self.ovn(), port),
            _ => (self.node(), port),
        }
    }

    /// The interface holding pod `i`'s gateway (whose MAC its frames out
    /// carry): namespace and interface.
    pub fn pod_gateway(&self, i: usize) -> (String, String) {
        match self.shape {
            Shape::Routed => (self.node(), format!("pod{i}")),
            Shape::Bridge => (self.node(), "cni0".into()),
            Shape::Gateway | Shape::NodeSegment => (self.ovn(), "ls".into()),
        }
    }

    pub fn new() -> Result<Topology> {
        Topology::with_shape(Shape::Routed)
    }

    pub fn with_shape(shape: Shape) -> Result<Topology> {
        let mut t = Topology {
            prefix: unique_prefix("cpt"),
            pods: 0,
            shape,
            port_names: Vec::new(),
            far: false,
        };
        if let Err(e) = t.build() {
            drop(t);
            return Err(e);
        }
        Ok(t)
    }

    fn build(&mut self) -> Result<()> {
        let t = self;
        let (ext, node) = (t.ext(), t.node());
        new_ns(&ext)?;
        new_ns(&node)?;
        veth("uplink", &node, "uplink", &ext)?;
        let uplink = |v4: &str, v6: &str| {
            vec![
                offload_off("uplink"),
                format!("ip addr add {v4} dev uplink"),
                format!("ip addr add {v6} dev uplink nodad"),
                "ip link set uplink up".into(),
            ]
        };
        // ext routes the LoadBalancer ranges (and the pod network, to reach
        // an unmanaged pod directly) via the node.
        let mut at_ext = uplink("198.51.100.1/24", "2001:db8:100::1/64");
        at_ext.extend(
            [
                "ip route add 203.0.113.0/24 via 198.51.100.2",
                "ip route add 192.0.2.0/24 via 198.51.100.2",
                "ip -6 route add 2001:db8:203::/64 via 2001:db8:100::2",
                "ip -6 route add 2001:db8:2::/64 via 2001:db8:100::2",
            ]
            .map(String::from),
        );
        cmds(&ext, &at_ext)?;
        let mut at_node = uplink("198.51.100.2/24", "2001:db8:100::2/64");
        at_node.extend(
            [
                "ip route add default via 198.51.100.1",
                "ip -6 route add default via 2001:db8:100::1",
            ]
            .map(String::from),
        );
        cmds(&node, &at_node)?;
        forwarding(&node)?;
        match t.shape {
            Shape::Routed => {}
            Shape::Bridge => bridge_gateway(&node, "192.0.2.1/24", "2001:db8:2::1/64")?,
            Shape::Gateway => t.build_router()?,
            Shape::NodeSegment => t.build_node_segment()?,
        }
        for _ in 0..POD_COUNT {
            t.add_pod()?;
        }
        // The CNI's masquerade for pod traffic leaving the uplink.
        let out = feed_in(&node, &["nft", "-f", "-"], MASQUERADE.as_bytes(), 5)?;
        if !out.status.success() {
            bail!("masquerade rules: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// The Gateway shape's router: the pods' segment `ls`, the join network
    /// `join` with the node's `ovn0` on it, the pod subnet routed via it.
    fn build_router(&self) -> Result<()> {
        let (node, ovn) = (self.node(), self.ovn());
        ovn_router(&ovn)?;
        join_node(&ovn, &node, "n1", "192.0.2.194/26", "2001:db8:64::2/64")?;
        // The pods' way out: the node (Kube-OVN's distributed gateway).
        cmds(
            &ovn,
            &[
                "ip route add default via 192.0.2.194",
                "ip -6 route add default via 2001:db8:64::2",
            ],
        )
    }

    /// The NodeSegment shape: the bridge `seg` in the node, the router's
    /// leg on it (its `ls`, holding the pods' gateway), the join network.
    fn build_node_segment(&self) -> Result<()> {
        let (node, ovn) = (self.node(), self.ovn());
        new_ns(&ovn)?;
        forwarding(&ovn)?;
        cmds(
            &node,
            &[
                "ip link add seg type bridge".into(),
                offload_off("seg"),
                "ip link set seg up".into(),
            ],
        )?;
        sysctls(
            &node,
            &[
                ("net.bridge.bridge-nf-call-iptables", "0"),
                ("net.bridge.bridge-nf-call-ip6tables", "0"),
            ],
        )?;
        veth("rtr", &node, "ls", &ovn)?;
        cmds(
            &node,
            &[
                "ip link set rtr master seg".into(),
                offload_off("rtr"),
                "ip link set rtr up".into(),
            ],
        )?;
        cmds(
            &ovn,
            &[
                "ip addr add 192.0.2.1/25 dev ls".into(),
                "ip addr add 2001:db8:2::1/64 dev ls nodad".into(),
                offload_off("ls"),
                "ip link set ls up".into(),
            ],
        )?;
        join_router(&ovn)?;
        join_node(&ovn, &node, "n1", "192.0.2.194/26", "2001:db8:64::2/64")?;
        cmds(
            &ovn,
            &[
                "ip route add default via 192.0.2.194",
                "ip -6 route add default via 2001:db8:64::2",
            ],
        )
    }

    /// A client `far` beyond ext, on a link whose MTU on ext's side is
    /// `mtu` (far's side keeps 1500, so its TCP handshakes announce the
    /// full segment size): ext becomes the router on the path, answering
    /// larger packets toward far with "fragmentation needed" / "packet too
    /// big" from its own address (`FAR_V4.1`, `FAR_V6.1`), as a narrower
    /// link of a real path does.
    pub fn add_far_client(&mut self, mtu: u32) -> Result<String> {
        let (ext, far) = (self.ext(), self.far());
        new_ns(&far)?;
        self.far = true;
        veth("narrow", &ext, "narrow", &far)?;
        let ((far4, ext4), (far6, ext6)) = (FAR_V4, FAR_V6);
        cmd(&ext, &format!("ip link set narrow mtu {mtu} up"))?;
        cmd(&ext, &format!("ip addr add {ext4}/32 dev narrow"))?;
        cmd(&ext, &format!("ip route add {far4}/32 dev narrow"))?;
        cmd(&ext, &format!("ip addr add {ext6}/64 dev narrow nodad"))?;
        cmd(
            &ext,
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
        )?;
        cmd(&far, "ip link set narrow up")?;
        cmd(&far, &format!("ip addr add {far4}/32 dev narrow"))?;
        cmd(&far, &format!("ip route add {ext4}/32 dev narrow"))?;
        cmd(&far, &format!("ip route add default via {ext4} dev narrow"))?;
        cmd(&far, &format!("ip addr add {far6}/64 dev narrow nodad"))?;
        cmd(
            &far,
            &format!("ip -6 route add default via {ext6} dev narrow"),
        )?;
        Ok(far)
    }

    /// A new pod (pod{N+1}) as the node's shape wires it; addresses
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
        let (ns, port) = self.pod_port(i);
        cmd(&ns, &format!("ip link del {port}"))?;
        self.wire_pod(i)
    }

    /// Pod `i`'s veth deleted and created again on another port (another
    /// name and ifindex), with the same addresses and link-layer address:
    /// a pod recreated with its IP and MAC (a VM's launcher pod on the same
    /// node, as Kube-OVN keeps both; a router's neighbour entry for the
    /// pod stays right, as a real CNI's gratuitous ARP would make it).
    pub fn move_pod(&mut self, i: usize) -> Result<()> {
        let (ns, old) = self.pod_port(i);
        let link = crate::sh::ok_in(&self.pod(i), &["ip", "-j", "link", "show", "dev", "eth0"])?;
        let link: serde_json::Value = serde_json::from_str(&link)?;
        let Some(mac) = link[0]["address"].as_str().map(str::to_string) else {
            bail!("pod{i}'s eth0 has no link-layer address: {link}");
        };
        cmd(&ns, &format!("ip link del {old}"))?;
        let moves = old
            .strip_prefix(&format!("pod{i}m"))
            .and_then(|n| n.parse::<u32>().ok());
        let new = format!("pod{i}m{}", moves.map_or(1, |n| n + 1));
        if self.port_names.len() <= i {
            self.port_names.resize(i + 1, None);
        }
        self.port_names[i] = Some(new);
        self.wire_pod(i)?;
        cmd(&self.pod(i), &format!("ip link set eth0 address {mac}"))
    }

    fn wire_pod(&self, i: usize) -> Result<()> {
        let pod = self.pod(i);
        let (v4, v6) = (format!("192.0.2.1{i}"), format!("2001:db8:2::1{i}"));
        let (ns, port) = self.pod_port(i);
        match self.shape {
            Shape::Routed => self.wire_routed_pod(i),
            Shape::Bridge => {
                wire_port(&ns, "cni0", &port, &pod)?;
                pod_on_segment(&pod, (&v4, 24, "192.0.2.1"), (&v6, 64, "2001:db8:2::1"))
            }
            Shape::Gateway => {
                wire_port(&ns, "ls", &port, &pod)?;
                pod_on_segment(&pod, (&v4, 25, "192.0.2.1"), (&v6, 64, "2001:db8:2::1"))
            }
            Shape::NodeSegment => {
                wire_port(&ns, "seg", &port, &pod)?;
                pod_on_segment(&pod, (&v4, 25, "192.0.2.1"), (&v6, 64, "2001:db8:2::1"))
            }
        }
    }

    fn wire_routed_pod(&self, i: usize) -> Result<()> {
        let (node, pod) = (self.node(), self.pod(i));
        let host_if = self.pod_port(i).1;
        veth(&host_if, &node, "eth0", &pod)?;
        cmds(
            &node,
            &[
                offload_off(&host_if),
                format!("ip addr add 192.0.2.1/32 dev {host_if}"),
                format!("ip addr add 2001:db8:2::1/128 dev {host_if} nodad"),
                format!("ip link set {host_if} up"),
                format!("ip route add 192.0.2.1{i}/32 dev {host_if}"),
                format!("ip -6 route add 2001:db8:2::1{i}/128 dev {host_if}"),
            ],
        )?;
        cmds(
            &pod,
            &[
                offload_off("eth0"),
                format!("ip addr add 192.0.2.1{i}/32 dev eth0"),
                format!("ip addr add 2001:db8:2::1{i}/128 dev eth0 nodad"),
                "ip link set eth0 up".into(),
                "ip route add 192.0.2.1 dev eth0".into(),
                "ip route add default via 192.0.2.1".into(),
                "ip -6 route add 2001:db8:2::1 dev eth0".into(),
                "ip -6 route add default via 2001:db8:2::1".into(),
            ],
        )
    }
}

/// A bridge `cni0` in `ns` holding the pods' gateway addresses, with
/// br_netfilter on (bridged IP traffic through the IP hooks, as kubeadm
/// nodes have it).
pub fn bridge_gateway(ns: &str, v4: &str, v6: &str) -> Result<()> {
    cmds(
        ns,
        &[
            "ip link add cni0 type bridge".into(),
            offload_off("cni0"),
            format!("ip addr add {v4} dev cni0"),
            format!("ip addr add {v6} dev cni0 nodad"),
            "ip link set cni0 up".into(),
        ],
    )?;
    sysctls(
        ns,
        &[
            ("net.bridge.bridge-nf-call-iptables", "1"),
            ("net.bridge.bridge-nf-call-ip6tables", "1"),
        ],
    )
}

/// The Gateway shape's router namespace `ovn`: forwarding, the pods'
/// segment `ls` holding their gateway (192.0.2.1/25, 2001:db8:2::1/64),
/// the join network's bridge.
pub fn ovn_router(ovn: &str) -> Result<()> {
    new_ns(ovn)?;
    forwarding(ovn)?;
    bridge_gateway(ovn, "192.0.2.1/25", "2001:db8:2::1/64")?;
    cmd(ovn, "ip link set cni0 name ls")?;
    join_router(ovn)
}

/// The join network's bridge in the router's namespace `ovn`, with the
/// router's address on it.
pub fn join_router(ovn: &str) -> Result<()> {
    cmds(
        ovn,
        &[
            "ip link add join type bridge".into(),
            offload_off("join"),
            format!("ip addr add {}/26 dev join", JOIN_V4.1),
            format!("ip addr add {}/64 dev join nodad", JOIN_V6.1),
            "ip link set join up".into(),
        ],
    )
}

/// A node's `ovn0` on the join network (its peer `port` a port of `join`),
/// and the node's route to the pod subnet via the router.
pub fn join_node(ovn: &str, node: &str, port: &str, v4: &str, v6: &str) -> Result<()> {
    veth(port, ovn, "ovn0", node)?;
    cmds(
        ovn,
        &[
            format!("ip link set {port} master join"),
            offload_off(port),
            format!("ip link set {port} up"),
        ],
    )?;
    cmds(
        node,
        &[
            offload_off("ovn0"),
            format!("ip addr add {v4} dev ovn0"),
            format!("ip addr add {v6} dev ovn0 nodad"),
            "ip link set ovn0 up".into(),
            format!("ip route add 192.0.2.0/25 via {}", JOIN_V4.1),
            format!("ip -6 route add 2001:db8:2::/64 via {}", JOIN_V6.1),
        ],
    )
}

/// A pod's veth: `eth0` in `pod`, its peer `port` in `ns` a port of
/// `bridge`.
pub fn wire_port(ns: &str, bridge: &str, port: &str, pod: &str) -> Result<()> {
    veth(port, ns, "eth0", pod)?;
    cmds(
        ns,
        &[
            format!("ip link set {port} master {bridge}"),
            offload_off(port),
            format!("ip link set {port} up"),
        ],
    )?;
    cmds(pod, &[offload_off("eth0"), "ip link set eth0 up".into()])
}

/// A pod's addresses on its segment `(address, prefix, gateway)` per
/// family, its default routes via the gateways.
pub fn pod_on_segment(pod: &str, v4: (&str, u8, &str), v6: (&str, u8, &str)) -> Result<()> {
    cmds(
        pod,
        &[
            format!("ip addr add {}/{} dev eth0", v4.0, v4.1),
            format!("ip addr add {}/{} dev eth0 nodad", v6.0, v6.1),
            format!("ip route add default via {}", v4.2),
            format!("ip -6 route add default via {}", v6.2),
        ],
    )
}

/// Kills what runs in the namespaces and removes them, as `ip netns pids`
/// and `ip netns del` do, without a process of their own: a process is in
/// a namespace when its `/proc/PID/ns/net` is the namespace's inode, and
/// the name goes with a lazy unmount and an unlink of `/run/netns/NAME`.
pub fn remove_namespaces(all: &[String]) {
    use std::os::unix::fs::MetadataExt;
    let paths: Vec<String> = all.iter().map(|ns| format!("/run/netns/{ns}")).collect();
    let inodes: Vec<(u64, u64)> = paths
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    for pid in crate::sh::process_ids() {
        let Ok(net) = std::fs::metadata(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        if inodes.contains(&(net.dev(), net.ino())) {
            // SAFETY: kill(2) on a process left in one of our namespaces.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    for path in &paths {
        if let Ok(c) = std::ffi::CString::new(path.as_str()) {
            // SAFETY: umount2(2) on a path we own, given as a C string.
            unsafe {
                libc::umount2(c.as_ptr(), libc::MNT_DETACH);
            }
        }
        let _ = std::fs::remove_file(path);
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut all = vec![self.ext(), self.node()];
        all.extend((1..=self.pods).map(|i| self.pod(i)));
        if self.shape.behind_router() {
            all.push(self.ovn());
        }
        if self.far {
            all.push(self.far());
        }
        remove_namespaces(&all);
    }
}
