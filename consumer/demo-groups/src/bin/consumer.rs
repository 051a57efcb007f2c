//! The demonstration's `consumer` binary: runs its groups, seeds the inventory's stock, reports
//! what a run did (`demo_groups::consumer_command`).

fn main() -> anyhow::Result<()> {
    demo_groups::consumer_command::main()
}
