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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
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

/// Where a message's delivery report goes.
pub enum Reply {
    /// To a future of its own ([`QuietProducer::send_result`]).
    One(oneshot::Sender<OwnedDeliveryResult>),
    /// To its place among a batch's reports ([`QuietProducer::send_in_batch`]).
    InBatch(BatchSlot),
}

/// The delivery reports of a batch of messages, gathered in one place: the batch is woken once,
/// when the last report has come, instead of a channel, a task and a wake-up for each message.
/// Report `i` belongs to the message sent with index `i`.
pub struct BatchReports {
    /// `None`: the report was lost (the producer dropped the message without one).
    slots: Vec<OnceLock<Option<OwnedDeliveryResult>>>,
    /// Reports still to come, and one more until [`BatchReports::sent_all`].
    remaining: AtomicUsize,
    done: tokio::sync::Notify,
}

impl BatchReports {
    /// Room for the reports of `len` messages, indexed from 0.
    pub fn new(len: usize) -> Arc<Self> {
        Arc::new(BatchReports {
            slots: (0..len).map(|_| OnceLock::new()).collect(),
            remaining: AtomicUsize::new(1),
            done: tokio::sync::Notify::new(),
        })
    }

    /// Every message of the batch has been handed to the producer (or refused):
    /// [`BatchReports::all_reported`] may now finish.
    pub fn sent_all(&self) {
        self.settle();
    }

    /// Waits until every message sent has its report. Call after [`BatchReports::sent_all`].
    pub async fn all_reported(&self) {
        loop {
            let notified = self.done.notified();
            if self.remaining.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// The report of message `index`: `None` until it came, `Some(Err(Canceled))` if the producer
    /// dropped the message without one.
    pub fn report(&self, index: usize) -> Option<OwnedDeliveryResult> {
        match self.slots.get(index)?.get()? {
            Some(Ok(d)) => Some(Ok(Delivery {
                partition: d.partition,
                offset: d.offset,
                timestamp: d.timestamp,
            })),
            Some(Err((error, message))) => Some(Err((error.clone(), message.clone()))),
            None => Some(Err((
                KafkaError::Canceled,
                rdkafka::message::OwnedMessage::new(
                    None,
                    None,
                    String::new(),
                    rdkafka::Timestamp::NotAvailable,
                    -1,
                    -1,
                    None,
                ),
            ))),
        }
    }

    fn settle(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}

/// One message's place among a batch's reports; a place dropped without its report (the
/// message refused, or dropped by the producer) records the report as lost.
pub struct BatchSlot {
    reports: Arc<BatchReports>,
    index: usize,
    filled: bool,
}

impl BatchSlot {
    /// The producer refused the message at once: no report will come for this send, and the
    /// place stays empty for the record's next send (after a full queue) to fill.
    fn withdraw(mut self) {
        self.filled = true;
        self.reports.settle();
    }

    fn fill(&mut self, report: Option<OwnedDeliveryResult>) {
        if let Some(slot) = self.reports.slots.get(self.index) {
            let _ = slot.set(report);
        }
        self.filled = true;
        self.reports.settle();
    }
}

impl Drop for BatchSlot {
    fn drop(&mut self) {
        if !self.filled {
            self.fill(None);
        }
    }
}

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
    type DeliveryOpaque = Box<Reply>;

    fn delivery(&self, result: &DeliveryResult<'_>, reply: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(message) => Ok(Delivery {
                partition: message.partition(),
                offset: message.offset(),
                timestamp: message.timestamp(),
            }),
            Err((error, message)) => Err((error.clone(), message.detach())),
        };
        match *reply {
            // The caller may have stopped waiting; the report then has no one to tell.
            Reply::One(reply) => {
                let _ = reply.send(owned);
            }
            Reply::InBatch(mut slot) => slot.fill(Some(owned)),
        }
    }
}

