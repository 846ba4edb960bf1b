//! The flows the programs remember, and the reverse translations of
//! in-cluster clients: their sweep, their counts, and what an apply leaves
//! to the sweep.
use super::apply_plan::key;
use super::maps::{absent_ok, named, Maps, BPF_NOEXIST};
use super::EbpfError;
use aya::maps::MapError;
use cozy_proxy_common::{flow, maps as names, FlowKey, FlowState, IpKey, RevKey, RevValue};
use std::collections::{BTreeMap, BTreeSet};

impl Maps {
    /// The flows remembered, keys and states.
    fn flow_entries(&self) -> Result<Vec<(FlowKey, FlowState)>, EbpfError> {
        self.flows
            .iter()
            .collect::<Result<_, _>>()
            .map_err(named(names::FLOWS))
    }

    /// Forgets every flow of `pods` (none: nothing read).
    pub(super) fn forget_flows_of(&mut self, pods: &BTreeSet<IpKey>) -> Result<(), EbpfError> {
        if pods.is_empty() {
            return Ok(());
        }
        for (k, _) in self.flow_entries()? {
            if pods.contains(&k.pod) {
                absent_ok(self.flows.remove(&k)).map_err(named(names::FLOWS))?;
            }
        }
        Ok(())
    }

    /// Recounts each mapping's remembered flows into `flow_counts` (the
    /// programs keep the counts as they go; this corrects what races and
    /// removals from here left, and zeroes slots that changed hands).
    /// `every`: write every local pod's count (after a read of the maps);
    /// else only the pods with flows, those counted with flows last time
    /// and the pods in `swept` (whose flows were just forgotten): not a
    /// write per pod at every sweep, a syscall each on the datapath's
    /// thread, holding up the changes meanwhile.
    pub fn count_flows(&mut self, every: bool, swept: &BTreeSet<IpKey>) -> Result<(), EbpfError> {
        let mut per_pod: BTreeMap<IpKey, u64> = BTreeMap::new();
        for (k, _) in self.flow_entries()? {
            *per_pod.entry(k.pod).or_default() += 1;
        }
        let last = std::mem::take(&mut self.sweep.counted);
        let writes: Vec<(u16, u64)> = self
            .known_entries()?
            .iter()
            .filter(|(_, i)| i.local_pod())
            .filter_map(|(a, i)| {
                let n = per_pod.get(&key(a)).copied().unwrap_or(0);
                let wanted = every || n > 0 || last.contains(&i.slot) || swept.contains(&key(a));
                wanted.then_some((i.slot, n))
            })
            .collect();
        for (slot, n) in writes {
            self.flow_counts
                .set(slot as u32, n, 0)
                .map_err(named(names::FLOW_COUNTS))?;
            if n > 0 {
                self.sweep.counted.insert(slot);
            }
        }
        Ok(())
    }

    /// Forgets the flows that have been quiet longer than their timeout
    /// (`now_ns` on the programs' clock, CLOCK_MONOTONIC), as conntrack's
    /// garbage collection does, and recounts; returns how many were
    /// forgotten. The programs forget an expired flow when they meet it;
    /// this frees the room of those nobody asks about again.
    /// Also forgets the flows of the pods left to the sweep (see
    /// `stale_flows`), and sweeps `rev_nat` ([`Maps::sweep_rev`]).
    pub fn expire_flows(&mut self, now_ns: u64) -> Result<usize, EbpfError> {
        let stale = std::mem::take(&mut self.sweep.stale_flows);
        let expired: Vec<FlowKey> = self
            .flow_entries()?
            .into_iter()
            .filter(|(k, s)| {
                stale.contains(&k.pod)
                    || now_ns.saturating_sub(s.last_seen_ns) > flow::timeout_ns(s.state)
            })
            .map(|(k, _)| k)
            .collect();
        for k in &expired {
            absent_ok(self.flows.remove(k)).map_err(named(names::FLOWS))?;
        }
        let mut swept: BTreeSet<IpKey> = expired.iter().map(|k| k.pod).collect();
        swept.extend(stale);
        self.count_flows(false, &swept)?;
        self.sweep_rev(now_ns)?;
        Ok(expired.len())
    }

    /// Forgets the reverse translations whose client has been quiet longer
    /// than [`RevValue::idle_s`] (`now_ns` on the programs' clock), and
    /// those through mappings removed or moved since the last sweep: a
    /// reply of that pod to that client must not come from an LB IP that
    /// no longer leads to it (a kubelet probe from a reused port would get
    /// it).
    fn sweep_rev(&mut self, now_ns: u64) -> Result<(), EbpfError> {
        let now_s = RevValue::seconds(now_ns);
        let stale = std::mem::take(&mut self.sweep.stale_rev);
        let gone: Vec<RevKey> = (self.rev_nat.iter())
            .filter_map(Result::ok)
            .filter(|(k, v)| {
                stale.contains(&(v.lb, k.backend))
                    || now_s.saturating_sub(v.seen_s) > RevValue::idle_s(k.proto)
            })
            .map(|(k, _)| k)
            .collect();
        for k in &gone {
            absent_ok(self.rev_nat.remove(k)).map_err(named(names::REV_NAT))?;
        }
        self.count_rev()
    }

    /// Recounts the reverse translations each client holds into
    /// `rev_held` (the programs count up as they record; this corrects
    /// what entries swept, evicted or lost to races left): a count is
    /// written only where it changed, and a client holding none is
    /// forgotten.
    fn count_rev(&mut self) -> Result<(), EbpfError> {
        let mut held: BTreeMap<IpKey, u64> = BTreeMap::new();
        for k in self.rev_nat.keys().filter_map(Result::ok) {
            *held.entry(k.client).or_default() += 1;
        }
        let counted: Vec<(IpKey, u64)> = self.rev_held.iter().filter_map(Result::ok).collect();
        for (client, n) in counted {
            match held.remove(&client) {
                Some(now) if now == n => {}
                Some(now) => self
                    .rev_held
                    .insert(client, now, 0)
                    .map_err(named(names::REV_HELD))?,
                None => absent_ok(self.rev_held.remove(&client)).map_err(named(names::REV_HELD))?,
            }
        }
        // Clients the programs' own count lost (evicted from `rev_held`).
        for (client, n) in held {
            self.rev_held
                .insert(client, n, 0)
                .map_err(named(names::REV_HELD))?;
        }
        Ok(())
    }

    /// The reverse translations each client holds, as `rev_held` counts
    /// them.
    pub fn rev_held(&self) -> Result<BTreeMap<IpKey, u64>, EbpfError> {
        self.rev_held
            .iter()
            .collect::<Result<_, _>>()
            .map_err(named(names::REV_HELD))
    }

    /// Takes the reverse translations an older layout of `rev_nat` held
    /// (an upgrade), where the programs have none for those flows yet.
    pub fn carry_over_rev(&mut self, entries: &[(RevKey, RevValue)]) -> Result<(), EbpfError> {
        for (k, v) in entries {
            match self.rev_nat.insert(k, v, BPF_NOEXIST) {
                Ok(()) => {}
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(named(names::REV_NAT)(e)),
            }
        }
        Ok(())
    }
}
