//! cozy-proxy command line: `run`, `dump`, `cleanup`, `check-ebpf`.
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cozy_proxy::{
    controller::{self, LoopSettings, WarningSink},
    datapath::{BackendKind, Datapath, Dump},
    ebpf::{EbpfBackend, EbpfConfig, Interfaces},
    events::EventPublisher,
    nft::NftBackend,
    source::{kube::KubeSource, ManifestSource, Source},
    telemetry::{self, Telemetry},
};
use std::{io::IsTerminal, path::PathBuf, time::Duration};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

#[derive(Parser)]
#[command(
    name = "cozy-proxy",
    version,
    about = "1:1 NAT from a LoadBalancer IP to its one pod"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "cozy_proxy=debug".
    #[arg(long, env = "COZY_PROXY_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

/// Where the eBPF backend keeps its state, and where it attaches.
#[derive(clap::Args, Clone)]
struct EbpfArgs {
    /// bpffs directory of the pinned maps and links.
    #[arg(long, env = "COZY_PROXY_BPF_PIN_DIR", default_value = cozy_proxy::ebpf::PIN_DIR)]
    bpf_pin_dir: PathBuf,
    /// "auto" (every Ethernet interface, following new ones) or a
    /// comma-separated list.
    #[arg(long, env = "COZY_PROXY_INTERFACES", default_value = "auto")]
    interfaces: Interfaces,
}

impl EbpfArgs {
    fn config(&self) -> EbpfConfig {
        EbpfConfig {
            pin_dir: self.bpf_pin_dir.clone(),
            interfaces: self.interfaces.clone(),
        }
    }
}

/// The datapath `run` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendChoice {
    Nft,
    Ebpf,
    /// eBPF where the kernel loads it, nftables otherwise.
    Auto,
}

/// Node label that overrides `--backend` on that node (read at start).
const BACKEND_LABEL: &str = "networking.cozystack.io/cozy-proxy-backend";

#[derive(clap::Args)]
struct RunArgs {
    #[arg(long, env = "COZY_PROXY_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
    #[command(flatten)]
    ebpf: EbpfArgs,
    /// Standalone: read Services and EndpointSlices from YAML/JSON manifests
    /// in DIR (re-applied within a second of any change) instead of the
    /// Kubernetes API.
    #[arg(long, value_name = "DIR")]
    manifests: Option<PathBuf>,
    /// Kubernetes API access from this kubeconfig (default: in-cluster
    /// service account, else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// This node's name (the DaemonSet sets it from the downward API).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Our DaemonSet, as NAMESPACE/NAME: at shutdown, if it is gone or being
    /// deleted (an uninstall), the datapath is removed; otherwise (a restart,
    /// a rolling update) it stays.
    #[arg(long, env = "COZY_PROXY_DAEMONSET")]
    daemonset: Option<String>,
    /// Address of /metrics, /healthz and /readyz ("" to disable).
    #[arg(long, env = "COZY_PROXY_METRICS_ADDR", default_value = "0.0.0.0:9402")]
    metrics_addr: String,
    /// How often the manifest directory is checked for changes.
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    poll_interval: Duration,
    /// How long to coalesce a burst of API events before reconciling.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    debounce: Duration,
    /// How often the kernel state is read again and drift repaired.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    resync: Duration,
    /// How often the datapath's traffic counters are copied into /metrics.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    counters_interval: Duration,
}

#[derive(Subcommand)]
enum Command {
    /// Keep the datapath equal to the Services and EndpointSlices of the
    /// Kubernetes API (or of a manifest directory).
    Run(Box<RunArgs>),
    /// Print the live datapath state, read back from the kernel.
    Dump {
        #[arg(long, value_enum, default_value_t = BackendKind::Nft)]
        backend: BackendKind,
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        ebpf: EbpfArgs,
    },
    /// Remove everything cozy-proxy installed in the kernel (both backends
    /// unless one is named).
    Cleanup {
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        #[command(flatten)]
        ebpf: EbpfArgs,
    },
    /// Load the embedded eBPF programs into the kernel and unload them.
    CheckEbpf,
    /// Print the Kubernetes RBAC rules the controller needs: the ClusterRole
    /// rules, or with --role-for NAME those of the Role in its namespace.
    Rbac {
        #[arg(long, value_name = "DAEMONSET")]
        role_for: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: u64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("invalid duration unit in {s:?} (use ms, s or m)")),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).context("--log")?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.command {
        Command::Run(args) => run(*args).await,
        Command::Dump {
            backend,
            output,
            ebpf,
        } => {
            let dump = match backend {
                BackendKind::Nft => NftBackend::new()?.dump()?,
                BackendKind::Ebpf => EbpfBackend::inspect(&ebpf.bpf_pin_dir)?,
            };
            print_dump(&dump, output)
        }
        Command::Cleanup { backend, ebpf } => {
            if backend != Some(BackendKind::Ebpf) {
                NftBackend::new()?.cleanup()?;
                info!("removed the nft datapath");
            }
            if backend != Some(BackendKind::Nft) {
                EbpfBackend::remove_all(&ebpf.bpf_pin_dir)?;
                info!("removed the eBPF datapath");
            }
            Ok(())
        }
        Command::Rbac { role_for } => {
            match role_for {
                Some(ds) => print!("{}", cozy_proxy::rbac::role_rules_yaml(&ds)),
                None => print!("{}", cozy_proxy::rbac::cluster_role_rules_yaml()),
            }
            Ok(())
        }
        Command::CheckEbpf => {
            let names = cozy_proxy::ebpf::load_check()?;
            println!("loaded: {}", names.join(", "));
            Ok(())
        }
    }
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

