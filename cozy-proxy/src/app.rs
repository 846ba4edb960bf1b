//! `cozy-proxy run`, wired together: the metrics server, the source
//! (manifests or the Kubernetes API), the node's datapath on its own thread,
//! the controller loop, and what happens at shutdown.
use crate::backend::{self, BackendConfig, Choice, NodeDatapath};
use crate::controller::{self, LoopSettings, RunContext, WarningSink};
use crate::datapath::{worker::Worker, BackendKind, Datapath};
use crate::ebpf::{EbpfConfig, Interfaces};
use crate::events::EventPublisher;
use crate::model::{cluster::ClusterConfig, Cidr, SliceTrust};
use crate::node;
use crate::reconcile::{NodeConfig, Reconciler};
use crate::source::{kube::KubeSource, ManifestSource, Source};
use crate::telemetry::{self, Telemetry};
use anyhow::{Context, Result};
use std::{future::Future, path::PathBuf, time::Duration};
use tokio::signal::unix::{signal, SignalKind};
use tracing::info;

/// Where the eBPF backend keeps its state, and where it attaches.
#[derive(clap::Args, Clone, Debug)]
pub struct EbpfArgs {
    /// bpffs directory of the pinned maps and links.
    #[arg(long, env = "COZY_PROXY_BPF_PIN_DIR", default_value = crate::ebpf::PIN_DIR)]
    pub bpf_pin_dir: PathBuf,
    /// "auto" (every Ethernet interface, following new ones) or a
    /// comma-separated list.
    #[arg(long, env = "COZY_PROXY_INTERFACES", default_value = "auto")]
    pub interfaces: Interfaces,
    /// Traffic between the outside and a local LB IP skips the host's
    /// stack: rewritten and handed to the pod (or to the uplink) by the
    /// programs where the route and the neighbour are known; the node's
    /// netfilter rules and conntrack do not see it (docs/ebpf-datapath.md).
    #[arg(long, env = "COZY_PROXY_FAST_PATH", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub fast_path: bool,
    /// How the programs are attached: "auto" (tcx links where the kernel
    /// has them, 6.6 and later; tc filters over netlink before) or
    /// "netlink" (tc filters always: the path of older kernels).
    #[arg(long, env = "COZY_PROXY_TC_ATTACH", value_enum, default_value_t = crate::ebpf::TcAttach::Auto)]
    pub tc_attach: crate::ebpf::TcAttach,
    /// The XDP program on the uplinks (the default routes' interfaces),
    /// ahead of the skb: it drops what the port filter, the source ranges
    /// and unmapped LB IPs refuse, and with the fast path hands packets to
    /// pods whose interface takes XDP frames. "auto": natively, on drivers
    /// the tests run it on (veth); "on": every uplink, generic where the
    /// driver has no native XDP; "off", the default (docs/ebpf-datapath.md).
    #[arg(long, env = "COZY_PROXY_XDP", value_enum, default_value_t = crate::ebpf::XdpChoice::Off)]
    pub xdp: crate::ebpf::XdpChoice,
}

