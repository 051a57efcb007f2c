//! What each operation takes, as the command line and the console give it: the targets, each
//! command's actions and arguments. Below both the command line ([`crate::cli`]) and the console,
//! which call the same operations with them.

use clap::Subcommand;
use pipeline_core::db::DEFAULT_DATABASE_URL;
use pipeline_core::kafka::KafkaArgs;

use crate::error::BadInput;

/// The databases and the Kafka cluster the commands read and change.
#[derive(Debug, clap::Args)]
pub struct TargetArgs {
    /// The outbox's database (the relay's, and the service's that appends the events); also
    /// each group's unless --group-database names another.
    #[arg(long, global = true, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// A group whose tables live in a database of its own, as NAME=URL; repeatable (comma
    /// separated in the environment). A group not listed uses --database-url.
    #[arg(long = "group-database", global = true, env = "PIPELINE_GROUP_DATABASES", value_delimiter = ',',
          value_parser = parse_group_database)]
    pub group_databases: Vec<(String, String)>,
    /// The groups to show or act on (names without the prefix): `status` and `trace` show
    /// these (default: every group that owns a partition in the databases given);
    /// `dead-letters` and `reprocess` act on one. A name must be known: registered by this
    /// program, or with rows in its database (processed events, dead letters, partition
    /// owners), or, for `status`, a group id Kafka knows (a live group, or committed offsets on
    /// --topic). Any other name is an error (exit status 2).
    #[arg(
        long = "group",
        global = true,
        env = "CONSUMER_GROUPS",
        value_delimiter = ',',
        value_parser = parse_name
    )]
    pub groups: Vec<String>,
    /// Prefix of the Kafka group ids and of the groups' rows, as the groups run with it.
    #[arg(long, global = true, env = "CONSUMER_GROUP_PREFIX", default_value = "",
          value_parser = parse_name)]
    pub group_prefix: String,
    /// Topics the groups consume (default: the topics each group has owned partitions of, from
    /// its database).
    #[arg(
        long = "topic",
        global = true,
        env = "CONSUMER_TOPICS",
        value_delimiter = ','
    )]
    pub topics: Vec<String>,
    /// The Kafka cluster.
    #[command(flatten)]
    pub kafka: KafkaArgs,
}

/// A group's name or prefix: refused when it holds a control character (an escape sequence, a
/// line break), which would reach the operator's terminal and the logs.
fn parse_name(s: &str) -> Result<String, String> {
    if s.chars().any(char::is_control) {
        return Err(format!("`{}` holds a control character", s.escape_debug()));
    }
    Ok(s.to_owned())
}

fn parse_group_database(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, url))
            if !name.trim().is_empty()
                && !url.trim().is_empty()
                && !name.chars().any(char::is_control) =>
        {
            Ok((name.trim().to_owned(), url.trim().to_owned()))
        }
        _ => Err(format!("`{s}` is not GROUP=URL")),
    }
}

