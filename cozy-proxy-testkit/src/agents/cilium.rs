//! The real Cilium agent beside cozy-proxy: `cilium-agent` 1.20 (the
//! `github.com/cilium/cilium` module, built by `cargo xtask setup`, its
//! datapath compiled at start by Debian's clang 19, the LLVM its own image
//! carries), configured from Cilium's own Helm chart with Cozystack's
//! values (kube-proxy replacement, generic-veth chaining, tcx, native
//! routing, host firewall), on the namespace nodes of a [`Cluster`] with
//! the real control plane.
//!
//! What it models, and what not:
//! - **as on a real node**: the agent's configuration is the chart's
//!   `cilium-config` ConfigMap, rendered by the real helm; its API access
//!   is the chart's ServiceAccount and RBAC; it compiles and attaches its
//!   programs (tcx) to the node's devices and to the pods' host-side veths,
//!   which its own CNI plugin (`cilium-cni`, called as a CNI chain calls it
//!   after the primary plugin, with that plugin's result) announces to it;
//!   it serves the cluster's Services (kube-proxy replacement), CRDs and
//!   identities through the real API server.
//! - **not a real node**: no kubelet starts it (a process in the node's
//!   network namespace, with private mounts of its own: a bpffs at
//!   /sys/fs/bpf, a tmpfs for its state; its socket programs act on a
//!   cgroup of its own, holding the processes of the tests' pods that use
//!   a ClusterIP, not on the whole machine); no operator runs (the
//!   CRDs are applied from the module, as the operator registers them);
//!   the primary CNI is the test topology's wiring, not Kube-OVN; the
//!   devices are the node's uplink where Cozystack names Kube-OVN's `ovn0`
//!   and `genev_sys_6081` (no Open vSwitch, no Geneve here); Envoy and the
//!   Gateway API, which Cozystack enables, are off (no L7 here); IPv4
//!   only, as Cozystack runs Cilium.
use crate::control_plane::k8s::ControlPlane;
use crate::nodes::cluster::Cluster;
use crate::sh::{ok_in, Proc};
use anyhow::{bail, Context, Result};
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

pub const NAMESPACE: &str = "kube-system";

/// The cache `cargo xtask setup` builds Cilium into (xtask/src/cilium.rs).
pub fn cache() -> PathBuf {
    crate::sh::setup_cache("COZY_PROXY_CILIUM_CACHE", "cilium-v1.20.2")
}

pub fn available() -> bool {
    cache().join("bin/cilium-agent").is_file()
}

/// Cozystack's values for Cilium on Kube-OVN (its packages/system/cilium:
/// values.yaml, values-talos.yaml, values-kubeovn.yaml), as keys of the
/// upstream chart; `@DEVICES@` is the node's devices.
const COZYSTACK_VALUES: &str = "\
kubeProxyReplacement: true
hostFirewall:
  enabled: true
hubble:
  enabled: false
externalIPs:
  enabled: true
nodePort:
  enabled: true
loadBalancer:
  algorithm: maglev
  serviceTopology: true
ipam:
  mode: kubernetes
cgroup:
  autoMount:
    enabled: false
  hostRoot: /sys/fs/cgroup
daemon:
  enableSourceIPVerification: false
sctp:
  enabled: true
autoDirectNodeRoutes: false
bpf:
  masquerade: false
cni:
  chainingMode: generic-veth
  customConf: true
  configMap: cni-configuration
routingMode: native
enableIPv4Masquerade: false
enableIPv6Masquerade: false
enableIdentityMark: false
devices: \"@DEVICES@\"
# Cozystack names Kube-OVN's devices and lets Cilium detect the others
# (the uplink); here the devices are named whole: detection would take the
# pods' routed veths too (they hold the pods' gateway address), where
# Kube-OVN's are address-less Open vSwitch ports, and Cilium's device
# programs would then end their chains before its endpoint programs.
forceDeviceDetection: false
# Not here (no L7 proxy, no Gateway API CRDs).
envoy:
  enabled: false
l7Proxy: false
gatewayAPI:
  enabled: false
";

/// The CNI chain the agent reads (`read-cni-conf`): the primary plugin,
/// then Cilium's, as Cozystack's `cni-configuration` ConfigMap has it.
const CNI_CHAIN: &str = r#"{
  "name": "generic-veth",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "ptp"},
    {"type": "cilium-cni"}
  ]
}"#;

