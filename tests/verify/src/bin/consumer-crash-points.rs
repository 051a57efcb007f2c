//! The demonstration's `consumer` binary with the libraries' crash points armed from the
//! environment (`PIPELINE_CRASH_AT`, `PIPELINE_CRASH_TRIGGER`): the verification run's consumers.

fn main() -> anyhow::Result<()> {
    demo_groups::consumer_command::main_with_crash_points()
}
