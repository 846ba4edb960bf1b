//! cozy-proxy command line: `run`, `dump`, `cleanup`, `check-ebpf`.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cozy_proxy::{
    datapath::{BackendKind, Datapath, Dump},
    ebpf::{EbpfBackend, EbpfConfig, Interfaces},
    nft::NftBackend,
    reconcile::Reconciler,
    source::manifests,
};
use std::{
    io::IsTerminal,
    path::{Path, PathBuf},
    time::Duration,
};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

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
    #[arg(long, default_value = "auto")]
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
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendChoice {
    Nft,
    Ebpf,
    /// eBPF where the kernel loads it, nftables otherwise.
    Auto,
}

#[derive(Subcommand)]
enum Command {
    /// Keep the datapath equal to the Services and EndpointSlices of a source.
    Run {
        #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
        backend: BackendChoice,
        #[command(flatten)]
        ebpf: EbpfArgs,
        /// Read Services and EndpointSlices from YAML/JSON manifests in DIR
        /// and re-apply within a second of any change.
        #[arg(long, value_name = "DIR")]
        manifests: PathBuf,
        /// How often the manifest directory is checked for changes.
        #[arg(long, default_value = "250ms", value_parser = parse_duration)]
        poll_interval: Duration,
    },
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
        _ => Err(format!("invalid duration unit in {s:?} (use ms or s)")),
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
        Command::Run {
            backend,
            ebpf,
            manifests,
            poll_interval,
        } => run(backend, &ebpf, &manifests, poll_interval).await,
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
        Command::CheckEbpf => {
            let names = cozy_proxy::ebpf::load_check()?;
            println!("loaded: {}", names.join(", "));
            Ok(())
        }
    }
}

/// Starts the chosen backend; once it has synced, the other backend's state
/// is removed (switching a node's backend leaves nothing behind, and the
/// two never leave a gap: they translate the same way, idempotently).
async fn run(choice: BackendChoice, ebpf: &EbpfArgs, dir: &Path, poll: Duration) -> Result<()> {
    let pin_dir = ebpf.bpf_pin_dir.clone();
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
    match ebpf_backend {
        Some(b) => {
            info!(backend = "ebpf", "datapath chosen");
            run_manifests(b, dir, poll, || {
                NftBackend::new()?.cleanup()?;
                Ok(())
            })
            .await
        }
        None => {
            info!(backend = "nft", "datapath chosen");
            run_manifests(NftBackend::new()?, dir, poll, move || {
                EbpfBackend::remove_all(&pin_dir)?;
                Ok(())
            })
            .await
        }
    }
}

async fn run_manifests<D: Datapath>(
    datapath: D,
    dir: &Path,
    poll: Duration,
    retire_other: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let mut retire_other = Some(retire_other);
    let mut reconciler = Reconciler::new(datapath);
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(poll);
    let mut applied: Option<Vec<(PathBuf, Vec<u8>)>> = None;
    info!(dir = %dir.display(), "watching manifests");
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if let Err(e) = reconciler.datapath_mut().tick() {
            warn!(error = %e, "datapath upkeep failed");
        }
        let files = match manifests::fingerprint(dir) {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot read the manifest directory; keeping the datapath as it is");
                continue;
            }
        };
        if applied.as_ref() == Some(&files) {
            continue;
        }
        let loaded = manifests::parse(&files);
        for s in &loaded.skipped {
            warn!(file = %s.file.display(), document = s.document, "skipped: {}", s.reason);
        }
        match reconciler.reconcile(&loaded.snapshot) {
            Ok(_) => {
                applied = Some(files);
                if let Some(retire) = retire_other.take() {
                    if let Err(e) = retire() {
                        warn!(error = %e, "removing the other backend's state failed");
                    }
                }
            }
            // Retried at the next tick; the datapath keeps its last state.
            Err(e) => error!(error = %e, "sync failed"),
        }
    }
    // No flush on exit: the kernel keeps translating while we restart.
    info!("stopping; the datapath stays in place (`cozy-proxy cleanup` removes it)");
    Ok(())
}

fn print_dump(dump: &Dump, output: Output) -> Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(dump)?),
        Output::Text => print!("{}", cozy_proxy::datapath::render_text(dump)),
    }
    Ok(())
}
