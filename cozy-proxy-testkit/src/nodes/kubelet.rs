//! A real Kubernetes node on this machine: a kubelet and containerd (with
//! runc and the CNI plugins) joined to the tests' control plane, in the
//! node's network namespace and a mount namespace of the node's own.
//!
//! The mount namespace gives the node what a machine of its own has and
//! the other nodes here must not share: a bpffs at `/sys/fs/bpf` (the
//! chart's pin directory), and `/var/lib/kubelet`, `/var/lib/containerd`,
//! `/run/containerd`, `/etc/cni/net.d`, `/var/lib/cni` and `/var/log/pods`
//! bound from the node's directory, so the components run with their
//! default paths. Its propagation is slave: the machine's mounts (the
//! cgroup hierarchies above all) reach in, the node's stay inside. Every
//! component is entered with `nsenter`, not `ip netns exec`, which mounts
//! `/sys` anew without the cgroup v1 hierarchies the kubelet and runc need.
//!
//! What differs from a systemd node (docs/testing.md): the kubelet uses
//! the cgroupfs driver, no QoS cgroups and no node allocatable
//! enforcement; containerd's runc runtime `SystemdCgroup = false`, and
//! `restrict_oom_score_adj` (this machine lets no process lower its OOM
//! score). The kubelet authenticates with a static token as
//! `system:node:<name>`, authorized by the Node authorizer; it serves its
//! API (logs, exec) with a self-signed certificate to anonymous callers.
//!
//! What it does not model: the node's own kernel (the nodes share this
//! machine's, as every namespace test does), image pulls (the images are
//! imported, nodes/images.rs), and cgroup limits per node.
use crate::control_plane::k8s::ControlPlane;
use crate::nodes::images::{archives, PAUSE};
use crate::sh::{ok, setup_cache, tail, Proc};
use crate::traffic::eventually;
use anyhow::{bail, Context, Result};
use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

/// The versions `cargo xtask setup` builds (xtask/src/node_runtime.rs).
pub const CONTAINERD: &str = "v2.4.2";
pub const CRI_TOOLS: &str = "v1.37.0";

/// containerd's binaries' directory (the shim is found there on PATH).
fn containerd_dir() -> PathBuf {
    setup_cache(
        "COZY_PROXY_CONTAINERD_CACHE",
        &format!("containerd-{CONTAINERD}"),
    )
    .join("bin")
}

fn containerd_bin(name: &str) -> String {
    containerd_dir().join(name).display().to_string()
}

/// crictl, built by setup.
pub fn crictl_bin() -> String {
    setup_cache("COZY_PROXY_CRICTL_CACHE", &format!("crictl-{CRI_TOOLS}"))
        .join("bin/crictl")
        .display()
        .to_string()
}

fn kubelet_bin() -> String {
    crate::control_plane::k8s::bin_dir()
        .join("kubelet")
        .display()
        .to_string()
}

/// Are the node's binaries there? (`cargo xtask setup` builds them.)
pub fn available() -> bool {
    [
        containerd_bin("containerd"),
        containerd_bin("containerd-shim-runc-v2"),
        containerd_bin("ctr"),
        crictl_bin(),
        kubelet_bin(),
    ]
    .iter()
    .all(|b| Path::new(b).is_file())
}

/// The directories bound into the node's mount namespace: (under the
/// node's directory, where).
const BOUND: &[(&str, &str)] = &[
    ("kubelet", "/var/lib/kubelet"),
    ("containerd", "/var/lib/containerd"),
    ("run-containerd", "/run/containerd"),
    ("cni-conf", "/etc/cni/net.d"),
    ("cni-state", "/var/lib/cni"),
    ("pod-logs", "/var/log/pods"),
];

/// The CNI plugin that wires the node's pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cni {
    /// `ptp`: a routed veth per pod, the node side the gateway (Calico's
    /// and Cilium's native routing shape).
    Ptp,
    /// `bridge`: the pods' veths on bridge `cni0`, the gateway on the
    /// bridge (Flannel's and kindnet's shape).
    Bridge,
}

/// What a node is given: its name, namespace, addresses and pod networks.
pub struct NodeSpec {
    pub cni: Cni,
    pub name: String,
    pub ns: String,
    /// Its InternalIPs (the kubelet's `--node-ip`).
    pub addresses: Vec<IpAddr>,
    /// The CNI's ranges on this node: (subnet, first, last, gateway).
    pub pod_ranges: Vec<(String, IpAddr, IpAddr, IpAddr)>,
}

