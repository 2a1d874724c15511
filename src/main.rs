//! The `mrtr-gateway` binary; see `cli` for the commands.

fn main() -> std::process::ExitCode {
    mrtr_gateway::cli::main()
}
