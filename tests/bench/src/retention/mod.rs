//! Retention under load (`--phases retention`): whether removing old rows keeps the tables flat
//! without costing the pipeline latency, throughput or lock waits.
//!
//! In one database and topic:
//!
//! 1. [`history`]: `--retention-history-events` events three days old, published and applied by
//!    both groups, loaded in bulk; the table sizes then are the start;
//! 2. segment "off": relay and consumer with retention off (`--retention-interval 0s`, the same
//!    windows as "on", which shape the effect history's partitions), the order
//!    service at `--retention-rate` for `--retention-off-seconds` ([`segment`]), after
//!    `--retention-settle-seconds` of the same load not measured (the bulk load leaves the
//!    server writing it out and its caches cold for the first minutes);
//! 3. drain "off": the consumer stopped while `--retention-drain-events` pile up, then started
//!    again and timed through them ([`drain`]), retention still off, the history all there;
//! 4. drain "on": the same with a relay and a consumer that run retention with windows of
//!    `--retention-window-seconds` (progress keeps its default), started as the drain begins, so
//!    the drain runs while retention removes the history;
//! 5. segment "on": the load again for `--retention-on-seconds` with those processes, the sizes
//!    read halfway through and at the end.
//!
//! Throughout, lock waits are watched ([`locks`]) and the sizes read every 30 s ([`sizes`]).

pub mod applied;
pub mod background;
pub mod disk;
pub mod drain;
pub mod histogram;
pub mod history;
pub mod locks;
pub mod process_logs;
pub mod processes;
pub mod segment;
pub mod server_log;
pub mod server_writes;
pub mod sizes;
pub mod table;

use std::collections::BTreeMap;
use std::time::Instant;

use pipeline_testkit::TestEnv;
use serde::Serialize;

use self::disk::Room;
pub use self::drain::Drain;
pub use self::history::HistoryLoad;
pub use self::locks::{LockWaits, LoggedWaits, SampledWaits};
use self::locks::{Locks, ServerLog};
use self::process_logs::LogLevels;
use self::processes::{start_consumer, start_relay};
use self::segment::Running;
pub use self::segment::Segment;
use self::sizes::SizeSampler;
pub use self::sizes::Sizes;
use crate::config::Settings;
use crate::envs::EnvRegistry;
use crate::run::say;
use crate::services::{self, GROUPS};

/// The longest lock wait a statement of the pipeline may see while retention runs.
pub const LOCK_WAIT_TARGET_MS: f64 = 100.0;

/// Growth of the tables from the middle to the end of the segment with retention on, in
/// percent, that still counts as flat.
pub const FLAT_GROWTH_PCT: f64 = 5.0;

/// The phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RetentionResult {
    pub history: HistoryLoad,
    pub off: Segment,
    pub on: Segment,
    pub drain_off: Drain,
    pub drain_on: Drain,
    /// Sizes after the load (start), at the end of the segment off, halfway through and at the
    /// end of the segment on.
    pub sizes_start: Sizes,
    pub sizes_off_end: Sizes,
    pub sizes_on_mid: Sizes,
    pub sizes_on_end: Sizes,
    /// Every 30 s from the start of the segment off.
    pub sizes_over_time: Vec<Sizes>,
    /// Bytes of all the tables at the end of the segment on over halfway through it, minus one,
    /// in percent.
    pub growth_on_mid_to_end_pct: f64,
    /// The same over the segment off (end of the segment over the start).
    pub growth_off_pct: f64,
    /// The span of the effect history's time partitions for the phase's window: the table
    /// sheds a partition at a time, so its rows swing by that much of the load.
    pub effect_partition_span_seconds: f64,
    /// The server log lock waits were read from (`None`: it could not be read, and the notes
    /// say why; the sampler's figures stand alone).
    pub server_log: Option<String>,
    /// Wall seconds of each step, in order.
    pub steps: Vec<(String, f64)>,
    /// WARN and ERROR lines in each process's log.
    pub process_logs: BTreeMap<String, LogLevels>,
}

/// The tables whose old rows retention removes in the segment on (the history loaded before it
/// is all past their windows then).
pub const TRIMMED: [&str; 4] = [
    "outbox",
    "outbox_delivery",
    "processed_message",
    "applied_effect",
];

impl RetentionResult {
    /// The longest lock wait while retention ran (the drain and segment on), ms, and what
    /// waited.
    pub fn longest_lock_wait_on(&self) -> (f64, Option<&str>) {
        longest(&self.drain_on.lock_waits, &self.on.lock_waits)
    }

    /// The longest lock wait of a statement of the pipeline while retention ran, ms: retention's
    /// own waits left out (a partition's detach waits for the transactions reading the table to
    /// end, and holds up no one meanwhile).
    pub fn pipeline_longest_lock_wait_on(&self) -> f64 {
        self.drain_on
            .lock_waits
            .pipeline_longest_ms()
            .max(self.on.lock_waits.pipeline_longest_ms())
    }

