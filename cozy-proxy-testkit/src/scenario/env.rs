//! One node's scenario environment: a [`Topology`], the controller on
//! it, the manifests or API it reads, and what the node must hold
//! ([`expected_state`], read from the model and the kernel's own routes).
use crate::controller::manifests::ManifestDir;
use crate::controller::{bin, test_bpffs, Backend, Controller, How, SourceKind, StandIn};
use crate::nodes::net::{Fam, Net};
use crate::nodes::topology::{Shape, Topology};
use crate::sh::ok_in;
use anyhow::{bail, Context, Result};
use cozy_proxy::datapath::DatapathState;
use std::{fs, path::PathBuf, time::Duration};

/// What `Env::in_container` asks for.
struct ContainerRequest {
    seccomp: Option<crate::controller::image::SeccompChoice>,
    bpffs: Option<PathBuf>,
}

/// Everything one scenario runs in. Fields drop in order: the controller
/// stops before the namespaces go.
pub struct Env {
    pub ctl: Controller,
    /// The API stand-in, with the kube source.
    pub standin: Option<StandIn>,
    /// The real control plane, with `SourceKind::RealApi` (dropped after
    /// the controller: a stopping controller asks it for its DaemonSet).
    pub api: Option<crate::control_plane::k8s::ControlPlane>,
    pub dir: ManifestDir,
    pub topo: Topology,
    pub net: Net,
    pub backend: Backend,
}

impl Env {
    pub fn new(backend: Backend, fam: Fam) -> Result<Env> {
        Env::with_source(backend, SourceKind::Manifests, fam)
    }

    pub fn with_source(backend: Backend, source: SourceKind, fam: Fam) -> Result<Env> {
        Env::create(backend, source, fam, Shape::Routed, None, None)
    }

    /// On a node of the given shape (manifests source).
    pub fn with_shape(backend: Backend, fam: Fam, shape: Shape) -> Result<Env> {
        Env::create(backend, SourceKind::Manifests, fam, shape, None, None)
    }

    /// With `binary` as the controller (another build: the previous
    /// release) instead of the one under test; manifests source, routed.
    pub fn with_binary(backend: Backend, fam: Fam, binary: String) -> Result<Env> {
        Env::create(
            backend,
            SourceKind::Manifests,
            fam,
            Shape::Routed,
            None,
            Some(binary),
        )
    }

    /// The controller runs from the image as a container under the chart's
    /// security settings (`image`), with `seccomp` (`None`: the chart's
    /// own choice) and the manifests source; `bpffs`: the host directory
    /// mounted where the chart mounts the bpffs (`None`: the tests' bpffs).
    pub fn in_container(
        backend: Backend,
        fam: Fam,
        seccomp: Option<crate::controller::image::SeccompChoice>,
        bpffs: Option<PathBuf>,
    ) -> Result<Env> {
        Env::create(
            backend,
            SourceKind::Manifests,
            fam,
            Shape::Routed,
            Some(ContainerRequest { seccomp, bpffs }),
            None,
        )
    }

    fn create(
        backend: Backend,
        source: SourceKind,
        fam: Fam,
        shape: Shape,
        container: Option<ContainerRequest>,
        binary: Option<String>,
    ) -> Result<Env> {
        check_root()?;
        let topo = Topology::with_shape(shape)?;
        backend.xdp_pods((1..=topo.pods).map(|i| (topo.pod(i), "eth0".to_string())))?;
        let dir = ManifestDir::new(&topo.prefix)?;
        let log = std::env::temp_dir().join(format!("{}-controller.log", topo.prefix));
        let _ = fs::remove_file(&log);
        let bpffs = match container.as_ref().and_then(|c| c.bpffs.clone()) {
            Some(dir) => dir,
            None => test_bpffs()?,
        };
        // On the tests' bpffs whatever the backend: an nft node may be
        // switched to eBPF (a container's is the chart's hostPath,
        // created when missing).
        let pin_dir = bpffs.join(&topo.prefix);
        if container.is_some() {
            fs::create_dir_all(&pin_dir)?;
        }
        let (standin, api, source_args) = match source {
            SourceKind::Manifests => (
                None,
                None,
                vec!["--manifests".to_string(), dir.path.display().to_string()],
            ),
            SourceKind::Kube => {
                let s = StandIn::start(
                    &topo.node(),
                    dir.path.clone(),
                    std::env::temp_dir().join(&topo.prefix),
                )?;
                // The stand-in serves the fixtures' hand-written slices,
                // as a cluster whose operator trusts every namespace's.
                let args = vec![
                    "--kubeconfig".to_string(),
                    s.kubeconfig.display().to_string(),
                    "--trust-unmanaged-slices=*".to_string(),
                ];
                (Some(s), None, args)
            }
            SourceKind::RealApi => {
                let (cp, args) = real_api(&topo, backend, &dir)?;
                (None, Some(cp), args)
            }
        };
        let container = match container {
            None => None,
            Some(request) => Some(crate::controller::image::container(
                backend.arg(),
                &std::env::temp_dir().join(format!("{}-bundle", topo.prefix)),
                &topo.prefix,
                request.seccomp,
                &pin_dir,
                vec![crate::controller::image::Bind {
                    source: dir.path.clone(),
                    destination: dir.path.clone(),
                    read_only: true,
                }],
            )?),
        };
        let ctl = Controller::launch(
            &topo.node(),
            "node1",
            backend,
            source_args,
            pin_dir,
            log,
            How { container, binary },
        )?;
        Ok(Env {
            ctl,
            standin,
            api,
            dir,
            topo,
            net: Net::new(fam),
            backend,
        })
    }