/// One node's agent, and what outlives its process as on a node: its
/// mount namespace (held by a process of its own) with its bpffs and its
/// state, and its cgroup, so that a restart finds its pinned programs,
/// maps and endpoints.
pub struct Agent {
    pub node: String,
    pub ns: String,
    holder: Proc,
    proc: Option<Proc>,
    pub log: PathBuf,
    config_dir: PathBuf,
    /// The cgroup (in cgroup2) the agent's socket programs act on: only
    /// the processes put there, not the whole machine's.
    cgroup: PathBuf,
}

/// Where the tests mount the machine's cgroup2 hierarchy: outside /sys,
/// which `ip netns exec` mounts anew for each process it starts.
const CGROUP2: &str = "/run/cozy-proxy-tests/cgroup2";

fn mount_cgroup2() -> Result<()> {
    // Tests start agents on several threads: one mounts, the others see
    // the mount (two mounts at once: the second is refused).
    static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MOUNTING.lock().unwrap_or_else(|e| e.into_inner());
    fs::create_dir_all(CGROUP2)?;
    if crate::sh::ok(&["mountpoint", "-q", CGROUP2]).is_err() {
        crate::sh::ok(&["mount", "-t", "cgroup2", "none", CGROUP2])?;
    }
    Ok(())
}

impl Agent {
    /// The holder's process id: its mount namespace holds the agent's
    /// socket and bpffs.
    fn holder_pid(&self) -> String {
        self.holder.child.id().to_string()
    }

    pub fn log_tail(&self, n: usize) -> String {
        crate::sh::tail(&self.log, n)
    }

    /// `args` in the agent's mount and network namespaces (its socket,
    /// its bpffs): `cilium-dbg`, `cilium-cni`.
    pub fn exec(&self, env: &[String], args: &[&str]) -> Result<String> {
        let pid = self.holder_pid();
        let mut all = vec!["nsenter", "-t", pid.as_str(), "-m", "-n", "--", "env"];
        all.extend(env.iter().map(String::as_str));
        all.extend_from_slice(args);
        crate::sh::ok(&all)
    }

    /// `cilium-dbg ARGS` against this agent.
    pub fn dbg(&self, args: &[&str]) -> Result<String> {
        let bin = cache().join("bin/cilium-dbg").display().to_string();
        let mut all = vec![bin.as_str()];
        all.extend_from_slice(args);
        self.exec(&[], &all)
    }

    /// Starts the agent's process (again), and waits until it reports
    /// itself ready.
    pub fn start(&mut self) -> Result<()> {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let path = format!(
            "{}:{}",
            cache().join("llvm").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let script = format!(
            "export K8S_NODE_NAME={} CILIUM_K8S_NAMESPACE={NAMESPACE} PATH={path}; exec {} --config-dir {}",
            self.node,
            cache().join("bin/cilium-agent").display(),
            self.config_dir.display()
        );
        let pid = self.holder_pid();
        self.proc = Some(Proc::spawn(
            &["nsenter", "-t", &pid, "-m", "-n", "--", "sh", "-c", &script],
            Stdio::from(out.try_clone()?),
            Stdio::from(out),
        )?);
        crate::traffic::eventually(Duration::from_secs(180), || {
            match self.dbg(&["status", "--brief"]) {
                Ok(s) if s.contains("OK") => Ok(()),
                other => bail!("{other:?}\n{}", self.log_tail(20)),
            }
        })
        .with_context(|| format!("{}'s agent not ready", self.node))
    }

    /// Stops the agent's process (SIGTERM, as a kubelet stops a pod).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill(libc::SIGTERM);
            let _ = p.child.wait();
        }
    }

    /// `args` run in node namespace `ns` from within the cgroup the
    /// agent's socket programs act on (a pod's process, as the kubelet
    /// puts it in its cgroup).
    pub fn in_cgroup(&self, args: &[&str]) -> Vec<String> {
        let procs = self.cgroup.join("cgroup.procs").display().to_string();
        let mut all: Vec<String> = [
            "sh",
            "-c",
            &format!("echo $$ > {procs} && exec \"$@\""),
            "-",
        ]
        .map(String::from)
        .to_vec();
        all.extend(args.iter().map(|a| a.to_string()));
        all
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        self.holder.kill(libc::SIGKILL);
        let _ = self.holder.child.wait();
        let _ = fs::remove_dir(&self.cgroup);
    }
}