    /// The same without retention.
    pub fn pipeline_longest_lock_wait_off(&self) -> f64 {
        self.drain_off
            .lock_waits
            .pipeline_longest_ms()
            .max(self.off.lock_waits.pipeline_longest_ms())
    }

    /// Waits of a statement of the pipeline for a retention step while retention ran, and the
    /// longest of them, ms.
    pub fn held_by_retention(&self) -> (u64, f64) {
        let (a, b) = (
            &self.drain_on.lock_waits.sampled,
            &self.on.lock_waits.sampled,
        );
        (
            a.held_by_retention + b.held_by_retention,
            a.held_by_retention_longest_ms
                .max(b.held_by_retention_longest_ms),
        )
    }

    /// Waits in which a retention step waited or was waited for while retention ran, and the
    /// longest of them, ms.
    pub fn retention_step_waits(&self) -> (u64, f64) {
        let (a, b) = (
            &self.drain_on.lock_waits.sampled,
            &self.on.lock_waits.sampled,
        );
        (
            a.retention_waits + b.retention_waits,
            a.retention_longest_ms.max(b.retention_longest_ms),
        )
    }

    /// The same without retention (the segment and drain off).
    pub fn longest_lock_wait_off(&self) -> (f64, Option<&str>) {
        longest(&self.off.lock_waits, &self.drain_off.lock_waits)
    }

    /// Each trimmed table's estimated rows at the end of the segment on minus halfway through
    /// it: a table that gains rows there takes rows in faster than retention removes them, and
    /// would grow without end however flat the whole looks.
    pub fn trimmed_rows_on_mid_to_end(&self) -> Vec<(&'static str, i64)> {
        let rows = |s: &Sizes, t: &str| s.tables.get(t).map_or(0, |x| x.live_rows);
        TRIMMED
            .iter()
            .map(|t| {
                (
                    *t,
                    rows(&self.sizes_on_end, t) - rows(&self.sizes_on_mid, t),
                )
            })
            .collect()
    }

    /// The trimmed tables that gained more rows from the middle to the end of the segment on
    /// than their removal swings by: none for a table trimmed in steps (each run takes it back to
    /// its window), the rows one partition span of the load brings for the effect history,
    /// which goes a partition at a time.
    pub fn trimmed_tables_gaining(&self) -> Vec<(&'static str, i64)> {
        let partition_rows =
            (self.on.rate * GROUPS.len() as f64 * self.effect_partition_span_seconds) as i64;
        gaining(self.trimmed_rows_on_mid_to_end(), partition_rows)
    }
}

/// Of each trimmed table's gain, those over what its removal swings by (`partition_rows` for
/// the effect history, nothing for the others).
fn gaining(gains: Vec<(&'static str, i64)>, partition_rows: i64) -> Vec<(&'static str, i64)> {
    let swing = |table: &str| {
        if table == "applied_effect" {
            partition_rows
        } else {
            0
        }
    };
    gains.into_iter().filter(|(t, n)| *n > swing(t)).collect()
}

fn longest<'a>(a: &'a LockWaits, b: &'a LockWaits) -> (f64, Option<&'a str>) {
    let w = if a.longest_ms() >= b.longest_ms() {
        a
    } else {
        b
    };
    (w.longest_ms(), w.sampled.longest.as_deref())
}

/// Runs the phase in a database and topic of its own.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<RetentionResult> {
    let env = envs.create("bench_ret", settings.partitions).await?;
    let result = measure(settings, &env, notes).await;
    let logs = process_logs::read(&env.log_dir);
    for (file, levels) in &logs {
        if levels.errors > 0 {
            notes.push(format!(
                "retention: {file}: {} ERROR lines, first: {}",
                levels.errors,
                levels.error_examples.first().map_or("", String::as_str)
            ));
        }
    }
    if result.is_err() {
        notes.push(envs.retain(&env));
        env.pool.close().await;
    } else {
        notes.extend(envs.release(env).await);
    }
    result.map(|mut r| {
        r.process_logs = logs;
        r
    })
}

/// Wall time of the steps.
struct Steps {
    at: Instant,
    done: Vec<(String, f64)>,
}

impl Steps {
    fn new() -> Steps {
        Steps {
            at: Instant::now(),
            done: Vec::new(),
        }
    }

    fn next(&mut self, step: &str) {
        let seconds = crate::procstat::round1(self.at.elapsed().as_secs_f64());
        say(&format!("retention: {step} took {seconds} s"));
        self.done.push((step.to_owned(), seconds));
        self.at = Instant::now();
    }
}

