//! The operator command, `pipeline`: what an operator paged at 3 a.m. needs, against the real
//! databases and Kafka cluster.
//!
//! Layout, one module a command:
//! - [`status`]: the outbox's queue, the relay lease, each group's lag, dead letters and parked
//!   orders, at a bounded cost;
//! - [`trace`]: the history of an order's events across the outbox, the relay and every group;
//! - [`dead_letters`]: list, show, replay, skip, discard;
//! - [`requeue`]: failed outbox events back to pending;
//! - [`reprocess`]: a group's offsets moved back, its dedupe rows kept or cleared.
//!
//! Around them: [`cli`] (flags and environment), [`targets`] (the databases: the outbox's and
//! each group's), [`output`] (tables or JSON) and [`error`] (bad input, exit status 2).
//!
//! Every change is recorded with who made it and why (`operator_action`, in the database it
//! changes, in the same transaction) and shows in `trace`. A program that registers groups of
//! its own runs the same command with [`run`] and its [`consumer::Groups`], so `replay` applies
//! its events with its handlers.

#![warn(missing_docs)]

pub mod cli;
pub mod dead_letters;
pub mod error;
pub mod output;
pub mod reprocess;
pub mod requeue;
pub mod status;
pub mod targets;
pub mod trace;

use consumer::Groups;

use crate::cli::{Cli, Command, OutboxAction};
use crate::targets::Targets;

/// Runs one command of `cli`, printing its result; `groups` gives the handlers `replay` needs.
pub async fn run(cli: Cli, groups: &Groups) -> anyhow::Result<()> {
    let targets = Targets::new(cli.targets);
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
