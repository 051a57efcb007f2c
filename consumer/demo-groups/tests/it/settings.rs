//! The `consumer run` command line maps onto the libraries' settings: with no flag but the
//! required ones, every setting is the library's default.

use clap::Parser;
use consumer::ConsumerSettings;
use demo_groups::cli::{Cli, Command};
use demo_groups::export::ExportSettings;

#[test]
fn the_command_lines_defaults_are_the_libraries() {
    let cli = Cli::try_parse_from([
        "consumer",
        "run",
        "--group",
        "inventory",
        "--topic",
        "order-events",
    ])
    .expect("parses");
    let Command::Run(run) = cli.command else {
        panic!("run expected")
    };
    let expected = ConsumerSettings {
        groups: vec!["inventory".to_owned()],
        topics: vec!["order-events".to_owned()],
        // The environment of the test run may name the brokers.
        kafka: run.run.kafka.clone(),
        ..ConsumerSettings::default()
    };
    assert_eq!(format!("{:?}", run.run), format!("{expected:?}"));
    assert_eq!(
        format!("{:?}", run.export),
        format!("{:?}", ExportSettings::default())
    );
}

#[test]
fn the_topics_are_required() {
    let error =
        Cli::try_parse_from(["consumer", "run", "--group", "inventory"]).expect_err("no topic");
    assert!(error.to_string().contains("--topic"), "{error}");
}
