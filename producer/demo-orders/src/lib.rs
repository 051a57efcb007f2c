//! The order service: an HTTP API whose every change to an order is committed together with the
//! event describing it in the transactional outbox, which the relay publishes to Kafka.
//!
//! - [`orders`]: the order lifecycle and its transactions.
//! - [`validation`]: checks on client input.
//! - [`exports`]: asynchronous order exports (jobs submitted, polled, downloaded).
//! - [`api`]: the HTTP handlers; [`server`] serves them with the operations endpoints.
//! - [`catalog`]: the demonstration product catalogue.
//! - [`cli`]: the command line.

pub mod api;
pub mod catalog;
pub mod cli;
pub mod exports;
pub mod orders;
pub mod server;
pub mod validation;

/// The tables the order service uses: the outbox's, and its own (catalogue, orders, order lines).
pub use demo_events::schema::ORDER_SERVICE as SCHEMA;
