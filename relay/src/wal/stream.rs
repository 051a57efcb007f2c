//! What a relay in `--source wal` does while it holds the lease: stream the outbox's committed
//! inserts from the slot, hand each transaction's events to the producer in commit order, and
//! confirm a transaction's position once Kafka has acknowledged it and everything before it.
//! Events Kafka did not take go to the queue table, whose claim retries them; about once a second
//! the horizon moves up to what the confirmed position covers.
//!
//! The lease comes first, the slot second: only the lease's holder opens the slot, and a session
//! still streaming from it (a relay that lost the lease while frozen or cut off) is ended. The
//! slot admits one session at a time, so it fences the stream as the lease's epoch fences the
//! relay's writes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::stream::{FuturesOrdered, StreamExt};
use pgwire_replication::Lsn;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::queued::QueuedAggregates;
use super::reader::{WalError, WalRead, WalReader};
use super::source::{self, Probe};
use crate::claim::OutboxEvent;
use crate::lease::Lease;
use crate::mark::{queue_streamed, record_failures, FailedAttempt, MarkError};
use crate::metrics::RelayMetrics;
use crate::publish::{count_delivery, send_batch, BatchDelivery, RelayProducer};
use crate::settings::RelaySettings;

/// How often the horizon moves (when something was published since it last did).
const HORIZON_EVERY: Duration = Duration::from_secs(1);

/// A session that lasted this long resets the backoff of the next failure.
const STREAMED_WELL: Duration = Duration::from_secs(30);

/// How often, at most, the relay tries to take the slot from a session that holds it.
const SLOT_RETRY: Duration = Duration::from_millis(500);

/// Why streaming stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// Shutdown, or the lease was lost.
    Stopped,
    /// The producer hit a fatal error: replace it and stream again.
    ProducerFatal,
}

/// Why one session of streaming ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error(transparent)]
    Mark(#[from] MarkError),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("the server ended the replication stream")]
    Ended,
}

