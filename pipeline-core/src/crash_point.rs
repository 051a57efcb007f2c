//! Crash points for fault-injection runs: with the `fault-injection` feature, a process aborts at
//! the named point when `PIPELINE_CRASH_AT` names it and the file `PIPELINE_CRASH_TRIGGER` exists
//! (the file is removed first, so one trigger is one crash). An abort, like SIGKILL, runs no
//! cleanup. Without the feature this compiles to nothing.

/// The relay received every delivery report of a batch and has not marked it published yet.
pub const RELAY_AFTER_DELIVERY: &str = "relay-after-delivery";
/// A consumer committed a batch's transaction and has not committed its offset yet.
pub const CONSUMER_AFTER_DB_COMMIT: &str = "consumer-after-db-commit";

/// Aborts the process here when armed (see the module docs).
#[cfg(feature = "fault-injection")]
pub fn crash_point(name: &str) {
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<(String, String)>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        match (
            std::env::var("PIPELINE_CRASH_AT"),
            std::env::var("PIPELINE_CRASH_TRIGGER"),
        ) {
            (Ok(point), Ok(trigger)) => Some((point, trigger)),
            _ => None,
        }
    });
    if let Some((point, trigger)) = armed {
        if point == name && std::fs::remove_file(trigger).is_ok() {
            eprintln!("crash point {name} reached: aborting");
            std::process::abort();
        }
    }
}

/// Aborts the process here when armed (see the module docs).
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn crash_point(_name: &str) {}
