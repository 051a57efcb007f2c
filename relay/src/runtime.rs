//! The relay as a whole, for a program to embed: it stands by until it holds the lease, then
//! publishes ([`crate::active`]), releases due delayed events ([`crate::release`]) and removes
//! what is past its retention window ([`crate::retention`]) while it keeps it; beside that, whether active or not, it reports the backlog ([`crate::backlog`]) and
//! vacuums its queue table ([`crate::vacuum`]).

use std::time::Duration;

use pipeline_core::retention::{Backlog, RetentionMetrics, Runner};
use prometheus::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::active::run_active;
use crate::backlog::watch_backlog;
use crate::error::RelayError;
use crate::lease::Elector;
use crate::metrics::RelayMetrics;
use crate::publish::ProducerHandle;
use crate::release::release_while_active;
use crate::settings::RelaySettings;
use crate::vacuum::vacuum_queue;

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
                let outcome = run_active(
                    settings, pool, producer, metrics, &lease, &backlog, shutdown,
                )
                .await;
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
