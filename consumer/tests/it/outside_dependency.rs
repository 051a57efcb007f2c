//! A handler whose outside dependency (a payment provider, a mail API) is down: the partition
//! waits and retries with backoff, nothing is dead-lettered however long the outage lasts (past
//! the retry budget too), and it resumes by itself, applying every event once and in order. A
//! real partition task against a real PostgreSQL (`#[sqlx::test]`, `DATABASE_URL`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chrono::Utc;
use consumer::metrics::ConsumerMetrics;
use consumer::partition::{FatalSignal, FinishedOffset, PartitionTask, TaskContext};
use consumer::transaction::InboundMessage;
use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use futures::future::BoxFuture;
use pipeline_core::envelope::Envelope;
use prometheus::Registry;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const GROUP: &str = "ledger";
/// Retries the outage lasts for.
const RETRIES_IN_OUTAGE: u64 = 8;

/// Calls a "provider" that is down while `down` is set; counts the calls.
struct Ledger {
    down: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

struct LedgerTransaction<'h> {
    ledger: &'h Ledger,
}

impl Handler for Ledger {
    fn group(&self) -> &str {
        GROUP
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::new(LedgerTransaction { ledger: self })
    }
}

impl HandlerTransaction for LedgerTransaction<'_> {
    fn apply<'a>(
        &'a mut self,
        _: &'a mut PgConnection,
        _: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        let _ = self.ledger.calls.fetch_add(1, Ordering::SeqCst);
        let down = self.ledger.down.load(Ordering::SeqCst);
        Box::pin(async move {
            if down {
                Err(HandlerError::Unavailable(
                    "payment provider: 503".to_owned(),
                ))
            } else {
                Ok(())
            }
        })
    }
}

fn message(order: &str, sequence: i64, offset: i64) -> InboundMessage {
    InboundMessage {
        topic: "payments".into(),
        partition: 0,
        offset,
        key: Some(order.as_bytes().to_vec()),
        payload: Some(br#"{"amount_cents": 1200}"#.to_vec()),
        headers: serde_json::json!({}).into(),
        envelope: Ok(Envelope {
            event_id: Uuid::new_v4(),
            event_type: "payment.captured".into(),
            aggregate_id: order.into(),
            sequence,
            occurred_at: Utc::now(),
            traceparent: None,
        }),
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(GROUP)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(migrator = "consumer::MIGRATOR")]
async fn a_dependency_that_is_down_makes_the_partition_wait_and_resume_by_itself(pool: PgPool) {
    let down = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
    let (finished_tx, finished_rx) = mpsc::channel::<FinishedOffset>();
    let context = TaskContext {
        pool: pool.clone(),
        handler: Arc::new(Ledger {
            down: down.clone(),
            calls: calls.clone(),
        }),
        dead_letters: None,
        metrics: metrics.clone(),
        finished: finished_tx,
        fatal: FatalSignal::default(),
        max_batch: 100,
        custom_plans_up_to: 0,
        retry_base: Duration::from_millis(20),
        retry_max: Duration::from_millis(200),
        // Far shorter than the outage: a failing database would have had its message isolated
        // and dead-lettered by now; a dependency that is down must not.
        retry_budget: Duration::from_millis(100),
        shared_transactions: None,
        rate_limit: None,
        backlog: pipeline_core::retention::Backlog::new(),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let task = tokio::spawn(
        PartitionTask::new(
            context,
            "payments".into(),
            0,
            rx,
            Arc::new(AtomicUsize::new(0)),
            stop.clone(),
        )
        .run(),
    );
    for (offset, (order, sequence)) in [("pay-1", 1), ("pay-2", 1), ("pay-1", 2), ("pay-1", 3)]
        .into_iter()
        .enumerate()
    {
        tx.send(message(order, sequence, offset as i64))
            .expect("queued");
    }

    // The outage lasts well past the retry budget: the batch is tried again and again, with
    // backoff, and nothing is recorded, applied or dead-lettered. Eight retries take at least
    // 450 ms with backoff (at least half of each wait: 20, 40, 80, 160, then 200 ms), 4.5 times
    // the budget; without backoff (20 ms waits) under 200 ms.
    let outage = Instant::now();
    let deadline = outage + Duration::from_secs(10);
    while metrics.batch_retries.with_label_values(&[GROUP]).get() < RETRIES_IN_OUTAGE {
        assert!(!task.is_finished(), "the partition task stopped");
        assert!(
            Instant::now() < deadline,
            "fewer than {RETRIES_IN_OUTAGE} retries in 10 s of outage"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = outage.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "{RETRIES_IN_OUTAGE} retries in {took:?}: no backoff"
    );
    assert!(calls.load(Ordering::SeqCst) >= 3);
    for table in ["processed_message", "dead_letter", "applied_effect"] {
        assert_eq!(
            count(
                &pool,
                &format!("SELECT count(*) FROM {table} WHERE group_name = $1")
            )
            .await,
            0,
            "{table} written during the outage"
        );
    }
    assert!(
        finished_rx.try_recv().is_err(),
        "an offset moved during the outage"
    );

    // The provider answers again: the partition resumes by itself.
    down.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let applied = count(
            &pool,
            "SELECT count(*) FROM applied_effect WHERE group_name = $1",
        )
        .await;
        if applied == 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{applied} of 4 applied 10 s after the outage"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, sequence FROM applied_effect WHERE group_name = $1 ORDER BY id",
    )
    .bind(GROUP)
    .fetch_all(&pool)
    .await
    .expect("effects");
    let pay_1: Vec<i64> = applied
        .iter()
        .filter(|(o, _)| o == "pay-1")
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(pay_1, vec![1, 2, 3], "once each, in order");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM dead_letter WHERE group_name = $1"
        )
        .await,
        0
    );
    let last = finished_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("offset reported after the commit");
    assert!(last.next_offset >= 1);
    stop.cancel();
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
}
