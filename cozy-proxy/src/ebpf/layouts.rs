//! Which layout of each map this build uses, and where it is pinned.
//!
//! A map's layout version changes whenever the meaning of its keys or
//! values changes, not only their size: a field read another way, a flag
//! bit given another meaning, a key built from other parts. A map at
//! version 1 is pinned under its name (`flows`), at version N > 1 under
//! `name_vN` (`flows_v2`; bpffs refuses a `.` in a name). A pin of the same
//! map at another version, or of a map this build no longer uses, is
//! unpinned before the programs load: the loader then creates the map
//! anew, and the first sync fills it from the plan. The programs of the
//! previous instance keep their own maps until ours replace them after
//! that sync, so the plan's maps cost no packet. What a replaced map held
//! that no plan can rebuild (flow memory, reverse translations, fragments)
//! is carried over where this build can convert the older layout
//! ([`Carried`]: kept open, its entries copied into the new map right
//! before our programs take over), and lost otherwise; CHANGELOG.md says
//! which under the release that bumps it. A size that differs from this
//! build's under the same version is refused the same way, and a test
//! makes every size change name a new version.
use aya::maps::{HashMap, Map, MapData};
use cozy_proxy_common::{
    maps as names, AddrInfo, Config, Counter, FlowKey, FlowState, FragKey, IfRole, IpKey, LbSource,
    PortKey, Prefilter, RevKey, RevValue, ServiceCounters,
};
use std::{
    fs,
    mem::size_of,
    path::{Path, PathBuf},
};
use tracing::warn;

/// The layout version of each map this build uses.
pub const LAYOUTS: [(&str, u32); 15] = [
    (names::ADDRS, 1),
    (names::ALLOWED_PORTS, 1),
    (names::CLUSTER, 1),
    (names::SRC_RANGES, 1),
    (names::FLOWS, 1),
    (names::FLOW_COUNTS, 1),
    (names::FRAGS, 1),
    (names::REV_NAT, 2),
    (names::REV_HELD, 1),
    (names::STATS, 1),
    (names::DROP_STATS, 2),
    (names::CONFIG, 3),
    (names::PREFILTER, 2),
    (names::IFACES, 1),
    (names::XDP_TARGETS, 1),
];

/// Maps an older version pinned that this one does not use.
const RETIRED: [&str; 5] = [
    "pod_svc",
    "svc_pod",
    "filtered_pods",
    "unmapped_lbs",
    "svc_stats",
];

fn version(name: &str) -> u32 {
    LAYOUTS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(1, |(_, v)| *v)
}

/// The file name `name` is pinned under at this build's layout.
pub fn pin_name(name: &str) -> String {
    match version(name) {
        1 => name.to_string(),
        v => format!("{name}_v{v}"),
    }
}

pub fn pin_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(pin_name(name))
}

/// The map a pin's file name is of, and its layout version.
fn parse_pin(file: &str) -> (&str, u32) {
    match file.rsplit_once("_v") {
        Some((name, v)) => match v.parse::<u32>() {
            Ok(v) if v > 1 => (name, v),
            _ => (file, 1),
        },
        None => (file, 1),
    }
}

/// The map a pin's file name is of and its layout, if the map is ours
/// (in use or retired).
fn ours(file: &str) -> Option<(&str, u32)> {
    let (name, v) = parse_pin(file);
    (RETIRED.contains(&name) || names::ALL.contains(&name)).then_some((name, v))
}

/// Of the file names in a pin directory, those that are maps of ours at
/// a layout this build does not use (or retired maps).
fn stale<'a>(files: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    files
        .into_iter()
        .filter(|f| ours(f).is_some_and(|(name, v)| RETIRED.contains(&name) || v != version(name)))
        .collect()
}

/// The file names in `dir` (none where it cannot be read).
fn files_in(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect()
}

/// Every map pin of ours in `dir`, at any layout (retired maps too).
pub fn our_pins(dir: &Path) -> Vec<PathBuf> {
    files_in(dir)
        .into_iter()
        .filter(|f| ours(f).is_some())
        .map(|f| dir.join(f))
        .collect()
}

/// Key and value sizes the current programs expect.
fn expected_sizes(name: &str) -> Option<(usize, usize)> {
    Some(match name {
        names::ADDRS => (size_of::<IpKey>(), size_of::<AddrInfo>()),
        names::ALLOWED_PORTS => (size_of::<PortKey>(), 1),
        names::CLUSTER => (4 + size_of::<IpKey>(), 1),
        names::SRC_RANGES => (4 + size_of::<LbSource>(), 1),
        names::FLOWS => (size_of::<FlowKey>(), size_of::<FlowState>()),
        names::FLOW_COUNTS => (4, 8),
        names::FRAGS => (size_of::<FragKey>(), 8),
        names::REV_NAT => (size_of::<RevKey>(), size_of::<RevValue>()),
        names::REV_HELD => (size_of::<IpKey>(), 8),
        names::STATS => (4, size_of::<ServiceCounters>()),
        names::DROP_STATS => (4, size_of::<Counter>()),
        names::CONFIG => (4, size_of::<Config>()),
        names::PREFILTER => (4, size_of::<Prefilter>()),
        names::IFACES => (4, size_of::<IfRole>()),
        // struct bpf_devmap_val: the interface, a program's fd or id.
        names::XDP_TARGETS => (4, 8),
        _ => return None,
    })
}

