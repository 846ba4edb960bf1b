//! Our binary, run as the tests run it: `cozy-proxy run` as the node's
//! controller in the node's namespace (from the manifests' directory, the
//! API stand-in or the real API server), with the eBPF or the nft
//! datapath; the image under runc with the chart's settings (`image`);
//! the previous release (`release`); a kernel that refuses some `bpf(2)`
//! calls (`refuse`); the manifests an operator writes (`manifests`).
//! It does not model a kubelet: nothing here schedules, probes or
//! restarts the controller as a DaemonSet's pod.
pub mod binary;
pub mod image;
pub mod manifests;
pub mod refuse;
pub mod release;

use crate::sh::Proc;
use anyhow::{bail, Result};
pub use binary::{bin, built_beside, workspace};
use std::{fs, path::PathBuf, process::Stdio, time::Duration};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Ebpf,
    /// The eBPF backend with its fast path on (`--fast-path=true`).
    EbpfFast,
    /// The XDP path: the fast path with the XDP program on the uplinks
    /// (`--xdp=auto`), the pods' ends of their veths with GRO on, so that
    /// their interfaces take XDP frames ([`Backend::xdp_pods`]).
    EbpfXdp,
}

impl Backend {
    /// The `--backend` argument.
    pub fn arg(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Ebpf | Backend::EbpfFast | Backend::EbpfXdp => "ebpf",
        }
    }

    /// `cozy-proxy run` arguments beyond `--backend`.
    pub fn run_args(self) -> &'static [&'static str] {
        match self {
            Backend::Nft => &[],
            Backend::Ebpf => &["--fast-path=false"],
            Backend::EbpfFast => &["--fast-path=true"],
            Backend::EbpfXdp => &["--fast-path=true", "--xdp=auto"],
        }
    }

    /// Does the fast path run (TC's or XDP's)?
    pub fn fast(self) -> bool {
        matches!(self, Backend::EbpfFast | Backend::EbpfXdp)
    }

    /// For the XDP path: GRO on at the pod's end of each `(namespace,
    /// interface)`, as some CNIs set it (a veth whose peer has GRO on takes
    /// frames an XDP program redirects to it). Nothing for the others.
    pub fn xdp_pods(self, pods: impl IntoIterator<Item = (String, String)>) -> Result<()> {
        if self != Backend::EbpfXdp {
            return Ok(());
        }
        for (ns, dev) in pods {
            crate::sh::ok_in(&ns, &["ethtool", "-K", &dev, "gro", "on"])?;
        }
        Ok(())
    }

    pub fn is_ebpf(self) -> bool {
        self != Backend::Nft
    }
}

/// A bpffs the tests pin under. `ip netns exec` mounts a fresh /sys, which
/// hides /sys/fs/bpf; a bpffs mounted elsewhere stays visible.
const TEST_BPFFS: &str = "/run/cozy-proxy-tests/bpf";

pub fn test_bpffs() -> Result<PathBuf> {
    let path = PathBuf::from(TEST_BPFFS);
    fs::create_dir_all(&path)?;
    let mounts = fs::read_to_string("/proc/mounts")?;
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(TEST_BPFFS))
    {
        // Another test may mount it at the same moment: check again after.
        let _ = crate::sh::ok(&["mount", "-t", "bpf", "bpf", TEST_BPFFS]);
        let mounts = fs::read_to_string("/proc/mounts")?;
        if !mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(TEST_BPFFS))
        {
            bail!("could not mount a bpffs at {TEST_BPFFS}");
        }
    }
    Ok(path)
}

/// Where the controller gets Services and EndpointSlices from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// `--manifests DIR`: the standalone source.
    Manifests,
    /// `--kubeconfig`: the real kube-rs client against the API stand-in
    /// (`standin`), which serves the same directory.
    Kube,
    /// `--kubeconfig`: the real kube-rs client against a real control plane
    /// (`k8s`: etcd, kube-apiserver, kube-controller-manager) with the
    /// chart's RBAC; Services and Pods go through the API (the directory
    /// still holds the manifests the model's expectation is read from).
    RealApi,
}

