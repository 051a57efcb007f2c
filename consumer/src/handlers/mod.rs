//! What a consumer group does with an event: the handler contract (`Handler`, its part of each
//! transaction, `HandlerTransaction`, and its errors), the registry of the groups a program runs
//! (`Groups`), and the demonstration's groups, [`inventory`] and [`notification`], and the order
//! service's [`export`] group.

pub mod export;
mod handler;
pub mod inventory;
pub mod notification;
mod registry;

use demo_events::schema::{CONSUMER_MIGRATOR, DEMO_GROUPS_MIGRATOR};
use sqlx::migrate::Migrator;

pub use handler::{order_snapshot, Event, Handler, HandlerError, HandlerTransaction};
pub use registry::{demo_groups, export_group, Groups, UnknownGroup};

/// The tables this program uses: the groups' bookkeeping and the demonstration groups' effects.
pub const SCHEMA: [&Migrator; 2] = [&CONSUMER_MIGRATOR, &DEMO_GROUPS_MIGRATOR];