/// The agents of a cluster's nodes.
pub struct Cilium {
    pub agents: Vec<Agent>,
    /// The rendered configuration and each agent's files.
    dir: PathBuf,
    config: BTreeMap<String, String>,
    kubeconfig: PathBuf,
}

impl Drop for Cilium {
    /// The agents stopped, then their files gone (a failure's report
    /// carries the end of each agent's log).
    fn drop(&mut self) {
        self.agents.clear();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Cilium {
    /// Applies the chart's objects but its workloads (the agent's
    /// ServiceAccount, RBAC, ConfigMap) and the CRDs, rendered by the real
    /// helm with Cozystack's values; `devices` the nodes' devices.
    pub fn install(cp: &ControlPlane, dir: &Path, devices: &str) -> Result<Cilium> {
        fs::create_dir_all(dir)?;
        let values = dir.join("values.yaml");
        fs::write(&values, COZYSTACK_VALUES.replace("@DEVICES@", devices))?;
        let chart = cache().join("chart").display().to_string();
        let rendered = cp.helm(&[
            "template",
            "cilium",
            &chart,
            "--namespace",
            NAMESPACE,
            "--values",
            &values.display().to_string(),
        ])?;
        let mut config = BTreeMap::new();
        let mut objects = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(&rendered) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            let kind = v["kind"].as_str().unwrap_or_default();
            if v["metadata"]["name"] == "cilium-config" {
                for (k, value) in v["data"].as_object().context("cilium-config data")? {
                    config.insert(k.clone(), value.as_str().unwrap_or_default().to_string());
                }
            }
            if !kind.is_empty() && !matches!(kind, "DaemonSet" | "Deployment") {
                objects.push(serde_json::to_string(&v)?);
            }
        }
        if config.is_empty() {
            bail!("the chart rendered no cilium-config");
        }
        for crds in ["crds/v2", "crds/v2alpha1"] {
            let path = cache().join(crds).display().to_string();
            cp.kubectl(&["apply", "--server-side", "-f", &path])?;
        }
        for o in &objects {
            cp.apply(o)?;
        }
        let kubeconfig = cp.service_account_kubeconfig(NAMESPACE, "cilium")?;
        Ok(Cilium {
            agents: Vec::new(),
            dir: dir.to_path_buf(),
            config,
            kubeconfig,
        })
    }

    /// Starts node `node`'s agent in namespace `ns`, its router device
    /// (`cilium_host`) on `router`, and waits until it reports itself
    /// ready. The router address is given: Cilium's IPAM takes one at
    /// random from the node's pod network, where the tests' pods hold
    /// addresses no IPAM hands out (a real primary CNI's IPAM would), and
    /// one pod in about twenty found its address on `cilium_host`.
    pub fn start_agent(
        &mut self,
        ns: &str,
        node: &str,
        router: std::net::IpAddr,
    ) -> Result<&mut Agent> {
        let own = self.dir.join(node);
        let config_dir = own.join("config");
        let _ = fs::remove_dir_all(&own);
        fs::create_dir_all(&config_dir)?;
        let cni = own.join("cni-config");
        fs::write(&cni, CNI_CHAIN)?;
        mount_cgroup2()?;
        let cgroup = Path::new(CGROUP2).join(format!(
            "{}-{node}",
            self.dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("cilium")
        ));
        fs::create_dir_all(&cgroup)?;
        let mut config = self.config.clone();
        // A pod's mounts on a real node, here the agent's own mount
        // namespace or its files.
        for (k, v) in [
            ("procfs", "/proc".to_string()),
            ("read-cni-conf", cni.display().to_string()),
            (
                "write-cni-conf-when-ready",
                own.join("05-cilium.conflist").display().to_string(),
            ),
            ("k8s-kubeconfig-path", self.kubeconfig.display().to_string()),
            ("lib-dir", cache().join("lib").display().to_string()),
            ("cgroup-root", cgroup.display().to_string()),
            ("local-router-ipv4", router.to_string()),
        ] {
            config.insert(k.into(), v);
        }
        for (k, v) in &config {
            fs::write(config_dir.join(k), v)?;
        }
        // `ip netns exec` gives the holder a mount namespace of its own
        // (its /sys remounted): the agent's bpffs, state and cgroup2 are
        // mounted there, seen by nothing else, kept while it lives.
        let script = "set -e; mount -t bpf bpf /sys/fs/bpf; mkdir -p /run/cilium; \
             mount -t tmpfs tmpfs /run/cilium; exec sleep infinity";
        let holder = Proc::spawn_in(ns, &["sh", "-c", script], Stdio::null(), Stdio::null())?;
        let mut agent = Agent {
            node: node.to_string(),
            ns: ns.to_string(),
            holder,
            proc: None,
            log: own.join("agent.log"),
            config_dir,
            cgroup,
        };
        // The holder's mounts in place before the agent enters.
        crate::traffic::eventually(Duration::from_secs(5), || {
            agent
                .exec(&[], &["mountpoint", "-q", "/run/cilium"])
                .map(|_| ())
        })?;
        agent.start()?;
        self.agents.push(agent);
        self.agents.last_mut().context("the agent just started")
    }

    /// Announces pod `name` (namespace `pod_ns`, its `eth0` the peer of
    /// `host_veth` on node `k`) to node `k`'s agent through Cilium's own
    /// CNI plugin, as the generic-veth chain calls it after the primary
    /// plugin: with that plugin's result (the veth pair and the address).
    pub fn announce_pod(
        &self,
        k: usize,
        pod_ns: &str,
        host_veth: &str,
        name: &str,
        ip: std::net::IpAddr,
    ) -> Result<()> {
        let agent = &self.agents[k - 1];
        let mac = |ns: &str, dev: &str| -> Result<String> {
            let link: serde_json::Value =
                serde_json::from_str(&ok_in(ns, &["ip", "-j", "link", "show", "dev", dev])?)?;
            Ok(link[0]["address"]
                .as_str()
                .context("a link-layer address")?
                .to_string())
        };
        let netns = format!("/var/run/netns/{pod_ns}");
        let prev = serde_json::json!({
            "cniVersion": "0.3.1",
            "name": "generic-veth",
            "type": "cilium-cni",
            "prevResult": {
                "cniVersion": "0.3.1",
                "interfaces": [
                    {"name": host_veth, "mac": mac(&agent.ns, host_veth)?},
                    {"name": "eth0", "mac": mac(pod_ns, "eth0")?, "sandbox": netns},
                ],
                "ips": [{"version": "4", "address": format!("{ip}/32"), "interface": 1}],
            },
        });
        let input = self.dir.join(format!("cni-{name}.json"));
        fs::write(&input, prev.to_string())?;
        let container = format!("{:x}", md5ish(name));
        let env = [
            "CNI_COMMAND=ADD".to_string(),
            format!("CNI_CONTAINERID={container}"),
            format!("CNI_NETNS={netns}"),
            "CNI_IFNAME=eth0".to_string(),
            format!("CNI_PATH={}", cache().join("bin").display()),
            format!(
                "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container}"
            ),
        ];
        let plugin = format!(
            "exec {} < {}",
            cache().join("bin/cilium-cni").display(),
            input.display()
        );
        agent
            .exec(&env, &["sh", "-c", &plugin])
            .with_context(|| format!("cilium-cni ADD {name}"))?;
        Ok(())
    }
}

/// A container id for a pod's name (stable, hex).
fn md5ish(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

/// The agents of both nodes of `c`, on `devices`.
pub fn on_cluster(c: &Cluster, devices: &str) -> Result<Cilium> {
    let api = c
        .api
        .as_ref()
        .context("the Cilium lane needs the real API")?;
    let dir = std::env::temp_dir().join(format!("{}-cilium", c.topo.prefix));
    let mut cilium = Cilium::install(&api.cp, &dir, devices)?;
    for k in 1..=2 {
        cilium.start_agent(
            &c.topo.node(k),
            &format!("node{k}"),
            c.net.agent_router_v4(k),
        )?;
    }
    Ok(cilium)
}