    pub fn fam(&self) -> Fam {
        self.net.fam
    }

    /// The node's pod replaced by one running `backend` under the chart's
    /// settings for it, as helm switches a node's backend: the old pod
    /// stops and leaves its datapath (a rolling update), the new one starts
    /// with the same pin directory mounted.
    pub fn switch_container_to(&mut self, backend: Backend) -> Result<()> {
        let old = (self.ctl.container.clone()).context("the controller is not a container")?;
        self.ctl.stop()?;
        old.discard();
        let bundle = old.bundle.with_file_name(format!(
            "{}-{}",
            old.bundle
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
            backend.arg()
        ));
        let host_pins = old.host_pins.clone().context("no pin directory mounted")?;
        let new = crate::controller::image::container(
            backend.arg(),
            &bundle,
            &format!("{}-{}", old.id, backend.arg()),
            None,
            &host_pins,
            old.binds.clone(),
        )?;
        self.ctl.container = Some(new);
        self.ctl.backend = backend;
        self.backend = backend;
        self.ctl.spawn()
    }

    /// What the XDP program on the node's uplink redirected and dropped
    /// so far (all zero where none runs).
    pub fn xdp_verdicts(&self) -> Result<(u64, u64)> {
        crate::traffic::xdp_verdicts(&self.topo.node(), "uplink")
    }

    /// A scratch file for this scenario.
    pub fn scratch(&self, name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("{}-{name}", self.topo.prefix))
    }

    /// `cozy-proxy dump -o json` of this backend, in the node namespace:
    /// state, counters and details.
    pub fn dump_json(&self) -> Result<serde_json::Value> {
        let out = ok_in(
            &self.topo.node(),
            &[
                &bin(),
                "dump",
                "--backend",
                self.backend.arg(),
                "-o",
                "json",
                "--bpf-pin-dir",
                &self.ctl.pin_dir.display().to_string(),
            ],
        )?;
        serde_json::from_str(&out).context("dump output")
    }

    /// The live datapath state, read from the kernel by `cozy-proxy dump`.
    pub fn dump(&self) -> Result<DatapathState> {
        Ok(serde_json::from_value(self.dump_json()?["state"].clone())?)
    }

    /// What the kernel must hold for the manifests now in the directory,
    /// per the model.
    pub fn expected(&self) -> Result<DatapathState> {
        expected_state(self.dir.path(), &self.topo.node(), Some("node1"), &[])
    }

    /// Waits until the kernel holds what the manifests ask for (or fails
    /// after a bound), and checks the controller is still alive.
    pub fn settle(&mut self) -> Result<DatapathState> {
        let want = self.expected()?;
        let got = crate::traffic::eventually(Duration::from_secs(4), || {
            let got = self.dump()?;
            if got != want {
                bail!("datapath not yet as expected:\n got {got:?}\nwant {want:?}");
            }
            Ok(got)
        });
        if !self.ctl.alive() {
            bail!("controller died:\n{}", self.ctl.log_text());
        }
        got.with_context(|| format!("controller log:\n{}", self.ctl.log_text()))
    }

    /// Removes a Service's manifest and its EndpointSlice's (as written by
    /// the kube source tests: `NAME.yaml` and `NAME-eps.yaml`).
    pub fn delete_service_files(&self, name: &str) -> Result<()> {
        self.dir.remove(name)?;
        self.dir.remove(&format!("{name}-eps"))
    }

    /// Waits for `needle` in the controller's log.
    pub fn wait_log(&self, needle: &str) -> Result<()> {
        self.wait_log_times(needle, 1)
    }

    /// Waits until `needle` is in the controller log `times` times (the
    /// log of every instance of a test's controller, appended).
    pub fn wait_log_times(&self, needle: &str, times: usize) -> Result<()> {
        crate::traffic::eventually(Duration::from_secs(3), || {
            if self.ctl.log_text().matches(needle).count() >= times {
                Ok(())
            } else {
                bail!(
                    "{needle:?} not in the controller log:\n{}",
                    self.ctl.log_text()
                )
            }
        })
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Stop the controller, then remove what it left in the kernel that
        // outlives the namespaces (pinned maps and links live in bpffs).
        let _ = self.ctl.stop();
        let pins = self.ctl.pin_dir.display().to_string();
        let _ = crate::sh::run_in(
            &self.topo.node(),
            &[&bin(), "cleanup", "--bpf-pin-dir", &pins],
        );
        if let Some(c) = &self.ctl.container {
            c.discard();
        }
    }
}