/// `rev_nat` at layout 1 (0.1.0): without the client's last-seen time.
#[repr(C)]
#[derive(Clone, Copy)]
struct RevValueV1 {
    lb: IpKey,
    before_conntrack: u8,
    _pad: u8,
    _pad2: u16,
    ifindex: u32,
}

// SAFETY: plain old data, every bit pattern valid, no unnamed padding.
unsafe impl aya::Pod for RevValueV1 {}

const _: () = assert!(size_of::<RevValueV1>() == 28);

/// Maps of an older layout whose entries this build converts instead of
/// losing them: opened before their pins go (an open map lives on), and
/// held until the new map takes their entries.
#[derive(Default)]
pub struct Carried {
    rev_nat_v1: Option<MapData>,
}

impl Carried {
    /// The reverse translations of the older `rev_nat`, in this build's
    /// layout, each seen at `now_s` (its age restarts at the upgrade).
    pub fn rev_nat(self, now_s: u32) -> Vec<(RevKey, RevValue)> {
        let Some(data) = self.rev_nat_v1 else {
            return Vec::new();
        };
        let Ok(map) = Map::from_map_data(data) else {
            return Vec::new();
        };
        let Ok(old) = HashMap::<MapData, RevKey, RevValueV1>::try_from(map) else {
            return Vec::new();
        };
        old.iter()
            .filter_map(Result::ok)
            .map(|(k, v)| {
                let value = RevValue {
                    lb: v.lb,
                    before_conntrack: v.before_conntrack,
                    _pad: 0,
                    _pad2: 0,
                    ifindex: v.ifindex,
                    seen_s: now_s,
                };
                (k, value)
            })
            .collect()
    }
}

/// Opens the pin `file` to carry its entries over, if this build converts
/// that map at that layout.
fn carry(carried: &mut Carried, pin_dir: &Path, file: &str) {
    if parse_pin(file) != (names::REV_NAT, 1) {
        return;
    }
    let path = pin_dir.join(file);
    let sizes = aya::maps::MapInfo::from_pin(&path)
        .map(|i| (i.key_size() as usize, i.value_size() as usize));
    if sizes.ok() != Some((size_of::<RevKey>(), size_of::<RevValueV1>())) {
        return;
    }
    carried.rev_nat_v1 = MapData::from_pin(&path).ok();
}

/// Unpins what this build must not reuse: maps at another layout
/// version, retired maps, and maps whose sizes differ from this build's;
/// returns those whose entries it carries over.
pub fn drop_other_layouts(pin_dir: &Path) -> Carried {
    let files = files_in(pin_dir);
    let mut carried = Carried::default();
    for file in stale(files.iter().map(String::as_str)) {
        carry(&mut carried, pin_dir, file);
        if fs::remove_file(pin_dir.join(file)).is_ok() {
            warn!(
                pin = file,
                "unpinned a map of another layout; it is created anew"
            );
        }
    }
    for name in names::ALL {
        let path = pin_path(pin_dir, name);
        let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
            continue;
        };
        if let Some((k, v)) = expected_sizes(name) {
            if info.key_size() as usize != k || info.value_size() as usize != v {
                warn!(map = name, "pinned map has other sizes; replacing it");
                let _ = fs::remove_file(&path);
            }
        }
    }
    carried
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every map's version and sizes as of this build. A size that
    /// changes fails here: give the map a new version in [`LAYOUTS`] (a
    /// previous release's pins of it are then replaced, not misread),
    /// write the loss into CHANGELOG.md, and update this table.
    #[test]
    fn a_size_change_names_a_new_layout() {
        let known: [(&str, u32, usize, usize); 15] = [
            ("addrs", 1, 20, 32),
            ("allowed_ports", 1, 24, 1),
            ("cluster", 1, 24, 1),
            ("src_ranges", 1, 44, 1),
            ("flows", 1, 48, 16),
            ("flow_counts", 1, 4, 8),
            ("frags", 1, 48, 8),
            ("rev_nat", 2, 48, 32),
            ("rev_held", 1, 20, 8),
            ("stats", 1, 4, 32),
            ("drop_stats", 2, 4, 16),
            ("config", 3, 4, 16),
            ("prefilter", 2, 4, 409_608),
            ("ifaces", 1, 4, 8),
            ("xdp_targets", 1, 4, 8),
        ];
        let now: Vec<_> = names::ALL
            .iter()
            .map(|n| {
                let (k, v) = expected_sizes(n).expect("sizes of every map");
                (*n, version(n), k, v)
            })
            .collect();
        assert_eq!(now, known, "a map's sizes changed: bump its layout version");
        assert_eq!(LAYOUTS.map(|(n, _)| n), names::ALL);
    }

    #[test]
    fn pins_of_other_layouts_are_stale() {
        assert_eq!(parse_pin("flows"), ("flows", 1));
        assert_eq!(parse_pin("flows_v3"), ("flows", 3));
        assert_eq!(parse_pin("flows_v1"), ("flows_v1", 1));
        assert_eq!(parse_pin("flows_vx"), ("flows_vx", 1));
        let dir = [
            "addrs",
            "flows",
            "flows_v2",
            "rev_nat",
            "rev_nat_v2",
            "svc_pod",
            "links",
        ];
        assert_eq!(stale(dir), ["flows_v2", "rev_nat", "svc_pod"]);
        assert_eq!(pin_name("rev_nat"), "rev_nat_v2");
        assert_eq!(pin_name("flows"), "flows");
    }
}
