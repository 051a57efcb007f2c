//! The relay as a whole, for a program to embed: it stands by until it holds the lease, then
//! publishes ([`crate::active`]), releases due delayed events ([`crate::release`]) and removes
//! what is past its retention window ([`crate::retention`]) while it keeps it; beside that, whether active or not, it reports the backlog ([`crate::backlog`]) and
//! vacuums its queue table ([`crate::vacuum`]).

use std::time::Duration;

use pipeline_core::retention::{Backlog, RetentionMetrics, Runner};
use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::active::{run_active, Turn};
use crate::backlog::watch_backlog;
use crate::error::RelayError;
use crate::lease::Elector;
use crate::mark::MarkError;
use crate::metrics::RelayMetrics;
use crate::publish::ProducerHandle;
use crate::release::release_while_active;
use crate::settings::{RelaySettings, Source};
use crate::vacuum::vacuum_queue;
use crate::wal::source;
use crate::wal::stream::{run_streaming, StreamEnd};

/// How often the backlog gauges are refreshed.
const BACKLOG_EVERY: Duration = Duration::from_secs(1);

/// A relay ready to run: settings checked, metrics registered, Kafka producer made.
pub struct Relay {
    settings: RelaySettings,
    pool: PgPool,
    metrics: RelayMetrics,
    retention: RetentionMetrics,
    producer: ProducerHandle,
}

impl Relay {
    /// A relay on `pool` (see [`crate::connect`] for the sessions it should have; the tables of
    /// [`crate::MIGRATOR`] must exist), with its metrics registered on `registry`.
    ///
    /// The producer is made here and kept across activations, so a standby that takes over is
    /// warm. The lease's presence session is a connection of its own, made with `pool`'s
    /// connect options.
    pub fn new(
        settings: RelaySettings,
        pool: PgPool,
        registry: &Registry,
    ) -> Result<Self, RelayError> {
        settings.validate()?;
        let metrics = RelayMetrics::register(registry)?;
        let retention = RetentionMetrics::register(registry, "relay")?;
        let producer = ProducerHandle::create(
            &settings.kafka,
            &settings.producer_settings(),
            metrics.clone(),
        )?;
        Ok(Relay {
            settings,
            pool,
            metrics,
            retention,
            producer,
        })
    }

    /// The relay's metrics, as registered.
    pub fn metrics(&self) -> &RelayMetrics {
        &self.metrics
    }

    /// Runs until `shutdown`, or until the relay cannot go on (its Kafka producer failed for
    /// good and cannot be replaced, or it cannot listen for new events): then the error.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), RelayError> {
        let Relay {
            settings,
            pool,
            metrics,
            retention,
            mut producer,
        } = self;
        let beside = shutdown.child_token();
        let backlog = tokio::spawn(watch_backlog(
            pool.clone(),
            settings.lock_key,
            metrics.clone(),
            BACKLOG_EVERY,
            beside.clone(),
        ));
        let vacuum = (!settings.queue_vacuum_interval.is_zero()).then(|| {
            tokio::spawn(vacuum_queue(
                pool.clone(),
                settings.queue_vacuum_interval,
                metrics.batch_size.clone(),
                beside.clone(),
            ))
        });
        let result = take_turns(
            &settings,
            &pool,
            &mut producer,
            &metrics,
            &retention,
            &shutdown,
        )
        .await;
        beside.cancel();
        let _ = backlog.await;
        if let Some(vacuum) = vacuum {
            let _ = vacuum.await;
        }
        // Whatever is still queued was already waited for by its batch; flush anyway.
        let _ = producer.producer().flush(Duration::from_secs(5));
        tracing::info!("relay stopped");
        result
    }
}

/// Runs a relay with `settings` on `pool` until `shutdown`: [`Relay::new`], then [`Relay::run`].
pub async fn run(
    settings: RelaySettings,
    pool: PgPool,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    Relay::new(settings, pool, registry)?.run(shutdown).await
}

