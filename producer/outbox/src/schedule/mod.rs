//! Recurring schedules: a cron expression in a time zone, and the event each occurrence appends
//! to the outbox.
//!
//! A schedule is a row of `outbox_schedule` ([`add_schedule`], [`set_enabled`],
//! [`remove_schedule`], [`run_now`], in the caller's transaction). The active relay materialises
//! each occurrence that falls due ([`materialise_due`]) as a delayed event whose publish time is
//! the occurrence's, once: `outbox_schedule_occurrence` holds one row per (schedule, fire time),
//! and the event's business fact (`schedule:<name>:<fire time>`) is unique too. The relay then
//! publishes it like any delayed event; a schedule's events are one aggregate, so they are
//! applied in occurrence order.
//!
//! Layout: [`times`] (cron expressions, time zones and daylight saving), [`store`] (the rows and
//! what changes them), [`materialise`] (due occurrences to delayed events, and the
//! missed-occurrence policy).

pub mod materialise;
mod occurrence;
pub mod store;
pub mod times;

pub use materialise::{materialise_due, Materialised, MISSED_GRACE};
pub use store::{
    add_schedule, get_schedule, list_schedules, occurrences, remove_schedule, run_now,
    schedule_floor, set_enabled, Occurrence, ScheduleRow,
};
pub use times::{fire_times, CronTimes};

use serde_json::Value;

/// What occurrences that fell due while no relay was active become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missed {
    /// Only the latest is fired; the others are recorded `skipped`.
    Latest,
    /// Every one is fired, in order.
    All,
    /// None more than [`MISSED_GRACE`] late is fired; each is recorded `skipped`.
    Skip,
}

impl Missed {
    /// Its name in `outbox_schedule.missed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Missed::Latest => "latest",
            Missed::All => "all",
            Missed::Skip => "skip",
        }
    }
}

impl std::str::FromStr for Missed {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "latest" => Ok(Missed::Latest),
            "all" => Ok(Missed::All),
            "skip" => Ok(Missed::Skip),
            other => Err(format!(
                "`{other}` is not a missed-occurrence policy: latest, all or skip"
            )),
        }
    }
}

/// A schedule to add.
#[derive(Debug, Clone)]
pub struct NewSchedule {
    /// Its name: 1 to 63 of `a-z 0-9 . _ -`, starting with a letter or digit.
    pub name: String,
    /// A cron expression: six fields (seconds first) or the usual five (minute first).
    pub cron: String,
    /// The IANA time zone it is evaluated in (e.g. `Europe/Berlin`, `UTC`).
    pub time_zone: String,
    /// The event type each occurrence appends.
    pub event_type: String,
    /// The aggregate of its events (their Kafka key and sequence).
    pub aggregate_id: String,
    /// The topic its events go to.
    pub topic: String,
    /// The payload: string values may name `{{schedule}}`, `{{fire_at}}` (UTC, RFC 3339) and
    /// `{{local_time}}` (the wall-clock time in the schedule's zone).
    pub payload: Value,
    /// What missed occurrences become.
    pub missed: Missed,
}

/// Why a schedule could not be added or changed; nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// The name is not 1 to 63 of `a-z 0-9 . _ -` starting with a letter or digit.
    #[error(
        "`{0}` is not a schedule name: 1 to 63 of a-z 0-9 . _ -, starting with a letter or digit"
    )]
    InvalidName(String),
    /// The cron expression does not parse, or never fires.
    #[error("invalid cron expression `{expression}`: {reason}")]
    InvalidCron {
        /// The expression given.
        expression: String,
        /// Why.
        reason: String,
    },
    /// Not an IANA time zone name.
    #[error("`{0}` is not a time zone (an IANA name such as Europe/Berlin or UTC)")]
    InvalidTimeZone(String),
    /// Two occurrences come closer together than the deployment's floor allows.
    #[error(
        "`{expression}` fires every {every:?} at times, more often than this database's floor of \
         {floor:?} (outbox_schedule_floor, set by whoever owns the database)"
    )]
    TooFrequent {
        /// The expression given.
        expression: String,
        /// The shortest gap between its next occurrences.
        every: std::time::Duration,
        /// The floor.
        floor: std::time::Duration,
    },
    /// A schedule with this name exists.
    #[error("a schedule named `{0}` already exists")]
    Duplicate(String),
    /// No schedule has this name.
    #[error("no schedule named `{0}`")]
    NotFound(String),
    /// The event an occurrence would append is refused by the outbox's checks.
    #[error("its events would be refused: {0}")]
    Event(#[from] crate::EnqueueError),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