/// A record the producer refused at once: the error, the record to send again, and where its
/// report would have gone.
type Refused<'a, K, P> = (KafkaError, FutureRecord<'a, K, P>, Box<Reply>);

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
        self.send_with(record, Reply::One(reply))
            .map(|()| report)
            .map_err(|(error, back, _)| (error, back))
    }

    /// Queues `record` as message `index` of the batch `reports` (see [`BatchReports`]); a
    /// record the producer refuses at once comes back with the error, and its place stays
    /// empty: sent again (after a full queue), its report fills the place; given up, its
    /// [`BatchReports::report`] stays `None`.
    #[allow(clippy::result_large_err)]
    pub fn send_in_batch<'a, K, P>(
        &self,
        record: FutureRecord<'a, K, P>,
        reports: &Arc<BatchReports>,
        index: usize,
    ) -> Result<(), (KafkaError, FutureRecord<'a, K, P>)>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        // Counted before the send, as its report may come before the send returns; a refused
        // record's slot is withdrawn, which settles it.
        let _ = reports.remaining.fetch_add(1, Ordering::AcqRel);
        let slot = BatchSlot {
            reports: Arc::clone(reports),
            index,
            filled: false,
        };
        self.send_with(record, Reply::InBatch(slot))
            .map_err(|(error, back, reply)| {
                if let Reply::InBatch(slot) = *reply {
                    slot.withdraw();
                }
                (error, back)
            })
    }

    #[allow(clippy::result_large_err)]
    fn send_with<'a, K, P>(
        &self,
        record: FutureRecord<'a, K, P>,
        reply: Reply,
    ) -> Result<(), Refused<'a, K, P>>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let base = BaseRecord {
            topic: record.topic,
            partition: record.partition,
            payload: record.payload,
            key: record.key,
            timestamp: record.timestamp,
            headers: record.headers,
            delivery_opaque: Box::new(reply),
        };
        self.producer.send(base).map_err(|(e, b)| {
            let mut back = FutureRecord::to(b.topic);
            back.partition = b.partition;
            back.payload = b.payload;
            back.key = b.key;
            back.timestamp = b.timestamp;
            back.headers = b.headers;
            (e, back, b.delivery_opaque)
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

    /// Held by each test that makes a producer: `polling_threads` counts the process's threads.
    static PRODUCERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A producer no broker answers (each message times out after 300 ms), with `extra` settings.
    fn producer_without_broker(extra: (&str, &str)) -> QuietProducer<DefaultClientContext> {
        let mut config = ClientConfig::new();
        let _ = config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("message.timeout.ms", "300")
            .set(extra.0, extra.1);
        QuietProducer::create(&config, DefaultClientContext).expect("producer")
    }

    /// Waits for every report of `reports`, as a batch does, up to 10 s.
    fn wait_all_reported(reports: &BatchReports) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(10), reports.all_reported()).await
            })
            .expect("every report within the messages' timeout");
    }

    #[test]
    fn a_batch_is_reported_once_every_message_it_sent_has_its_report() {
        let _alone = PRODUCERS.lock().unwrap_or_else(|e| e.into_inner());
        // No broker answers: each message times out, and the batch learns it once, in order.
        let producer = producer_without_broker(("message.max.bytes", "2000"));
        let reports = BatchReports::new(4);
        let big = "x".repeat(5000);
        let mut refused = Vec::new();
        for (index, payload) in ["a", "b", big.as_str(), "d"].into_iter().enumerate() {
            let record = FutureRecord::<str, str>::to("reports")
                .key("k")
                .payload(payload);
            if let Err((e, _)) = producer.send_in_batch(record, &reports, index) {
                refused.push((index, e));
            }
        }
        reports.sent_all();
        wait_all_reported(&reports);
        assert!(
            matches!(refused.as_slice(), [(2, KafkaError::MessageProduction(_))]),
            "the large one is refused at once: {refused:?}"
        );
        for index in [0, 1, 3] {
            match reports.report(index) {
                Some(Err((KafkaError::MessageProduction(code), _))) => {
                    assert_eq!(code, RDKafkaErrorCode::MessageTimedOut, "{index}")
                }
                other => panic!("message {index}: {other:?}"),
            }
        }
        // The refused message's place was settled without a report of Kafka's.
        assert!(reports.report(2).is_none());
        drop(producer);
        assert_eq!(polling_threads_become(0), 0, "its polling thread ended");
    }

    #[test]
    fn a_message_sent_again_after_a_full_queue_gets_its_own_report() {
        let _alone = PRODUCERS.lock().unwrap_or_else(|e| e.into_inner());
        // Room for one message: the second is refused with a full queue until the first has
        // timed out (no broker answers), then sent again.
        let producer = producer_without_broker(("queue.buffering.max.messages", "1"));
        let reports = BatchReports::new(2);
        let first = FutureRecord::<str, str>::to("reports")
            .key("k")
            .payload("a");
        assert!(producer.send_in_batch(first, &reports, 0).is_ok());
        let mut record = FutureRecord::<str, str>::to("reports")
            .key("k")
            .payload("b");
        let mut refusals = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match producer.send_in_batch(record, &reports, 1) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the queue never had room"
                    );
                    refusals += 1;
                    record = back;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err((e, _)) => panic!("refused for another reason: {e}"),
            }
        }
        assert!(refusals > 0, "the queue was full at least once");
        reports.sent_all();
        wait_all_reported(&reports);
        // The second message's report is Kafka's, not the refusal's: it is not read as lost.
        for index in [0, 1] {
            match reports.report(index) {
                Some(Err((KafkaError::MessageProduction(code), _))) => {
                    assert_eq!(code, RDKafkaErrorCode::MessageTimedOut, "{index}")
                }
                other => panic!("message {index}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_polling_thread_lives_as_long_as_a_clone_of_its_producer() {
        let _alone = PRODUCERS.lock().unwrap_or_else(|e| e.into_inner());
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
