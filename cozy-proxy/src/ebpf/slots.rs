//! The counter slots of local mappings, and what this process keeps of each
//! `addrs` entry it wrote.
use super::EbpfError;
use cozy_proxy_common::{addr, maps as names, AddrInfo};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// The counter slots of local mappings: kept while a mapping lives (its
/// counts go on), zeroed when it goes (a new mapping starts at 0). Kept
/// from one apply to the next.
pub struct Slots {
    used: BTreeSet<u16>,
    /// Slots assigned during the current update, by LB IP.
    given: BTreeMap<IpAddr, u16>,
    /// Where the search for a free slot starts: after the last one given
    /// (a search from 0 each time made a full sync quadratic: 43 s for
    /// 50 000 mappings).
    cursor: u32,
    /// Slots given anew or freed, whose counters are to be zeroed (in one
    /// batch, before the addresses are written).
    to_zero: Vec<u16>,
}

/// What this process keeps of an `addrs` entry it wrote: the rest is the
/// state's to say, not kept twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    pub flags: u16,
    pub slot: u16,
}

impl Written {
    pub fn of(info: &AddrInfo) -> Written {
        Written {
            flags: info.flags,
            slot: info.slot,
        }
    }

    /// The LB IP of a mapping translated here: it owns a counter slot.
    pub fn local_lb(&self) -> bool {
        self.flags & addr::LB != 0 && self.flags & addr::LOCAL != 0
    }

    /// The pod of a mapping translated here (it shares its LB IP's slot).
    pub fn local_pod(&self) -> bool {
        self.flags & addr::POD != 0 && self.flags & addr::LOCAL != 0
    }
}

impl Slots {
    pub fn of(current: &BTreeMap<IpAddr, Written>) -> Slots {
        Slots {
            used: current
                .values()
                .filter(|w| w.local_lb())
                .map(|w| w.slot)
                .collect(),
            given: BTreeMap::new(),
            cursor: 0,
            to_zero: Vec::new(),
        }
    }

    /// Starts the slot assignments of one apply.
    pub fn begin(&mut self) {
        self.given.clear();
    }

    /// The slots freed or given anew since the last call: their counters
    /// are to be zeroed before an address that counts in them is written.
    pub fn take_zeroed(&mut self) -> Vec<u16> {
        std::mem::take(&mut self.to_zero)
    }

    pub fn release(&mut self, old: &Written) {
        if old.local_lb() && self.used.remove(&old.slot) {
            self.to_zero.push(old.slot);
        }
    }

    /// The slot of the local mapping of `lb`: the one it has, or a free one.
    pub fn of_lb(
        &mut self,
        lb: &IpAddr,
        current: &BTreeMap<IpAddr, Written>,
    ) -> Result<u16, EbpfError> {
        if let Some(s) = self.given.get(lb) {
            return Ok(*s);
        }
        let kept = current.get(lb).filter(|w| w.local_lb()).map(|w| w.slot);
        let slot = match kept {
            Some(s) => s,
            None => {
                // From the cursor to the end, then from the start (slots
                // released below it).
                let free = (self.cursor..=u32::from(u16::MAX))
                    .chain(0..self.cursor)
                    .map(|s| s as u16)
                    .find(|s| !self.used.contains(s))
                    .ok_or(EbpfError::Full { map: names::STATS })?;
                self.cursor = u32::from(free) + 1;
                self.used.insert(free);
                self.to_zero.push(free);
                free
            }
        };
        self.given.insert(*lb, slot);
        Ok(slot)
    }
}