pub struct KubeletNode {
    pub spec: NodeSpec,
    pub dir: PathBuf,
    /// `sleep` holding the node's mount namespace.
    holder: Proc,
    containerd: Option<Proc>,
    kubelet: Option<Proc>,
    kubeconfig: PathBuf,
}

/// The CNI configuration: the node's plugin ([`Cni`]), addresses from
/// `host-local` in the node's ranges.
fn cni_conflist(spec: &NodeSpec) -> String {
    let ranges: Vec<serde_json::Value> = (spec.pod_ranges.iter())
        .map(|(subnet, first, last, gateway)| {
            serde_json::json!([{"subnet": subnet, "rangeStart": first.to_string(),
                "rangeEnd": last.to_string(), "gateway": gateway.to_string()}])
        })
        .collect();
    let routes: Vec<serde_json::Value> = (spec.pod_ranges.iter())
        .map(|(_, _, _, gw)| match gw {
            IpAddr::V4(_) => serde_json::json!({"dst": "0.0.0.0/0"}),
            IpAddr::V6(_) => serde_json::json!({"dst": "::/0"}),
        })
        .collect();
    let ipam = serde_json::json!({"type": "host-local", "ranges": ranges, "routes": routes});
    let plugin = match spec.cni {
        Cni::Ptp => serde_json::json!({"type": "ptp", "ipMasq": false, "mtu": 1500, "ipam": ipam}),
        Cni::Bridge => serde_json::json!({"type": "bridge", "bridge": "cni0", "isGateway": true,
            "ipMasq": false, "mtu": 1500, "ipam": ipam}),
    };
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "pods",
        "plugins": [plugin, {"type": "loopback"}]
    })
    .to_string()
}

/// containerd's configuration. NRI is off: its socket
/// (`/var/run/nri/nri.sock`) is not among the node's own directories, and
/// two nodes' containerds started at once both bind it (the second one
/// then fails to start).
fn containerd_config() -> String {
    format!(
        r#"version = 3
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE}'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = '/usr/sbin/runc'
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '/etc/cni/net.d'
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
[plugins.'io.containerd.nri.v1.nri']
  disable = true
"#
    )
}

/// The kubelet's configuration for this machine (see the module comment).
fn kubelet_config() -> &'static str {
    r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
resolvConf: ""
clusterDomain: cluster.local
evictionHard: {memory.available: "1Mi", nodefs.available: "1Mi", imagefs.available: "1Mi"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
fileCheckFrequency: 5s
serializeImagePulls: false
localStorageCapacityIsolation: false
"#
}

impl KubeletNode {
    /// Starts the node's mount namespace, containerd (the images
    /// imported) and the kubelet, which registers with `cp`; returns once
    /// the Node is Ready.
    pub fn start(spec: NodeSpec, dir: PathBuf, cp: &ControlPlane) -> Result<KubeletNode> {
        if !available() {
            bail!("the node's binaries are missing (cargo xtask setup builds them)");
        }
        fs::create_dir_all(&dir)?;
        for (sub, _) in BOUND {
            fs::create_dir_all(dir.join(sub))?;
        }
        fs::write(dir.join("cni-conf/10-pods.conflist"), cni_conflist(&spec))?;
        fs::write(dir.join("containerd.toml"), containerd_config())?;
        fs::write(dir.join("kubelet.yaml"), kubelet_config())?;
        let kubeconfig = cp.node_kubeconfig(&spec.name)?;
        let holder = hold_mounts(&spec.ns, &dir)?;
        let mut node = KubeletNode {
            spec,
            dir,
            holder,
            containerd: None,
            kubelet: None,
            kubeconfig,
        };
        node.start_containerd()?;
        node.import_images()?;
        node.start_kubelet()?;
        node.wait_ready(cp)?;
        Ok(node)
    }

    fn holder_pid(&self) -> String {
        self.holder.child.id().to_string()
    }