/// A control plane in the node namespace with the chart installed and the
/// test node registered; the controller's arguments for it (the chart's
/// ServiceAccount's token, its DaemonSet).
/// The cluster-wide objects the API server holds from the start (its
/// ServiceCIDR, our Node) are also written to `dir`, for the model.
fn real_api(
    topo: &Topology,
    backend: Backend,
    dir: &ManifestDir,
) -> Result<(crate::control_plane::k8s::ControlPlane, Vec<String>)> {
    let cp = crate::control_plane::k8s::ControlPlane::start(
        &topo.node(),
        std::env::temp_dir().join(format!("{}-k8s", topo.prefix)),
    )?;
    cp.install_chart(backend.arg())?;
    cp.create_node("node1")?;
    dir.put(
        "node1",
        &crate::control_plane::k8s::node_yaml("node1", None),
    )?;
    dir.put(
        "servicecidr",
        &crate::control_plane::k8s::service_cidr_yaml(),
    )?;
    let args = cp.controller_args()?;
    Ok((cp, args))
}

/// What node `node` (network namespace `ns`) must hold for the manifests
/// in `dir`, with `cluster_cidrs` given: the model's plan for that node,
/// with the paths toward the pods as `ip route get fibmatch` shows them in
/// `ns` (an independent reading of the kernel's routes).
pub fn expected_state(
    dir: &std::path::Path,
    ns: &str,
    node: Option<&str>,
    cluster_cidrs: &[cozy_proxy::model::Cidr],
) -> Result<DatapathState> {
    use cozy_proxy::datapath::{shared_pods, NodeView};
    use cozy_proxy::model::cluster::{cluster_ranges, ClusterConfig};
    let files = cozy_proxy::source::manifests::fingerprint(dir)?;
    let s = cozy_proxy::source::manifests::parse(&files).snapshot;
    let outcome = cozy_proxy::model::compute_plan(&s.services, &s.endpoint_slices, &s.nodes);
    let cfg = ClusterConfig {
        configured: cluster_cidrs.to_vec(),
        derive: true,
    };
    let ranges = cluster_ranges(&cfg, &s.nodes, &s.service_cidrs, &s.pools);
    let addresses = cozy_proxy::model::cluster::internal_addresses(&s.nodes);
    let view = |away| NodeView {
        name: node,
        addresses: &addresses,
        away,
    };
    let none = std::collections::BTreeSet::new();
    let first = DatapathState::for_node(&outcome.plan, &ranges.ranges, view(&none));
    let mut paths = paths_in(ns, first.pods())?;
    // A pod two nodes' endpoints name: translated here unless the kernel
    // delivers it at the other.
    let away = match node {
        Some(me) => {
            let shared = shared_pods(&outcome.plan.mappings, me);
            cozy_proxy::datapath::away(&shared, me, &addresses, &paths)
        }
        None => none.clone(),
    };
    let mut state = DatapathState::for_node(&outcome.plan, &ranges.ranges, view(&away));
    let more: Vec<_> = state
        .pods()
        .into_iter()
        .filter(|p| !paths.contains_key(p))
        .collect();
    paths.extend(paths_in(ns, more)?);
    state.resolve(&paths);
    // Planned only: a dump of the kernel has none.
    state.remote_hosts.clear();
    Ok(state)
}

