//! A real MetalLB in layer 2 mode for the tests: its controller (allocates
//! LoadBalancer IPs from an `IPAddressPool`) beside the control plane, and
//! one speaker per node, in the node's namespace (answers ARP and NDP for
//! the LB IPs it announces, writes `ServiceL2Status`), as the DaemonSet
//! runs them: memberlist off (every node with a speaker is eligible), no
//! webhook. Built from `go.universe.tf/metallb` by `cargo xtask setup`
//! (xtask/src/metallb.rs), with its CRDs.
use crate::control_plane::k8s::ControlPlane;
use crate::sh::Proc;
use anyhow::{bail, Context, Result};
use std::{fs, net::IpAddr, path::PathBuf, process::Stdio};

/// The release `cargo xtask setup` builds.
pub const METALLB: &str = "v0.16.1";
/// MetalLB's own namespace (its configuration and statuses live there).
pub const NAMESPACE: &str = "metallb-system";

/// Setup's cache: `bin/` and `crds/`.
pub fn cache_dir() -> PathBuf {
    crate::sh::setup_cache("COZY_PROXY_METALLB_CACHE", &format!("metallb-{METALLB}"))
}

pub fn available() -> bool {
    let c = cache_dir();
    c.join("bin/controller").is_file() && c.join("bin/speaker").is_file() && c.join("crds").is_dir()
}

/// A node a speaker runs on: its namespace and its Node's name.
pub struct SpeakerNode<'a> {
    pub ns: &'a str,
    pub name: &'a str,
}

pub struct MetalLb {
    procs: Vec<Proc>,
    /// The components' logs (`controller.log`, `speaker-<node>.log`).
    pub logs: PathBuf,
}

/// The objects MetalLB's configuration is: one pool of `addresses`, and
/// its announcement in layer 2 from every node.
fn configuration(addresses: &[IpAddr]) -> String {
    let list: Vec<String> = addresses
        .iter()
        .map(|a| match a {
            IpAddr::V4(_) => format!("\"{a}/32\""),
            IpAddr::V6(_) => format!("\"{a}/128\""),
        })
        .collect();
    format!(
        "apiVersion: metallb.io/v1beta1\nkind: IPAddressPool\nmetadata:\n  name: public\n  namespace: {NAMESPACE}\n\
         spec:\n  addresses: [{}]\n---\n\
         apiVersion: metallb.io/v1beta1\nkind: L2Advertisement\nmetadata:\n  name: public\n  namespace: {NAMESPACE}\n\
         spec:\n  ipAddressPools: [public]\n",
        list.join(", ")
    )
}

/// MetalLB's two programs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Controller,
    Speaker,
}

impl Kind {
    fn binary(self) -> &'static str {
        match self {
            Kind::Controller => "controller",
            Kind::Speaker => "speaker",
        }
    }
}

/// The Pod object of a MetalLB component (each one reads its own, to own
/// the objects it writes). Without kubelets no one runs it; with real
/// kubelets it runs `placeholder` (an image of the nodes' own, sleeping,
/// on the host's network) while the component runs beside it.
fn component_pod(kind: Kind, name: &str, node: Option<&str>, placeholder: Option<&str>) -> String {
    let node = node.map_or(String::new(), |n| format!("  nodeName: {n}\n"));
    let binary = kind.binary();
    let container = match placeholder {
        None => format!("{{name: {binary}, image: quay.io/metallb/{binary}:{METALLB}}}"),
        Some(image) => format!(
            "{{name: {binary}, image: {image}, imagePullPolicy: Never, args: [sleep, \"2147483647\"]}}"
        ),
    };
    let host = if placeholder.is_some() {
        // `sleep` ignores SIGTERM: gone at once when deleted (a drain).
        "  hostNetwork: true\n  tolerations: [{operator: Exists}]\n  terminationGracePeriodSeconds: 1\n"
    } else {
        ""
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {NAMESPACE}\n\
         spec:\n{node}{host}  containers:\n  - {container}\n"
    )
}

impl MetalLb {
    /// Installs the CRDs and the configuration through `cp`, starts the
    /// controller in `cp`'s namespace and a speaker on each node.
    pub fn start(cp: &ControlPlane, pool: &[IpAddr], nodes: &[SpeakerNode]) -> Result<MetalLb> {
        MetalLb::start_placed(cp, pool, nodes, None)
    }

