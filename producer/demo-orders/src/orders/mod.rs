//! The order domain: the lifecycle rules and the transactions that change an order together with
//! the event recording the change.
//!
//! Every write here happens in one PostgreSQL transaction with its [`outbox::enqueue_all`]
//! call, so an order change and its event are committed together or not at all.
//!
//! - [`model`]: the order, the actions on it and the lifecycle; [`error`]: why an operation did
//!   not happen.
//! - [`service`]: the [`OrderService`], which runs each change alone or hands it to the
//!   [`shared_transactions`].
//! - [`place`], [`transition`]: the changes' SQL; [`store`]: reading orders back.
//! - [`writer`]: what writes a change's events ([`events`]) and the payment reminders placing
//!   delayed events ([`reminder`]).

mod error;
mod events;
mod model;
mod place;
mod reminder;
mod service;
mod shared_transactions;
mod store;
mod transition;
mod writer;

pub use error::OrderError;
pub use model::{Action, IllegalTransition, Order};
pub use place::Placed;
pub use reminder::PaymentReminders;
pub use service::OrderService;
pub use shared_transactions::{SharedTransactionMetrics, SharedTransactionSettings};
pub use store::fetch_order;
