//! A limited group's partition task: it applies a backlog at the limit's rate in batches no
//! larger than the bucket, every event once and in order; a batch retried after a failure pays
//! for its events once; a task waiting for the bucket stops at once when told to. A real
//! partition task against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chrono::Utc;
use consumer::metrics::ConsumerMetrics;
use consumer::partition::{FatalSignal, FinishedOffset, PartitionTask, TaskContext};
use consumer::rate_limit::GroupRateLimiter;
use consumer::transaction::InboundMessage;
use consumer::{Event, Handler, HandlerError, HandlerTransaction, RateLimit};
use futures::future::BoxFuture;
use pipeline_core::envelope::Envelope;
use prometheus::Registry;
use sqlx::{PgConnection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const GROUP: &str = "limited";

/// Fails its first `failures` calls as if its dependency were down, then applies.
struct Flaky {
    failures: usize,
    calls: AtomicUsize,
}

struct FlakyTransaction<'h> {
    handler: &'h Flaky,
}

impl Handler for Flaky {
    fn group(&self) -> &str {
        GROUP
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(FlakyTransaction { handler: self })
    }
}

impl HandlerTransaction for FlakyTransaction<'_> {
    fn apply<'a>(
        &'a mut self,
        _: &'a mut PgConnection,
        _: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        let call = self.handler.calls.fetch_add(1, Ordering::SeqCst);
        let down = call < self.handler.failures;
        Box::pin(async move {
            if down {
                Err(HandlerError::Unavailable("provider: 503".to_owned()))
            } else {
                Ok(())
            }
        })
    }
}