/// The backend named by this node's label, if any (read once at start).
async fn node_backend(client: &kube::Client, node: &str) -> Option<BackendChoice> {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    match nodes.get(node).await {
        Ok(n) => {
            let value = n.metadata.labels.as_ref()?.get(BACKEND_LABEL)?.clone();
            match BackendChoice::from_str(&value, true) {
                Ok(b) => {
                    info!(node, backend = %value, "backend chosen by the node label {BACKEND_LABEL}");
                    Some(b)
                }
                Err(_) => {
                    warn!(node, value = %value, "invalid {BACKEND_LABEL} label (ebpf, nft or auto); using --backend");
                    None
                }
            }
        }
        Err(e) => {
            warn!(node, error = %e, "could not read this node's labels; using --backend");
            None
        }
    }
}

/// Resolves at SIGTERM or SIGINT. The handlers are registered when this is
/// called (not when first polled), so a signal that comes early is not lost
/// to the default action.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

async fn run(args: RunArgs) -> Result<()> {
    let shutdown = shutdown_signal()?;
    let telemetry = Telemetry::new();
    if !args.metrics_addr.is_empty() {
        let listener = tokio::net::TcpListener::bind(&args.metrics_addr)
            .await
            .with_context(|| format!("listening on {}", args.metrics_addr))?;
        tokio::spawn(telemetry::serve(listener, telemetry.clone()));
    }
    let settings = LoopSettings {
        debounce: args.debounce,
        resync: args.resync,
        upkeep: Duration::from_secs(1),
        counters: args.counters_interval,
    };
    if let Some(dir) = &args.manifests {
        let source = ManifestSource::new(dir.clone(), args.poll_interval);
        return with_backend(
            args.backend,
            &args.ebpf,
            source,
            telemetry,
            settings,
            Box::new(|_| {}),
            shutdown,
        )
        .await;
    }
    let client = kube_client(args.kubeconfig.as_ref()).await?;
    let mut choice = args.backend;
    if let Some(node) = &args.node_name {
        if let Some(b) = node_backend(&client, node).await {
            choice = b;
        }
    }
    let source = KubeSource::start(client.clone());
    let events = EventPublisher::new(client.clone(), args.node_name.clone());
    let uids = source.uid_lookup();
    let sink: WarningSink =
        Box::new(move |w| events.publish(w, |ns, name| uids.service_uid(ns, name)));
    with_backend(
        choice, &args.ebpf, source, telemetry, settings, sink, shutdown,
    )
    .await?;
    if let Some(ds) = &args.daemonset {
        if uninstalling(&client, ds).await {
            info!(daemonset = %ds, "our DaemonSet is gone: uninstall; removing the datapath");
            NftBackend::new()?.cleanup()?;
            EbpfBackend::remove_all(&args.ebpf.bpf_pin_dir)?;
        } else {
            info!(daemonset = %ds, "our DaemonSet remains: the datapath stays for the next pod");
        }
    }
    Ok(())
}

/// Is `namespace/name` (our DaemonSet) gone or being deleted? When the API
/// cannot say, the answer is no: keeping the datapath is the safe side.
async fn uninstalling(client: &kube::Client, daemonset: &str) -> bool {
    let Some((ns, name)) = daemonset.split_once('/') else {
        warn!(daemonset, "expected NAMESPACE/NAME");
        return false;
    };
    let api: kube::Api<k8s_openapi::api::apps::v1::DaemonSet> =
        kube::Api::namespaced(client.clone(), ns);
    match api.get_opt(name).await {
        Ok(None) => true,
        Ok(Some(ds)) => ds.metadata.deletion_timestamp.is_some(),
        Err(e) => {
            warn!(error = %e, "could not read our DaemonSet; keeping the datapath");
            false
        }
    }
}

/// Starts the chosen backend and runs the loop; once it has synced, the
/// other backend's state is removed (switching a node's backend leaves
/// nothing behind, and there is no gap: both translate the same way).
async fn with_backend<S: Source>(
    choice: BackendChoice,
    ebpf: &EbpfArgs,
    source: S,
    telemetry: Telemetry,
    settings: LoopSettings,
    sink: WarningSink<'_>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let ebpf_backend = match choice {
        BackendChoice::Nft => None,
        BackendChoice::Ebpf => {
            Some(EbpfBackend::new(ebpf.config()).context("starting the eBPF backend")?)
        }
        BackendChoice::Auto => match EbpfBackend::new(ebpf.config()) {
            Ok(b) => Some(b),
            Err(e) => {
                warn!(error = %e, "eBPF datapath unavailable on this node; using nftables");
                None
            }
        },
    };
    let pin_dir = ebpf.bpf_pin_dir.clone();
    match ebpf_backend {
        Some(b) => {
            info!(backend = "ebpf", "datapath chosen");
            let retire = || {
                if let Err(e) = NftBackend::new().and_then(|mut n| n.cleanup()) {
                    warn!(error = %e, "removing the nft datapath failed");
                }
            };
            controller::run(b, source, telemetry, settings, sink, retire, shutdown).await;
        }
        None => {
            if choice == BackendChoice::Ebpf {
                bail!("the eBPF backend could not start");
            }
            info!(backend = "nft", "datapath chosen");
            let retire = move || {
                if let Err(e) = EbpfBackend::remove_all(&pin_dir) {
                    warn!(error = %e, "removing the eBPF datapath failed");
                }
            };
            controller::run(
                NftBackend::new()?,
                source,
                telemetry,
                settings,
                sink,
                retire,
                shutdown,
            )
            .await;
        }
    }
    Ok(())
}

fn print_dump(dump: &Dump, output: Output) -> Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(dump)?),
        Output::Text => print!("{}", cozy_proxy::datapath::render_text(dump)),
    }
    Ok(())
}
