//! A Kafka producer whose delivery reports are futures, like rdkafka's `FutureProducer`, but
//! whose polling thread sleeps while nothing is produced.
//!
//! rdkafka's `FutureProducer` serves delivery reports on a thread that polls in 100 ms rounds,
//! and each round ends in a busy wait: the round's deadline is turned into whole milliseconds
//! for librdkafka, so its last fraction of a millisecond is polled with a zero timeout, again
//! and again, until it has passed. That is about 1% of a core for every idle producer (an idle
//! relay, its standby, each consumer process). This producer polls in rounds of
//! [`POLL_ROUND`]: a report still wakes the thread at once, and the busy end of a round comes
//! ten times less often.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::client::Client;
use rdkafka::config::{FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Message, ToBytes};
use rdkafka::producer::{
    BaseProducer, BaseRecord, DeliveryResult, FutureRecord, Producer, ProducerContext,
};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use tokio::sync::oneshot;

pub use rdkafka::producer::future_producer::{Delivery, OwnedDeliveryResult};

/// How long one poll of the delivery thread waits for a report.
pub const POLL_ROUND: Duration = Duration::from_secs(1);

/// How long [`QuietProducer::send`] pauses while the producer's queue is full.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(10);

/// A message's delivery report: `Err` when the producer was dropped before it came.
pub type DeliveryFuture = oneshot::Receiver<OwnedDeliveryResult>;

/// The client context of a [`QuietProducer`]: `C`'s, with each delivery report sent to the
/// future of its message.
pub struct DeliveryContext<C> {
    inner: C,
}

impl<C: ClientContext> ClientContext for DeliveryContext<C> {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        self.inner.log(level, fac, message);
    }

    fn stats(&self, statistics: Statistics) {
        self.inner.stats(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.inner.error(error, reason);
    }
}

impl<C: ClientContext> ProducerContext for DeliveryContext<C> {
    type DeliveryOpaque = Box<oneshot::Sender<OwnedDeliveryResult>>;

    fn delivery(&self, result: &DeliveryResult<'_>, reply: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(message) => Ok(Delivery {
                partition: message.partition(),
                offset: message.offset(),
                timestamp: message.timestamp(),
            }),
            Err((error, message)) => Err((error.clone(), message.detach())),
        };
        // The caller may have stopped waiting; the report then has no one to tell.
        let _ = reply.send(owned);
    }
}

/// A producer whose [`QuietProducer::send_result`] returns the delivery report as a future.
/// Its clones share one client; dropping the last stops the polling thread within
/// [`POLL_ROUND`], and messages still queued are then dropped with the client (flush first to
/// wait for them).
pub struct QuietProducer<C: ClientContext + 'static> {
    producer: Arc<BaseProducer<DeliveryContext<C>>>,
    _poller: Arc<Poller>,
}

impl<C: ClientContext + 'static> Clone for QuietProducer<C> {
    fn clone(&self) -> Self {
        QuietProducer {
            producer: Arc::clone(&self.producer),
            _poller: Arc::clone(&self._poller),
        }
    }
}

/// Stops the polling thread when the last clone of its producer is dropped.
struct Poller {
    stop: Arc<AtomicBool>,
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl<C: ClientContext + 'static> QuietProducer<C> {
    /// Creates the producer from `config` with `context`, and its polling thread.
    pub fn create(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        let producer = Arc::new(BaseProducer::from_config_and_context(
            config,
            DeliveryContext { inner: context },
        )?);
        let stop = Arc::new(AtomicBool::new(false));
        let (polled, stopped) = (Arc::clone(&producer), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("kafka-delivery".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    polled.poll(POLL_ROUND);
                }
            })
            .map_err(|e| KafkaError::ClientCreation(format!("starting its polling thread: {e}")))?;
        Ok(QuietProducer {
            producer,
            _poller: Arc::new(Poller { stop }),
        })
    }

    /// Queues `record`; its delivery report comes through the future. A record the producer
    /// refuses at once (its queue full, a message too large…) comes back with the error.
    #[allow(clippy::result_large_err)]
    pub fn send_result<'a, K, P>(
        &self,
        record: FutureRecord<'a, K, P>,
    ) -> Result<DeliveryFuture, (KafkaError, FutureRecord<'a, K, P>)>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let (reply, report) = oneshot::channel();
        let base = BaseRecord {
            topic: record.topic,
            partition: record.partition,
            payload: record.payload,
            key: record.key,
            timestamp: record.timestamp,
            headers: record.headers,
            delivery_opaque: Box::new(reply),
        };
        self.producer.send(base).map(|()| report).map_err(|(e, b)| {
            let mut back = FutureRecord::to(b.topic);
            back.partition = b.partition;
            back.payload = b.payload;
            back.key = b.key;
            back.timestamp = b.timestamp;
            back.headers = b.headers;
            (e, back)
        })
    }

    /// Queues `record` (waiting up to `queue_timeout` while the producer's queue is full) and
    /// waits for its delivery report.
    pub async fn send<K, P>(
        &self,
        mut record: FutureRecord<'_, K, P>,
        queue_timeout: Duration,
    ) -> Result<Delivery, KafkaError>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let deadline = tokio::time::Instant::now() + queue_timeout;
        loop {
            match self.send_result(record) {
                Ok(report) => {
                    return match report.await {
                        Ok(Ok(delivery)) => Ok(delivery),
                        Ok(Err((error, _))) => Err(error),
                        Err(_) => Err(KafkaError::Canceled),
                    }
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if tokio::time::Instant::now() < deadline =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((error, _)) => return Err(error),
            }
        }
    }

    /// The librdkafka client (its fatal error, metadata…).
    pub fn client(&self) -> &Client<DeliveryContext<C>> {
        self.producer.client()
    }

    /// Waits up to `timeout` for every queued message's delivery report.
    pub fn flush(&self, timeout: Duration) -> KafkaResult<()> {
        self.producer.flush(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::client::DefaultClientContext;

    /// Threads of this process named like the producers' polling threads.
    fn polling_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .filter_map(Result::ok)
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|name| name.trim_end() == "kafka-delivery")
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// Waits up to five polling rounds for [`polling_threads`] to be `count` (a new thread takes
    /// its name once it runs), and returns what it is then.
    fn polling_threads_become(count: usize) -> usize {
        let deadline = std::time::Instant::now() + 5 * POLL_ROUND;
        while polling_threads() != count && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        polling_threads()
    }

    #[test]
    fn the_polling_thread_lives_as_long_as_a_clone_of_its_producer() {
        // No broker is needed: the client connects in the background and never succeeds.
        let mut config = ClientConfig::new();
        let _ = config.set("bootstrap.servers", "127.0.0.1:1");
        let producer = QuietProducer::create(&config, DefaultClientContext).expect("producer");
        let clone = producer.clone();
        assert_eq!(polling_threads_become(1), 1);
        drop(producer);
        std::thread::sleep(POLL_ROUND + Duration::from_millis(300));
        assert_eq!(polling_threads(), 1, "a clone still holds the producer");
        drop(clone);
        assert_eq!(
            polling_threads_become(0),
            0,
            "the last clone's drop ends the thread"
        );
    }
}
