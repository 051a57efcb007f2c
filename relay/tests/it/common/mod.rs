//! What the relay's tests share: holding the relay lease of a test database, and one relay step.

use std::time::Duration;

use relay::backoff::RetryPolicy;
use relay::batch::{Batch, BatchOutcome};
use relay::claim::ClaimSessions;
use relay::lease::{Elector, Lease, LeaseSettings};
use relay::mark::MarkError;
use relay::metrics::RelayMetrics;
use relay::publish::RelayProducer;
use sqlx::PgPool;

/// Lease settings for tests: a random key (tests run side by side) and a long time to live.
pub(crate) fn lease_settings(ttl: Duration) -> LeaseSettings {
    LeaseSettings {
        lock_key: i64::from(rand::random::<i32>()),
        lease_ttl: ttl,
        standby_retry: Duration::from_millis(100),
    }
}

/// An elector for `pool`'s database with `settings`.
pub(crate) fn elector(pool: &PgPool, settings: LeaseSettings) -> Elector {
    Elector::new(settings, (*pool.connect_options()).clone())
}

/// Takes a fresh lease on `pool`'s database; keep the elector alive as long as the lease is used
/// (its session is the holder's presence).
pub(crate) async fn hold_lease(pool: &PgPool) -> (Elector, Lease) {
    hold_lease_with(pool, lease_settings(Duration::from_secs(120))).await
}

/// Takes a fresh lease on `pool`'s database with `settings`, as [`hold_lease`] does.
pub(crate) async fn hold_lease_with(pool: &PgPool, settings: LeaseSettings) -> (Elector, Lease) {
    let mut elector = elector(pool, settings);
    let (lease, _) = elector
        .try_acquire()
        .await
        .expect("lease statement")
        .expect("a vacant lease");
    (elector, lease)
}

/// One relay step under `lease`, the two steps the relay loop takes for each batch, with no
/// other batch out: claim up to `batch_size` events, publish them and record the results.
pub(crate) async fn relay_batch(
    pool: &PgPool,
    producer: &RelayProducer,
    lease: &Lease,
    batch_size: i64,
    retry: &RetryPolicy,
    metrics: &RelayMetrics,
) -> Result<BatchOutcome, MarkError> {
    Batch::claim(&ClaimSessions::new(pool), batch_size, &[])
        .await?
        .publish(pool, producer, lease, retry, metrics)
        .await
}

/// Drops the replication slot `slot` if it exists, once its session has ended (the server ends
/// it a moment after the client): a slot keeps WAL, and its database from being dropped.
pub(crate) async fn drop_slot(pool: &PgPool, slot: &str) -> Result<(), String> {
    for _ in 0..100 {
        match sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(slot)
        .execute(pool)
        .await
        {
            Ok(_) => return Ok(()),
            Err(e) if e.to_string().contains("is active") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!("slot {slot} still active after 10 s"))
}
