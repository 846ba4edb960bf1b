//! Another agent's TC programs on the node's hooks, as Cilium attaches its
//! own: a program that ends the chain (`TC_ACT_OK`, never "next"), as a
//! tcx link at the head or the tail of a hook, or as a tc filter at
//! priority 1 (Cilium's `bpf-filter-priority` default) with handle 1. The
//! program is the object's `test_chain_end`, loaded on maps of its own.
use crate::sh::in_netns;
use anyhow::{bail, Context, Result};
use aya::{
    programs::{
        links::{FdLink, LinkOrder},
        tc::{self, NlOptions, TcAttachOptions},
        SchedClassifier, TcAttachType,
    },
    Ebpf, EbpfLoader,
};
use cozy_proxy::ebpf::OBJECT;
use cozy_proxy_common::maps as names;

/// Where another agent attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A tcx link before every program (`BPF_F_BEFORE`).
    TcxHead,
    /// A tcx link after every program (Cilium: `link.Tail()`).
    TcxTail,
    /// A tc filter at priority 1, handle 1.
    TcFilter,
}

/// The hooks cozy-proxy uses.
pub const HOOKS: [(TcAttachType, &str); 2] = [
    (TcAttachType::Ingress, "ingress"),
    (TcAttachType::Egress, "egress"),
];

/// The other agent's priority and handle for tc filters.
pub const TC_PRIORITY: u16 = 1;
pub const TC_HANDLE: u32 = 1;

pub struct OtherAgent {
    ebpf: Ebpf,
    /// tcx links held (dropping one detaches it), with their namespace,
    /// interface and hook.
    links: Vec<(FdLink, String, String, TcAttachType)>,
    /// tc filters added: (namespace, interface, hook).
    filters: Vec<(String, String, &'static str)>,
}

impl OtherAgent {
    pub fn new() -> Result<OtherAgent> {
        let mut loader = EbpfLoader::new();
        // Maps of its own, as small as they go: the program reads none.
        for name in names::ALL {
            loader.map_max_entries(name, 1);
        }
        let mut ebpf = loader.load(OBJECT)?;
        let prog: &mut SchedClassifier = ebpf
            .program_mut("test_chain_end")
            .context("no program test_chain_end")?
            .try_into()?;
        prog.load()?;
        Ok(OtherAgent {
            ebpf,
            links: Vec::new(),
            filters: Vec::new(),
        })
    }

    fn prog(&mut self) -> Result<&mut SchedClassifier> {
        Ok(self
            .ebpf
            .program_mut("test_chain_end")
            .context("no program test_chain_end")?
            .try_into()?)
    }

    /// Attaches the program to `dev`'s hook in namespace `ns`.
    pub fn attach(
        &mut self,
        ns: &str,
        dev: &str,
        hook: (TcAttachType, &'static str),
        place: Place,
    ) -> Result<()> {
        let prog = self.prog()?;
        let (attach_type, hook_name) = hook;
        let link = in_netns(ns, || {
            let options = match place {
                Place::TcxHead => TcAttachOptions::TcxOrder(LinkOrder::first()),
                Place::TcxTail => TcAttachOptions::TcxOrder(LinkOrder::last()),
                Place::TcFilter => {
                    let _ = tc::qdisc_add_clsact(dev);
                    TcAttachOptions::Netlink(NlOptions {
                        priority: TC_PRIORITY,
                        handle: TC_HANDLE.into(),
                        ..Default::default()
                    })
                }
            };
            let id = prog
                .attach_with_options(dev, attach_type, options)
                .map_err(|e| {
                    anyhow::anyhow!("attaching the other agent to {dev} {hook_name}: {e:?}")
                })?;
            Ok(prog.take_link(id)?)
        })?;
        match place {
            Place::TcFilter => {
                // Dropping a tc link deletes its filter: it stays until
                // [`OtherAgent::detach_all`] or the namespace goes.
                std::mem::forget(link);
                self.filters.push((ns.into(), dev.into(), hook_name));
            }
            _ => self
                .links
                .push((FdLink::try_from(link)?, ns.into(), dev.into(), attach_type)),
        }
        Ok(())
    }

    /// The ids of the programs on `dev`'s tcx hook in namespace `ns`, in
    /// the order they run.
    pub fn tcx_chain(ns: &str, dev: &str, hook: TcAttachType) -> Result<Vec<u32>> {
        let dev = dev.to_string();
        in_netns(ns, move || {
            let index = nix_ifindex(&dev)?;
            Ok(cozy_proxy::ebpf::chain::tcx_program_ids(index, hook)?)
        })
    }

    /// The id of the other agent's program.
    pub fn program_id(&mut self) -> Result<u32> {
        Ok(self.prog()?.info()?.id())
    }

    /// Attaches the program to both hooks of every interface in `devs`.
    pub fn attach_all(&mut self, ns: &str, devs: &[&str], place: Place) -> Result<()> {
        for dev in devs {
            for hook in HOOKS {
                self.attach(ns, dev, hook, place)?;
            }
        }
        Ok(())
    }

    /// Detaches everything it attached (an agent going away, or the first
    /// half of its restart), and returns once the kernel has let go of
    /// every tcx link: a process another thread is just forking holds a
    /// copy of the link's descriptor until it execs, and until then the
    /// link stays attached (attaching the program there again would fail
    /// with EEXIST).
    pub fn detach_all(&mut self) -> Result<()> {
        let id = self.program_id()?;
        for (link, ns, dev, hook) in std::mem::take(&mut self.links) {
            drop(link);
            crate::traffic::eventually(std::time::Duration::from_secs(2), || {
                let chain = OtherAgent::tcx_chain(&ns, &dev, hook)?;
                if chain.contains(&id) {
                    bail!("the other agent's program is still on {dev} in {ns}: {chain:?}");
                }
                Ok(())
            })?;
        }
        for (ns, dev, hook) in std::mem::take(&mut self.filters) {
            crate::sh::ok_in(
                &ns,
                &[
                    "tc",
                    "filter",
                    "del",
                    "dev",
                    &dev,
                    hook,
                    "pref",
                    &TC_PRIORITY.to_string(),
                    "handle",
                    &TC_HANDLE.to_string(),
                    "bpf",
                ],
            )?;
        }
        Ok(())
    }
}

fn nix_ifindex(dev: &str) -> Result<u32> {
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        bail!("no interface {dev}");
    }
    Ok(index)
}
