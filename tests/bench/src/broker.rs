//! The broker's ceiling: a plain producer, configured as the relay's, writes the backlog's events
//! to a fresh topic; a plain consumer reads them back. No database involved.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use pipeline_core::kafka::KafkaArgs;
use pipeline_testkit::kafka::{brokers, kafka_args};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

use super::config::Settings;
use super::envs::EnvRegistry;
use super::orders::{backlog_order, EventMessage, EVENTS_PER_ORDER};
use super::procstat::{round1, shared_processes, CpuMeter, CpuUse};

/// What the plain clients achieved.
#[derive(Debug, Clone, Serialize)]
pub struct BrokerResult {
    pub topic: String,
    pub messages: u64,
    /// Orders (keys) the messages are spread over.
    pub orders: u64,
    pub partitions: i32,
    /// Average bytes of key + payload + headers, as the relay sends them.
    pub message_bytes: f64,
    pub payload_bytes: f64,
    /// The producer's librdkafka settings: the relay's.
    pub producer_config: BTreeMap<String, String>,
    /// The median round of [`PRODUCE_ROUNDS`], each after the producer is connected and the
    /// broker warm (an untimed round of the same messages first).
    pub produce_seconds: f64,
    pub produce_eps: f64,
    /// Every round's rate, in the order run.
    pub produce_rounds_eps: Vec<f64>,
    pub consume_seconds: f64,
    pub consume_eps: f64,
    /// The same messages again, produced as the relay does: a batch of `--relay-batch-size`,
    /// then every delivery report, then the next batch. The part of the relay's time that is
    /// Kafka's.
    pub produce_batched_eps: f64,
    pub produce_batched_seconds: f64,
    /// CPU over the timed rounds (per event: over every round's messages).
    pub cpu_produce: CpuUse,
    pub cpu_consume: CpuUse,
    pub cpu_produce_batched: CpuUse,
}

/// Timed rounds of the plain producer; the ceiling is their median. One round of a couple of
/// seconds moves with whatever else the shared machine does.
pub const PRODUCE_ROUNDS: usize = 3;

/// Produces `settings.broker_messages` events on a fresh topic, [`PRODUCE_ROUNDS`] times, and
/// consumes them once.
pub async fn run(settings: &Settings, envs: &EnvRegistry) -> anyhow::Result<BrokerResult> {
    let (kafka, topic) = fresh_topic(settings, envs, "bench-broker").await?;

    let orders = settings.broker_messages.div_ceil(EVENTS_PER_ORDER as u64);
    let ids: Vec<Uuid> = (0..orders).map(|_| Uuid::new_v4()).collect();
    let count = usize::try_from(settings.broker_messages)?;
    // Built up front: the relay reads finished payloads from the database, it does not encode them.
    let build = || -> Vec<EventMessage> {
        backlog_order(orders)
            .take(count)
            .map(|(g, seq)| {
                let id = ids[usize::try_from(g).unwrap_or(0)];
                EventMessage::new(id, g, seq, settings.products)
            })
            .collect()
    };
    let messages = build();
    let n = messages.len() as f64;
    let message_bytes = messages.iter().map(EventMessage::size).sum::<usize>() as f64 / n;
    let payload_bytes = messages.iter().map(|m| m.payload.len()).sum::<usize>() as f64 / n;

    let producer_config = relay_producer_config(settings.relay_linger_ms);
    let mut config = kafka.client_config();
    for (k, v) in &producer_config {
        config.set(k, v);
    }
    let producer: FutureProducer = config.create().context("creating the plain producer")?;
    // Connected, with the topic's metadata and an idempotent producer id, before the clock
    // starts: the relay's producer is warm too when it drains. Then one untimed round: the
    // broker is a JVM, whose produce path runs interpreted until the JIT has compiled it.
    produce_all(&producer, &topic, messages[..1].to_vec()).await?;
    produce_all(&producer, &topic, messages).await?;
    let meter = CpuMeter::start(shared_processes());
    let mut rounds: Vec<f64> = Vec::with_capacity(PRODUCE_ROUNDS);
    for _ in 0..PRODUCE_ROUNDS {
        let batch = build();
        let started = Instant::now();
        produce_all(&producer, &topic, batch).await?;
        rounds.push(started.elapsed().as_secs_f64());
    }
    let cpu_produce = meter.finish().with_events(n as u64 * PRODUCE_ROUNDS as u64);
    let mut sorted = rounds.clone();
    sorted.sort_by(f64::total_cmp);
    let produce_seconds = sorted[sorted.len() / 2];

    let meter = CpuMeter::start(shared_processes());
    let expected = settings.broker_messages;
    let (partitions, reader_kafka, reader_topic) =
        (settings.partitions, kafka.clone(), topic.clone());
    let consume_seconds = tokio::task::spawn_blocking(move || {
        consume_all(&reader_kafka, &reader_topic, partitions, expected)
    })
    .await??;
    let cpu_consume = meter.finish().with_events(expected);

    let messages = build();
    let meter = CpuMeter::start(shared_processes());
    let started = Instant::now();
    for batch in messages.chunks(usize::try_from(settings.relay_batch_size)?) {
        produce_all(&producer, &topic, batch.to_vec()).await?;
    }
    let produce_batched_seconds = started.elapsed().as_secs_f64();
    let cpu_produce_batched = meter.finish().with_events(n as u64);

    Ok(BrokerResult {
        topic,
        messages: expected,
        orders,
        partitions: settings.partitions,
        message_bytes: round1(message_bytes),
        payload_bytes: round1(payload_bytes),
        producer_config,
        produce_seconds: round3(produce_seconds),
        produce_eps: (n / produce_seconds).round(),
        produce_rounds_eps: rounds.iter().map(|r| (n / r).round()).collect(),
        consume_seconds: round3(consume_seconds),
        consume_eps: (n / consume_seconds).round(),
        produce_batched_eps: (n / produce_batched_seconds).round(),
        produce_batched_seconds: round3(produce_batched_seconds),
        cpu_produce,
        cpu_consume,
        cpu_produce_batched,
    })
}

