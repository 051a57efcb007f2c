//! Recurring schedules through the real binaries: a schedule firing every two seconds, two
//! relays, and the active one killed with SIGKILL between two occurrences. Every occurrence from
//! the first to the last is published, each with one event (Kafka may hold a record twice after
//! the kill, never two events for one occurrence), at its fire time or after; run-now publishes
//! one extra occurrence.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::schedule::{add_schedule, run_now, set_enabled, Missed, NewSchedule};
use outbox::Outbox;
use pipeline_testkit::kafka::read_topic;
use pipeline_testkit::{scrape_sum, wait_until, TestEnv};
use rdkafka::message::{Headers, Message};

const NAME: &str = "every-two-seconds";
const EVENT_TYPE: &str = "tick.two_seconds";

/// Sets the database's schedule floor to one second, as a deployment that wants schedules this
/// frequent does.
async fn lower_the_floor(env: &TestEnv) -> anyhow::Result<()> {
    let _ = sqlx::query("UPDATE outbox_schedule_floor SET least_gap = interval '1 second'")
        .execute(&env.pool)
        .await?;
    Ok(())
}

async fn fired(env: &TestEnv) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox_schedule_occurrence WHERE schedule = $1 AND outcome = 'fired'",
    )
    .bind(NAME)
    .fetch_one(&env.pool)
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_occurrence_is_published_once_across_a_relay_killed_between_two() -> anyhow::Result<()>
{
    let env = TestEnv::new("schedules", 3).await?;
    let (relay_a, metrics_a) = env.relay("relay-a").await?;
    let (relay_b, metrics_b) = env.relay("relay-b").await?;
    let active =
        pipeline_testkit::one_active_relay(&[&metrics_a, &metrics_b], Duration::from_secs(30))
            .await?;
    let (active_relay, _standby, standby_metrics) = if active == 0 {
        (relay_a, relay_b, metrics_b)
    } else {
        (relay_b, relay_a, metrics_a)
    };

    lower_the_floor(&env).await?;
    let mut tx = env.pool.begin().await?;
    add_schedule(
        &mut tx,
        &Outbox::default(),
        &NewSchedule {
            name: NAME.to_owned(),
            cron: "*/2 * * * * *".to_owned(),
            time_zone: "UTC".to_owned(),
            event_type: EVENT_TYPE.to_owned(),
            aggregate_id: format!("schedule:{NAME}"),
            topic: env.topic.clone(),
            payload: serde_json::json!({"fire_at": "{{fire_at}}"}),
            missed: Missed::All,
        },
    )
    .await?;
    tx.commit().await?;

    // Three occurrences fired, then the active relay dies right after one: before the next.
    wait_until("three occurrences", Duration::from_secs(30), || async {
        Ok((fired(&env).await? >= 3).then_some(()))
    })
    .await?;
    let before_kill = fired(&env).await?;
    wait_until("the next occurrence", Duration::from_secs(10), || async {
        Ok((fired(&env).await? > before_kill).then_some(()))
    })
    .await?;
    active_relay.kill_hard()?;
    wait_until(
        "the standby takes over",
        Duration::from_secs(20),
        || async {
            Ok(
                (scrape_sum(&standby_metrics, "relay_active", &[]).await? as i64 == 1)
                    .then_some(()),
            )
        },
    )
    .await?;
    let at_kill = fired(&env).await?;
    wait_until("four more occurrences", Duration::from_secs(30), || async {
        Ok((fired(&env).await? >= at_kill + 4).then_some(()))
    })
    .await?;

    // One extra occurrence now; then pause, so the set is closed.
    let mut tx = env.pool.begin().await?;
    let (extra_at, extra_event) = run_now(&mut tx, &Outbox::default(), NAME).await?;
    set_enabled(&mut tx, NAME, false).await?;
    tx.commit().await?;
    let occurrences: Vec<(DateTime<Utc>, String, uuid::Uuid)> = sqlx::query_as(
        "SELECT fire_at, outcome, event_id FROM outbox_schedule_occurrence
         WHERE schedule = $1 ORDER BY fire_at",
    )
    .bind(NAME)
    .fetch_all(&env.pool)
    .await?;
    wait_until(
        "every occurrence published",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM outbox_delayed)
                  + (SELECT count(*) FROM outbox_unpublished)",
            )
            .fetch_one(&env.pool)
            .await?;
            Ok((waiting == 0).then_some(()))
        },
    )
    .await?;

    // The topic: fire time → the event ids published for it.
    let kafka = env.kafka();
    let topic = env.topic.clone();
    let expected = occurrences.len();
    let records = tokio::task::spawn_blocking(move || {
        read_topic(&kafka, &topic, expected + 50, Duration::from_secs(15))
    })
    .await??;
    let mut published: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in &records {
        let header = |name: &str| {
            r.headers().and_then(|h| {
                h.iter()
                    .find(|x| x.key == name)
                    .and_then(|x| x.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        if header("schedule").as_deref() == Some(NAME) {
            published
                .entry(header("fire-at").unwrap_or_default())
                .or_default()
                .insert(header("event-id").unwrap_or_default());
        }
    }
    assert_eq!(published.len(), occurrences.len(), "{published:?}");
    for (fire_at, events) in &published {
        assert_eq!(
            events.len(),
            1,
            "occurrence {fire_at} has {} events",
            events.len()
        );
    }
    // The scheduled occurrences are every two seconds, none missing, none twice.
    let scheduled: Vec<DateTime<Utc>> = occurrences
        .iter()
        .filter(|(_, outcome, _)| outcome == "fired")
        .map(|(t, _, _)| *t)
        .collect();
    assert!(scheduled.len() >= 8, "{scheduled:?}");
    for pair in scheduled.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            chrono::Duration::seconds(2),
            "{scheduled:?}"
        );
    }
    // And one run-now occurrence, with its own event.
    let extra: Vec<_> = occurrences
        .iter()
        .filter(|(_, outcome, _)| outcome == "run_now")
        .collect();
    assert_eq!(extra.len(), 1);
    assert_eq!((extra[0].0, extra[0].2), (extra_at, extra_event));
    // Each published no earlier than its fire time.
    let early: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_schedule_occurrence c JOIN outbox_delivery d
             ON d.id = (SELECT id FROM outbox o WHERE o.event_id = c.event_id)
         WHERE c.schedule = $1 AND d.published_at < c.fire_at",
    )
    .bind(NAME)
    .fetch_one(&env.pool)
    .await?;
    assert_eq!(early, 0);
    Ok(())
}