    /// `args` in the node's network and mount namespaces.
    pub fn command(&self, args: &[&str]) -> Vec<String> {
        let mut all = vec![
            "nsenter".to_string(),
            "-t".into(),
            self.holder_pid(),
            "-m".into(),
            "-n".into(),
            "--".into(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        all
    }

    /// Runs `args` in the node; its standard output, failing unless it
    /// succeeds.
    pub fn ok(&self, args: &[&str]) -> Result<String> {
        let all = self.command(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        ok(&all)
    }

    fn spawn(&self, args: &[&str], log: &str) -> Result<Proc> {
        let all = self.command(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(log))?;
        Proc::spawn(&all, Stdio::null(), Stdio::from(out))
    }

    /// The end of a component's log (`containerd.log`, `kubelet.log`).
    pub fn log_tail(&self, log: &str, lines: usize) -> String {
        tail(&self.dir.join(log), lines)
    }

    /// Starts containerd; returns once its CRI answers.
    pub fn start_containerd(&mut self) -> Result<()> {
        let config = self.dir.join("containerd.toml").display().to_string();
        let path = format!(
            "{}:{}",
            containerd_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // The shim is found on PATH.
        let proc = self.spawn(
            &[
                "env",
                &format!("PATH={path}"),
                &containerd_bin("containerd"),
                "--config",
                &config,
            ],
            "containerd.log",
        )?;
        self.containerd = Some(proc);
        eventually(Duration::from_secs(30), || {
            self.ok(&[&crictl_bin(), "info"]).map(|_| ())
        })
        .with_context(|| format!("containerd:\n{}", self.log_tail("containerd.log", 30)))
    }

    /// Stops containerd (its shims, and so the pods, keep running).
    pub fn stop_containerd(&mut self) {
        if let Some(mut p) = self.containerd.take() {
            p.kill(libc::SIGTERM);
            let _ = p.child.wait();
        }
    }

    fn import_images(&self) -> Result<()> {
        for archive in archives()? {
            let path = archive.path.display().to_string();
            let mut args = vec![containerd_bin("ctr"), "-n".into(), "k8s.io".into()];
            args.extend(["images".into(), "import".into()]);
            if archive.ref_name != archive.image {
                // A bare tag in the archive: the repository goes before it.
                let repository = archive
                    .image
                    .trim_end_matches(&format!(":{}", archive.ref_name));
                args.extend(["--base-name".into(), repository.to_string()]);
            }
            args.push(path);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.ok(&args)
                .with_context(|| format!("importing {}", archive.image))?;
        }
        let listed = self.ok(&[&containerd_bin("ctr"), "-n", "k8s.io", "images", "ls", "-q"])?;
        for archive in archives()? {
            if !listed.lines().any(|l| l.trim() == archive.image) {
                bail!("{} not imported; the node has:\n{listed}", archive.image);
            }
        }
        Ok(())
    }

    /// Starts the kubelet.
    pub fn start_kubelet(&mut self) -> Result<()> {
        let ips: Vec<String> = self.spec.addresses.iter().map(IpAddr::to_string).collect();
        let config = self.dir.join("kubelet.yaml").display().to_string();
        let kubeconfig = self.kubeconfig.display().to_string();
        let proc = self.spawn(
            &[
                &kubelet_bin(),
                "--config",
                &config,
                "--kubeconfig",
                &kubeconfig,
                "--hostname-override",
                &self.spec.name,
                "--node-ip",
                &ips.join(","),
                "--v",
                "1",
            ],
            "kubelet.log",
        )?;
        self.kubelet = Some(proc);
        Ok(())
    }

    /// Tags image `from` as `to` in the node's image store (a new release
    /// of the same image, for a rolling upgrade).
    pub fn tag_image(&self, from: &str, to: &str) -> Result<()> {
        let ctr = containerd_bin("ctr");
        self.ok(&[&ctr, "-n", "k8s.io", "images", "tag", "--force", from, to])
            .map(|_| ())
    }

    /// Stops the kubelet and containerd and starts them again (the pods
    /// keep running under their shims); returns once the Node is Ready.
    pub fn restart_runtime(&mut self, cp: &ControlPlane) -> Result<()> {
        self.stop_kubelet();
        self.stop_containerd();
        self.start_containerd()?;
        self.start_kubelet()?;
        self.wait_ready(cp)
    }

    /// Stops the kubelet (the pods keep running).
    pub fn stop_kubelet(&mut self) {
        if let Some(mut p) = self.kubelet.take() {
            p.kill(libc::SIGTERM);
            let _ = p.child.wait();
        }
    }

    /// Waits until the Node is Ready.
    pub fn wait_ready(&self, cp: &ControlPlane) -> Result<()> {
        eventually(Duration::from_secs(90), || {
            let ready = cp.kubectl(&[
                "get",
                "node",
                &self.spec.name,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ])?;
            if ready.trim() == "True" {
                Ok(())
            } else {
                bail!("node {} not Ready: {ready:?}", self.spec.name)
            }
        })
        .with_context(|| format!("kubelet:\n{}", self.log_tail("kubelet.log", 40)))
    }

    /// The network namespace of pod `namespace/name`'s sandbox, attached
    /// on the host as `as_name` (so every namespace tool reaches it).
    pub fn attach_pod_netns(&self, namespace: &str, name: &str, as_name: &str) -> Result<()> {
        let id = self.ok(&[
            &crictl_bin(),
            "pods",
            "--namespace",
            namespace,
            "--name",
            name,
            "--state",
            "ready",
            "-q",
        ])?;
        let id = id
            .lines()
            .next()
            .context("no ready sandbox")?
            .trim()
            .to_string();
        let info = self.ok(&[&crictl_bin(), "inspectp", &id])?;
        let info: serde_json::Value = serde_json::from_str(&info)?;
        let pid = info["info"]["pid"]
            .as_u64()
            .context("the sandbox's pid")?
            .to_string();
        let _ = ok(&["ip", "netns", "del", as_name]);
        ok(&["ip", "netns", "attach", as_name, &pid]).map(|_| ())
    }

    /// Every container's task on the node, as containerd lists them.
    fn task_pids(&self) -> Vec<Task> {
        let ctr = containerd_bin("ctr");
        let listed = self
            .ok(&[&ctr, "-n", "k8s.io", "tasks", "ls"])
            .unwrap_or_default();
        // "TASK PID STATUS", a line each.
        (listed.lines().skip(1))
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let id = f.next()?.to_string();
                let pid = f.next()?.parse().ok()?;
                (pid > 0).then_some(Task { id, pid })
            })
            .collect()
    }

    /// Every process in the node's mount namespace but the holder: the
    /// kubelet, containerd, the shims and the pods' processes.
    fn processes(&self) -> Vec<i32> {
        let ours = fs::read_link(format!("/proc/{}/ns/mnt", self.holder_pid())).ok();
        crate::sh::process_ids()
            .into_iter()
            .filter(|pid| *pid as u32 != self.holder.child.id())
            .filter(|pid| {
                ours.is_some() && fs::read_link(format!("/proc/{pid}/ns/mnt")).ok() == ours
            })
            .collect()
    }
}

/// A container's task: its id and its process on the host.
struct Task {
    id: String,
    pid: i32,
}

impl Task {
    /// Is its process still there (the same one: in its container's
    /// cgroup, named by the task's id)?
    fn still_runs(&self) -> bool {
        fs::read_to_string(format!("/proc/{}/cgroup", self.pid)).is_ok_and(|c| c.contains(&self.id))
    }
}

/// A process in `ns` that holds a new mount namespace (slave) with the
/// node's bpffs and directories mounted; returns once they are.
fn hold_mounts(ns: &str, dir: &Path) -> Result<Proc> {
    let mut script = String::from("set -e\nmount -t bpf bpf /sys/fs/bpf\n");
    for (sub, at) in BOUND {
        script += &format!(
            "mkdir -p {at}\nmount --bind {} {at}\n",
            dir.join(sub).display()
        );
    }
    let ready = dir.join("mounted");
    let _ = fs::remove_file(&ready);
    script += &format!("touch {}\nexec sleep infinity\n", ready.display());
    let log = fs::File::create(dir.join("mounts.log"))?;
    let netns = format!("--net=/run/netns/{ns}");
    let mut holder = Proc::spawn(
        &[
            "nsenter",
            &netns,
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            &script,
        ],
        Stdio::null(),
        Stdio::from(log),
    )?;
    eventually(Duration::from_secs(10), || {
        if !holder.alive() {
            bail!("exited: {}", tail(&dir.join("mounts.log"), 10));
        }
        if ready.exists() {
            Ok(())
        } else {
            bail!("not mounted yet")
        }
    })
    .context("the node's mount namespace")?;
    Ok(holder)
}

impl Drop for KubeletNode {
    fn drop(&mut self) {
        self.stop_kubelet();
        // The containers' own processes, which live in mount namespaces of
        // their own: killed below if the CRI leaves one running.
        let tasks = self.task_pids();
        // The pods stopped and removed through the CRI: runc deletes their
        // cgroups, the CNI plugin their veths and addresses.
        let _ = self.ok(&[&crictl_bin(), "rmp", "--all", "--force"]);
        self.stop_containerd();
        // The shims, the containers' processes: nobody's children here.
        for _ in 0..3 {
            let mut pids = self.processes();
            pids.extend(tasks.iter().filter(|t| t.still_runs()).map(|t| t.pid));
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                // SAFETY: kill(2) of a process of this node's namespace.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.holder.kill(libc::SIGKILL);
        let _ = self.holder.child.wait();
        if std::env::var_os("COZY_PROXY_KEEP_K8S").is_none() {
            // The node's mounts went with its mount namespace.
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
