//! `verify`: proves the pipeline under failure. It runs the real binaries in a world of their
//! own (a fresh database, topic and groups, and a three-node Apache Kafka cluster replicating
//! every topic three times, one group on each consumer group protocol) under load, injects a
//! seeded plan of faults (kills, crashes at exact points, Kafka nodes killed, frozen,
//! restarted one by one or two at once, PostgreSQL restarts, rebalances, frozen consumers and
//! relays, cut database paths), records every acknowledged state change, and then checks the
//! history against the database and the topic: nothing lost, nothing applied twice, nothing out
//! of order, nothing marked published that the topic does not hold. `scripts/verify.sh` builds
//! the binaries and runs it.
//!
//! - [`run`]: one run from start to clean-up, saying how it goes ([`progress`]);
//! - [`config`]: command line and profiles; [`fault_plan`]: the seeded fault plan;
//! - [`environment`], [`topology`], [`kafka_cluster`], [`processes`], [`postgres`]: the world
//!   and its processes;
//! - [`driver`]: the load (the `load` command's order generator) and its history;
//! - [`faults`] ([`broker_faults`], [`upgrade`], [`injection`]), [`recovery`], [`publishing`]:
//!   injecting faults and measuring recovery;
//! - [`drain`], [`checks`] ([`queries`], [`topic_scan`], [`examples`]) and [`report`].

pub mod broker_faults;
pub mod checks;
pub mod config;
pub mod drain;
pub mod driver;
pub mod environment;
pub mod examples;
pub mod fault_plan;
pub mod faults;
pub mod injection;
pub mod kafka_cluster;
pub mod postgres;
pub mod processes;
pub mod progress;
pub mod proxy;
pub mod publishing;
pub mod queries;
pub mod recovery;
pub mod report;
pub mod run;
pub mod topic_scan;
pub mod topology;
pub mod upgrade;

pub use run::run;