/// The order service's digest schedule, every two seconds: each occurrence becomes one digest
/// notification for the operations team, and the inventory passes over it (no dead letter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_services_digest_schedule_becomes_digest_notifications() -> anyhow::Result<()> {
    let env = TestEnv::new("digest", 3).await?;
    lower_the_floor(&env).await?;
    let producer = env.spawn(
        "producer",
        "order-service",
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--topic",
            &env.topic,
            "--digest-schedule",
            "*/2 * * * * *",
        ],
    )?;
    producer
        .wait_for_log_value("order service listening on ", Duration::from_secs(30))
        .await?;
    let (_relay, _) = env.relay("relay-1").await?;
    let (_consumer, _) = env.consumer("consumer").await?;
    let digests = wait_until("three digests", Duration::from_secs(60), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM notification WHERE template = 'daily-digest'")
                .fetch_one(&env.pool)
                .await?;
        Ok((n >= 3).then_some(n))
    })
    .await?;
    // One notification per occurrence fired, none twice; both groups applied every digest.
    let (fired, distinct): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_schedule_occurrence WHERE schedule = 'daily-digest'),
                (SELECT count(DISTINCT event_id) FROM notification WHERE template = 'daily-digest')",
    )
    .fetch_one(&env.pool)
    .await?;
    assert!(
        digests <= fired && distinct == digests,
        "{digests} {fired} {distinct}"
    );
    let letters: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letter")
        .fetch_one(&env.pool)
        .await?;
    assert_eq!(letters, 0);
    let inventory: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM applied_effect WHERE event_type = 'digest.daily'
           AND group_name LIKE '%inventory'",
    )
    .fetch_one(&env.pool)
    .await?;
    assert!(inventory >= 3, "{inventory}");
    Ok(())
}
