//! The operator command, `pipeline`: what an operator paged at 3 a.m. needs, against the real
//! databases and Kafka cluster.
//!
//! Layout, one module a command:
//! - [`status`]: the outbox's queue, the relay lease, each group's lag, dead letters and parked
//!   orders, at a bounded cost;
//! - [`trace`]: the history of an order's events across the outbox, the relay and every group;
//! - [`dead_letters`]: list, show, replay, skip, discard;
//! - [`requeue`]: failed outbox events back to pending;
//! - [`reprocess`]: a group's offsets moved back, its dedupe rows kept or cleared;
//! - [`group`]: a group paused everywhere it runs (its members keep their partitions and take
//!   no batch), and resumed;
//! - [`retention`]: each table's window and last run; a run by hand, or a dry run;
//! - [`schedules`]: the outbox's recurring schedules, their occurrences, and changes to them;
//! - [`console`]: the web console (`pipeline console --listen ADDR`): the same reads and actions
//!   from pages, for logged-in users with a role.
//!
//! Around them: [`cli`] (the command line: flags and environment), [`args`] (each operation's
//! inputs, as the command line and the console give them), [`targets`] (what the commands act on: the
//! outbox's database and each group's, the known groups and their topics), [`output`] (tables
//! or JSON) and [`error`] (bad input, exit status 2). [`main`] and [`run`] are the entries.
//!
//! Every change is recorded with who made it and why (`operator_action`, in the database it
//! changes, in the same transaction) and shows in `trace`.
//!
//! A program's `pipeline` binary is one line: [`main`] with the program's registered groups, so
//! `replay` applies their events with their handlers and every command knows their names:
//!
//! ```no_run
//! # struct Shipping;
//! # impl consumer::Handler for Shipping {
//! #     fn group(&self) -> &str { "shipping" }
//! #     fn transaction(&self) -> Box<dyn consumer::HandlerTransaction + '_> { unimplemented!() }
//! # }
//! fn main() -> std::process::ExitCode {
//!     operator::main(consumer::Groups::new().register("shipping", |_| Shipping))
//! }
//! ```
//!
//! A group name must be known: registered by the program, holding rows in its database
//! (processed events, dead letters, partition owners) or, for `status`, a group id Kafka knows.
//! Any other name is bad input (see [`targets`]).

#![deny(missing_docs)]

pub mod args;
pub mod cli;
pub mod console;
pub mod dead_letters;
pub mod error;
pub mod group;
pub mod output;
pub mod reprocess;
pub mod requeue;
pub mod retention;
pub mod schedules;
pub mod status;
pub mod targets;
pub mod trace;

use std::process::ExitCode;

use consumer::Groups;
use pipeline_core::telemetry::{self, LogArgs};

use crate::args::OutboxAction;
use crate::cli::{Cli, Command};
use crate::error::exit_code;
use crate::targets::Targets;

/// The `pipeline` command of a program whose groups are `groups`: parses the command line, runs
/// the command, prints its result (errors to stderr) and returns the exit status: 0, 2 for bad
/// input (an unknown group, a letter that does not exist, …), 1 for anything else.
pub fn main(groups: Groups) -> ExitCode {
    let cli = <Cli as clap::Parser>::parse();
    // Results go to stdout; only warnings are logged (to stderr) unless RUST_LOG says more.
    telemetry::init(&LogArgs {
        log_json: false,
        log: std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
    });
    let result = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(run(cli, &groups)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", output::shown(&format!("{e:#}")));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Runs one command of `cli`, printing its result; `groups` are the program's registered groups
/// (the names every command knows, the handlers `replay` needs).
pub async fn run(cli: Cli, groups: &Groups) -> anyhow::Result<()> {
    let targets = Targets::new(cli.targets, groups);
    let json = cli.json;
    match cli.command {
        Command::Status => {
            let status = status::read(&targets).await?;
            if json {
                output::json(&status)
            } else {
                status::print(&status);
                Ok(())
            }
        }
        Command::Trace { id } => {
            let trace = trace::read(&targets, &id).await?;
            if json {
                output::json(&trace)
            } else {
                trace::print(&trace);
                Ok(())
            }
        }
        Command::DeadLetters(args) => dead_letters::run(&targets, &args, groups, json).await,
        Command::Outbox {
            action: OutboxAction::Requeue(args),
        } => {
            let requeued = requeue::requeue(&targets.outbox().await?, &args).await?;
            if json {
                output::json(&requeued)
            } else {
                requeue::print(&requeued);
                Ok(())
            }
        }
        Command::Group { action } => group::run(&targets, &action, json).await,
        Command::Schedules { action } => schedules::run(&targets, &action, json).await,
        Command::Retention { action } => retention::run(&targets, &action, json).await,
        Command::Console(args) => console::run(targets, groups.clone(), &args).await,
        Command::Reprocess(args) => {
            let done = reprocess::reprocess(&targets, &args).await?;
            if json {
                output::json(&done)
            } else {
                reprocess::print(&done);
                Ok(())
            }
        }
    }
}
