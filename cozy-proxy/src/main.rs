//! cozy-proxy command line: `run`, `dump`, `cleanup`, `check-ebpf`.
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cozy_proxy::{
    datapath::{BackendKind, Datapath, Dump},
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

#[derive(Subcommand)]
enum Command {
    /// Keep the datapath equal to the Services and EndpointSlices of a source.
    Run {
        #[arg(long, value_enum, default_value_t = BackendKind::Nft)]
        backend: BackendKind,
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
    },
    /// Remove everything cozy-proxy installed in the kernel.
    Cleanup {
        #[arg(long, value_enum, default_value_t = BackendKind::Nft)]
        backend: BackendKind,
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

fn nft_only(backend: BackendKind) -> Result<()> {
    if backend == BackendKind::Ebpf {
        bail!("the ebpf backend is not implemented yet; use --backend nft");
    }
    Ok(())
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
            manifests,
            poll_interval,
        } => {
            nft_only(backend)?;
            run_manifests(NftBackend::new()?, &manifests, poll_interval).await
        }
        Command::Dump { backend, output } => {
            nft_only(backend)?;
            print_dump(&NftBackend::new()?.dump()?, output)
        }
        Command::Cleanup { backend } => {
            nft_only(backend)?;
            NftBackend::new()?.cleanup()?;
            info!(%backend, "removed the datapath");
            Ok(())
        }
        Command::CheckEbpf => {
            let names = cozy_proxy::ebpf::load_check()?;
            println!("loaded: {}", names.join(", "));
            Ok(())
        }
    }
}

async fn run_manifests<D: Datapath>(datapath: D, dir: &Path, poll: Duration) -> Result<()> {
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
            Ok(_) => applied = Some(files),
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
