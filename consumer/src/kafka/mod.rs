//! The member of a Kafka consumer group: a poll thread per group (`member`) whose client context
//! (`rebalance`) starts and stops the partition tasks (`tasks`) and commits the offsets they
//! finished (`offsets`), all configured by `settings`; the database probe that makes it leave its group while the database is
//! out of reach (`reachability`); and the lag collector (`lag`).

mod lag;
mod member;
mod offsets;
mod reachability;
mod rebalance;
mod settings;
mod tasks;

pub use lag::{read_group, run_collector, GroupSnapshot, LagCollector};
pub use member::{run_member, MemberSignals};
pub use reachability::{probe, Reachability};
pub use settings::{GroupProtocol, MemberSettings};