/// Streams under `lease` until it is lost, `stop`, or the producer fails for good. Failures of
/// the session or the database are retried with the relay's backoff, each time from the slot's
/// confirmed position: what was sent but not confirmed is sent again (consumers skip it).
pub async fn run_streaming(
    settings: &RelaySettings,
    pool: &PgPool,
    producer: &RelayProducer,
    metrics: &RelayMetrics,
    lease: &Lease,
    stop: &CancellationToken,
) -> StreamEnd {
    let url = settings
        .source
        .replication_url
        .clone()
        .unwrap_or_default();
    let slot = settings.source.slot.as_str();
    let retry = settings.retry_policy();
    let lost = lease.lost();
    let mut streak: i32 = 0;
    loop {
        if stop.is_cancelled() || !lease.is_live() {
            return StreamEnd::Stopped;
        }
        if producer.client().fatal_error().is_some() {
            return StreamEnd::ProducerFatal;
        }
        let session = std::time::Instant::now();
        let outcome = stream(settings, &url, pool, producer, metrics, lease, stop).await;
        if session.elapsed() >= STREAMED_WELL {
            // A session that lasted: a failure now is a new one, retried from the first pause.
            streak = 0;
        }
        let pause = match outcome {
            Ok(()) => {
                if producer.client().fatal_error().is_some() {
                    return StreamEnd::ProducerFatal;
                }
                return StreamEnd::Stopped;
            }
            Err(SessionError::Mark(MarkError::LeaseLost(epoch))) => {
                tracing::warn!(epoch, "a write of the stream was fenced: another relay holds the lease");
                metrics.fenced.inc();
                lease.give_up();
                return StreamEnd::Stopped;
            }
            Err(SessionError::Wal(WalError::SlotLost(_))) => {
                tracing::error!(
                    slot,
                    "the replication slot is lost (PostgreSQL removed WAL it still needed, \
                     max_slot_wal_keep_size): falling back to the queue from the horizon, then \
                     streaming from a new slot"
                );
                metrics.wal_slot_lost.inc();
                match recover_lost_slot(&url, slot, pool, lease).await {
                    Ok(queued) => {
                        tracing::warn!(slot, queued, "events since the horizon queued again; the slot is made anew");
                        Duration::ZERO
                    }
                    Err(e) => {
                        tracing::error!(slot, error = %e, "recovering from the lost slot failed; retrying");
                        streak = streak.saturating_add(1);
                        retry.delay(streak.min(10))
                    }
                }
            }
            Err(e) if e_slot_in_use(&e) => {
                // The lease is this relay's: the session holding the slot belongs to a relay that
                // lost it. End that session and take the slot.
                match source::end_other_reader(pool, slot).await {
                    Ok(ended) => tracing::warn!(
                        slot,
                        ended,
                        "another session streams from the slot; ending it"
                    ),
                    Err(e) => tracing::warn!(slot, error = %e, "cannot end the session holding the slot"),
                }
                SLOT_RETRY
            }
            Err(e) => {
                streak = streak.saturating_add(1);
                let pause = retry.delay(streak.min(10));
                tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "streaming from the write-ahead log failed; retrying from the confirmed position");
                metrics.publish_errors.with_label_values(&["wal"]).inc();
                pause
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return StreamEnd::Stopped,
            _ = lost.cancelled() => return StreamEnd::Stopped,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

fn e_slot_in_use(e: &SessionError) -> bool {
    matches!(e, SessionError::Wal(w) if w.slot_in_use())
}

/// The slot is lost: queue again what the horizon does not cover, and drop the slot, so that
/// the next session makes it anew (streaming from then on).
async fn recover_lost_slot(
    url: &str,
    slot: &str,
    pool: &PgPool,
    lease: &Lease,
) -> Result<u64, SessionError> {
    let queued = source::fall_back_to_queue(pool, lease.fence()).await?;
    WalReader::drop_slot(url, slot).await?;
    Ok(queued.unwrap_or(0))
}

/// Events on their way to Kafka: the position that confirms them (a transaction's end; `None`
/// for the first events of a transaction still being read), and its events once every delivery
/// report is in.
type Sending = (Option<Lsn>, Vec<OutboxEvent>, BatchDelivery);

/// One session on the slot, until `stop`, the lease's loss (`Ok`) or a failure (`Err`).
async fn stream(
    settings: &RelaySettings,
    url: &str,
    pool: &PgPool,
    producer: &RelayProducer,
    metrics: &RelayMetrics,
    lease: &Lease,
    stop: &CancellationToken,
) -> Result<(), SessionError> {
    let slot = settings.source.slot.as_str();
    let fence = lease.fence();
    let opening = std::time::Instant::now();
    if source::slot_missing(pool, fence.lock_key).await? {
        // Streamed before, from a slot that is gone (dropped by hand, or the server's data
        // restored without it): what it had not confirmed is queued from the horizon.
        tracing::error!(slot, "the replication slot the relay streamed from is gone: falling back to the queue from the horizon, then streaming from a new slot");
        metrics.wal_slot_lost.inc();
        let queued = source::fall_back_to_queue(pool, fence).await?;
        tracing::warn!(slot, queued, "events since the horizon queued again");
    }
    // Only the lease's holder streams: a session on the slot is a former holder's. End it
    // before opening, so that the slot is free once this relay asks for it.
    if source::end_other_reader(pool, slot).await? {
        tracing::warn!(slot, "a former holder of the lease still streamed from the slot; its session is ended");
        source::until_slot_free(pool, slot, SLOT_RETRY * 10).await?;
    }
    let mut reader = WalReader::open(url, slot).await?;
    source::switch_to_wal(pool, fence, slot).await?;
    let mut queued = QueuedAggregates::start(pool).await?;
    tracing::info!(
        slot,
        opened_in_ms = opening.elapsed().as_millis() as u64,
        "streaming the outbox from the write-ahead log"
    );
    let limit = usize::try_from(settings.batch_size)
        .unwrap_or(usize::MAX)
        .saturating_mul(settings.pipeline_depth as usize);
    let retry = settings.retry_policy();
    let lost = lease.lost();
    let mut sending: FuturesOrdered<futures::future::BoxFuture<'static, Sending>> =
        FuturesOrdered::new();
    let mut events_out: usize = 0;
    // The position every transaction up to which Kafka has acknowledged, and the horizon's state:
    // a probe waiting for the confirmed position to pass it, and whether anything was published
    // since the last probe.
    let mut confirmed = Lsn(0);
    let mut probe: Option<Probe> = None;
    // The horizon the stream has moved to, and the newest event it has published: a probe
    // is taken while the one does not cover the other.
    let mut covered: Option<DateTime<Utc>> = None;
    let mut newest: Option<DateTime<Utc>> = None;
    let mut horizon_tick = tokio::time::interval(HORIZON_EVERY);
    horizon_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        if producer.client().fatal_error().is_some() {
            break Ok(());
        }
        tokio::select! {
            read = reader.next(), if events_out < limit => match read? {
                None => break Err(SessionError::Ended),
                Some(WalRead::Transaction { events, confirm }) => {
                    let events = hold_behind_queue(pool, lease, &mut queued, events).await?;
                    if events.is_empty() {
                        if sending.is_empty() {
                            confirmed = confirm;
                            reader.confirm(confirm);
                        } else {
                            sending.push_back(Box::pin(async move {
                                (Some(confirm), Vec::new(), BatchDelivery::default())
                            }));
                        }
                        continue;
                    }
                    events_out += events.len();
                    sending.push_back(send(producer, events, Some(confirm)).await);
                }
                Some(WalRead::Events { events }) => {
                    let events = hold_behind_queue(pool, lease, &mut queued, events).await?;
                    events_out += events.len();
                    sending.push_back(send(producer, events, None).await);
                }
                Some(WalRead::Idle { wal_end }) => {
                    if sending.is_empty() {
                        confirmed = wal_end.max(confirmed);
                        reader.confirm(confirmed);
                    }
                }
            },
            Some((confirm, events, delivery)) = sending.next(), if !sending.is_empty() => {
                events_out -= events.len();
                if !events.is_empty() {
                    pipeline_core::crash_point::crash_point(
                        pipeline_core::crash_point::RELAY_AFTER_DELIVERY,
                    );
                    record(pool, lease, metrics, &retry, &events, &delivery).await?;
                    queued.add(queued_by(&events, &delivery));
                    newest = newest.max(events.iter().map(|e| e.created_at).max());
                }
                if let Some(confirm) = confirm {
                    confirmed = confirm;
                    reader.confirm(confirm);
                }
            }
            _ = horizon_tick.tick() => {
                let passed = probe.filter(|p| confirmed >= p.position);
                if let Some(p) = passed {
                    covered = Some(p.horizon);
                }
                let behind = newest.is_some() && newest >= covered;
                if passed.is_some() || (probe.is_none() && behind) {
                    let next = source::advance(pool, fence, passed, confirmed).await?;
                    probe = behind.then_some(next);
                }
            }
            _ = lost.cancelled() => break Ok(()),
            _ = stop.cancelled() => {
                // Let what was sent be acknowledged and confirmed before the session ends.
                while let Some((confirm, events, delivery)) = sending.next().await {
                    if !events.is_empty() {
                        record(pool, lease, metrics, &retry, &events, &delivery).await?;
                    }
                    if let Some(confirm) = confirm {
                        reader.confirm(confirm);
                    }
                }
                break Ok(());
            }
        }
    };
    // Ends the session only once the server knows the confirmed position.
    if let Err(e) = reader.close().await {
        tracing::debug!(error = %e, "closing the replication session");
    }
    result
}

/// The events of a read to send: those of an aggregate with an event in the relay's queue join
/// the queue behind it instead (a failed event, one waiting for its retry, or one queued before
/// the stream began), so that no event is published ahead of an earlier one of its aggregate.
async fn hold_behind_queue(
    pool: &PgPool,
    lease: &Lease,
    queued: &mut QueuedAggregates,
    events: Vec<OutboxEvent>,
) -> Result<Vec<OutboxEvent>, SessionError> {
    if events.is_empty() {
        return Ok(events);
    }
    let mut aggregates: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    aggregates.sort_unstable();
    aggregates.dedup();
    let behind = queued.among(pool, &aggregates).await?;
    if behind.is_empty() {
        return Ok(events);
    }
    let (held, send): (Vec<OutboxEvent>, Vec<OutboxEvent>) = events
        .into_iter()
        .partition(|e| behind.contains(&e.aggregate_id));
    let ids: Vec<i64> = held.iter().map(|e| e.id).collect();
    let _ = queue_streamed(pool, lease.fence(), &ids).await?;
    tracing::info!(
        events = ids.len(),
        "streamed events queued behind earlier events of their aggregates"
    );
    Ok(send)
}

/// The aggregates of the events [`record`] queued: those Kafka did not take, and those held
/// behind them.
fn queued_by<'a>(events: &'a [OutboxEvent], delivery: &BatchDelivery) -> Vec<&'a str> {
    if delivery.failed.is_empty() && delivery.held.is_empty() {
        return Vec::new();
    }
    let ids: std::collections::HashSet<i64> = delivery
        .failed
        .iter()
        .map(|f| f.id)
        .chain(delivery.held.iter().copied())
        .collect();
    events
        .iter()
        .filter(|e| ids.contains(&e.id))
        .map(|e| e.aggregate_id.as_str())
        .collect()
}