/// The kernel's paths toward `pods` in namespace `ns`, as `ip route get
/// fibmatch` shows them.
fn paths_in(
    ns: &str,
    pods: impl IntoIterator<Item = std::net::IpAddr>,
) -> Result<std::collections::BTreeMap<std::net::IpAddr, cozy_proxy::datapath::Path>> {
    use cozy_proxy::datapath::Path;
    let mut paths = std::collections::BTreeMap::new();
    for pod in pods {
        let out = crate::sh::run_in(
            ns,
            &["ip", "-j", "route", "get", "fibmatch", &pod.to_string()],
        )?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let route = &v[0];
        let (Some(dev), Some(dst)) = (route["dev"].as_str(), route["dst"].as_str()) else {
            continue;
        };
        if dst == "default" {
            continue;
        }
        let oif = ifindex_in(ns, dev)?;
        let onlink = route["flags"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == "onlink"));
        let gateway: Option<std::net::IpAddr> =
            route["gateway"].as_str().and_then(|g| g.parse().ok());
        let entry = bridge_port(ns, dev, &gateway.unwrap_or(pod))?
            .map_or(Ok(oif), |port| ifindex_in(ns, &port))?;
        // Behind a next hop, the source the route picks (a fibmatch shows
        // only a configured one).
        let mut src = None;
        if gateway.is_some() {
            let chosen = crate::sh::run_in(ns, &["ip", "-j", "route", "get", &pod.to_string()])?;
            let chosen: serde_json::Value =
                serde_json::from_slice(&chosen.stdout).unwrap_or_default();
            src = chosen[0]["prefsrc"].as_str().and_then(|a| a.parse().ok());
        }
        paths.insert(
            pod,
            Path {
                oif,
                gateway,
                onlink,
                entry,
                src,
            },
        );
    }
    Ok(paths)
}

/// The index of interface `dev` in namespace `ns`.
fn ifindex_in(ns: &str, dev: &str) -> Result<u32> {
    let link: serde_json::Value = serde_json::from_str(&crate::sh::ok_in(
        ns,
        &["ip", "-j", "link", "show", "dev", dev],
    )?)?;
    Ok(link[0]["ifindex"].as_u64().context("ifindex")? as u32)
}

/// When `dev` is a bridge: the port behind which `hop` lives, as `ip neigh`
/// (its link-layer address) and `bridge fdb` (where that was learned) show
/// it; `None` for another interface, or a hop the kernel has not learned.
fn bridge_port(ns: &str, dev: &str, hop: &std::net::IpAddr) -> Result<Option<String>> {
    let details: serde_json::Value = serde_json::from_str(&crate::sh::ok_in(
        ns,
        &["ip", "-j", "-d", "link", "show", "dev", dev],
    )?)?;
    if details[0]["linkinfo"]["info_kind"] != "bridge" {
        return Ok(None);
    }
    if let Some(port) = owning_port(ns, dev, hop)? {
        return Ok(Some(port));
    }
    let neigh: serde_json::Value = serde_json::from_str(&crate::sh::ok_in(
        ns,
        &[
            "ip",
            "-j",
            "neigh",
            "show",
            "dev",
            dev,
            "to",
            &hop.to_string(),
        ],
    )?)?;
    let Some(mac) = neigh[0]["lladdr"].as_str() else {
        return Ok(None);
    };
    let fdb: serde_json::Value = serde_json::from_str(&crate::sh::ok_in(
        ns,
        &["bridge", "-j", "fdb", "show", "br", dev],
    )?)?;
    Ok(fdb.as_array().and_then(|entries| {
        entries
            .iter()
            .find(|e| {
                e["mac"] == mac
                    && e["master"] == dev
                    && e["state"].as_str().is_none_or(|s| s != "permanent")
            })
            .and_then(|e| e["ifname"].as_str().map(str::to_string))
    }))
}

/// The one port of bridge `dev` whose veth peer holds `hop` as its own
/// address, as `ip link` (the peer's namespace id and index), `ip netns`
/// (that namespace's name) and `ip addr` inside it show it.
fn owning_port(ns: &str, dev: &str, hop: &std::net::IpAddr) -> Result<Option<String>> {
    let json = |args: &[&str]| -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&crate::sh::ok_in(ns, args)?).unwrap_or_default())
    };
    let names: std::collections::BTreeMap<i64, String> = json(&["ip", "-j", "netns", "list"])?
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| Some((n["id"].as_i64()?, n["name"].as_str()?.to_string())))
        .collect();
    let ports = json(&["ip", "-j", "-d", "link", "show", "master", dev])?;
    let mut owners = Vec::new();
    for port in ports.as_array().into_iter().flatten() {
        let (Some(name), Some(id), Some(peer)) = (
            port["ifname"].as_str(),
            port["link_netnsid"].as_i64(),
            port["link_index"].as_u64(),
        ) else {
            continue;
        };
        let Some(peer_ns) = names.get(&id) else {
            continue;
        };
        let addrs: serde_json::Value =
            serde_json::from_str(&crate::sh::ok_in(peer_ns, &["ip", "-j", "addr", "show"])?)?;
        let holds = addrs.as_array().into_iter().flatten().any(|l| {
            l["ifindex"].as_u64() == Some(peer)
                && l["addr_info"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|a| a["local"].as_str().and_then(|x| x.parse().ok()) == Some(*hop))
        });
        if holds {
            owners.push(name.to_string());
        }
    }
    Ok((owners.len() == 1).then(|| owners.remove(0)))
}

fn check_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the datapath scenarios need root (network namespaces, nftables, BPF)");
    }
    Ok(())
}
