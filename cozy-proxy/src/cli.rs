//! The command line's shape (clap), shared by the binary and by the test
//! that generates docs/operating.md's flag tables from it.
use crate::app::{EbpfArgs, RunArgs};
use crate::datapath::BackendKind;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "cozy-proxy",
    version,
    about = "1:1 NAT from a LoadBalancer IP to its one pod"
)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "cozy_proxy=debug".
    #[arg(long, env = "COZY_PROXY_LOG", default_value = "info", global = true)]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Keep the datapath equal to the Services and EndpointSlices of the
    /// Kubernetes API (or of a manifest directory).
    Run(Box<RunArgs>),
    /// Print the live datapath state, read back from the kernel.
    Dump {
        /// Whose state to read; without it, the backend whose datapath is
        /// installed (eBPF's while both are, in a switch; nft where none is).
        #[arg(long, value_enum)]
        backend: Option<BackendKind>,
        /// Tables for a person, or the whole state as JSON.
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
        /// Only this backend's state.
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
pub enum Output {
    Text,
    Json,
}