impl EbpfArgs {
    pub fn config(&self) -> BackendConfig {
        BackendConfig {
            ebpf: EbpfConfig {
                pin_dir: self.bpf_pin_dir.clone(),
                interfaces: self.interfaces.clone(),
                fast_path: self.fast_path,
                tc_attach: self.tc_attach,
                xdp: self.xdp,
            },
            install_part_lbs: crate::datapath::PART_LBS,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The node's datapath: "auto" takes eBPF where the programs can serve
    /// the node and nftables otherwise, saying why; the node's label
    /// networking.cozystack.io/cozy-proxy-backend overrides it.
    #[arg(long, env = "COZY_PROXY_BACKEND", value_enum, default_value_t = Choice::Auto)]
    pub backend: Choice,
    #[command(flatten)]
    pub ebpf: EbpfArgs,
    /// Standalone: read Services and EndpointSlices from YAML/JSON manifests
    /// in DIR (re-applied within a second of any change) instead of the
    /// Kubernetes API.
    #[arg(long, value_name = "DIR")]
    pub manifests: Option<PathBuf>,
    /// Kubernetes API access from this kubeconfig (default: in-cluster
    /// service account, else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (the DaemonSet sets it from the downward API): only
    /// mappings whose endpoint is on this node are translated here; the
    /// others are steered toward their node.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// In-cluster ranges (pod and service networks, comma-separated): a
    /// mapped pod keeps its own IP toward them, and clients in them reach
    /// LB IPs through client-side translation. Added to what is derived.
    #[arg(long, env = "COZY_PROXY_CLUSTER_CIDRS", value_delimiter = ',')]
    pub cluster_cidrs: Vec<Cidr>,
    /// Also take the in-cluster ranges the cluster publishes (Nodes'
    /// podCIDRs and addresses, ServiceCIDR objects).
    #[arg(long, env = "COZY_PROXY_DERIVE_CLUSTER_CIDRS", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub derive_cluster_cidrs: bool,
    /// Addresses no Service may take (comma-separated CIDRs): node VIPs
    /// (kube-vip, keepalived, an API server's VIP), which no Node object
    /// names. A Service on one is refused with a ForbiddenAddress warning;
    /// otherwise the nodes' own traffic to that address would reach its pod.
    #[arg(long, env = "COZY_PROXY_RESERVED_CIDRS", value_delimiter = ',')]
    pub reserved_cidrs: Vec<Cidr>,
    /// Namespaces (comma-separated; `*`: every one) whose EndpointSlices
    /// count whoever wrote them. Elsewhere a Service's pod is read only
    /// from the EndpointSlice controller's own slices of a Service with a
    /// selector, so that a slice someone writes by hand cannot map an LB
    /// IP to another tenant's pod. For selector-less Services whose slices
    /// an administrator writes (or mirrors from Endpoints). Manifests
    /// (`--manifests`) are trusted whole.
    #[arg(
        long,
        env = "COZY_PROXY_TRUST_UNMANAGED_SLICES",
        value_delimiter = ',',
        value_name = "NAMESPACES"
    )]
    pub trust_unmanaged_slices: Vec<String>,
    /// The percentage of each datapath table of a node one namespace's
    /// Services may take (1-100): beyond it a namespace's newer Services
    /// are not translated on that node (a NamespaceShare warning), so one
    /// tenant cannot take the room the others' Services need.
    #[arg(long, env = "COZY_PROXY_NAMESPACE_SHARE", default_value_t = 50, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub namespace_share: u8,
    /// Our DaemonSet, as NAMESPACE/NAME: at shutdown, if it is gone or being
    /// deleted (an uninstall), the datapath is removed; otherwise (a restart,
    /// a rolling update) it stays.
    #[arg(long, env = "COZY_PROXY_DAEMONSET")]
    pub daemonset: Option<String>,
    /// Address of /metrics, /healthz and /readyz ("" to disable).
    #[arg(long, env = "COZY_PROXY_METRICS_ADDR", default_value = "0.0.0.0:9402")]
    pub metrics_addr: String,
    /// Address of a second server of /healthz and /readyz, for the
    /// kubelet's probes ("" to disable): on the loopback, the network's
    /// clients cannot take its connections.
    #[arg(long, env = "COZY_PROXY_HEALTH_ADDR", default_value = "127.0.0.1:9403")]
    pub health_addr: String,
    /// Binds the metrics server to this address instead of the host part
    /// of --metrics-addr (the chart passes the node's IP from the downward
    /// API: the server is not exposed on every address of the node).
    #[arg(long, env = "COZY_PROXY_METRICS_HOST")]
    pub metrics_host: Option<std::net::IpAddr>,
    /// LB IPs per step when installing onto a node that holds none of
    /// ours (tests take small steps to see them).
    #[arg(long, hide = true, default_value_t = crate::datapath::PART_LBS)]
    pub install_part_lbs: usize,
    /// How often the manifest directory is checked for changes.
    #[arg(long, default_value = "250ms", value_parser = parse_period)]
    pub poll_interval: Duration,
    /// How long to coalesce a burst of API events before reconciling.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub debounce: Duration,
    /// How often the kernel state is read again and drift repaired.
    #[arg(long, default_value = "60s", value_parser = parse_period)]
    pub resync: Duration,
    /// How long a ready endpoint that turns not ready without terminating
    /// keeps backing its LB IP while no other can (a kubelet restart
    /// resets every readiness probe until it runs again; 0: not at all).
    #[arg(long, env = "COZY_PROXY_NOT_READY_HOLD", default_value = "15s", value_parser = parse_duration)]
    pub not_ready_hold: Duration,
    /// How often the datapath's traffic counters are copied into /metrics.
    #[arg(long, default_value = "10s", value_parser = parse_period)]
    pub counters_interval: Duration,
}

