//! The demonstration's consumer groups, built on the consumer library as an adopter's own groups
//! would be: each a [`consumer::Handler`] registered in a [`consumer::Groups`] by [`groups`].
//!
//! - [`inventory`]: reserves stock when an order is placed, releases or settles it later.
//! - [`notification`]: records the notification each order event calls for; a dispatcher beside
//!   the group sends them.
//! - [`export`]: the order service's export jobs: the handler starts each requested job, a worker
//!   beside the group writes its CSV file.
//! - [`order`]: the order snapshot the inventory and notification groups read from each event.
//!
//! Beside them: [`cli`], the command line of the demonstration's binaries (`consumer`: run,
//! seed-stock, report; `pipeline`: the operator command with these groups registered),
//! [`consumer_command`], what the `consumer` binary runs, and [`report`], `consumer report`'s
//! summary of a run.

#![deny(missing_docs)]

pub mod cli;
pub mod consumer_command;
pub mod export;
pub mod inventory;
pub mod notification;
pub mod order;
pub mod report;

use std::sync::Arc;

use consumer::Groups;
use demo_events::schema::DEMO_GROUPS_MIGRATOR;
use sqlx::migrate::Migrator;

use crate::export::metrics::ExportMetrics;
use crate::export::{ExportSettings, Exports};
use crate::inventory::Inventory;
use crate::notification::{DispatchSettings, NotificationSender, Notifications};

/// The tables the demonstration's groups use: the consumer library's and the groups' effects.
pub const SCHEMA: [&Migrator; 2] = [&consumer::MIGRATOR, &DEMO_GROUPS_MIGRATOR];

/// The demonstration's groups, by name:
/// - `inventory` (stock reservations);
/// - `notification` (records the notification each order event calls for; a dispatcher beside
///   it sends them with `sender`, as `dispatch` says);
/// - `export` (starts each requested export job; a worker beside it writes the job's CSV file
///   into `export.dir`, counted in the `export_*` metrics). Its database must be the order
///   service's, and it runs in a consumer process of its own on the export topic (see
///   [`export::check_runs_alone`]).
pub fn groups(
    sender: Arc<dyn NotificationSender>,
    dispatch: DispatchSettings,
    export: ExportSettings,
) -> prometheus::Result<Groups> {
    let metrics = ExportMetrics::new()?;
    let worker_metrics = metrics.clone();
    Ok(Groups::new()
        .register("inventory", Inventory::new)
        .register("notification", Notifications::new)
        .beside("notification", move |pool, stop| {
            notification::dispatch(pool, sender.clone(), dispatch.clone(), stop)
        })
        .register("export", Exports::new)
        .beside("export", move |pool, stop| {
            export::worker::run(pool, export.clone(), worker_metrics.clone(), stop)
        })
        .metrics("export", move |registry| metrics.register(registry))
        .waiting("export", |pool| async move {
            let (count, oldest) = export::jobs::waiting(&pool).await?;
            Ok(consumer::Waiting {
                what: "export jobs".to_owned(),
                count,
                oldest_seconds: (count > 0).then_some(oldest),
            })
        }))
}
