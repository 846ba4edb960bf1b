//! Many map elements written, deleted or read in one syscall
//! (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`, `BPF_MAP_LOOKUP_BATCH`,
//! Linux 5.6): a full sync writes hundreds of thousands of elements, and
//! one syscall each was most of the eBPF backend's sync time (aya 0.14 has
//! no batch call). What a batch does not do (an older kernel, a full map,
//! a key already gone) is left to the caller's one-element path, which
//! reports it as before.
use aya::maps::{IterableMap, MapData};
use aya::Pod;
use std::os::fd::{AsFd, AsRawFd};
use tracing::debug;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Writes `count` elements into `map`: `keys` and `values` point at them
/// back to back, each as long as the map's key and value (for a per-CPU
/// map, a value is one 8-byte-aligned copy per possible CPU). Returns how
/// many were written: all of them, or those before the error that stopped
/// the batch.
///
/// # Safety
/// `keys` and `values` must each point at `count` elements of the map's
/// key and value size.
unsafe fn update_raw(map: &MapData, keys: *const u8, values: *const u8, count: usize) -> usize {
    // SAFETY: the caller's promise, passed on.
    unsafe { batch_raw(BPF_MAP_UPDATE_BATCH, map, keys, values, count) }
}

/// The bpf(2) batch command `cmd` with `attr`.
///
/// # Safety
/// The pointers in `attr` must point at what `cmd` reads and writes.
unsafe fn sys_bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    // SAFETY: the caller's promise about `attr`'s pointers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>(),
        )
    };
    match ret {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// One batch command `cmd` over `count` keys (and values, for an update);
/// how many it did.
///
/// # Safety
/// `keys` (and `values`, unless null) must each point at `count` elements
/// of the map's key and value size.
unsafe fn batch_raw(
    cmd: libc::c_long,
    map: &MapData,
    keys: *const u8,
    values: *const u8,
    count: usize,
) -> usize {
    let Ok(n) = u32::try_from(count) else {
        return 0;
    };
    if count == 0 {
        return 0;
    }
    let mut attr = BatchAttr {
        keys: keys as u64,
        values: values as u64,
        count: n,
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` points at `count` keys and values laid out as the
    // map's (the caller's promise); the kernel reads them and writes back
    // `count` only.
    let Err(error) = (unsafe { sys_bpf(cmd, &mut attr) }) else {
        return count;
    };
    // On an error the kernel says how many went in before it.
    let done = (attr.count as usize).min(count);
    debug!(%error, done, count, cmd, "batch map command stopped; the rest one by one");
    done
}

/// Writes `keys[i]` -> `values[i]` into `map`, as many as a batch takes;
/// returns how many (the caller writes the rest one by one, handling a
/// full map as it wants).
pub fn write<M, K, V>(map: &M, keys: &[K], values: &[V]) -> usize
where
    M: IterableMap<K, V>,
    K: Pod,
    V: Pod,
{
    let count = keys.len().min(values.len());
    // SAFETY: a typed aya map checked when it was opened that K and V are
    // as long as its key and value; the slices hold `count` of each.
    unsafe {
        update_raw(
            map.map(),
            keys.as_ptr().cast(),
            values.as_ptr().cast(),
            count,
        )
    }
}

/// Deletes `keys` from `map`, as many as a batch takes; returns how many
/// (a batch stops at a key that is not there: the caller deletes the rest
/// one by one, a missing key being no error).
pub fn delete<M, K, V>(map: &M, keys: &[K]) -> usize
where
    M: IterableMap<K, V>,
    K: Pod,
    V: Pod,
{
    // SAFETY: a typed aya map checked when it was opened that K is as long
    // as its key; a delete reads no values.
    unsafe {
        batch_raw(
            BPF_MAP_DELETE_BATCH,
            map.map(),
            keys.as_ptr().cast(),
            std::ptr::null(),
            keys.len(),
        )
    }
}

/// Zeroes the values of `indexes` in per-CPU array `map` (values of
/// `value_size` bytes), as many as a batch takes; returns how many.
pub fn zero_per_cpu(map: &MapData, indexes: &[u32], value_size: usize, cpus: usize) -> usize {
    let per_element = value_size.div_ceil(8) * 8 * cpus;
    let zeros = vec![0u8; per_element * indexes.len()];
    // SAFETY: u32 array indexes, and `cpus` 8-byte-aligned values per
    // index, as the kernel lays out a per-CPU array's value.
    unsafe { update_raw(map, indexes.as_ptr().cast(), zeros.as_ptr(), indexes.len()) }
}

/// Bytes of values one read of [`read_per_cpu`] asks for at most.
const READ_BYTES: usize = 256 * 1024;

/// Reads the elements of per-CPU array `map` (values `V`, one per
/// possible CPU of `cpus`), a few hundred KiB per syscall: `each(index,
/// values)` for each, in order, until it returns false. Not one lookup per
/// element: every counters period, on the datapath's thread, a change
/// arriving meanwhile would wait for them all. An error (an
/// older kernel) is the caller's to handle, having seen the elements
/// before it.
pub fn read_per_cpu<V: Pod>(
    map: &MapData,
    cpus: usize,
    mut each: impl FnMut(u32, &[V]) -> bool,
) -> std::io::Result<()> {
    let stride = std::mem::size_of::<V>().div_ceil(8) * 8;
    let per_element = stride * cpus.max(1);
    let chunk = (READ_BYTES / per_element).max(1);
    let mut keys = vec![0u32; chunk];
    // u64s: the kernel's 8-byte-aligned per-CPU values.
    let mut values = vec![0u64; chunk * per_element / 8];
    let mut per_cpu: Vec<V> = Vec::with_capacity(cpus);
    let (mut from, mut next) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            // The first read starts at the first index; the others after
            // the last one read.
            in_batch: if first { 0 } else { &from as *const u32 as u64 },
            out_batch: &mut next as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: map.fd().as_fd().as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `keys` and `values` have room for `count` array indexes
        // and per-CPU values; `in_batch` and `out_batch` point at an index.
        // ENOENT: the end of the array, after `count` more.
        let end = match unsafe { sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) } {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e),
        };
        let got = (attr.count as usize).min(chunk);
        let bytes = values.as_ptr().cast::<u8>();
        for (i, index) in keys.iter().enumerate().take(got) {
            per_cpu.clear();
            for cpu in 0..cpus {
                // SAFETY: within `values` (element `i` of `got` <= `chunk`,
                // CPU `cpu` of `cpus`); read unaligned, as `V` may ask more
                // alignment than the u64s give.
                per_cpu.push(unsafe {
                    std::ptr::read_unaligned(bytes.add(i * per_element + cpu * stride).cast::<V>())
                });
            }
            if !each(*index, &per_cpu) {
                return Ok(());
            }
        }
        if end || got == 0 {
            return Ok(());
        }
        from = next;
        first = false;
    }
}

/// Against maps of the kernel's: they need root (CAP_BPF), so the
/// rootless tier (`cargo xtask test --unit`) skips every `kernel_tests`.
#[cfg(test)]
mod kernel_tests {
    use super::*;
    use aya::maps::{HashMap, Map, PerCpuArray};
    use std::os::fd::{FromRawFd, OwnedFd};

    /// A new map of the kernel's (root only): `(type, key, value, max)`.
    fn create(map_type: u32, key_size: u32, value_size: u32, max_entries: u32) -> MapData {
        let mut attr = [0u32; 16];
        attr[..4].copy_from_slice(&[map_type, key_size, value_size, max_entries]);
        // SAFETY: BPF_MAP_CREATE reads the first fields of `attr`.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                0,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        assert!(
            fd >= 0,
            "BPF_MAP_CREATE: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: the syscall gave us this new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        MapData::from_fd(fd).expect("map data")
    }

    #[test]
    fn a_batch_writes_every_element_or_says_where_it_stopped() {
        const HASH: u32 = 1;
        let data = create(HASH, 4, 8, 3);
        let map: HashMap<MapData, u32, u64> = HashMap::try_from(Map::HashMap(data)).expect("typed");
        let keys = [10u32, 11, 12, 13, 14];
        let values = [100u64, 110, 120, 130, 140];
        // Room for three of five: the first three go in, and it says so.
        assert_eq!(write(&map, &keys, &values), 3);
        for (k, v) in keys.iter().zip(&values).take(3) {
            assert_eq!(map.get(k, 0).expect("written"), *v);
        }
        assert!(map.get(&13, 0).is_err());
        // Rewriting present keys takes no more room.
        assert_eq!(write(&map, &keys[..3], &[1, 2, 3]), 3);
        assert_eq!(map.get(&12, 0).expect("rewritten"), 3);
        // A delete stops at the first key not there (13), after 10.
        assert_eq!(delete(&map, &[10, 13, 11]), 1);
        assert!(map.get(&10, 0).is_err());
        assert_eq!(map.get(&11, 0).expect("kept"), 2);
        assert_eq!(delete(&map, &[11, 12]), 2);
        assert!(map.get(&11, 0).is_err() && map.get(&12, 0).is_err());
    }

    #[test]
    fn a_per_cpu_array_is_read_whole_in_batches() {
        const PERCPU_ARRAY: u32 = 6;
        let cpus = aya::util::nr_cpus().expect("cpus");
        // More elements than one read takes, and not a multiple of it.
        let len = (READ_BYTES / (16 * cpus)) as u32 * 2 + 7;
        let data = create(PERCPU_ARRAY, 4, 16, len);
        let mut map: PerCpuArray<MapData, [u64; 2]> =
            PerCpuArray::try_from(Map::PerCpuArray(data)).expect("typed");
        for i in (0..len).step_by(3) {
            let values: Vec<[u64; 2]> = (0..cpus as u64).map(|c| [i as u64, c]).collect();
            let values = aya::maps::PerCpuValues::try_from(values).expect("values");
            map.set(i, values, 0).expect("set");
        }
        let mut seen = Vec::new();
        read_per_cpu::<[u64; 2]>(IterableMap::map(&map), cpus, |i, values| {
            let want: Vec<[u64; 2]> = match i % 3 {
                0 => (0..cpus as u64).map(|c| [i as u64, c]).collect(),
                _ => vec![[0, 0]; cpus],
            };
            assert_eq!(values, want.as_slice(), "index {i}");
            seen.push(i);
            true
        })
        .expect("read");
        assert_eq!(seen, (0..len).collect::<Vec<_>>());
        // Stopped where asked.
        let mut last = 0;
        read_per_cpu::<[u64; 2]>(IterableMap::map(&map), cpus, |i, _| {
            last = i;
            i < len - 10
        })
        .expect("read");
        assert_eq!(last, len - 10);
    }

    #[test]
    fn per_cpu_counters_are_zeroed_in_one_batch() {
        const PERCPU_ARRAY: u32 = 6;
        let cpus = aya::util::nr_cpus().expect("cpus");
        let data = create(PERCPU_ARRAY, 4, 16, 8);
        let mut map: PerCpuArray<MapData, [u64; 2]> =
            PerCpuArray::try_from(Map::PerCpuArray(data)).expect("typed");
        for i in 0..8 {
            let ones = aya::maps::PerCpuValues::try_from(vec![[7u64, 7]; cpus]).expect("values");
            map.set(i, ones, 0).expect("set");
        }
        assert_eq!(zero_per_cpu(IterableMap::map(&map), &[1, 5], 16, cpus), 2);
        for i in 0..8 {
            let values = map.get(&i, 0).expect("get");
            let want = if i == 1 || i == 5 { [0, 0] } else { [7, 7] };
            assert!(values.iter().all(|v| *v == want), "index {i}: {values:?}");
        }
    }
}