/// Where the metrics server listens: `--metrics-addr`, its host replaced
/// by `--metrics-host` when given (IPv6 bracketed).
fn metrics_bind_address(addr: &str, host: Option<std::net::IpAddr>) -> Result<String> {
    let Some(host) = host else {
        return Ok(addr.to_string());
    };
    let port = addr
        .rsplit_once(':')
        .map(|(_, p)| p)
        .context("--metrics-addr needs a port")?;
    Ok(std::net::SocketAddr::new(host, port.parse().context("--metrics-addr port")?).to_string())
}

/// The longest duration a setting takes: a day (longer ones are typos,
/// and would overflow the timers' arithmetic).
const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// A duration such as `50ms`, `60s`, `5m` (a bare number is seconds),
/// zero allowed, at most a day.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: u64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => n
            .checked_mul(60)
            .map(Duration::from_secs)
            .ok_or_else(|| format!("duration {s:?} is too long (at most 24h)"))?,
        _ => return Err(format!("invalid duration unit in {s:?} (use ms, s or m)")),
    };
    if d > MAX_DURATION {
        return Err(format!("duration {s:?} is too long (at most 24h)"));
    }
    Ok(d)
}

/// The period of something repeated (resync, polling, counters): a
/// duration of at least 10 ms (a timer of zero period cannot run, and a
/// shorter one only burns the CPU).
pub fn parse_period(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err(format!(
            "period {s:?} is too short: at least 10ms (it sets how often something repeats)"
        ));
    }
    Ok(d)
}

/// Resolves at SIGTERM or SIGINT. The handlers are registered when this is
/// called (not when first polled), so a signal that comes early is not lost
/// to the default action.
fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

