//! Handing freed memory back to the kernel.

/// glibc keeps what a full round frees (every object read and copied, the
/// plan built again) in its arenas, in pieces too small to give back on
/// its own, so the resident size would grow to several times the heap's
/// peak. `malloc_trim` after each full round returns the free pages of
/// every arena (not pages that still hold a live piece). Other allocators
/// measured no better (docs/notes/2026-11-controller-memory.md). With
/// `cozy_proxy::memory` at debug, the heap is logged after each full
/// round.
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
/// reused by the others instead of staying in its arena. The threads are
/// few and rarely allocate at once, so they do not contend for it. To call
/// before any thread starts.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