/// Stands by until this relay holds the lease, then publishes while it keeps it; again after
/// each loss, until `shutdown` or an error.
async fn take_turns(
    settings: &RelaySettings,
    pool: &PgPool,
    producer: &mut ProducerHandle,
    metrics: &RelayMetrics,
    retention: &RetentionMetrics,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let mut elector = Elector::new(settings.lease_settings(), (*pool.connect_options()).clone());
    // Raised by a claim that comes back full; retention waits while it is.
    let backlog = Backlog::new();
    while !shutdown.is_cancelled() {
        let Some((lease, acquired)) = elector.acquire(shutdown).await else {
            break;
        };
        tracing::info!(
            epoch = lease.fence().epoch,
            how = acquired.reason.label(),
            since_previous_renewal_s = acquired.since_previous_renewal,
            "relay is active"
        );
        metrics.record_takeover(lease.fence().epoch, &acquired);
        metrics.active.set(1);
        // The lease is renewed beside the loop, and handed back only once the loop has recorded
        // what its batches did (handing it back first would refuse those writes).
        let stop_renewing = CancellationToken::new();
        let releasing = tokio::spawn(release_while_active(
            pool.clone(),
            lease.clone(),
            settings.release_batch_size,
            settings.release_interval,
            metrics.clone(),
            stop_renewing.clone(),
        ));
        let retaining = retain_while_active(settings, pool, retention, &backlog, &stop_renewing);
        let (outcome, ()) = tokio::join!(
            async {
                let turn = Turn {
                    settings,
                    pool,
                    metrics,
                    lease: &lease,
                    backlog: &backlog,
                };
                let outcome = match settings.source.source {
                    Source::Queue => run_queue(turn, producer, shutdown).await,
                    Source::Wal => run_wal(turn, producer, shutdown).await,
                };
                stop_renewing.cancel();
                outcome
            },
            async {
                let end = elector.keep(&lease, &stop_renewing).await;
                metrics.record_lease_end(end);
            },
        );
        let _ = releasing.await;
        if let Some(retaining) = retaining {
            let _ = retaining.await;
        }
        metrics.active.set(0);
        outcome?;
    }
    Ok(())
}

