//! The pipeline over secured transports, as production runs it: a three-node Kafka cluster
//! (replication factor 3, `min.insync.replicas` 2) through a SASL/SCRAM listener over TLS
//! (`KAFKA_OPTIONS`), PostgreSQL over TLS with the server's certificate and
//! name checked (`sslmode=verify-full`); both with certificates this test makes. A wrong password
//! stops the relay and the consumer at start with the brokers' reason.

use std::time::{Duration, Instant};

use pipeline_testkit::secure::{Certificates, PostgresTls, SecureCluster};
use pipeline_testkit::{effects, TestEnv, Transport};
use uuid::Uuid;

const GROUPS: [&str; 2] = ["inventory", "notification"];
const USER: (&str, &str) = ("order-pipeline", "a long and right secret");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipeline_runs_over_sasl_scram_and_tls_and_refuses_a_wrong_password_with_the_reason(
) -> anyhow::Result<()> {
    let id = Uuid::new_v4().simple().to_string();
    let dir = pipeline_testkit::bin_dir()
        .join("test-logs")
        .join(format!("secure-{}", &id[..10]));
    let certs = Certificates::make(&dir)?;
    let broker = SecureCluster::start(&dir, &certs, &[USER]).await?;
    let _tls = PostgresTls::serve(&certs).await?;
    let transport = Transport {
        brokers: broker.brokers.clone(),
        kafka_options: broker.options(USER.0, USER.1),
        // The name the server's certificate holds, checked with the test's authority.
        database_host: "localhost".to_owned(),
        database_query: format!("sslmode=verify-full&sslrootcert={}", certs.ca.display()),
    };
    let env = TestEnv::with_transport("secure", 3, Some(transport)).await?;
    assert!(env.database_url.contains("sslmode=verify-full"));
    let durability = env.kafka().topic_durability(&env.topic).await?;
    assert_eq!(
        (
            durability.replication_factor,
            durability.min_insync_replicas,
            durability.unclean_leader_election
        ),
        (3, Some(2), Some(false)),
        "the production settings on the secure cluster"
    );

    env.seed_catalog(20)?;
    env.seed_stock(20, Some(1_000_000))?;
    let (_orders, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let (_consumer, _) = env.consumer("consumer").await?;
    env.place_orders(&url, 60, 20, 11)?;
    env.wait_drained(&GROUPS, Duration::from_secs(90)).await?;
    effects::assert_exactly_once_in_order(&env, &GROUPS).await?;
    let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_delivery")
        .fetch_one(&env.pool)
        .await?;
    assert!(published >= 60, "{published} events published");

    // Every session the pipeline's programs hold on the database is encrypted.
    let sessions: Vec<(String, bool)> = sqlx::query_as(
        "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
           AND a.application_name IN ('producer', 'relay', 'consumer')",
    )
    .fetch_all(&env.pool)
    .await?;
    for program in ["producer", "relay", "consumer"] {
        assert!(
            sessions.iter().any(|(p, _)| p == program),
            "{program} holds no session: {sessions:?}"
        );
    }
    assert!(sessions.iter().all(|(_, ssl)| *ssl), "{sessions:?}");

    // A wrong password: each stops at once with the brokers' reason.
    let wrong: Vec<String> = broker
        .options(USER.0, "a wrong secret")
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let wrong = wrong.join(",");
    let relay = env.spawn_with_env(
        "relay",
        "relay-wrong-password",
        &["run", "--metrics-listen", "127.0.0.1:0"],
        &[("KAFKA_OPTIONS", &wrong)],
    )?;
    let consumer = env.spawn_with_env(
        "consumer",
        "consumer-wrong-password",
        &env.consumer_run_args(&["inventory"]),
        &[("KAFKA_OPTIONS", &wrong)],
    )?;
    for mut refused in [relay, consumer] {
        let started = Instant::now();
        while !refused.exited() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "still running with a wrong password:\n{}",
                refused.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let log = refused.log();
        assert!(
            log.contains("Kafka refused the connection")
                && log.contains("invalid credentials with SASL mechanism SCRAM-SHA-512"),
            "{log}"
        );
    }
    // Dropped in reverse order: the binaries, then the environment (its database), then the
    // server's own TLS settings, then the cluster.
    Ok(())
}
