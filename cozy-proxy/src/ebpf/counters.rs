//! The programs' counters: per Service (a slot each) and drops by reason.
use super::apply_plan::ip;
use super::maps::{named, possible_cpus, Maps};
use super::slots::Written;
use super::{batch, EbpfError};
use crate::datapath::{Count, Counters, ServiceCount};
use aya::maps::IterableMap;
use cozy_proxy_common::{maps as names, Counter, DropReason, ServiceCounters};
use std::net::IpAddr;
use tracing::debug;

impl Maps {
    /// Per-service counters (summed over CPUs) and drops by reason.
    pub fn counters(&self) -> Result<Counters, EbpfError> {
        let count = |c: &Counter| Count {
            packets: c.packets,
            bytes: c.bytes,
        };
        let mut out = Counters::default();
        // The slots of our local LB IPs: from what we last wrote when we
        // know it (reading `addrs` back is a syscall per entry, on the
        // datapath's thread, holding up changes meanwhile).
        let read;
        let local_lbs: Box<dyn Iterator<Item = (IpAddr, Written)>> =
            match self.belief.as_ref().map(|b| &b.addrs) {
                Some(known) => Box::new(known.iter().map(|(a, w)| (*a, *w))),
                None => {
                    read = self.entries()?;
                    Box::new(read.iter().map(|(k, i)| (ip(k), Written::of(i))))
                }
            };
        let mut by_slot: Vec<(u32, IpAddr)> = local_lbs
            .filter(|(_, w)| w.local_lb())
            .map(|(a, w)| (u32::from(w.slot), a))
            .collect();
        by_slot.sort_unstable();
        // Gathered in slot order, sorted into the map once at the end.
        let mut services = Vec::with_capacity(by_slot.len());
        let mut add = |a: IpAddr, per_cpu: &[ServiceCounters]| {
            let mut sum = ServiceCount::default();
            for c in per_cpu {
                sum.ingress += count(&c.ingress);
                sum.egress += count(&c.egress);
            }
            services.push((a, sum));
        };
        // The whole array in a few reads, the slots in use picked as they
        // come (in order); one lookup per slot where the kernel has no
        // batch read.
        let mut next = 0;
        let batched = if by_slot.is_empty() {
            Ok(())
        } else {
            batch::read_per_cpu(
                IterableMap::map(&self.stats),
                possible_cpus()?,
                |index, per_cpu| {
                    while by_slot.get(next).is_some_and(|(slot, _)| *slot < index) {
                        next += 1;
                    }
                    while let Some((_, a)) = by_slot.get(next).filter(|(slot, _)| *slot == index) {
                        add(*a, per_cpu);
                        next += 1;
                    }
                    // Nothing to read past the last slot in use.
                    next < by_slot.len()
                },
            )
        };
        if let Err(error) = batched {
            debug!(%error, "no batch read of the counters; one slot at a time");
            for (slot, a) in &by_slot[next..] {
                let per_cpu = self.stats.get(slot, 0).map_err(named(names::STATS))?;
                add(*a, &per_cpu[..]);
            }
        }
        out.services = services.into_iter().collect();
        for reason in DropReason::ALL {
            let per_cpu = self
                .drop_stats
                .get(&(reason as u32), 0)
                .map_err(named(names::DROP_STATS))?;
            let sum = out.drops.entry(reason.name()).or_default();
            for c in per_cpu.iter() {
                *sum += count(c);
            }
        }
        Ok(out)
    }
}