/// `pipeline group …`
#[derive(Debug, Subcommand)]
pub enum GroupAction {
    /// Pause a group: within about a second every member, in every process, finishes the batch
    /// in flight, commits it and takes no new one, keeping its partitions; the lag grows.
    Pause {
        /// The group's name (without the prefix).
        #[arg(value_name = "GROUP")]
        group: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
    /// Resume a paused group: its members go on where they stopped.
    Resume {
        /// The group's name (without the prefix).
        #[arg(value_name = "GROUP")]
        group: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
}

/// `pipeline schedules …`
#[derive(Debug, Subcommand)]
pub enum ScheduleAction {
    /// Every schedule with its next fire times.
    List,
    /// One schedule, its next fire times and its last occurrences with where their events are.
    Show {
        /// The schedule's name.
        name: String,
    },
    /// Add a schedule: each occurrence appends its event once, as a delayed event due at the
    /// occurrence's time.
    Add(AddScheduleArgs),
    /// Pause a schedule: it fires nothing until resumed.
    Pause {
        /// The schedule's name.
        name: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
    /// Resume a paused schedule from its next occurrence after now.
    Resume {
        /// The schedule's name.
        name: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
    /// Remove a schedule (events it already appended stay).
    Remove {
        /// The schedule's name.
        name: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
    /// One extra occurrence now, whatever the schedule's times (paused or not).
    RunNow {
        /// The schedule's name.
        name: String,
        /// Who and why.
        #[command(flatten)]
        change: Change,
    },
}

/// `pipeline schedules add`
#[derive(Debug, clap::Args)]
pub struct AddScheduleArgs {
    /// Its name: 1 to 63 of a-z 0-9 . _ -, starting with a letter or digit.
    pub name: String,
    /// A cron expression: five fields (minute hour day month weekday) or six (seconds first).
    #[arg(long)]
    pub cron: String,
    /// The IANA time zone it is read in.
    #[arg(long, default_value = "UTC")]
    pub time_zone: String,
    /// The event type of its events.
    #[arg(long)]
    pub event_type: String,
    /// The aggregate of its events (their key and sequence) [default: schedule:NAME].
    #[arg(long)]
    pub aggregate: Option<String>,
    /// The topic its events go to.
    #[arg(id = "event_topic", long = "event-topic")]
    pub topic: String,
    /// The payload, JSON; string values may name {{schedule}}, {{fire_at}} and {{local_time}}.
    #[arg(long, default_value = "{}")]
    pub payload: String,
    /// Occurrences that fell due while no relay was active: fire the latest only, all of them,
    /// or none more than a minute late (latest, all, skip).
    #[arg(long, default_value = "latest")]
    pub missed: outbox::schedule::Missed,
    /// Who and why.
    #[command(flatten)]
    pub change: Change,
}

/// `pipeline retention …`
#[derive(Debug, Subcommand)]
pub enum RetentionAction {
    /// Each table's window, what it keeps whatever its age, and its runner's last run.
    Status,
    /// Run every database's retention now, to the end of what is removable (or, with
    /// --dry-run, say what it would remove and remove nothing).
    Run(RetentionRunArgs),
}

/// `pipeline retention run`
#[derive(Debug, clap::Args)]
pub struct RetentionRunArgs {
    /// Remove nothing: every step is rolled back, and the counts say what it would remove.
    #[arg(long)]
    pub dry_run: bool,
    /// Who acts (default: $USER).
    #[arg(long, env = "PIPELINE_ACTOR")]
    pub actor: Option<String>,
    /// Why: kept with the run (not needed with --dry-run).
    #[arg(long)]
    pub note: Option<String>,
}

impl RetentionRunArgs {
    /// The actor: the flag, else `$PIPELINE_ACTOR`, else `$USER`.
    pub fn actor(&self) -> Result<String, BadInput> {
        Change {
            actor: self.actor.clone(),
            note: String::new(),
        }
        .actor()
    }
}

/// Who makes a change and why; recorded with it and shown by `trace`.
#[derive(Debug, Clone, clap::Args)]
pub struct Change {
    /// Who acts (default: $USER).
    #[arg(long, env = "PIPELINE_ACTOR")]
    pub actor: Option<String>,
    /// Why: kept with the change.
    #[arg(long)]
    pub note: String,
}

impl Change {
    /// The actor: the flag, else `$PIPELINE_ACTOR`, else `$USER`.
    pub fn actor(&self) -> Result<String, BadInput> {
        self.actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|a| !a.trim().is_empty())
            .ok_or(BadInput::NoActor)
    }
}

/// `pipeline outbox …`
#[derive(Debug, Subcommand)]
pub enum OutboxAction {
    /// Set failed events back to pending: the relay publishes them, then their orders' held
    /// events, in sequence order.
    Requeue(RequeueArgs),
}

/// Which failed events to requeue: at least one filter.
#[derive(Debug, clap::Args)]
pub struct RequeueArgs {
    /// This event (its event id); repeatable.
    #[arg(long = "event")]
    pub events: Vec<uuid::Uuid>,
    /// The failed events of this aggregate (an order id, for the order service's events).
    #[arg(long, visible_alias = "order")]
    pub aggregate: Option<String>,
    /// Failed events whose last error contains this text.
    #[arg(long)]
    pub error: Option<String>,
    /// Every failed event.
    #[arg(long, conflicts_with_all = ["events", "aggregate", "error"])]
    pub all: bool,
    /// Who and why.
    #[command(flatten)]
    pub change: Change,
}

/// `pipeline dead-letters --group G …`
#[derive(Debug, clap::Args)]
pub struct DeadLetterArgs {
    /// Dead-letter topic template, as the groups run with it; empty: do not publish dead
    /// letters raised while releasing parked events.
    #[arg(long, env = "DEAD_LETTER_TOPIC", default_value = "{topic}.dlq")]
    pub dead_letter_topic: String,
    /// What to do.
    #[command(subcommand)]
    pub action: DeadLetterAction,
}

/// Which dead letters: one id, or all that match the filters.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LetterFilter {
    /// Only this dead letter.
    #[arg(long)]
    pub id: Option<i64>,
    /// Only letters whose reason contains this text.
    #[arg(long)]
    pub reason: Option<String>,
    /// Only letters recorded at or after this time (RFC 3339, e.g. 2026-11-25T03:00:00Z).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only letters recorded before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only this aggregate's letters.
    #[arg(long, visible_alias = "order")]
    pub aggregate: Option<String>,
}

impl LetterFilter {
    /// True when no filter is given: an action then needs `--all`.
    pub fn is_empty(&self) -> bool {
        self.id.is_none()
            && self.reason.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.aggregate.is_none()
    }
}

/// `pipeline dead-letters --group G <action>`
#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// List letters, oldest first.
    List {
        /// Which letters.
        #[command(flatten)]
        filter: LetterFilter,
        /// Only letters in this state: open, replayed, skipped or discarded (default: open).
        #[arg(long, default_value = "open")]
        status: String,
    },
    /// One letter whole: its record, reason, attempts and the events parked behind it.
    Show {
        /// The dead letter's id.
        id: i64,
    },
    /// Apply the events again (after fixing their cause), then their orders' parked events.
    Replay(LetterAction),
    /// Pass over the events for good: their orders move past them and their parked events
    /// are applied in sequence. Works for unreadable records too.
    Skip(LetterAction),
    /// Close letters that hold no order back (nothing parked behind them).
    Discard(LetterAction),
}

/// The letters a changing action takes, and who and why.
#[derive(Debug, clap::Args)]
pub struct LetterAction {
    /// Which open letters.
    #[command(flatten)]
    pub filter: LetterFilter,
    /// Every open letter of the group (when no filter is given).
    #[arg(long)]
    pub all: bool,
    /// For an unreadable record whose key is not an aggregate id (none, not UTF-8, a NUL): the
    /// aggregate it held back (`skip` only). Without it such a letter is closed, moving no
    /// aggregate.
    #[arg(long = "for-aggregate", visible_alias = "for-order")]
    pub for_aggregate: Option<String>,
    /// Who and why.
    #[command(flatten)]
    pub change: Change,
}

/// `pipeline reprocess --group G --from …`
#[derive(Debug, clap::Args)]
pub struct ReprocessArgs {
    /// Where to start again: a time (RFC 3339) or an offset (applied to every partition).
    #[arg(long, value_parser = parse_position)]
    pub from: Position,
    /// Also forget that the group processed the events from there on (their dedupe rows, and
    /// each order's progress back to before its first such event), so their effects are applied
    /// a second time. Without it, old events are recognised and skipped: effects stay once-only.
    #[arg(long, default_value_t = false)]
    pub clear_dedupe: bool,
    /// Who and why.
    #[command(flatten)]
    pub change: Change,
}

/// Where `reprocess` starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// The first record at or after this time, in each partition.
    Time(chrono::DateTime<chrono::Utc>),
    /// This offset in each partition.
    Offset(i64),
}

fn parse_time(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("`{s}` is not an RFC 3339 time (e.g. 2026-11-25T03:00:00Z): {e}"))
}

fn parse_position(s: &str) -> Result<Position, String> {
    if let Ok(offset) = s.parse::<i64>() {
        if offset < 0 {
            return Err(format!("offset {offset} is negative"));
        }
        return Ok(Position::Offset(offset));
    }
    parse_time(s)
        .map(Position::Time)
        .map_err(|_| format!("`{s}` is neither an offset nor an RFC 3339 time"))
}
