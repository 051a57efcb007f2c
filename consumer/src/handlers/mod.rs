//! What a consumer group does with an event: the handler contract (`Handler`, its part of each
//! transaction, `HandlerTransaction`, and its errors) and the registry of the groups a program
//! runs (`Groups`).

mod handler;
mod registry;

pub use handler::{Event, Handler, HandlerError, HandlerTransaction};
pub use registry::{Groups, UnknownGroup, Waiting};
