//! The TC programs loaded for `BPF_PROG_TEST_RUN`, on maps filled by the
//! production code (`EbpfKernel::apply`), in a network namespace of their
//! own with real interfaces (the anti-spoofing and route lookups need
//! them): the packet tests, their fuzz and the per-packet benchmark.
use anyhow::{bail, Context, Result};
use aya::{
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use cozy_proxy::ebpf::layouts::pin_path;
use cozy_proxy::{
    datapath::{Applied, DatapathState, Desired, Kernel, RemotePods},
    ebpf::{EbpfConfig, EbpfKernel, Interfaces, OBJECT},
};
use cozy_proxy_common::maps as names;
use std::{fs::File, os::fd::AsRawFd, process::Command, time::Duration};

/// TC verdicts as BPF_PROG_TEST_RUN reports them.
pub const PASS: u32 = u32::MAX; // TC_ACT_UNSPEC (-1)
pub const DROP: u32 = 2; // TC_ACT_SHOT
pub const REDIRECT: u32 = 7; // TC_ACT_REDIRECT

/// The programs of the object, and an empty one for reference.
pub const PROGRAMS: [&str; 3] = ["cozy_ingress", "cozy_egress", "cozy_pass"];

/// Interfaces of the namespace: an uplink, two pod interfaces, the path to
/// another node, an unmanaged pod's interface.
#[derive(Clone, Copy, Debug)]
pub struct Ifaces {
    pub up: u32,
    pub pod: u32,
    pub fpod: u32,
    pub peer: u32,
    pub client: u32,
}

pub struct World {
    pub kernel: EbpfKernel,
    pub ebpf: Ebpf,
    /// Other builds of the programs loaded on the same maps, by label
    /// (`PERPACKET_COMPARE`): variant `i + 1` of the runs.
    pub others: Vec<(String, Ebpf)>,
    netns: File,
    pub ifs: Ifaces,
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("{args:?}"))?;
    if !out.status.success() {
        bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn ifindex(name: &str) -> Result<u32> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"));
    if let Some(i) = text.ok().and_then(|s| s.trim().parse().ok()) {
        return Ok(i);
    }
    // /sys shows the namespace that mounted it: ask ip instead.
    let out = Command::new("ip")
        .args(["-j", "link", "show", "dev", name])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v[0]["ifindex"]
        .as_u64()
        .map(|i| i as u32)
        .with_context(|| format!("ifindex of {name}"))
}

/// `__sk_buff` up to `ifindex`: `ingress_ifindex` (offset 36) non-zero
/// means received (forwarded), zero locally sent; `ifindex` (40) is the
/// device the program runs on.
pub fn skb_ctx(ingress_ifindex: u32, ifindex: u32) -> Vec<u8> {
    let mut ctx = vec![0u8; 44];
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// `xdp_md` for a test run: the frame's bounds and the interface it is
/// received on (queue 0).
pub fn xdp_ctx(len: usize, ingress_ifindex: u32) -> Vec<u8> {
    let mut ctx = vec![0u8; 24];
    ctx[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx
}

/// XDP verdicts.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;

/// The XDP program of the object, and an empty one for reference.
pub const XDP_PROGRAM: &str = "cozy_xdp";
pub const XDP_EMPTY: &str = "cozy_xdp_pass";

/// Loads the TC programs of `object` (and its XDP program, where it has
/// one) on the maps `loader` pins.
fn load_programs(loader: &mut EbpfLoader, object: &[u8]) -> Result<Ebpf> {
    let mut ebpf = loader.load(object)?;
    for name in PROGRAMS {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?
            .try_into()?;
        prog.load()?;
    }
    for name in [XDP_PROGRAM, XDP_EMPTY] {
        if let Some(p) = ebpf.program_mut(name) {
            let xdp: &mut Xdp = p.try_into()?;
            xdp.load()?;
        }
    }
    Ok(ebpf)
}

fn io_error(e: ProgramError) -> std::io::Error {
    match e {
        ProgramError::SyscallError(s) => s.io_error,
        other => std::io::Error::other(other.to_string()),
    }
}

/// The in-cluster client of the packet tests and the per-packet
/// benchmark (an unmapped pod of the node, on `v-client`), each family's.
pub const CLIENTS: [&str; 2] = ["192.0.2.50", "2001:db8:2::50"];

/// An in-cluster client behind `v-peer` (as behind Kube-OVN's `ovn0`,
/// where hairpins may leave), each family's.
pub const PEER_CLIENTS: [&str; 2] = ["192.0.2.51", "2001:db8:2::51"];

impl World {
    /// Moves this thread into a new network namespace, creates the
    /// interfaces, fills the maps with `state(interfaces)` through the
    /// production code and loads the programs on them. The maps are
    /// unpinned afterwards: they go with the process.
    pub fn new(state: impl FnOnce(Ifaces) -> DatapathState) -> Result<World> {
        // SAFETY: unshare on this thread only; the namespace lives as long
        // as the handle kept below.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            bail!("unshare: {}", std::io::Error::last_os_error());
        }
        let netns = File::open("/proc/thread-self/ns/net")?;
        sh(&["ip", "link", "set", "lo", "up"])?;
        // (This kernel has no dummy driver: veth pairs, both ends here.)
        for dev in ["uplink", "v-pod", "v-fpod", "v-peer", "v-client"] {
            let end = format!("{dev}-end");
            sh(&[
                "ip", "link", "add", dev, "type", "veth", "peer", "name", &end,
            ])?;
            sh(&["ip", "link", "set", dev, "up"])?;
            sh(&["ip", "link", "set", &end, "up"])?;
        }
        sh(&["ip", "addr", "add", "198.51.100.2/24", "dev", "uplink"])?;
        sh(&[
            "ip",
            "addr",
            "add",
            "2001:db8:100::2/64",
            "dev",
            "uplink",
            "nodad",
        ])?;
        sh(&["ip", "route", "add", "default", "dev", "uplink"])?;
        sh(&["ip", "-6", "route", "add", "default", "dev", "uplink"])?;
        // The unmapped pod on `v-client`, routed there as a CNI routes its
        // pod: the programs take it for a client in the cluster only where
        // the node routes it back.
        for client in CLIENTS {
            sh(&["ip", "route", "add", client, "dev", "v-client"])?;
        }
        for client in PEER_CLIENTS {
            sh(&["ip", "route", "add", client, "dev", "v-peer"])?;
        }
        sh(&[
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
        ])?;
        let ifs = Ifaces {
            up: ifindex("uplink")?,
            pod: ifindex("v-pod")?,
            fpod: ifindex("v-fpod")?,
            peer: ifindex("v-peer")?,
            client: ifindex("v-client")?,
        };
        let pin_dir = crate::test_bpffs()?.join(format!("packets-{}", std::process::id()));
        let cfg = EbpfConfig {
            pin_dir: pin_dir.clone(),
            interfaces: Interfaces::Named(vec![]),
            fast_path: false,
            tc_attach: Default::default(),
            xdp: cozy_proxy::ebpf::XdpChoice::Off,
        };
        let mut kernel = EbpfKernel::start(cfg)?;
        let desired = state(ifs);
        apply_state(&mut kernel, &DatapathState::default(), &desired, Some(()))?;
        let mut loader = EbpfLoader::new();
        for name in names::ALL {
            loader.map_pin_path(name, pin_path(&pin_dir, name));
        }
        // `PERPACKET_OBJECT`: another build of the programs (with the same
        // maps), for an A/B of two programs in one sitting.
        let other = match std::env::var_os("PERPACKET_OBJECT") {
            Some(path) => Some(std::fs::read(&path).with_context(|| format!("reading {path:?}"))?),
            None => None,
        };
        let ebpf = load_programs(&mut loader, other.as_deref().unwrap_or(OBJECT))?;
        // `PERPACKET_COMPARE=label=path,...`: more builds, each on the same
        // maps, whose runs the per-packet benchmark interleaves with this
        // one's ("this build" again for an A/A control).
        let mut others = Vec::new();
        for item in std::env::var("PERPACKET_COMPARE")
            .unwrap_or_default()
            .split(',')
        {
            let Some((label, path)) = item.split_once('=') else {
                continue;
            };
            let object = if path == "this" {
                OBJECT.to_vec()
            } else {
                std::fs::read(path).with_context(|| format!("reading {path}"))?
            };
            others.push((label.to_string(), load_programs(&mut loader, &object)?));
        }
        // Both sides hold the maps now: unpinned, they go with the process.
        for name in names::ALL {
            let _ = std::fs::remove_file(pin_path(&pin_dir, name));
        }
        let _ = std::fs::remove_dir(pin_dir.join("links"));
        let _ = std::fs::remove_dir(&pin_dir);
        Ok(World {
            kernel,
            ebpf,
            others,
            netns,
            ifs,
        })
    }

    /// Runs a command in the world's namespace (the calling thread must be
    /// in it: [`World::enter`]).
    pub fn sh(&self, args: &[&str]) -> Result<()> {
        sh(args)
    }

    /// `addr` as a CNI and neighbour discovery leave it for the FIB: a
    /// route by `dev` (none by the uplink, whose network is on-link) and a
    /// permanent neighbour entry with `lladdr` there.
    pub fn reachable(&self, addr: std::net::IpAddr, dev: &str, lladdr: &str) -> Result<()> {
        let addr = addr.to_string();
        if dev != "uplink" {
            sh(&["ip", "route", "replace", &addr, "dev", dev])?;
        }
        sh(&[
            "ip",
            "neigh",
            "replace",
            &addr,
            "lladdr",
            lladdr,
            "dev",
            dev,
            "nud",
            "permanent",
        ])
    }

    /// Moves this thread into the world's namespace.
    pub fn enter(&self) -> Result<()> {
        // SAFETY: setns on this thread, into the namespace we hold.
        if unsafe { libc::setns(self.netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn program(&self, prog: &str) -> std::io::Result<&SchedClassifier> {
        self.program_of(0, prog)
    }

    /// The build `variant` (0: this one, `i + 1`: `others[i]`).
    fn build(&self, variant: usize) -> std::io::Result<&Ebpf> {
        match variant {
            0 => Ok(&self.ebpf),
            i => (self.others.get(i - 1).map(|(_, e)| e))
                .ok_or_else(|| std::io::Error::other(format!("no build {i}"))),
        }
    }

    fn program_of(&self, variant: usize, prog: &str) -> std::io::Result<&SchedClassifier> {
        let p = (self.build(variant)?.program(prog))
            .ok_or_else(|| std::io::Error::other(format!("no program {prog}")))?;
        p.try_into().map_err(io_error)
    }

    /// `repeat` runs of the XDP program `prog` of build `variant` on
    /// `frame` received on `ingress_ifindex`: the last verdict and the
    /// kernel's mean time per run. `None` where that build has no such
    /// program.
    pub fn run_xdp_repeated(
        &self,
        variant: usize,
        prog: &str,
        frame: &[u8],
        ingress_ifindex: u32,
        repeat: u32,
    ) -> std::io::Result<Option<(u32, Duration)>> {
        let Some(p) = self.build(variant)?.program(prog) else {
            return Ok(None);
        };
        let p: &Xdp = p.try_into().map_err(io_error)?;
        let ctx = xdp_ctx(frame.len(), ingress_ifindex);
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.ctx_in = Some(&ctx);
        opts.repeat = repeat;
        let r = p.test_run(opts).map_err(io_error)?;
        Ok(Some((r.return_value, r.duration)))
    }

    /// One run of the XDP program on `frame`: the verdict and the frame
    /// after.
    pub fn run_xdp(&self, frame: &[u8], ingress_ifindex: u32) -> std::io::Result<(u32, Vec<u8>)> {
        let p = (self.ebpf.program(XDP_PROGRAM))
            .ok_or_else(|| std::io::Error::other("no XDP program"))?;
        let p: &Xdp = p.try_into().map_err(io_error)?;
        let mut out = vec![0u8; frame.len() + 256];
        let ctx = xdp_ctx(frame.len(), ingress_ifindex);
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.ctx_in = Some(&ctx);
        let r = p.test_run(opts).map_err(io_error)?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out))
    }

    /// One run of `prog` on `frame` as seen on interface `dev`, received on
    /// `ingress_ifindex` (0: sent by the node): the verdict and the frame
    /// after. The runner's own error as is.
    pub fn run(
        &self,
        prog: &str,
        frame: &[u8],
        ingress_ifindex: u32,
        dev: u32,
    ) -> std::io::Result<(u32, Vec<u8>)> {
        let mut out = vec![0u8; frame.len() + 256];
        let ctx = skb_ctx(ingress_ifindex, dev);
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.ctx_in = Some(&ctx);
        let r = self.program(prog)?.test_run(opts).map_err(io_error)?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out))
    }

    /// `repeat` runs of `prog` on `frame` in the kernel (each on the frame
    /// the previous run left): the last verdict and the kernel's mean time
    /// per run.
    pub fn run_repeated(
        &self,
        prog: &str,
        frame: &[u8],
        ingress_ifindex: u32,
        dev: u32,
        repeat: u32,
    ) -> std::io::Result<(u32, Duration)> {
        self.run_repeated_in(0, prog, frame, (ingress_ifindex, dev), repeat)
    }

    /// [`World::run_repeated`] of build `variant` (see [`World::others`]).
    pub fn run_repeated_in(
        &self,
        variant: usize,
        prog: &str,
        frame: &[u8],
        (ingress_ifindex, dev): (u32, u32),
        repeat: u32,
    ) -> std::io::Result<(u32, Duration)> {
        let ctx = skb_ctx(ingress_ifindex, dev);
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.ctx_in = Some(&ctx);
        opts.repeat = repeat;
        let r = self
            .program_of(variant, prog)?
            .test_run(opts)
            .map_err(io_error)?;
        Ok((r.return_value, r.duration))
    }
}

/// Moves `kernel` from holding `from` to holding `to`, as the sync layer
/// does (`found`: the first apply after a read).
pub fn apply_state<K: Kernel>(
    kernel: &mut K,
    from: &DatapathState,
    to: &DatapathState,
    found: Option<K::Found>,
) -> Result<Applied, K::Error> {
    let remote_pods = RemotePods::of(to);
    let desired = Desired {
        state: to,
        remote_pods: &remote_pods,
    };
    kernel.apply(&from.diff(to), desired, found)
}
