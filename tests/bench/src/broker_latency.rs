//! The broker's own latency at a latency-phase rate: a plain producer, configured as the relay's,
//! sends the pipeline's events at the same fixed open-loop rate to a fresh topic, and one plain
//! consumer per pipeline group reads them with the consumers' fetch settings. No database: what
//! the broker alone adds to every event, the part of end-to-end latency no pipeline on this
//! broker can go below.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chrono::Utc;
use pipeline_core::kafka::KafkaArgs;
use pipeline_load::figures::{micros_histogram, quantile_ms};
use rdkafka::message::{Header, Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::broker::{fresh_topic, plain_reader, relay_producer_config};
use super::config::Settings;
use super::envs::EnvRegistry;
use super::orders::EventMessage;
use super::procstat::{shared_processes, CpuMeter, CpuUse};
use super::services::GROUPS;

/// The reference readers' `fetch.wait.max.ms` unless the environment sets the consumers' (a
/// fetch returns as soon as records arrive, so it adds no latency).
const CONSUMER_FETCH_WAIT_MAX_MS: u64 = 20;

/// The `fetch.wait.max.ms` the reference readers run with: the pipeline's consumers' setting
/// in the environment (`CONSUMER_FETCH_WAIT_MAX`, a duration such as `100ms`), which the
/// benchmark passes on to them, or [`CONSUMER_FETCH_WAIT_MAX_MS`].
fn consumer_fetch_wait_max_ms() -> u64 {
    std::env::var("CONSUMER_FETCH_WAIT_MAX")
        .ok()
        .and_then(|v| humantime::parse_duration(&v).ok())
        .and_then(|d| u64::try_from(d.as_millis()).ok())
        .unwrap_or(CONSUMER_FETCH_WAIT_MAX_MS)
}
/// The header carrying the intended send time, µs since the epoch.
const SENT_HEADER: &str = "bench-intended-us";
/// Parts of the measured time [`BrokerLatency::ack_p50_by_part_ms`] splits it into.
const PARTS: usize = 5;

/// The broker alone at one rate, in ms from each message's intended send time.
#[derive(Debug, Clone, Serialize)]
pub struct BrokerLatency {
    pub topic: String,
    pub rate: f64,
    /// Messages sent in the measured time (after the warm-up).
    pub measured: u64,
    /// Plain consumers reading the topic, one per pipeline group.
    pub readers: usize,
    pub consumer_fetch_wait_max_ms: u64,
    /// Intended send → delivery report (`acks=all`).
    pub ack_p50_ms: f64,
    pub ack_p99_ms: f64,
    /// Intended send → read by a consumer, over every reader.
    pub read_p50_ms: f64,
    pub read_p99_ms: f64,
    pub read_p999_ms: f64,
    /// The ack p50 in each fifth of the measured time, in order: whether answers slow down as
    /// the topic grows.
    pub ack_p50_by_part_ms: Vec<f64>,
    pub cpu: CpuUse,
}

/// Sends `settings.products`-shaped events at `rate` for the warm-up and the measured time of a
/// latency run, reads them back with one consumer per group, and reports the latencies.
pub async fn measure(
    settings: &Settings,
    envs: &EnvRegistry,
    rate: f64,
) -> anyhow::Result<BrokerLatency> {
    let (kafka, topic) = fresh_topic(settings, envs, "bench-broker-lat").await?;

    let warmup = (settings.warmup.as_secs_f64() * rate).round() as u64;
    let measured = (settings.rate_duration.as_secs_f64() * rate).round() as u64;
    let total = warmup + measured;

    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for group in GROUPS {
        let (kafka, topic, stop) = (kafka.clone(), topic.clone(), stop.clone());
        let group = format!("{topic}-{group}");
        let partitions = settings.partitions;
        readers.push(tokio::task::spawn_blocking(move || {
            read_all(&kafka, &topic, &group, partitions, total, &stop)
        }));
    }

    let mut config = kafka.client_config();
    for (k, v) in &relay_producer_config(settings.relay_linger_ms) {
        config.set(k, v);
    }
    let producer: FutureProducer = config.create().context("creating the plain producer")?;
    let ids: Vec<Uuid> = (0..total.div_ceil(2)).map(|_| Uuid::new_v4()).collect();

    let meter = CpuMeter::start(shared_processes());
    let (acks_tx, mut acks_rx) = mpsc::unbounded_channel::<(u64, i64, Option<i64>)>();
    let interval_us = 1e6 / rate;
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let start_us = Utc::now().timestamp_micros() + 50_000;
    for i in 0..total {
        let offset_us = (i as f64 * interval_us) as i64;
        tokio::time::sleep_until(start + Duration::from_micros(offset_us as u64)).await;
        let intended_us = start_us + offset_us;
        // Two events per order, as the latency phase's requests make them in turn.
        let order = usize::try_from(i / 2)?;
        let m = EventMessage::new(ids[order], i / 2, (i % 2 + 1) as i64, settings.products);
        let intended = intended_us.to_string();
        let headers = m.headers.insert(Header {
            key: SENT_HEADER,
            value: Some(intended.as_str()),
        });
        let record = FutureRecord::to(&topic)
            .key(m.key.as_str())
            .payload(m.payload.as_str())
            .headers(headers);
        match producer.send_result(record) {
            Ok(delivery) => {
                let tx = acks_tx.clone();
                tokio::spawn(async move {
                    let acked = match delivery.await {
                        Ok(Ok(_)) => Some(Utc::now().timestamp_micros() - intended_us),
                        _ => None,
                    };
                    let _ = tx.send((i, intended_us, acked));
                });
            }
            Err((e, _)) => {
                stop.store(true, Ordering::SeqCst);
                bail!("producing to {topic}: {e}");
            }
        }
    }
    drop(acks_tx);
    let mut acks = Vec::with_capacity(usize::try_from(total)?);
    while let Some((i, intended_us, acked)) = acks_rx.recv().await {
        match acked {
            Some(us) => acks.push((i, intended_us, us)),
            None => {
                stop.store(true, Ordering::SeqCst);
                bail!("message {i} was not delivered");
            }
        }
    }
    let mut read = micros_histogram();
    let measured_from_us = start_us + (warmup as f64 * interval_us) as i64;
    for reader in readers {
        for (intended_us, us) in reader.await?? {
            if intended_us >= measured_from_us {
                read.record(us.max(1) as u64)?;
            }
        }
    }
    let cpu = meter.finish().with_events(total);

    acks.sort_unstable_by_key(|a| a.0);
    let measured_acks = &acks[usize::try_from(warmup)?..];
    let mut ack = micros_histogram();
    for (_, _, us) in measured_acks {
        ack.record((*us).max(1) as u64)?;
    }
    let ack_us: Vec<i64> = measured_acks.iter().map(|a| a.2).collect();
    let ack_p50_by_part_ms = p50_by_part_ms(&ack_us, PARTS);
    Ok(BrokerLatency {
        topic,
        rate,
        measured,
        readers: GROUPS.len(),
        consumer_fetch_wait_max_ms: consumer_fetch_wait_max_ms(),
        ack_p50_ms: quantile_ms(&ack, 0.5),
        ack_p99_ms: quantile_ms(&ack, 0.99),
        read_p50_ms: quantile_ms(&read, 0.5),
        read_p99_ms: quantile_ms(&read, 0.99),
        read_p999_ms: quantile_ms(&read, 0.999),
        ack_p50_by_part_ms,
        cpu,
    })
}

/// Reads `expected` messages from every partition's beginning as group `group`, with the
/// pipeline consumers' fetch settings; returns (intended send µs, µs from then to read) of each.
fn read_all(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    partitions: i32,
    expected: u64,
    stop: &AtomicBool,
) -> anyhow::Result<Vec<(i64, i64)>> {
    let consumer = plain_reader(
        kafka,
        topic,
        group,
        partitions,
        &[
            ("queued.max.messages.kbytes", "4096".to_owned()),
            (
                "fetch.wait.max.ms",
                consumer_fetch_wait_max_ms().to_string(),
            ),
        ],
    )?;
    let mut seen = Vec::with_capacity(usize::try_from(expected)?);
    let mut last_read = Instant::now();
    while (seen.len() as u64) < expected {
        if stop.load(Ordering::SeqCst) {
            bail!("stopped: the producer failed");
        }
        if last_read.elapsed() > Duration::from_secs(60) {
            bail!(
                "{group}: read {} of {expected} messages, then nothing for 60 s",
                seen.len()
            );
        }
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => {
                let now_us = Utc::now().timestamp_micros();
                last_read = Instant::now();
                let intended = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == SENT_HEADER))
                    .and_then(|h| h.value)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse::<i64>().ok())
                    .context("a message without its intended send time")?;
                seen.push((intended, now_us - intended));
            }
            Some(Err(e)) => bail!("consuming {topic}: {e}"),
            None => {}
        }
    }
    Ok(seen)
}

/// The p50 in ms of each of `parts` consecutive, equal parts of `us` (the last may be shorter).
fn p50_by_part_ms(us: &[i64], parts: usize) -> Vec<f64> {
    let part = us.len().div_ceil(parts.max(1)).max(1);
    us.chunks(part)
        .map(|chunk| {
            let mut h = micros_histogram();
            for &v in chunk {
                let _ = h.record(v.max(1) as u64);
            }
            quantile_ms(&h, 0.5)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_each_part_in_order() {
        // Ten answers slowing down: 1..=10 ms, in five parts of two.
        let us: Vec<i64> = (1..=10).map(|ms| ms * 1000).collect();
        let close = |got: Vec<f64>, want: &[f64]| {
            // HdrHistogram keeps 3 significant digits.
            got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() < 0.01)
        };
        assert!(close(p50_by_part_ms(&us, 5), &[1.0, 3.0, 5.0, 7.0, 9.0]));
        // Fewer values than parts: one part each.
        assert!(close(p50_by_part_ms(&us[..2], 5), &[1.0, 2.0]));
        assert!(p50_by_part_ms(&[], 5).is_empty());
    }
}
