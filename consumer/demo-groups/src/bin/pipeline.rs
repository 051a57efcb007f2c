//! The operator command with the demonstration's groups registered (inventory, notification,
//! export), so `dead-letters replay` applies their events with their handlers.

use std::process::ExitCode;
use std::sync::Arc;

use demo_groups::export::ExportSettings;
use demo_groups::notification::LoggingSender;

fn main() -> ExitCode {
    match demo_groups::groups(Arc::new(LoggingSender), ExportSettings::default()) {
        Ok(groups) => operator::main(groups),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
