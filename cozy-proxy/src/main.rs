//! cozy-proxy command line: `run`, `dump`, `cleanup`, `check-ebpf`, `rbac`.
use anyhow::{Context, Result};
use clap::Parser;
use cozy_proxy::{
    app, backend,
    cli::{Cli, Command, Output},
    datapath::{placements, BackendKind, ControllerWord, Dump},
};
use std::io::IsTerminal;

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
            let backend = backend.unwrap_or_else(|| backend::dumped_by_default(&cfg));
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
