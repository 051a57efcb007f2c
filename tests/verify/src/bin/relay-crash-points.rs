//! The `relay` binary with the libraries' crash points armed from the environment
//! (`PIPELINE_CRASH_AT`, `PIPELINE_CRASH_TRIGGER`): the verification run's relays.

fn main() -> anyhow::Result<()> {
    relay_cli::main_with_crash_points()
}