fn message(order: &str, sequence: i64, offset: i64) -> InboundMessage {
    InboundMessage {
        topic: "limited-events".into(),
        partition: 0,
        offset,
        key: Some(order.as_bytes().to_vec()),
        payload: Some(b"{}".to_vec()),
        headers: serde_json::json!({}).into(),
        envelope: Ok(Envelope {
            event_id: Uuid::new_v4(),
            event_type: "thing.happened".into(),
            aggregate_id: order.into(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

/// A partition task of a group limited to `limit`, its handler failing its first `failures`
/// calls; returns the task, its stop token, the sender of its messages and the metrics.
fn limited_task(
    pool: &PgPool,
    limit: &RateLimit,
    failures: usize,
) -> (
    JoinHandle<()>,
    CancellationToken,
    tokio::sync::mpsc::UnboundedSender<InboundMessage>,
    ConsumerMetrics,
    mpsc::Receiver<FinishedOffset>,
) {
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let limiter = GroupRateLimiter::new(limit, &metrics, GROUP).expect("valid limit");
    let (finished_tx, finished_rx) = mpsc::channel();
    let context = TaskContext {
        pool: pool.clone(),
        handler: Arc::new(Flaky {
            failures,
            calls: AtomicUsize::new(0),
        }),
        dead_letters: None,
        metrics: metrics.clone(),
        finished: finished_tx,
        fatal: FatalSignal::default(),
        // As the runtime sets it: no batch larger than the bucket.
        max_batch: limiter.max_batch(),
        custom_plans_up_to: 0,
        retry_base: Duration::from_millis(20),
        retry_max: Duration::from_millis(50),
        retry_budget: Duration::from_secs(30),
        shared_transactions: None,
        rate_limit: Some(Arc::new(limiter)),
        backlog: pipeline_core::retention::Backlog::new(),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let task = tokio::spawn(
        PartitionTask::new(
            context,
            "limited-events".into(),
            0,
            rx,
            Arc::new(AtomicUsize::new(0)),
            stop.clone(),
        )
        .run(),
    );
    (task, stop, tx, metrics, finished_rx)
}

async fn applied(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM applied_effect WHERE group_name = $1")
        .bind(GROUP)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "consumer::MIGRATOR")]
async fn a_backlog_is_applied_at_the_limit_in_batches_no_larger_than_the_bucket(pool: PgPool) {
    const EVENTS: i64 = 300;
    let (task, stop, tx, metrics, finished) =
        limited_task(&pool, &RateLimit::per_second(GROUP, 100), 0);
    // Thirty orders of ten events each, interleaved, in offset order.
    for offset in 0..EVENTS {
        let order = format!("order-{}", offset % 30);
        tx.send(message(&order, offset / 30 + 1, offset))
            .expect("queued");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while applied(&pool).await < EVENTS {
        assert!(Instant::now() < deadline, "not applied within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    task.await.expect("task");

    let (span, reordered, twice): (f64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT EXTRACT(EPOCH FROM max(applied_at) - min(applied_at))::float8
                 FROM applied_effect WHERE group_name = $1),
                (SELECT count(*) FROM (
                     SELECT sequence, row_number() OVER (PARTITION BY aggregate_id ORDER BY id) AS rn
                     FROM applied_effect WHERE group_name = $1) x WHERE sequence <> rn),
                (SELECT count(*) - count(DISTINCT event_id) FROM applied_effect
                 WHERE group_name = $1)",
    )
    .bind(GROUP)
    .fetch_one(&pool)
    .await
    .expect("span");
    assert_eq!((reordered, twice), (0, 0), "in order, once each");
    let rate = (EVENTS - 1) as f64 / span;
    println!("{EVENTS} events limited to 100/s: {rate:.1}/s over {span:.2} s");
    // The lower bound leaves room for a busy machine, where applying a batch takes time of
    // its own; applying without the limit runs at thousands a second.
    assert!(
        (75.0..=115.0).contains(&rate),
        "{rate:.1} events/s against a limit of 100/s"
    );
    let batches = metrics.batch_size.with_label_values(&[GROUP]);
    assert!(
        batches.get_sample_count() >= (EVENTS / 10) as u64,
        "{} batches of at most the bucket's 10 events",
        batches.get_sample_count()
    );
    // Every batch after the first bucket waits for its tokens, unless applying the one before
    // took so long on a busy machine that the tokens were back already.
    let delayed = metrics.rate_limit_delayed.with_label_values(&[GROUP]).get();
    assert!(
        delayed >= (EVENTS / 2) as u64 && delayed <= (EVENTS - 10) as u64,
        "{delayed} delayed"
    );
    let last = finished.try_iter().last().expect("offsets reported");
    assert_eq!(last.next_offset, EVENTS, "the last offset is committed");
}

#[sqlx::test(migrator = "consumer::MIGRATOR")]
async fn a_retried_batch_pays_once_and_a_waiting_task_stops_at_once(pool: PgPool) {
    // One event a minute: the bucket holds one, so the first event goes at once and any
    // further token would take a minute.
    let (task, stop, tx, metrics, _finished) =
        limited_task(&pool, &RateLimit::per_minute(GROUP, 1), 5);
    tx.send(message("order-1", 1, 0)).expect("queued");
    tx.send(message("order-1", 2, 1)).expect("queued");
    // The first event's batch fails five times and is retried with backoff: had each attempt
    // taken a token again, the first would wait a minute for its second try.
    let deadline = Instant::now() + Duration::from_secs(10);
    while applied(&pool).await < 1 {
        assert!(
            Instant::now() < deadline,
            "the retried batch waited for the limit again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metrics.batch_retries.with_label_values(&[GROUP]).get() >= 5);
    // The second event waits for its token; stopping the task ends the wait.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(applied(&pool).await, 1, "the second waits for the limit");
    let stopping = Instant::now();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the task stopped while waiting for the limit")
        .expect("task");
    assert!(stopping.elapsed() < Duration::from_secs(2));
    assert_eq!(applied(&pool).await, 1, "nothing applied after the stop");
    assert_eq!(
        metrics.rate_limit_delayed.with_label_values(&[GROUP]).get(),
        1,
        "only the second event waited"
    );
}
