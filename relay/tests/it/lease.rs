//! The relay lease against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`): a frozen holder
//! is replaced once its lease expires and not before, a dead one at once, one handed back at
//! once, and whatever the old holder writes after a takeover is refused.

use crate::common;

use std::time::Duration;

use prometheus::Registry;
use relay::lease::{LeaseEnd, LeaseSettings, TakeoverReason};
use relay::mark::{mark_published, record_failures, FailedAttempt, MarkError, Published};
use relay::metrics::RelayMetrics;
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

async fn enqueue(pool: &PgPool, order: &str) -> i64 {
    let event = outbox::NewEvent {
        business_key: order.to_owned(),
        event_type: "order.placed".to_owned(),
        aggregate_id: order.to_owned(),
        topic: "orders".to_owned(),
        payload: serde_json::json!({"order": order}),
        headers: vec![],
    };
    let mut tx = pool.begin().await.expect("begin");
    let enqueued = outbox::enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    sqlx::query_scalar("SELECT id FROM outbox WHERE event_id = $1")
        .bind(enqueued.event_id())
        .fetch_one(pool)
        .await
        .expect("id")
}

/// (queued, attempts) of an outbox event.
async fn queue_row(pool: &PgPool, id: i64) -> Option<i32> {
    sqlx::query_scalar("SELECT attempts FROM outbox_unpublished WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .expect("queue row")
}

/// Whether the database holds a renewal of the lease made more than twice its time to live
/// after it was taken.
async fn renewed_past_twice_its_ttl(pool: &PgPool, settings: &LeaseSettings) -> bool {
    sqlx::query_scalar(
        "SELECT renewed_at > acquired_at + $2 * interval '1 millisecond'
         FROM relay_lease WHERE lease_key = $1",
    )
    .bind(settings.lock_key)
    .bind(2 * i64::try_from(settings.lease_ttl.as_millis()).expect("ttl"))
    .fetch_one(pool)
    .await
    .expect("lease row")
}

fn published(id: i64) -> Published {
    Published {
        id,
        partition: 0,
        offset: Some(7),
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_frozen_holder_is_replaced_once_its_lease_expires_and_is_fenced(pool: PgPool) {
    let ttl = Duration::from_millis(2_000);
    let settings = common::lease_settings(ttl);
    // The old holder takes the lease, then stops renewing (frozen): its session stays open.
    let taken_at = Instant::now();
    let (mut old, old_lease) = common::hold_lease_with(&pool, settings.clone()).await;
    // The lease started between the two instants: the earliest bounds the takeover from below,
    // the latest from above (a slow connection before the acquisition counts against neither).
    let held_at = Instant::now();
    let event = enqueue(&pool, "order-a").await;

    let mut standby = common::elector(&pool, settings.clone());
    assert!(
        standby.try_acquire().await.expect("try").is_none(),
        "a live lease is not taken over"
    );
    let (new_lease, acquired) = standby
        .acquire(&CancellationToken::new())
        .await
        .expect("acquired");
    let waited = taken_at.elapsed();
    assert_eq!(acquired.reason, TakeoverReason::Expired);
    assert!(
        waited >= ttl - Duration::from_millis(100),
        "taken over after {waited:?}, before the lease of {ttl:?} ran out"
    );
    let within = held_at.elapsed();
    assert!(
        within <= settings.takeover_bound() + Duration::from_millis(500),
        "taken over {within:?} after the lease was taken; the bound is {:?}",
        settings.takeover_bound()
    );
    assert!(new_lease.fence().epoch > old_lease.fence().epoch);
    assert!(
        !old_lease.is_live(),
        "the old holder's own clock says its lease ran out"
    );

    // The old holder wakes up and tries to record what it did: refused, nothing written.
    let refused = record_failures(
        &pool,
        old_lease.fence(),
        &[FailedAttempt {
            id: event,
            error: "zombie".to_owned(),
            retry_in: Duration::from_secs(60),
            give_up: true,
        }],
    )
    .await;
    assert!(
        matches!(refused, Err(MarkError::LeaseLost(_))),
        "{refused:?}"
    );
    let refused = mark_published(&pool, old_lease.fence(), &[published(event)]).await;
    assert!(
        matches!(refused, Err(MarkError::LeaseLost(_))),
        "{refused:?}"
    );
    assert_eq!(
        queue_row(&pool, event).await,
        Some(0),
        "the event is still queued, untouched"
    );

    // Its keeper stops too: by its own clock the lease ran out, so it renews nothing, says the
    // lease expired (counted as lost) and stands by.
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    let end = tokio::time::timeout(
        Duration::from_secs(10),
        old.keep(&old_lease, &CancellationToken::new()),
    )
    .await
    .expect("the old holder gives up at once");
    assert_eq!(end, LeaseEnd::Expired);
    assert!(old_lease.lost().is_cancelled());
    metrics.record_lease_end(end);
    assert_eq!(metrics.lease_lost.with_label_values(&["expired"]).get(), 1);

    // The new holder's writes go through.
    assert_eq!(
        mark_published(&pool, new_lease.fence(), &[published(event)])
            .await
            .expect("mark"),
        1
    );
    assert_eq!(queue_row(&pool, event).await, None);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_holder_whose_session_ends_is_replaced_at_once(pool: PgPool) {
    let settings = common::lease_settings(Duration::from_secs(120));
    let (old, old_lease) = common::hold_lease_with(&pool, settings.clone()).await;
    drop(old); // the process died: its presence session ends with it

    let started = Instant::now();
    let mut standby = common::elector(&pool, settings);
    let (new_lease, acquired) = tokio::time::timeout(
        Duration::from_secs(10),
        standby.acquire(&CancellationToken::new()),
    )
    .await
    .expect("taken over long before the 120 s lease expires")
    .expect("acquired");
    assert_eq!(acquired.reason, TakeoverReason::HolderGone);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(new_lease.fence().epoch, old_lease.fence().epoch + 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_lease_handed_back_on_shutdown_is_taken_at_once_and_renewals_keep_it(pool: PgPool) {
    let settings = common::lease_settings(Duration::from_millis(1_500));
    let (mut holder, lease) = common::hold_lease_with(&pool, settings.clone()).await;
    let stop = CancellationToken::new();
    let keeper = {
        let (lease, stop) = (lease.clone(), stop.clone());
        tokio::spawn(async move { holder.keep(&lease, &stop).await })
    };
    // Renewed, it outlives its time to live several times over: until the database holds a
    // renewal made more than twice the time to live after the lease was taken, a standby finds
    // it held at every look.
    let mut standby = common::elector(&pool, settings.clone());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        assert!(
            standby.try_acquire().await.expect("try").is_none(),
            "taken from its renewing holder"
        );
        assert!(lease.is_live());
        if renewed_past_twice_its_ttl(&pool, &settings).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not renewed past twice its time to live within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    stop.cancel();
    assert_eq!(keeper.await.expect("keeper"), LeaseEnd::HandedBack);
    let (_, acquired) = standby
        .try_acquire()
        .await
        .expect("try")
        .expect("handed-back lease taken at once");
    assert_eq!(acquired.reason, TakeoverReason::Vacant);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_holder_whose_renewal_is_refused_is_fenced_and_stands_by(pool: PgPool) {
    let settings = common::lease_settings(Duration::from_millis(1_500));
    let (mut holder, lease) = common::hold_lease_with(&pool, settings.clone()).await;
    // Another relay takes the lease over while this one's clock still says it holds it.
    let _ = sqlx::query("UPDATE relay_lease SET epoch = epoch + 1 WHERE lease_key = $1")
        .bind(settings.lock_key)
        .execute(&pool)
        .await
        .expect("takeover");
    assert!(lease.is_live());
    let end = tokio::time::timeout(
        Duration::from_secs(10),
        holder.keep(&lease, &CancellationToken::new()),
    )
    .await
    .expect("the next renewal is refused");
    assert_eq!(end, LeaseEnd::Fenced);
    assert!(lease.lost().is_cancelled());
    let metrics = RelayMetrics::register(&Registry::new()).expect("metrics");
    metrics.record_lease_end(end);
    assert_eq!(
        (
            metrics.fenced.get(),
            metrics.lease_lost.with_label_values(&["fenced"]).get()
        ),
        (1, 1)
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_slow_write_holds_off_a_takeover_but_not_its_holders_renewals(pool: PgPool) {
    let settings = common::lease_settings(Duration::from_millis(1_500));
    let (mut holder, lease) = common::hold_lease_with(&pool, settings.clone()).await;
    let event = enqueue(&pool, "order-a").await;
    // Another session holds the event's queue row, so the mark below takes the lease's fence
    // and then waits, as a mark whose COMMIT stalls on a saturated disk holds it.
    let mut blocker = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM outbox_unpublished WHERE id = $1 FOR UPDATE")
        .bind(event)
        .execute(&mut *blocker)
        .await
        .expect("row locked");
    let mark = {
        let (pool, fence) = (pool.clone(), lease.fence());
        tokio::spawn(async move { mark_published(&pool, fence, &[published(event)]).await })
    };
    let waiting = Instant::now() + Duration::from_secs(10);
    loop {
        let marks_waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%outbox_unpublished%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&pool)
        .await
        .expect("activity");
        if marks_waiting > 0 {
            break;
        }
        assert!(Instant::now() < waiting, "the mark never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The holder renews meanwhile: its renewals do not wait for its own write, so the lease
    // outlives its time to live several times over.
    let stop = CancellationToken::new();
    let keeper = {
        let (lease, stop) = (lease.clone(), stop.clone());
        tokio::spawn(async move { holder.keep(&lease, &stop).await })
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        assert!(
            lease.is_live(),
            "the holder lost its lease behind its own write"
        );
        if renewed_past_twice_its_ttl(&pool, &settings).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not renewed past twice its time to live within 15 s while its write waited"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!mark.is_finished(), "the mark still waits");

    // The holder hands the lease back; a standby cannot take it while the write made under it
    // is in flight, and takes it once that write is done.
    stop.cancel();
    assert_eq!(keeper.await.expect("keeper"), LeaseEnd::HandedBack);
    let mut standby = common::elector(&pool, settings.clone());
    let taken = tokio::time::timeout(Duration::from_secs(1), standby.try_acquire()).await;
    assert!(
        !matches!(taken, Ok(Ok(Some(_)))),
        "taken over while a write under the lease was in flight"
    );
    blocker.rollback().await.expect("rollback");
    assert_eq!(
        mark.await.expect("mark task").expect("mark"),
        1,
        "the write made under the lease went through"
    );
    let (new_lease, _) = standby
        .try_acquire()
        .await
        .expect("try")
        .expect("taken once the write was done");
    assert!(new_lease.fence().epoch > lease.fence().epoch);
    assert_eq!(queue_row(&pool, event).await, None);
}

/// A standby whose retry interval is long still takes a frozen holder's lease as it runs out:
/// each attempt learns when the lease expires and the next one is made then.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_standby_tries_again_when_the_lease_it_saw_expires(pool: PgPool) {
    let ttl = Duration::from_millis(2_000);
    let settings = LeaseSettings {
        standby_retry: Duration::from_millis(4_000),
        ..common::lease_settings(ttl)
    };
    let (_old, old_lease) = common::hold_lease_with(&pool, settings.clone()).await;
    let held_at = Instant::now();

    // The attempt at 0 finds the lease live and learns it expires at 2 s, two seconds before
    // the next retry: the standby tries again then. (The bound leaves a loaded machine a second
    // for the attempts; waiting for the retry takes 4 s.)
    let mut standby = common::elector(&pool, settings.clone());
    let (new_lease, acquired) = standby
        .acquire(&CancellationToken::new())
        .await
        .expect("acquired");
    let within = held_at.elapsed();
    assert_eq!(acquired.reason, TakeoverReason::Expired);
    assert!(
        within < ttl + Duration::from_millis(1_000),
        "taken over {within:?} after a lease of {ttl:?} was taken: the standby waited for its \
         next retry (every {:?}) instead of the expiry",
        settings.standby_retry
    );
    assert!(new_lease.fence().epoch > old_lease.fence().epoch);
}

/// A standby looking at a live lease does not wait for the holder's open transaction (one that
/// took the lease row's fence and is stalled, or frozen with the holder).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_standby_looking_at_a_live_lease_waits_for_no_write_of_the_holder(pool: PgPool) {
    let settings = common::lease_settings(Duration::from_secs(30));
    let (_holder, lease) = common::hold_lease_with(&pool, settings.clone()).await;
    let mut write = pool.begin().await.expect("begin");
    sqlx::query("SELECT epoch FROM relay_lease WHERE lease_key = $1 AND epoch = $2 FOR KEY SHARE")
        .bind(lease.fence().lock_key)
        .bind(lease.fence().epoch)
        .execute(&mut *write)
        .await
        .expect("fence taken");

    let mut standby = common::elector(&pool, settings.clone());
    for _ in 0..3 {
        let started = Instant::now();
        let attempt = standby.try_acquire().await;
        assert!(
            matches!(attempt, Ok(None)),
            "a live lease is neither taken nor failed on: {attempt:?}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "an attempt on a live lease took {:?} behind the holder's open write",
            started.elapsed()
        );
    }
    write.commit().await.expect("the holder's write commits");
}
