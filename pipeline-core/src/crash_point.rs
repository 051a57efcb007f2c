//! Crash points for fault-injection runs. A process aborts at the named point when it was armed
//! (the verification run's crash-point binaries call [`arm_from_env`] first), when
//! `PIPELINE_CRASH_AT` names the point and the file `PIPELINE_CRASH_TRIGGER` exists (the file is
//! removed first, so one trigger is one crash). An abort, like SIGKILL, runs no cleanup.
//!
//! The libraries carry the points; only a binary arms them. A process that never armed them
//! (every production build) passes each point with one atomic load: no environment is read and
//! nothing can make it abort. So the verification run's crash-point binaries differ from the
//! normal ones only in their `main`, and building them recompiles no library.

use std::sync::OnceLock;

/// The relay received every delivery report of a batch and has not marked it published yet.
pub const RELAY_AFTER_DELIVERY: &str = "relay-after-delivery";
/// A consumer committed a batch's transaction and has not committed its offset yet.
pub const CONSUMER_AFTER_DB_COMMIT: &str = "consumer-after-db-commit";

/// The armed point and its trigger file; unset unless a crash-point binary armed it.
static ARMED: OnceLock<(String, String)> = OnceLock::new();

/// Arms the crash point `PIPELINE_CRASH_AT` names, with its trigger file
/// `PIPELINE_CRASH_TRIGGER`, when both are set. Only binaries built for fault injection call it.
pub fn arm_from_env() {
    if let (Ok(point), Ok(trigger)) = (
        std::env::var("PIPELINE_CRASH_AT"),
        std::env::var("PIPELINE_CRASH_TRIGGER"),
    ) {
        let _ = ARMED.set((point, trigger));
    }
}

/// Aborts the process here when this point is armed and its trigger file exists (see the module
/// docs).
#[inline]
pub fn crash_point(name: &str) {
    if let Some((point, trigger)) = ARMED.get() {
        if point == name && std::fs::remove_file(trigger).is_ok() {
            eprintln!("crash point {name} reached: aborting");
            std::process::abort();
        }
    }
}