/// Hands `events` to the producer in order, and returns the wait for their delivery reports.
async fn send(
    producer: &RelayProducer,
    events: Vec<OutboxEvent>,
    confirm: Option<Lsn>,
) -> futures::future::BoxFuture<'static, Sending> {
    let sent = send_batch(producer, &events).await;
    let producer = producer.clone();
    Box::pin(async move {
        let delivery = sent.delivered(&producer, &events).await;
        (confirm, events, delivery)
    })
}

/// Records what Kafka did with a transaction's events: those it did not take, and those held
/// behind them, join the queue with their failed attempt; the metrics as the queue's batches
/// count them.
async fn record(
    pool: &PgPool,
    lease: &Lease,
    metrics: &RelayMetrics,
    retry: &crate::backoff::RetryPolicy,
    events: &[OutboxEvent],
    delivery: &BatchDelivery,
) -> Result<(), MarkError> {
    let fence = lease.fence();
    let mut given_up = 0;
    if !delivery.failed.is_empty() || !delivery.held.is_empty() {
        let ids: Vec<i64> = delivery
            .failed
            .iter()
            .map(|f| f.id)
            .chain(delivery.held.iter().copied())
            .collect();
        queue_streamed(pool, fence, &ids).await?;
        let failures: Vec<FailedAttempt> = delivery
            .failed
            .iter()
            .map(|f| FailedAttempt {
                id: f.id,
                error: f.error.clone(),
                retry_in: retry.delay(1),
                give_up: retry.gives_up(1, f.permanent),
            })
            .collect();
        record_failures(pool, fence, &failures).await?;
        for f in &delivery.failed {
            metrics.publish_errors.with_label_values(&[f.reason]).inc();
            tracing::warn!(outbox_id = f.id, error = %f.error, permanent = f.permanent, "publish attempt failed; the event joins the queue");
        }
        given_up = failures.iter().filter(|f| f.give_up).count();
    }
    count_delivery(metrics, events, delivery, given_up, Utc::now());
    metrics
        .last_success
        .set(Utc::now().timestamp_millis() as f64 / 1000.0);
    Ok(())
}