async fn measure(
    settings: &Settings,
    env: &TestEnv,
    notes: &mut Vec<String>,
) -> anyhow::Result<RetentionResult> {
    let r = &settings.retention;
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&env.pool)
        .await?;
    // Before any process connects: the setting reaches the sessions that start after it.
    locks::log_lock_waits(&env.pool, &database).await?;
    let mut steps = Steps::new();

    say(&format!(
        "retention: loading {} history events three days old",
        r.history_events
    ));
    let group_ids: Vec<String> = GROUPS.iter().map(|g| env.group(g)).collect();
    let room = Room::of(&env.pool).await;
    let history = history::load(
        &env.database_url,
        r.history_events,
        &env.topic,
        settings.partitions,
        &group_ids,
        &room,
    )
    .await?;
    steps.next("history load");
    let started = Instant::now();
    let sizes_start = sizes::read(&env.pool, 0.0).await?;

    services::seed_catalog_and_stock(env, settings)?;
    let (order_service, url) = env.order_service().await?;
    let url = format!("{url}/").parse()?;
    let server_log = match ServerLog::open(&env.pool, r.server_log.as_deref()).await {
        Ok(log) => Some(log),
        Err(e) => {
            notes.push(format!(
                "retention: the server's log is not read for lock waits: {e:#}"
            ));
            None
        }
    };
    let server_log_path = server_log.as_ref().map(ServerLog::display);
    let locks = Locks {
        database_url: &env.database_url,
        database: &database,
        pool: &env.pool,
        log: server_log,
    };
    let sampler = SizeSampler::start(env.pool.clone(), started);

    say("retention: segment with retention off");
    let relay = start_relay(env, settings, false, "relay-off").await?;
    let consumer = start_consumer(env, settings, false, "consumer-off", true).await?;
    let running = Running {
        env,
        order_service: &order_service,
        url: &url,
        relay: &relay,
    };
    if !r.settle_duration.is_zero() {
        say(&format!(
            "retention: {} s of load to settle before the baseline (not measured)",
            r.settle_duration.as_secs()
        ));
        segment::run(
            settings,
            &running,
            &consumer,
            false,
            r.settle_duration,
            started,
        )
        .await?;
        steps.next("settle");
    }
    let watch = locks.watch().await?;
    let (mut off, _) = segment::run(
        settings,
        &running,
        &consumer,
        false,
        r.off_duration,
        started,
    )
    .await?;
    off.lock_waits = watch.finish().await;
    let sizes_off_end = sizes::read(&env.pool, started.elapsed().as_secs_f64()).await?;
    steps.next("segment off");

    room.ensure(0, "the drain off")?;
    say("retention: consumer drain, retention off");
    notes.extend(consumer.stop().await);
    let watch = locks.watch().await?;
    let (mut drain_off, consumer) =
        drain::run(settings, &running, false, "consumer-off-drain").await?;
    drain_off.lock_waits = watch.finish().await;
    notes.extend(consumer.stop().await);
    notes.extend(relay.stop().await);
    steps.next("drain off");

    say("retention: consumer drain, retention on (as retention starts on the history)");
    let relay = start_relay(env, settings, true, "relay-on").await?;
    let running = Running {
        env,
        order_service: &order_service,
        url: &url,
        relay: &relay,
    };
    let watch = locks.watch().await?;
    let (mut drain_on, consumer) = drain::run(settings, &running, true, "consumer-on").await?;
    drain_on.lock_waits = watch.finish().await;
    steps.next("drain on");

    room.ensure(0, "the segment on")?;
    say("retention: segment with retention on");
    let watch = locks.watch().await?;
    let (mut on, sizes_on_mid) =
        segment::run(settings, &running, &consumer, true, r.on_duration, started).await?;
    on.lock_waits = watch.finish().await;
    let sizes_on_end = sizes::read(&env.pool, started.elapsed().as_secs_f64()).await?;
    steps.next("segment on");

    notes.extend(consumer.stop().await);
    notes.extend(relay.stop().await);
    notes.extend(services::stop(order_service).await);
    let sizes_over_time = sampler.finish().await;
    let growth = |from: &Sizes, to: &Sizes| {
        crate::procstat::round1(
            (to.total_bytes() as f64 / (from.total_bytes() as f64).max(1.0) - 1.0) * 100.0,
        )
    };
    Ok(RetentionResult {
        growth_on_mid_to_end_pct: growth(&sizes_on_mid, &sizes_on_end),
        growth_off_pct: growth(&sizes_start, &sizes_off_end),
        effect_partition_span_seconds: pipeline_core::retention::partitions::span(
            settings.retention.window,
        )
        .as_secs_f64(),
        history,
        off,
        on,
        drain_off,
        drain_on,
        sizes_start,
        sizes_off_end,
        sizes_on_mid,
        sizes_on_end,
        sizes_over_time,
        server_log: server_log_path,
        steps: steps.done,
        process_logs: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::gaining;

    #[test]
    fn the_effect_history_may_swing_by_a_partition_and_other_tables_not_at_all() {
        let gains = vec![
            ("outbox", 1),
            ("processed_message", -625_285),
            ("applied_effect", 1_184),
        ];
        assert_eq!(gaining(gains, 120_000), vec![("outbox", 1)]);
        assert_eq!(
            gaining(vec![("applied_effect", 599_000)], 120_000),
            vec![("applied_effect", 599_000)]
        );
    }
}
