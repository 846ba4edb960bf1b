//! How the eBPF datapath is set up on a node: where it pins, which
//! interfaces get the programs, how they are attached.
use std::path::PathBuf;

/// Which interfaces get the programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Interfaces {
    /// Every Ethernet-type interface but loopback, following links that
    /// appear and disappear.
    Auto,
    Named(Vec<String>),
}

impl std::str::FromStr for Interfaces {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Interfaces::Auto);
        }
        let names: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Err("give \"auto\" or a comma-separated list of interfaces".into());
        }
        Ok(Interfaces::Named(names))
    }
}

#[derive(Clone, Debug)]
pub struct EbpfConfig {
    /// bpffs directory for the pinned maps and links.
    pub pin_dir: PathBuf,
    pub interfaces: Interfaces,
    /// LB traffic from and to the outside skips the host stack where it
    /// can (redirects).
    pub fast_path: bool,
    pub tc_attach: TcAttach,
    /// The XDP program on the uplinks (see `xdp_place.rs`).
    pub xdp: super::xdp_place::XdpChoice,
}

/// How the programs are attached to an interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// tcx links where the kernel has them (6.6+), tc filters before.
    #[default]
    Auto,
    /// tc filters over netlink (clsact), as on kernels before 6.6.
    Netlink,
}
