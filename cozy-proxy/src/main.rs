//! cozy-proxy command line: `run`, `dump`, `cleanup`, `check-ebpf`, `rbac`.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cozy_proxy::{
    app::{self, EbpfArgs, RunArgs},
    backend,
    datapath::{placements, BackendKind, ControllerWord, Dump},
};
use std::io::IsTerminal;

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
        /// The running controller's health or metrics address (`run
        /// --health-addr`), asked why it steers the mappings several nodes
        /// hold ("" not to ask).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9403")]
        controller: String,
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
    /// Print the seccomp profile the chart runs the eBPF backend under (the
    /// runtime default plus bpf and perf_event_open), or with --install
    /// PATH write it there (the chart's init container installs it into
    /// the kubelet's seccomp directory).
    SeccompProfile {
        #[arg(long, value_name = "PATH")]
        install: Option<std::path::PathBuf>,
    },
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

fn main() -> Result<()> {
    // Before any other thread exists: threads take their arenas at their
    // first allocation.
    cozy_proxy::memory::one_arena();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run_cli())
}

async fn run_cli() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).context("--log")?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.command {
        Command::Run(args) => app::run(*args).await,
        Command::Dump {
            backend,
            output,
            controller,
            ebpf,
        } => {
            let cfg = ebpf.config();
            let mut dump = backend::installed(backend, &cfg)?.dump()?;
            let word = match controller.as_str() {
                "" => ControllerWord::NotAsked,
                addr => match cozy_proxy::telemetry::read_hosting(addr) {
                    Ok(shared) => ControllerWord::Shared(shared),
                    Err(e) => ControllerWord::Silent(e.to_string()),
                },
            };
            dump.placement = placements(&dump.state, &word);
            if let Some(why) = backend::ebpf_unserved(&cfg.ebpf) {
                if let Some(details) = dump.details.as_object_mut() {
                    details.insert("ebpf_unserved".into(), why.into());
                }
            }
            print_dump(&dump, output)
        }
        Command::Cleanup { backend, ebpf } => {
            let kinds = backend.map_or(BackendKind::ALL.to_vec(), |k| vec![k]);
            Ok(backend::remove(&kinds, &ebpf.config())?)
        }
        Command::Rbac { role_for } => {
            match role_for {
                Some(ds) => print!("{}", cozy_proxy::rbac::role_rules_yaml(&ds)),
                None => print!("{}", cozy_proxy::rbac::cluster_role_rules_yaml()),
            }
            Ok(())
        }
        Command::SeccompProfile { install } => match install {
            Some(path) => {
                cozy_proxy::seccomp::install(&path)
                    .with_context(|| format!("installing {}", path.display()))?;
                eprintln!("installed {}", path.display());
                Ok(())
            }
            None => {
                print!("{}", cozy_proxy::seccomp::EBPF_PROFILE);
                Ok(())
            }
        },
        Command::CheckEbpf => {
            let names = cozy_proxy::ebpf::load_check()?;
            println!("loaded: {}", names.join(", "));
            Ok(())
        }
    }
}

fn print_dump(dump: &Dump, output: Output) -> Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(dump)?),
        Output::Text => print!("{}", cozy_proxy::datapath::render_text(dump)),
    }
    Ok(())
}
