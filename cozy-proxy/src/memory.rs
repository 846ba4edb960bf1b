//! Handing freed memory back to the kernel.

/// glibc keeps what a full round frees (every object read and copied, the
/// plan built again) in its arenas, in pieces too small to give back on
/// its own: measured at 10 000 Services, 86 MiB resident for a 14 MiB heap
/// peak (heaptrack). `malloc_trim` returns the free pages of every arena,
/// but not pages that still hold a live piece: at 50 000 + 50 000 Services
/// through the API, 110 MiB in use (mallinfo2, with the allocator's
/// headers; heaptrack: 97 MiB of live data) stay 155 MiB resident after
/// it (148 MiB with [`one_arena`], of which 12 MiB is the program's code).
/// jemalloc with immediate decay measured 122 MiB there, with its default
/// decay and a purge here 148 MiB: not taken (a C dependency for less than
/// the long-lived state's own size would save). With `cozy_proxy::memory`
/// at debug, the heap is logged after each full round.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks the allocator's own free lists.
        unsafe {
            libc::malloc_trim(0);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            // SAFETY: mallinfo2 only reads the allocator's counters.
            let info = unsafe { libc::mallinfo2() };
            let mib = |b: usize| b as f64 / f64::from(1 << 20);
            tracing::debug!(
                in_use_mib = mib(info.uordblks + info.hblkhd),
                free_mib = mib(info.fordblks),
                "heap after handing freed memory back"
            );
        }
    }
}

/// One malloc arena for every thread, instead of one per thread that
/// contends: the Kubernetes objects are read on the runtime's threads and
/// the plan built on the datapath's, and what one thread frees is then
/// reused by the others instead of staying in its arena. Measured through
/// the API at 50 000 + 50 000 Services: peak RSS 168-174 -> 159 MiB (nft),
/// 187-188 -> 176 MiB (eBPF), the change latency unchanged (few threads,
/// and they rarely allocate at once). To call before any thread starts.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
