//! The operator command with the demonstration's groups registered (inventory, notification,
//! export), so `dead-letters replay` applies their events with their handlers.

use std::process::ExitCode;
use std::sync::Arc;

use demo_groups::export::ExportSettings;
use demo_groups::notification::{DispatchSettings, LoggingSender};

fn main() -> ExitCode {
    let groups = demo_groups::groups(
        Arc::new(LoggingSender),
        DispatchSettings::default(),
        ExportSettings::default(),
    );
    match groups {
        Ok(groups) => operator::main(groups),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
