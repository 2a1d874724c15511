//! The `mrtr-gateway` binary; see `cli` for the commands.

/// jemalloc: the pending-flow footprint and pass-through throughput measured in
/// benches/RESULTS.md are better with it than with the system allocator.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    mrtr_gateway::cli::main()
}