/// Plain clients' connection settings and a new topic named `<prefix>-<random>` with the run's
/// partitions, dropped at clean-up.
pub(super) async fn fresh_topic(
    settings: &Settings,
    envs: &EnvRegistry,
    prefix: &str,
) -> anyhow::Result<(KafkaArgs, String)> {
    let kafka = kafka_args(&brokers());
    let topic = format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..10]);
    kafka
        .ensure_topics(std::slice::from_ref(&topic), settings.partitions)
        .await
        .with_context(|| format!("creating topic {topic}"))?;
    envs.track_topic(&topic);
    Ok((kafka, topic))
}

/// The settings `relay/src/publish.rs` gives its producer (with `relay run`'s defaults), but no
/// client statistics. Copied rather than called, so the ceiling stays a plain client; the request
/// timeouts are the relay's constants.
pub(super) fn relay_producer_config(linger_ms: u64) -> BTreeMap<String, String> {
    use relay::publish::{BROKER_ACK_TIMEOUT, PRODUCE_REQUEST_TIMEOUT};
    [
        ("acks", "all".to_owned()),
        ("enable.idempotence", "true".to_owned()),
        ("max.in.flight.requests.per.connection", "5".to_owned()),
        (
            "socket.timeout.ms",
            PRODUCE_REQUEST_TIMEOUT.as_millis().to_string(),
        ),
        (
            "request.timeout.ms",
            BROKER_ACK_TIMEOUT.as_millis().to_string(),
        ),
        ("message.timeout.ms", "30000".to_owned()),
        ("linger.ms", linger_ms.to_string()),
        ("compression.type", "none".to_owned()),
        ("batch.num.messages", "10000".to_owned()),
        ("queue.buffering.max.messages", "200000".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Sends every message, waiting for a delivery report whenever the local queue is full, and
/// then for all the rest.
async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    messages: Vec<EventMessage>,
) -> anyhow::Result<()> {
    let mut in_flight: FuturesUnordered<DeliveryFuture> = FuturesUnordered::new();
    let mut failed = 0u64;
    let mut tally = |report: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, _>| {
        if !matches!(report, Ok(Ok(_))) {
            failed += 1;
        }
    };
    for m in messages {
        let mut record = FutureRecord::to(topic)
            .key(m.key.as_str())
            .payload(m.payload.as_str())
            .headers(m.headers);
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    in_flight.push(delivery);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    match in_flight.next().await {
                        Some(report) => tally(report),
                        None => tokio::time::sleep(Duration::from_millis(1)).await,
                    }
                }
                Err((e, _)) => bail!("producing to {topic}: {e}"),
            }
        }
        // Collect the reports already in, so the set stays small.
        while let Some(Some(report)) = in_flight.next().now_or_never() {
            tally(report);
        }
    }
    while let Some(report) = in_flight.next().await {
        tally(report);
    }
    if failed > 0 {
        bail!("{failed} messages were not delivered");
    }
    Ok(())
}

/// Reads `expected` messages from every partition's beginning; returns the seconds it took.
fn consume_all(
    kafka: &KafkaArgs,
    topic: &str,
    partitions: i32,
    expected: u64,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let consumer = plain_reader(
        kafka,
        topic,
        &format!("{topic}-reader"),
        partitions,
        &[("fetch.wait.max.ms", "20".to_owned())],
    )?;
    let deadline = started + Duration::from_secs(600);
    let (mut read, mut bytes) = (0u64, 0usize);
    while read < expected {
        if Instant::now() > deadline {
            bail!("read {read} of {expected} messages in 600 s");
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                read += 1;
                bytes += m.payload_len() + m.key().map_or(0, <[u8]>::len);
            }
            Some(Err(e)) => bail!("consuming {topic}: {e}"),
            None => {}
        }
    }
    anyhow::ensure!(bytes > 0, "messages without payload");
    Ok(started.elapsed().as_secs_f64())
}

/// A plain consumer of group `group` with `settings`, no auto commit, assigned every partition of
/// `topic` from its beginning.
pub(super) fn plain_reader(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    partitions: i32,
    settings: &[(&str, String)],
) -> anyhow::Result<BaseConsumer> {
    let mut config = kafka.client_config();
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    for (k, v) in settings {
        config.set(*k, v);
    }
    let consumer: BaseConsumer = config.create().context("creating a plain consumer")?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    Ok(consumer)
}

/// Three decimal places.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn librdkafka_takes_the_relay_like_settings() {
        // Creating a producer checks every property; no broker is contacted yet.
        let mut config = kafka_args("127.0.0.1:1").client_config();
        for (k, v) in &relay_producer_config(1) {
            config.set(k, v);
        }
        let producer: Result<FutureProducer, _> = config.create();
        assert!(producer.is_ok(), "{:?}", producer.err());
    }
}
