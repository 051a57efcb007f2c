//! The `relay` binary: publishes outbox events to Kafka (`relay run`), creates topics
//! (`relay ensure-topics`). Everything is in the `relay_cli` library.

fn main() -> anyhow::Result<()> {
    relay_cli::main()
}
