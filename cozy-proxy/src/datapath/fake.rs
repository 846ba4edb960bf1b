//! An in-memory [`Kernel`]: the reconcile loop and the controller are
//! tested with it, without root. A [`FakeHandle`] lets a test play the rest
//! of the world: change the "kernel" behind the backend's back (drift),
//! make the next operations fail, and see what was applied.
use super::{
    Applied, BackendKind, Capacity, DatapathState, Desired, Dump, Entries, Kernel, Path, Paths,
    Routes, StateDiff,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard},
};

/// The fake kernel's paths: every pod on its own link, through interface
/// 7, or 8 once the pods have `moved` (see [`FakeWorld::moved`]).
pub fn paths(pods: &BTreeSet<IpAddr>, moved: bool) -> BTreeMap<IpAddr, Path> {
    pods.iter()
        .map(|p| {
            (
                *p,
                Path {
                    oif: if moved { 8 } else { 7 },
                    gateway: None,
                    onlink: false,
                    entry: if moved { 8 } else { 7 },
                    src: None,
                },
            )
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
#[error("fake kernel: {0}")]
pub struct FakeError(pub String);

impl super::ErrorKind for FakeError {
    fn kind(&self) -> &'static str {
        "fake"
    }
}

#[derive(Debug, Default)]
pub struct FakeWorld {
    /// What the fake kernel holds.
    pub kernel: DatapathState,
    /// Whether our schema (tables, programs) is in place.
    pub schema: bool,
    /// The next this many reads or applies fail.
    pub failures: usize,
    /// What the tables hold at most (`None`: no limit); an apply beyond
    /// it fails, as a full BPF map refuses a new key.
    pub capacity: Option<Capacity>,
    pub reads: usize,
    pub applies: usize,
    pub upkeeps: usize,
    /// The pods' paths go through another interface: the next upkeep
    /// (or path news) reports that the paths changed.
    pub moved: bool,
    /// The next this many path news find nothing: the kernel's
    /// notification has not reached the socket that reads them yet.
    pub late_news: usize,
    /// The next this many path news fail, their news lost (as a socket
    /// error loses what it held).
    pub lost_news: usize,
}

/// The test's side of a [`FakeKernel`].
#[derive(Clone, Debug, Default)]
pub struct FakeHandle(Arc<Mutex<FakeWorld>>);

impl FakeHandle {
    pub fn world(&self) -> MutexGuard<'_, FakeWorld> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct FakeKernel {
    world: FakeHandle,
    /// The paths last asked for.
    paths: Paths,
    /// [`FakeWorld::moved`] as of the last upkeep.
    moved: bool,
    /// The routes of the last [`Kernel::apply_step`], applied when
    /// settled, as the real backends change them on another thread.
    in_flight: Option<StateDiff>,
}

impl FakeKernel {
    pub fn new() -> (FakeKernel, FakeHandle) {
        let world = FakeHandle::default();
        (
            FakeKernel {
                world: world.clone(),
                paths: Paths::new(),
                moved: false,
                in_flight: None,
            },
            world,
        )
    }

    fn step(&self) -> Result<MutexGuard<'_, FakeWorld>, FakeError> {
        let mut w = self.world.world();
        if w.failures > 0 {
            w.failures -= 1;
            return Err(FakeError("injected failure".into()));
        }
        Ok(w)
    }
}

impl Kernel for FakeKernel {
    type Error = FakeError;
    type Found = bool;

    fn kind(&self) -> BackendKind {
        BackendKind::Nft
    }

    fn capacity(&self) -> Capacity {
        self.world.world().capacity.unwrap_or(Capacity::UNLIMITED)
    }

    fn paths(&mut self, pods: &BTreeSet<IpAddr>) -> Result<&Paths, FakeError> {
        let moved = self.world.world().moved;
        self.paths = paths(pods, moved)
            .into_iter()
            .map(|(p, at)| (p, Some(at)))
            .collect();
        Ok(&self.paths)
    }

    fn read(&mut self) -> Result<(DatapathState, bool), FakeError> {
        let mut w = self.step()?;
        w.reads += 1;
        Ok((w.kernel.clone(), w.schema))
    }

    /// Applies like a kernel would: removing an absent element or adding a
    /// present one fails the whole step (as an nf_tables batch does).
    /// Overlapped routes are applied when settled (or at the next apply).
    fn apply_routed(
        &mut self,
        diff: &StateDiff,
        _desired: Desired<'_>,
        found: Option<bool>,
        routes: Routes,
    ) -> Result<Applied, FakeError> {
        self.settle()?;
        let mut now = diff.clone();
        let later = (routes == Routes::Overlapped).then(|| StateDiff {
            routes: std::mem::take(&mut now.routes),
            ..Default::default()
        });
        let mut w = self.step()?;
        w.applies += 1;
        let mut next = w.kernel.clone();
        next.apply(&now)
            .map_err(|what| FakeError(format!("{what}: no such element")))?;
        if let Some(cap) = &w.capacity {
            let over = Entries::of_state(&next).over(cap);
            if !over.is_empty() {
                return Err(FakeError(format!("{over:?}: table full")));
            }
        }
        w.kernel = next;
        let installed_schema = found == Some(false);
        w.schema = true;
        drop(w);
        // In flight once the tables they follow are in.
        self.in_flight = later;
        Ok(Applied {
            extra_changes: 0,
            installed_schema,
        })
    }

    fn settle(&mut self) -> Result<(), FakeError> {
        let Some(routes) = self.in_flight.take() else {
            return Ok(());
        };
        let mut w = self.world.world();
        let mut next = w.kernel.clone();
        next.apply(&routes)
            .map_err(|what| FakeError(format!("{what}: no such element")))?;
        w.kernel = next;
        Ok(())
    }

    fn upkeep(&mut self) -> Result<bool, FakeError> {
        let mut w = self.world.world();
        w.upkeeps += 1;
        let changed = w.moved != self.moved;
        self.moved = w.moved;
        Ok(changed)
    }

    fn paths_news(&mut self) -> Result<bool, FakeError> {
        let mut w = self.world.world();
        if w.lost_news > 0 {
            w.lost_news -= 1;
            self.moved = w.moved;
            return Err(FakeError("path news lost".into()));
        }
        if w.late_news > 0 {
            w.late_news -= 1;
            return Ok(false);
        }
        let changed = w.moved != self.moved;
        self.moved = w.moved;
        Ok(changed)
    }

    fn dump(&self) -> Result<Dump, FakeError> {
        let w = self.world.world();
        Ok(Dump {
            backend: BackendKind::Nft,
            installed: w.schema,
            state: w.kernel.clone(),
            counters: Default::default(),
            details: serde_json::Value::Null,
            placement: Vec::new(),
        })
    }

    fn cleanup(&mut self) -> Result<(), FakeError> {
        let mut w = self.step()?;
        w.kernel = DatapathState::default();
        w.schema = false;
        Ok(())
    }
}