/// The Kubernetes API stand-in, serving the manifest directory in the node
/// namespace on 127.0.0.1:6443 (in this process, on a thread of its own).
pub struct StandIn {
    server: Option<crate::standin::Running>,
    ns: String,
    dir: PathBuf,
    pub kubeconfig: PathBuf,
}

pub const STANDIN_URL: &str = "http://127.0.0.1:6443";

impl StandIn {
    pub(crate) fn start(ns: &str, dir: PathBuf, scratch: PathBuf) -> Result<StandIn> {
        let kubeconfig = scratch.with_extension("kubeconfig");
        fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster: {{server: \"{STANDIN_URL}\"}}\n\
                 users:\n- name: test\n  user: {{token: test}}\ncontexts:\n- name: standin\n  context: {{cluster: standin, user: test}}\n\
                 current-context: standin\n"
            ),
        )?;
        let mut s = StandIn {
            server: None,
            ns: ns.into(),
            dir,
            kubeconfig,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<()> {
        self.server = Some(crate::standin::Running::start(
            &self.ns,
            self.dir.clone(),
            "127.0.0.1:6443",
        )?);
        crate::traffic::eventually(Duration::from_secs(3), || self.get("/version").map(|_| ()))
    }

    /// Stops the stand-in: every connection closes (an API server outage).
    pub fn stop(&mut self) {
        self.server = None;
    }

    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()
    }

    fn call(&self, method: &str, path: &str) -> Result<String> {
        let url = format!("{STANDIN_URL}{path}");
        let out = crate::sh::ok_in(
            &self.ns,
            &["curl", "-sS", "-f", "-X", method, "--max-time", "2", &url],
        )?;
        Ok(out)
    }

    pub fn get(&self, path: &str) -> Result<String> {
        self.call("GET", path)
    }

    pub fn post(&self, path: &str) -> Result<String> {
        self.call("POST", path)
    }
}

/// How a controller runs: from the image (`container`), and which
/// binary (`None`: the one under test).
#[derive(Default)]
pub(crate) struct How {
    pub(crate) container: Option<image::Container>,
    pub(crate) binary: Option<String>,
}

/// The controller process (`cozy-proxy run`) in the node namespace.
pub struct Controller {
    proc: Option<Proc>,
    ns: String,
    /// `--node-name`.
    pub node: String,
    pub(crate) backend: Backend,
    /// `--manifests DIR` or `--kubeconfig FILE`.
    source_args: Vec<String>,
    /// More arguments for `run`, taken at the next (re)start.
    pub extra_args: Vec<String>,
    /// The eBPF backend's pin directory (unique per test).
    pub pin_dir: PathBuf,
    pub log: PathBuf,
    /// Run from the image, as a container (`None`: the binary directly).
    pub container: Option<image::Container>,
    /// The binary run (`None`: [`bin`], the one under test).
    pub binary: Option<String>,
    /// `bpf(2)` commands the kernel refuses the binary at the next (re)start
    /// ([`refuse`]; not for a container).
    pub refused_bpf: Vec<u32>,
    /// A command the binary runs under from the next (re)start (`strace
    /// ... --`; not for a container).
    pub wrapper: Vec<String>,
}

impl Controller {
    /// HTTP GET on its metrics port (/metrics, /readyz, /healthz), in its
    /// node's namespace: status code and body.
    pub fn http(&self, path: &str) -> Result<(u16, String)> {
        let url = format!("http://127.0.0.1:9402{path}");
        let out = crate::sh::run_in(
            &self.ns,
            &[
                "curl",
                "-sS",
                "--max-time",
                "2",
                "-w",
                "\n%{http_code}",
                &url,
            ],
        )?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text
            .rsplit_once('\n')
            .ok_or_else(|| anyhow::anyhow!("curl output: {text}"))?;
        Ok((code.trim().parse()?, body.to_string()))
    }

