//! The outbox library ([`outbox`](::outbox)), which the order service uses like any other
//! service would.

pub use ::outbox::*;