    /// The same where kubelets run the components' Pod objects: they run
    /// image `placeholder` (see `component_pod`).
    pub fn start_placed(
        cp: &ControlPlane,
        pool: &[IpAddr],
        nodes: &[SpeakerNode],
        placeholder: Option<&str>,
    ) -> Result<MetalLb> {
        if !available() {
            bail!(
                "MetalLB is not in {} (cargo xtask setup builds it)",
                cache_dir().display()
            );
        }
        let crds = cache_dir().join("crds").display().to_string();
        cp.kubectl(&["apply", "--server-side", "-f", &crds])?;
        for crd in ["ipaddresspools", "l2advertisements", "servicel2statuses"] {
            cp.kubectl(&[
                "wait",
                "--for=condition=Established",
                &format!("crd/{crd}.metallb.io"),
            ])?;
        }
        cp.apply(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NAMESPACE}\n"
        ))?;
        cp.apply(&configuration(pool))?;
        let logs = cp.dir.join("metallb");
        fs::create_dir_all(&logs)?;
        let mut m = MetalLb {
            procs: Vec::new(),
            logs,
        };
        m.spawn(
            cp,
            &cp.ns,
            (Kind::Controller, "controller", None),
            placeholder,
        )?;
        for n in nodes {
            let pod = format!("speaker-{}", n.name);
            m.spawn(cp, n.ns, (Kind::Speaker, &pod, Some(n.name)), placeholder)?;
        }
        Ok(m)
    }

    /// Component `name` (its Pod object too) in `ns`, as the admin, its
    /// metrics off; a speaker runs for `node`.
    fn spawn(
        &mut self,
        cp: &ControlPlane,
        ns: &str,
        (kind, name, node): (Kind, &str, Option<&str>),
        placeholder: Option<&str>,
    ) -> Result<()> {
        cp.apply(&component_pod(kind, name, node, placeholder))?;
        let bin = (cache_dir().join("bin").join(kind.binary()))
            .display()
            .to_string();
        let kubeconfig = format!("KUBECONFIG={}", cp.admin.display());
        let mut args = vec![
            "env",
            &kubeconfig,
            &bin,
            "--namespace",
            NAMESPACE,
            "--port",
            "0",
            "--log-level",
            "debug",
        ];
        args.extend(["--pod-name", name]);
        if let Some(node) = node {
            args.extend(["--node-name", node]);
        }
        if kind == Kind::Controller {
            args.extend(["--webhook-mode=disabled", "--disable-cert-rotation"]);
        }
        let log = fs::File::create(self.logs.join(format!("{name}.log")))?;
        self.procs
            .push(Proc::spawn_in(ns, &args, Stdio::null(), Stdio::from(log))?);
        Ok(())
    }

    /// The nodes MetalLB's speakers say announce Service `default/name`
    /// now (their `ServiceL2Status` objects, label `metallb.io/node`).
    pub fn announcers(cp: &ControlPlane, service: &str) -> Result<Vec<String>> {
        let out = cp.kubectl(&[
            "get",
            "servicel2statuses",
            "-n",
            NAMESPACE,
            "-l",
            &format!("metallb.io/service-name={service},metallb.io/service-namespace=default"),
            "-o",
            "jsonpath={range .items[*]}{.metadata.labels.metallb\\.io/node}{\"\\n\"}{end}",
        ])?;
        let mut nodes: Vec<String> = out.lines().map(str::to_string).collect();
        nodes.sort();
        Ok(nodes)
    }

    /// The last lines of every component's log, for a failure report.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for entry in fs::read_dir(&self.logs).into_iter().flatten().flatten() {
            out += &format!(
                "--- {} ---\n{}\n",
                entry.file_name().to_string_lossy(),
                crate::sh::tail(&entry.path(), 15)
            );
        }
        out
    }

    /// The LB IP MetalLB gave Service `default/name`.
    pub fn allocated(cp: &ControlPlane, service: &str) -> Result<IpAddr> {
        let out = cp.kubectl(&[
            "get",
            "service",
            service,
            "-n",
            "default",
            "-o",
            "jsonpath={.status.loadBalancer.ingress[0].ip}",
        ])?;
        out.trim()
            .parse()
            .with_context(|| format!("no LB IP allocated to {service} yet: {out:?}"))
    }
}

impl Drop for MetalLb {
    fn drop(&mut self) {
        for p in &mut self.procs {
            p.kill(libc::SIGKILL);
            let _ = p.child.wait();
        }
    }
}
