//! `relay ensure-topics` against the real broker: it creates what is missing and says what an
//! acknowledged event on each topic rests on (partitions, replicas, min.insync.replicas).

use std::time::Duration;

use pipeline_testkit::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_topics_reports_what_durability_rests_on() -> anyhow::Result<()> {
    let env = TestEnv::new("topics", 3).await?;
    let fresh = format!("{}-fresh", env.topic);
    let out = env.run_to_end(
        "relay",
        &[
            "ensure-topics",
            "--topic",
            &env.topic,
            "--topic",
            &fresh,
            "--partitions",
            "5",
        ],
        Duration::from_secs(60),
    )?;
    for (topic, partitions) in [(&env.topic, 3), (&fresh, 5)] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("topic {topic}: ")))
            .unwrap_or_else(|| panic!("no line for {topic} in {out}"));
        // The existing topic keeps its 3 partitions; the new one has the 5 asked for.
        assert!(
            line.contains(&format!(": {partitions} partitions, replication factor ")),
            "{line}"
        );
        let min_isr = line
            .rsplit("min.insync.replicas ")
            .next()
            .and_then(|v| v.parse::<u32>().ok());
        assert!(
            min_isr.is_some_and(|n| n >= 1),
            "min.insync.replicas read from the cluster: {line}"
        );
    }
    Ok(())
}