async fn kube_client(kubeconfig: Option<&PathBuf>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no in-cluster config or kubeconfig")?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// The node's datapath, started on its own thread.
/// `retire_other`: remove the other backend's state after the first sync
/// (not when the node's label, which may name it, could not be read).
fn start_datapath(
    choice: Choice,
    retire_other: bool,
    cfg: BackendConfig,
    node: NodeConfig,
) -> Result<Worker<Reconciler<NodeDatapath>>> {
    Worker::spawn("datapath", move || {
        NodeDatapath::start(choice, cfg).map(|mut d| {
            if !retire_other {
                d.keep_other();
            }
            Reconciler::new(d, node)
        })
    })
    .context("starting the datapath")
}

pub async fn run(args: RunArgs) -> Result<()> {
    // A mistyped directory is a start-up error, not a warning repeated
    // for ever while nothing is served.
    if let Some(dir) = &args.manifests {
        if !dir.is_dir() {
            anyhow::bail!("--manifests {}: no such directory", dir.display());
        }
    }
    let shutdown = shutdown_signal()?;
    let telemetry = Telemetry::new();
    if !args.metrics_addr.is_empty() {
        let addr = metrics_bind_address(&args.metrics_addr, args.metrics_host)?;
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        tokio::spawn(telemetry::serve(listener, telemetry.clone()));
    }
    if !args.health_addr.is_empty() {
        let listener = tokio::net::TcpListener::bind(&args.health_addr)
            .await
            .with_context(|| format!("listening on {}", args.health_addr))?;
        tokio::spawn(telemetry::serve(listener, telemetry.clone()));
    }
    let settings = LoopSettings {
        debounce: args.debounce,
        resync: args.resync,
        upkeep: Duration::from_secs(1),
        counters: args.counters_interval,
    };
    let mut cfg = args.ebpf.config();
    cfg.install_part_lbs = args.install_part_lbs;
    let node = NodeConfig {
        name: args.node_name.clone(),
        cluster: ClusterConfig {
            configured: args.cluster_cidrs.clone(),
            derive: args.derive_cluster_cidrs,
        },
        reserved: args.reserved_cidrs.clone(),
        namespace_share: Some(args.namespace_share),
        slices: SliceTrust::with_unmanaged_in(&args.trust_unmanaged_slices),
    };
    if let Some(dir) = &args.manifests {
        let source = ManifestSource::new(dir.clone(), args.poll_interval);
        let node = NodeConfig {
            slices: SliceTrust::Any,
            ..node
        };
        let datapath = start_datapath(args.backend, true, cfg, node)?;
        run_loop(
            datapath,
            source,
            telemetry,
            settings,
            Box::new(|_| {}),
            shutdown,
        )
        .await;
        return Ok(());
    }
    let client = kube_client(args.kubeconfig.as_ref()).await?;
    let mut choice = args.backend;
    let mut retire_other = true;
    if let Some(name) = &args.node_name {
        match node::backend_label(&client, name).await {
            node::LabelChoice::Named(b) => choice = b,
            node::LabelChoice::Absent => {}
            node::LabelChoice::Unknown => {
                // Whatever the label said last time is what is installed:
                // keep running that one rather than --backend beside it.
                retire_other = false;
                if let [kind] = backend::installed_kinds(&cfg).as_slice() {
                    info!(backend = %kind, "the node's label could not be read; keeping the backend installed on this node");
                    choice = match kind {
                        BackendKind::Nft => Choice::Nft,
                        BackendKind::Ebpf => Choice::Ebpf,
                    };
                }
            }
        }
    }
    let ds_watch = args
        .daemonset
        .as_deref()
        .map(|ds| node::DaemonSetWatch::start(&client, ds));
    let source = KubeSource::start(client.clone(), args.not_ready_hold).await;
    let events = EventPublisher::new(client.clone(), args.node_name.clone());
    let view = source.cluster_view();
    let sink: WarningSink = Box::new(move |w| events.publish(w, &view));
    let datapath = start_datapath(choice, retire_other, cfg.clone(), node)?;
    run_loop(datapath, source, telemetry, settings, sink, shutdown).await;
    if let Some(ds) = &args.daemonset {
        let deleted = ds_watch
            .as_ref()
            .is_some_and(node::DaemonSetWatch::saw_deletion);
        if deleted || node::uninstalling(&client, ds).await {
            info!(daemonset = %ds, "our DaemonSet is gone: uninstall; removing the datapath");
            tokio::task::spawn_blocking(move || backend::remove(&BackendKind::ALL, &cfg)).await??;
        } else {
            info!(daemonset = %ds, "our DaemonSet remains: the datapath stays for the next pod");
        }
    }
    Ok(())
}

async fn run_loop<D: Datapath + 'static, S: Source>(
    datapath: Worker<Reconciler<D>>,
    source: S,
    telemetry: Telemetry,
    settings: LoopSettings,
    on_warnings: WarningSink,
    shutdown: impl Future<Output = ()>,
) {
    let path_news = std::sync::Arc::new(tokio::sync::Notify::new());
    let wake = path_news.clone();
    if let Err(e) = crate::steer::watch_paths(move || wake.notify_one()) {
        tracing::warn!(error = %e, "cannot watch the kernel's paths; following them at each upkeep");
    }
    let ctx = RunContext {
        datapath,
        source,
        telemetry,
        settings,
        on_warnings,
        path_news,
    };
    controller::run(ctx, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, parse_period};
    use std::time::Duration;

    #[test]
    fn durations_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_duration("50ms"), Ok(Duration::from_millis(50)));
        assert_eq!(parse_duration("0ms"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        for bad in [
            "",
            "5h",
            "-1s",
            "1.5s",
            "99999999999999999999m",
            "307445734561825861m",
            "25h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_duration("1441m").unwrap_err().contains("at most 24h"));
    }

    #[test]
    fn the_metrics_host_replaces_the_address_host() {
        use super::metrics_bind_address as bind;
        assert_eq!(bind("0.0.0.0:9402", None).unwrap(), "0.0.0.0:9402");
        let v4 = "198.51.100.2".parse().ok();
        assert_eq!(bind("0.0.0.0:9402", v4).unwrap(), "198.51.100.2:9402");
        let v6 = "2001:db8::2".parse().ok();
        assert_eq!(bind("[::]:9402", v6).unwrap(), "[2001:db8::2]:9402");
        assert!(bind("nonsense", v4).is_err());
    }

    #[test]
    fn periods_are_never_zero() {
        for zero in ["0s", "0ms", "0", "9ms"] {
            let e = parse_period(zero).unwrap_err();
            assert!(e.contains("too short"), "{zero}: {e}");
        }
        assert_eq!(parse_period("10ms"), Ok(Duration::from_millis(10)));
        assert_eq!(parse_period("60s"), Ok(Duration::from_secs(60)));
    }
}
