//! The command line of `pipeline`; every shared flag also reads an environment variable. The
//! commands' arguments, which are also the operations' inputs, are in [`crate::args`].

use clap::{Parser, Subcommand};

use crate::args::{
    DeadLetterArgs, GroupAction, OutboxAction, ReprocessArgs, RetentionAction, ScheduleAction,
    TargetArgs,
};

/// Operate the pipeline: see where events are, follow one aggregate, unblock what is stuck.
#[derive(Debug, Parser)]
#[command(name = "pipeline", version)]
pub struct Cli {
    /// Where the outbox, the groups and Kafka are.
    #[command(flatten)]
    pub targets: TargetArgs,
    /// Print JSON instead of tables, for scripts.
    #[arg(long, global = true, env = "PIPELINE_JSON", default_value_t = false)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// One screen: the outbox's queue, the active relay, each group's lag, dead letters and
    /// parked orders. Reads a bounded amount whatever the tables' size.
    Status,
    /// The history of an order's events (or of one event), in time order: written, each publish
    /// attempt, published (partition, offset), and what each group did with it, with every
    /// operator action.
    Trace {
        /// An order id, an event id (a UUID), a schedule's name, or the key of a dead letter that
        /// names no order, escaped as `dead-letters show` prints it (e.g. `'\xff\xfe'`).
        id: String,
    },
    /// A group's (`--group G`) dead letters: list, show, replay, skip or discard.
    DeadLetters(DeadLetterArgs),
    /// The outbox's failed events.
    Outbox {
        /// What to do.
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Move a stopped group (`--group G`) back so it reads old events again.
    Reprocess(ReprocessArgs),
    /// Pause a consumer group everywhere it runs, or resume it.
    Group {
        /// What to do.
        #[command(subcommand)]
        action: GroupAction,
    },
    /// The outbox's recurring schedules: list, show, add, pause, resume, remove, run-now.
    Schedules {
        /// What to do.
        #[command(subcommand)]
        action: ScheduleAction,
    },
    /// What retention keeps and last removed in each database; run it by hand.
    Retention {
        /// What to do.
        #[command(subcommand)]
        action: RetentionAction,
    },
    /// The web console: the overview, an order's timeline and every action here from a page,
    /// for logged-in users (`--users-file` or `PIPELINE_CONSOLE_USERS`).
    Console(crate::console::ConsoleArgs),
}
