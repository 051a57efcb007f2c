//! What the example's tests share: the program's configuration for a test database and topic.

use payments_example::program::Config;
use pipeline_core::db::DbArgs;
use pipeline_testkit::kafka::{brokers, kafka_args};

/// The program on `url`'s database (its tables set up at start-up), consuming `topic` as the
/// group `prefix` + `shipping`, its router on a free port, no lag collector, dead letters
/// recorded in the database only, and no relay of its own.
pub(crate) fn config(url: &str, topic: &str, prefix: &str) -> Config {
    let mut config = Config {
        db: DbArgs {
            database_url: url.to_owned(),
            ..DbArgs::default()
        },
        listen: "127.0.0.1:0".parse().expect("an address"),
        ..Config::default()
    };
    config.consumer.kafka = kafka_args(&brokers());
    config.consumer.topics = vec![topic.to_owned()];
    config.consumer.group_prefix = prefix.to_owned();
    config.consumer.lag_interval = std::time::Duration::ZERO;
    config.consumer.dead_letter_topic = String::new();
    config
}