    pub fn start(
        ns: &str,
        node: &str,
        backend: Backend,
        source_args: Vec<String>,
        pin_dir: PathBuf,
        log: PathBuf,
    ) -> Result<Controller> {
        Controller::launch(ns, node, backend, source_args, pin_dir, log, How::default())
    }

    pub(crate) fn launch(
        ns: &str,
        node: &str,
        backend: Backend,
        source_args: Vec<String>,
        pin_dir: PathBuf,
        log: PathBuf,
        how: How,
    ) -> Result<Controller> {
        let How { container, binary } = how;
        let mut c = Controller {
            proc: None,
            ns: ns.into(),
            node: node.into(),
            backend,
            source_args,
            extra_args: Vec::new(),
            pin_dir,
            log,
            container,
            binary,
            refused_bpf: Vec::new(),
            wrapper: Vec::new(),
        };
        c.spawn()?;
        Ok(c)
    }

    pub(crate) fn spawn(&mut self) -> Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let pins = self.pin_dir.display().to_string();
        let node = self.node.clone();
        let bin = self.binary.clone().unwrap_or_else(bin);
        let mut args: Vec<&str> = self.wrapper.iter().map(String::as_str).collect();
        args.extend([bin.as_str(), "--log", "info", "run"]);
        // A test may ask for another backend choice (`auto`) itself.
        if !self.extra_args.iter().any(|a| a == "--backend") {
            args.extend(["--backend", self.backend.arg()]);
        }
        args.extend([
            "--poll-interval",
            "100ms",
            "--counters-interval",
            "1s",
            "--bpf-pin-dir",
            &pins,
            "--node-name",
            &node,
        ]);
        // A short resync (the tests' default) unless the test sets its own.
        if !self.extra_args.iter().any(|a| a == "--resync") {
            args.extend(["--resync", "2s"]);
        }
        args.extend(self.backend.run_args());
        args.extend(self.source_args.iter().map(String::as_str));
        args.extend(self.extra_args.iter().map(String::as_str));
        const STARTED: &str = "waiting for the initial lists";
        let before = self.log_text().matches(STARTED).count();
        self.proc = Some(match &self.container {
            Some(c) => {
                let command = c.command(Some(&self.ns), &args)?;
                let command: Vec<&str> = command.iter().map(String::as_str).collect();
                Proc::spawn(&command, Stdio::null(), Stdio::from(log))?
            }
            None => Proc::spawn_refused_in(
                &self.ns,
                &args,
                (Stdio::null(), Stdio::from(log)),
                !self.wrapper.is_empty(),
                &self.refused_bpf,
            )?,
        });
        // Up and handling signals (so a quick stop is a clean one), or
        // exited with an error the log explains. (Reading the node's label
        // takes up to 7 s of retries when the API does not answer.)
        crate::traffic::eventually(Duration::from_secs(15), || {
            if self.log_text().matches(STARTED).count() > before || !self.alive() {
                Ok(())
            } else {
                bail!("controller not started:\n{}", self.log_text())
            }
        })
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.kill(libc::SIGTERM);
            let status = p.child.wait()?;
            if let Some(c) = &self.container {
                c.remove();
            }
            if !status.success() {
                bail!("controller exited with {status} on SIGTERM");
            }
        }
        Ok(())
    }

    /// Stop, then start again.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.spawn()
    }

    /// Stop, then start again with `--backend` `backend` (a switch: the
    /// old process leaves its datapath in place, as a rolling update).
    pub fn restart_as(&mut self, backend: Backend) -> Result<()> {
        self.stop()?;
        self.backend = backend;
        self.spawn()
    }

    /// Stop, wait `gap` without a controller, then start `binary` (`None`:
    /// the one under test) in its place, as a DaemonSet's rolling update
    /// replaces the node's pod.
    pub fn replace_with(&mut self, binary: Option<String>, gap: Duration) -> Result<()> {
        self.stop()?;
        std::thread::sleep(gap);
        self.binary = binary;
        self.spawn()
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        self.proc
            .as_mut()
            .is_some_and(|p| matches!(p.child.try_wait(), Ok(None)))
    }
}
