//! The consumer runtime: consumer groups that apply events exactly once and in order per
//! aggregate, each a [`Handler`](handler::Handler) a program registers by name.
//!
//! ```no_run
//! use consumer::config::RunArgs;
//! use consumer::handler::{Event, Handler, HandlerBatch, HandlerError};
//! use futures::future::BoxFuture;
//! use sqlx::PgConnection;
//!
//! /// Counts events per aggregate: its effects commit in the transaction that records each
//! /// event processed, so each counts once.
//! struct Tally { group: String }
//! struct TallyBatch;
//!
//! impl Handler for Tally {
//!     fn group(&self) -> &str { &self.group }
//!     fn batch(&self) -> Box<dyn HandlerBatch + '_> { Box::new(TallyBatch) }
//! }
//!
//! impl HandlerBatch for TallyBatch {
//!     fn apply<'a>(&'a mut self, conn: &'a mut PgConnection, event: &'a Event)
//!         -> BoxFuture<'a, Result<(), HandlerError>> {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO tally (aggregate_id, events) VALUES ($1, 1)
//!                          ON CONFLICT (aggregate_id) DO UPDATE SET events = tally.events + 1")
//!                 .bind(&event.envelope.aggregate_id)
//!                 .execute(conn)
//!                 .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! # async fn start(args: RunArgs, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
//! // `args` as parsed from `--group tally --topic …`; the group's database gets the consumer
//! // library's tables from `consumer::MIGRATOR`.
//! let groups = consumer::Groups::new().register("tally", |group| Tally { group });
//! consumer::run(args, &groups, shutdown).await
//! # }
//! ```
//!
//! What every registered group gets: a batch's dedupe rows (`processed_message`) and its
//! effects commit in one transaction, and its Kafka offsets are committed only after it; one task
//! per partition; per-aggregate sequence checks, with events that arrive ahead of their
//! predecessor parked until it is applied; messages that cannot be applied dead-lettered with
//! their reason; a retry budget for batches that keep failing while the database answers; no
//! dead letter at all while the database or an outside dependency is down
//! ([`HandlerError::Unavailable`](handler::HandlerError::Unavailable)); ownership fencing, so a
//! member that lost its partitions (frozen, or cut off from its database) applies nothing;
//! rebalance-safe commits; shared transactions; metrics and lag.

#![warn(missing_docs)]

pub mod apply;
pub(crate) mod backoff;
pub mod config;
pub mod dead_letter;
pub(crate) mod effects;
pub mod group;
pub mod groups;
pub mod handler;
pub mod inventory;
pub mod lag;
pub mod message;
pub mod metrics;
pub mod notification;
pub mod parking;
pub mod process_error;
pub mod reachability;
pub mod rebalance;
pub mod report;
pub mod resolve;
pub mod runtime;
pub mod shared_tx;
pub mod store;
pub mod worker;

use anyhow::Context;
use pipeline_core::db::{CONSUMER_MIGRATOR, DEMO_GROUPS_MIGRATOR};
use pipeline_core::order_events::demo_product_id;
use sqlx::migrate::Migrator;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::RunArgs;
pub use crate::groups::{demo_groups, Groups, UnknownGroup};

/// The tables this program uses: the groups' bookkeeping and the demonstration groups' effects.
pub const SCHEMA: [&Migrator; 2] = [&CONSUMER_MIGRATOR, &DEMO_GROUPS_MIGRATOR];

/// The consumer library's migrations: what any group needs besides its own effect tables
/// (dedupe rows, progress, parked events, dead letters, effect history, partition ownership).
pub use pipeline_core::db::CONSUMER_MIGRATOR as MIGRATOR;

/// Runs the groups `args` names, each looked up in `groups`, until `shutdown` (or a fatal
/// error, which is returned). See [`runtime::Runtime`] for its steps.
pub async fn run(
    args: RunArgs,
    groups: &Groups,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    runtime::Runtime::start(args, groups, shutdown)
        .await?
        .wait()
        .await
}

/// Sets the available stock of products 1..=`products` of the demonstration catalogue.
pub async fn seed_stock(pool: &PgPool, products: u32, quantity: i32) -> anyhow::Result<()> {
    let ids: Vec<String> = (1..=products).map(demo_product_id).collect();
    sqlx::query(
        "INSERT INTO inventory_stock (product_id, available)
         SELECT p, $2 FROM unnest($1::text[]) AS p
         ON CONFLICT (product_id) DO UPDATE SET available = EXCLUDED.available",
    )
    .bind(&ids)
    .bind(quantity)
    .execute(pool)
    .await
    .context("seeding stock")?;
    Ok(())
}