/// The relay's turn with `--source queue`: if the relay streamed the write-ahead log before, it
/// falls back to the queue first (writers queue again, events past the horizon are queued, the
/// slot is dropped), then claims from the queue.
async fn run_queue(
    turn: Turn<'_>,
    producer: &mut ProducerHandle,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let Turn {
        settings,
        pool,
        lease,
        ..
    } = turn;
    let retry = settings.retry_policy();
    let mut streak = 0;
    loop {
        match source::fall_back_to_queue(pool, lease.fence()).await {
            Ok(None) => break,
            Ok(Some(queued)) => {
                tracing::warn!(queued, "the relay streamed the write-ahead log before: writers queue again, and the events past its horizon are queued");
                drop_unused_slot(pool, &settings.source.slot).await;
                break;
            }
            Err(MarkError::LeaseLost(_)) => {
                lease.give_up();
                return Ok(());
            }
            Err(e) => {
                streak += 1;
                let pause = retry.delay(streak.min(10));
                tracing::error!(error = %e, "falling back from the write-ahead log to the queue failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = lease.lost().cancelled() => return Ok(()),
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
    run_active(turn, producer, shutdown).await
}

/// A replication slot no relay streams from keeps the server's WAL for ever: dropped once the
/// relay is back on the queue, if the role may (else said, with the command).
async fn drop_unused_slot(pool: &PgPool, slot: &str) {
    let dropped = sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
         WHERE slot_name = $1 AND NOT active",
    )
    .bind(slot)
    .execute(pool)
    .await;
    if let Err(e) = dropped {
        tracing::warn!(
            slot,
            error = %e,
            "the replication slot the relay streamed from keeps the server's WAL: drop it with \
             SELECT pg_drop_replication_slot('{slot}')"
        );
    }
}

/// The relay's turn with `--source wal`: the stream from the slot, and beside it the queue's
/// claim for the events that are queued anyway (those Kafka refused, requeued ones, a
/// fall-back's). The producer is replaced when it fails for good, and both go on.
async fn run_wal(
    turn: Turn<'_>,
    producer: &mut ProducerHandle,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    let Turn {
        settings,
        pool,
        metrics,
        lease,
        ..
    } = turn;
    match source::sees_all_transactions(pool).await {
        Ok(true) => {}
        Ok(false) => return Err(RelayError::WalPrivileges),
        // Said again by the stream's own statements, which it retries.
        Err(e) => tracing::warn!(error = %e, "cannot read the relay role's privileges"),
    }
    loop {
        let stop_queue = shutdown.child_token();
        let streaming_producer = producer.producer().clone();
        let (queue, end) = tokio::join!(
            run_active(turn, producer, &stop_queue),
            async {
                let end =
                    run_streaming(settings, pool, &streaming_producer, metrics, lease, shutdown)
                        .await;
                stop_queue.cancel();
                end
            },
        );
        queue?;
        match end {
            StreamEnd::Stopped => return Ok(()),
            StreamEnd::ProducerFatal => {
                let _ = producer.renew_if_fatal()?;
            }
        }
    }
}

/// While this relay is active (until `stop`): runs retention on the outbox's database every
/// `--retention-interval`, unless that is `0s`, waiting while the relay catches up on a backlog.
fn retain_while_active(
    settings: &RelaySettings,
    pool: &PgPool,
    metrics: &RetentionMetrics,
    backlog: &Backlog,
    stop: &CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    if !settings.retention.enabled() {
        return None;
    }
    let (settings, pool, metrics, backlog, stop) = (
        settings.retention.clone(),
        pool.clone(),
        metrics.clone(),
        backlog.clone(),
        stop.clone(),
    );
    Some(tokio::spawn(async move {
        // Whether the groups share the database decides what is kept; asked again until known.
        let groups_here = loop {
            match crate::retention::groups_here(&pool).await {
                Ok(here) => break here,
                Err(e) => {
                    tracing::warn!(error = %e, "retention waits: cannot read the outbox's database")
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(settings.interval.duration()) => {}
            }
        };
        let runner = Runner::new(crate::retention::rules(&settings, groups_here), "relay")
            .batch_size(settings.batch_size)
            .pause_ratio(settings.pause_ratio)
            .catch_up(settings.catch_up)
            .yield_to(backlog)
            .with_metrics(metrics);
        runner.run_every(pool, settings.interval, stop).await;
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool that is never connected: making a relay reads no database.
    fn pool() -> PgPool {
        PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/nothing").expect("a lazy pool")
    }

    #[tokio::test]
    async fn a_host_can_tell_why_a_relay_cannot_start() {
        let invalid = RelaySettings {
            batch_size: 0,
            ..RelaySettings::default()
        };
        assert!(matches!(
            Relay::new(invalid, pool(), &Registry::new()),
            Err(RelayError::InvalidSettings(_))
        ));
        let registry = Registry::new();
        let _first = Relay::new(RelaySettings::default(), pool(), &registry).expect("one relay");
        assert!(matches!(
            Relay::new(RelaySettings::default(), pool(), &registry),
            Err(RelayError::Metrics(_))
        ));
        let mut refused = RelaySettings::default();
        refused
            .kafka
            .kafka_options
            .push(("no.such.option".to_owned(), "1".to_owned()));
        let error = Relay::new(refused, pool(), &Registry::new())
            .err()
            .expect("librdkafka refuses the option");
        assert!(matches!(error, RelayError::Producer(_)), "{error}");
        let chain = format!("{:#}", anyhow::Error::from(error));
        assert!(
            chain.starts_with("creating the Kafka producer: "),
            "{chain}"
        );
        assert!(chain.contains("no.such.option"), "{chain}");
    }
}
