//! The `mrtr-gateway` binary; see `cli` for the commands.

/// jemalloc: the pending-flow footprint and pass-through throughput measured in
/// benches/RESULTS.md are better with it than with the system allocator (feature
/// `jemalloc`, on by default).
#[cfg(feature = "jemalloc")]
mod allocator {
    #[global_allocator]
    static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

    /// jemalloc's options, read before `main`: a background thread returns pages freed
    /// after a burst of requests to the system within about a second (`dirty_decay_ms`),
    /// rather than only when later allocations happen to purge them, so an idle gateway's
    /// RSS is the memory it holds (pending flows, pools), which is what a sidecar's limit
    /// is sized by. `_RJEM_MALLOC_CONF` in the environment still overrides any of them.
    #[unsafe(export_name = "_rjem_malloc_conf")]
    static MALLOC_CONF: MallocConf =
        MallocConf(c"background_thread:true,dirty_decay_ms:1000".as_ptr());

    /// The `const char *` jemalloc reads.
    #[repr(transparent)]
    struct MallocConf(*const std::ffi::c_char);

    // SAFETY: it points at a static C string, which nothing writes.
    unsafe impl Sync for MallocConf {}
}

fn main() -> std::process::ExitCode {
    mrtr_gateway::cli::main()
}
