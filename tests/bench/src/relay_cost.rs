//! What relaying costs PostgreSQL, apart from everything else the pipeline asks of it. The same
//! open-loop stream of one-event transactions (one INSERT into the outbox each, from the order
//! service's pool size) is written at each rate three ways: with no relay (the insert trigger
//! skipping the queue, as it does while a relay streams), under the queue relay, and under the
//! write-ahead-log relay. Each relay is measured idle first. The relay's cost is the CPU of its
//! own server sessions (its pool's, and the walsender that decodes for its slot), read by
//! process; the server's whole CPU in each case is reported beside it (the writers' share
//! varies by several % of a core from one database to the next, more than the relay's, so the
//! difference of two cases' totals does not measure the relay).
//!
//! Two more cases write one-row transactions to a table outside the outbox, with no relay and
//! with the write-ahead-log relay streaming: logical decoding reads every transaction of the
//! server, so this is what the walsender spends passing over the transactions of the rest of a
//! shared server (a consumer group's, another service's).
//!
//! The cases alternate, round after round, each in a database of its own.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use pipeline_testkit::{scrape_sum, Service, TestEnv};
use serde::Serialize;
use uuid::Uuid;

use super::config::Settings;
use super::database::{self, WRITER_CONNECTIONS};
use super::envs::EnvRegistry;
use super::orders::EventMessage;
use super::procstat::{round1, shared_processes, CpuMeter, Watched, POSTGRES};
use super::services;

/// Writing before each measurement: connections, plans and the relay's first batches.
const WARM_UP: Duration = Duration::from_secs(2);

/// A relay's start-up before it is measured idle.
const IDLE_SETTLE: Duration = Duration::from_secs(3);

/// One way of writing the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Case {
    /// Outbox events, no relay.
    WritersAlone,
    /// Outbox events, the queue relay.
    Queue,
    /// Outbox events, the write-ahead-log relay.
    Wal,
    /// Rows of another table, no relay.
    OtherAlone,
    /// Rows of another table, the write-ahead-log relay streaming.
    OtherWal,
}

const CASES: [Case; 5] = [
    Case::WritersAlone,
    Case::Queue,
    Case::Wal,
    Case::OtherAlone,
    Case::OtherWal,
];

impl Case {
    fn relay_source(self) -> Option<&'static str> {
        match self {
            Case::Queue => Some("queue"),
            Case::Wal | Case::OtherWal => Some("wal"),
            Case::WritersAlone | Case::OtherAlone => None,
        }
    }

    fn outbox(self) -> bool {
        matches!(self, Case::WritersAlone | Case::Queue | Case::Wal)
    }
}

/// One case at one rate, over every round.
#[derive(Debug, Clone, Serialize)]
pub struct CaseCost {
    pub case: Case,
    /// The server's CPU, % of a core, each round.
    pub postgres_percent: Vec<f64>,
    /// The relay process's CPU, % of a core, each round (none without a relay).
    pub relay_percent: Vec<f64>,
    /// The server CPU of the relay's own sessions (its pool's and, streaming, the walsender's),
    /// % of a core, each round (none without a relay).
    pub relay_sessions_percent: Vec<f64>,
    /// The walsender's share of it, each round (none without a stream).
    pub walsender_percent: Vec<f64>,
    /// Transactions written per second, each round.
    pub written_per_s: Vec<f64>,
}

/// A case's relay before anything is written, over every round.
#[derive(Debug, Clone, Serialize)]
pub struct IdleCost {
    pub case: Case,
    /// The relay process's CPU, % of a core, each round.
    pub relay_percent: Vec<f64>,
    /// Its sessions' (the walsender included), each round.
    pub sessions_percent: Vec<f64>,
}

/// Every case at one rate, and what follows from them.
#[derive(Debug, Clone, Serialize)]
pub struct RateCost {
    pub rate: f64,
    pub cases: Vec<CaseCost>,
    /// The server CPU of the queue relay's own sessions, µs per event (measured by process,
    /// without the writers' share).
    pub queue_sessions_us: Option<f64>,
    /// The same of the write-ahead-log relay: the walsender and the relay's sessions.
    pub wal_sessions_us: Option<f64>,
    /// wal_sessions_us / queue_sessions_us.
    pub wal_vs_queue_sessions: Option<f64>,
    /// The walsender's CPU per transaction of another table it passes over, µs.
    pub wal_other_sessions_us: Option<f64>,
}

/// The phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RelayCost {
    pub seconds: f64,
    /// Seconds each relay is measured idle, before the writes.
    pub idle_seconds: f64,
    /// Each case with a relay, idle.
    pub idle: Vec<IdleCost>,
    pub rounds: u32,
    pub rates: Vec<RateCost>,
}

/// Runs every case at each of `settings.rates`, `rounds` times, alternating.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
    notes: &mut Vec<String>,
) -> anyhow::Result<RelayCost> {
    let (seconds, rounds) = if settings.quick { (5, 1) } else { (15, 2) };
    let idle = Duration::from_secs(if settings.quick { 5 } else { 10 });
    let measured = Duration::from_secs(seconds);
    let payload = EventMessage::new(Uuid::new_v4(), 1, 1, settings.products).payload;
    let mut rates: Vec<RateCost> = settings
        .rates
        .iter()
        .map(|&rate| RateCost {
            rate,
            cases: CASES
                .iter()
                .map(|&case| CaseCost {
                    case,
                    postgres_percent: Vec::new(),
                    relay_percent: Vec::new(),
                    relay_sessions_percent: Vec::new(),
                    walsender_percent: Vec::new(),
                    written_per_s: Vec::new(),
                })
                .collect(),
            queue_sessions_us: None,
            wal_sessions_us: None,
            wal_vs_queue_sessions: None,
            wal_other_sessions_us: None,
        })
        .collect();
    let mut idle_costs: Vec<IdleCost> = CASES
        .iter()
        .filter(|case| case.relay_source().is_some())
        .map(|&case| IdleCost {
            case,
            relay_percent: Vec::new(),
            sessions_percent: Vec::new(),
        })
        .collect();
    for round in 1..=rounds {
        for (c, &case) in CASES.iter().enumerate() {
            super::run::say(&format!("relay cost: {case:?}, round {round} of {rounds}"));
            let env = envs.create("bench_relaycost", settings.partitions).await?;
            let times = Times { measured, idle };
            let outcome = measure_case(settings, &env, case, &payload, times, &mut rates, c).await;
            notes.extend(envs.release(env).await);
            if let Some((relay, sessions)) = outcome? {
                if let Some(cost) = idle_costs.iter_mut().find(|i| i.case == case) {
                    cost.relay_percent.push(relay);
                    cost.sessions_percent.push(sessions);
                }
            }
        }
    }
    for r in &mut rates {
        let per_event = |percent: Option<f64>| Some(round1(percent? / 100.0 * 1e6 / r.rate));
        let sessions = |case: Case| {
            r.cases
                .iter()
                .find(|c| c.case == case && !c.relay_sessions_percent.is_empty())
                .map(|c| mean(&c.relay_sessions_percent))
        };
        r.queue_sessions_us = per_event(sessions(Case::Queue));
        r.wal_sessions_us = per_event(sessions(Case::Wal));
        r.wal_vs_queue_sessions = ratio(r.wal_sessions_us, r.queue_sessions_us);
        let walsender = r
            .cases
            .iter()
            .find(|c| c.case == Case::OtherWal && !c.walsender_percent.is_empty())
            .map(|c| mean(&c.walsender_percent));
        r.wal_other_sessions_us = per_event(walsender);
    }
    Ok(RelayCost {
        seconds: seconds as f64,
        idle_seconds: idle.as_secs_f64(),
        idle: idle_costs,
        rounds,
        rates,
    })
}

/// How long each measurement lasts.
#[derive(Clone, Copy)]
struct Times {
    measured: Duration,
    idle: Duration,
}

/// One case in `env`: its relay (if any) idle, then each rate in turn. Returns the relay's idle
/// CPU and its sessions', % of a core.
async fn measure_case(
    settings: &Settings,
    env: &TestEnv,
    case: Case,
    payload: &str,
    times: Times,
    rates: &mut [RateCost],
    index: usize,
) -> anyhow::Result<Option<(f64, f64)>> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WRITER_CONNECTIONS)
        .connect(&env.database_url)
        .await?;
    if !case.outbox() {
        database::create_row_table(&pool).await?;
    }
    if case == Case::WritersAlone {
        // The writers as they are while a relay streams: the trigger queues nothing.
        sqlx::query(
            "INSERT INTO outbox_wal_source (lock_key, slot, streaming, horizon)
             VALUES (0, 'bench_no_relay', true, now())",
        )
        .execute(&pool)
        .await?;
    }
    let relay = match case.relay_source() {
        Some(source) => Some(start_relay(settings, env, source).await?),
        None => None,
    };
    let mut idle = None;
    if let Some((relay, _)) = &relay {
        tokio::time::sleep(IDLE_SETTLE).await;
        let (sessions, walsenders) = relay_sessions(&pool).await?;
        let meter = CpuMeter::start(vec![
            Watched::Pid("relay", relay.pid().as_raw().unsigned_abs()),
            Watched::Pids(RELAY_SESSIONS, [sessions, walsenders].concat()),
        ]);
        tokio::time::sleep(times.idle).await;
        let cpu = meter.finish();
        let share = |name: &str| cpu.percent.get(name).copied().unwrap_or(0.0);
        idle = Some((share("relay"), share(RELAY_SESSIONS)));
    }
    let written = Arc::new(AtomicU64::new(0));
    let mut outcome = Ok(());
    for r in rates.iter_mut() {
        let writer = Writer {
            pool: &pool,
            case,
            topic: &env.topic,
            payload,
            written: &written,
        };
        let _ = writer.write(r.rate, WARM_UP).await?;
        let mut watched = shared_processes();
        if let Some((relay, _)) = &relay {
            watched.push(Watched::Pid("relay", relay.pid().as_raw().unsigned_abs()));
            let (sessions, walsenders) = relay_sessions(&pool).await?;
            watched.push(Watched::Pids(RELAY_SESSIONS, sessions));
            watched.push(Watched::Pids(WALSENDER, walsenders));
        }
        let meter = CpuMeter::start(watched);
        let (count, seconds) = writer.write(r.rate, times.measured).await?;
        let cpu = meter.finish();
        let cost = &mut r.cases[index];
        cost.postgres_percent
            .push(cpu.percent.get(POSTGRES).copied().unwrap_or(0.0));
        if relay.is_some() {
            cost.relay_percent
                .push(cpu.percent.get("relay").copied().unwrap_or(0.0));
            let share = |name: &str| cpu.percent.get(name).copied().unwrap_or(0.0);
            cost.relay_sessions_percent
                .push(round1(share(RELAY_SESSIONS) + share(WALSENDER)));
            if case.relay_source() == Some("wal") {
                cost.walsender_percent.push(share(WALSENDER));
            }
        }
        cost.written_per_s.push(round1(count as f64 / seconds));
        if let (Some((_, metrics)), true) = (&relay, case.outbox()) {
            outcome = published_all(metrics, written.load(Ordering::Relaxed)).await;
            if outcome.is_err() {
                break;
            }
        }
    }
    if let Some((relay, _)) = relay {
        let _ = services::stop(relay).await;
    }
    pool.close().await;
    outcome.map(|()| idle)
}

/// The watched names of the relay's pool's database sessions and of its walsender.
const RELAY_SESSIONS: &str = "relay-sessions";
const WALSENDER: &str = "walsender";

/// The server processes of the relay's sessions on this database: its pool's, and the
/// walsender's (`relay-wal`).
async fn relay_sessions(pool: &sqlx::PgPool) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
    let rows: Vec<(i32, bool)> = sqlx::query_as(
        "SELECT pid, application_name = 'relay-wal' FROM pg_stat_activity
         WHERE datname = current_database() AND application_name IN ('relay', 'relay-wal')",
    )
    .fetch_all(pool)
    .await?;
    let pid = |p: i32| u32::try_from(p).ok();
    let sessions = rows
        .iter()
        .filter(|r| !r.1)
        .filter_map(|r| pid(r.0))
        .collect();
    let walsenders = rows
        .iter()
        .filter(|r| r.1)
        .filter_map(|r| pid(r.0))
        .collect();
    Ok((sessions, walsenders))
}

/// `a / b`, two places.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some((a / b * 100.0).round() / 100.0),
        _ => None,
    }
}

/// Starts the relay with `--source source` and waits until it is active (and, streaming, has
/// opened its slot).
async fn start_relay(
    settings: &Settings,
    env: &TestEnv,
    source: &str,
) -> anyhow::Result<(Service, String)> {
    let mut settings = settings.clone();
    source.clone_into(&mut settings.relay_source);
    let (mut relay, metrics) = services::start_relay(env, &settings).await?;
    let started = Instant::now();
    loop {
        let active = scrape_sum(&metrics, "relay_active", &[]).await? >= 1.0;
        let streaming = source != "wal"
            || sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM outbox_wal_source WHERE streaming)",
            )
            .fetch_one(&env.pool)
            .await?;
        if active && streaming {
            return Ok((relay, metrics));
        }
        if started.elapsed() > Duration::from_secs(60) || relay.exited() {
            bail!(
                "relay not streaming 60 s after start (log: {})",
                relay.log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the relay has published `events` (a relay that fell behind would have had its
/// work left out of the measurement).
async fn published_all(metrics: &str, events: u64) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let published = scrape_sum(
            metrics,
            "outbox_published_total",
            &["outcome=\"published\""],
        )
        .await?;
        if published >= events as f64 {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the relay published {published} of {events} events within 30 s of the writes");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The open-loop writer of one case.
struct Writer<'a> {
    pool: &'a sqlx::PgPool,
    case: Case,
    topic: &'a str,
    payload: &'a str,
    /// Transactions written so far in this case's database (numbers the events).
    written: &'a Arc<AtomicU64>,
}

/// How often the writer starts the transactions that are due.
const TICK: Duration = Duration::from_millis(10);

impl Writer<'_> {
    /// Starts `rate` one-row transactions a second for `duration`, each on its own task;
    /// returns how many committed and over how many seconds.
    async fn write(&self, rate: f64, duration: Duration) -> anyhow::Result<(u64, f64)> {
        let started = Instant::now();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut due = 0u64;
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            let _ = tick.tick().await;
            let elapsed = started.elapsed();
            if elapsed >= duration {
                break;
            }
            let target = (elapsed.as_secs_f64() * rate) as u64;
            while due < target {
                due += 1;
                let n = self.written.fetch_add(1, Ordering::Relaxed);
                let (pool, payload) = (self.pool.clone(), self.payload.to_owned());
                let (case, topic) = (self.case, self.topic.to_owned());
                let _ = tasks.spawn(async move { insert(&pool, case, &topic, &payload, n).await });
            }
            while let Some(done) = tasks.try_join_next() {
                done??;
            }
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        Ok((due, started.elapsed().as_secs_f64()))
    }
}

/// Transaction `n` of a case: one outbox event (aggregate `n` mod 1000, the next of its
/// sequence), or one row of the other table.
async fn insert(
    pool: &sqlx::PgPool,
    case: Case,
    topic: &str,
    payload: &str,
    n: u64,
) -> anyhow::Result<()> {
    let n = i64::try_from(n)?;
    if case.outbox() {
        sqlx::query(
            "INSERT INTO outbox
                 (event_id, business_key, event_type, aggregate_id, sequence, topic, payload)
             VALUES ($1, $2, 'bench.cost', $3, $4, $5, $6::text::jsonb)",
        )
        .bind(Uuid::now_v7())
        .bind(format!("cost-{n}"))
        .bind(format!("aggregate-{}", n % 1000))
        .bind(n / 1000 + 1)
        .bind(topic)
        .bind(payload)
        .execute(pool)
        .await?;
    } else {
        sqlx::query("INSERT INTO bench_ceiling (event_id, payload) VALUES ($1, $2::text::jsonb)")
            .bind(Uuid::now_v7())
            .bind(payload)
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// The phase's lines of the printed table.
pub fn write_table(o: &mut String, cost: &RelayCost) -> std::fmt::Result {
    writeln!(
        o,
        "\nRelaying's cost to PostgreSQL (one-row transactions, {} round(s) of {:.0} s; the \
         server's CPU, % of a core, mean of the rounds)",
        cost.rounds, cost.seconds
    )?;
    let idle = |case: Case| {
        cost.idle
            .iter()
            .find(|i| i.case == case && !i.relay_percent.is_empty())
            .map_or("-".to_owned(), |i| {
                format!(
                    "{:.2}% + its sessions {:.2}%",
                    mean(&i.relay_percent),
                    mean(&i.sessions_percent)
                )
            })
    };
    writeln!(
        o,
        "    idle ({:.0} s): the queue relay {}; the write-ahead-log relay {}",
        cost.idle_seconds,
        idle(Case::Queue),
        idle(Case::Wal)
    )?;
    let us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} us"));
    let times = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    for r in &cost.rates {
        let case_of = |case: Case| r.cases.iter().find(|c| c.case == case);
        let pct = |case: Case, of: fn(&CaseCost) -> &Vec<f64>| {
            case_of(case)
                .filter(|c| !of(c).is_empty())
                .map_or("-".to_owned(), |c| format!("{:.1}%", mean(of(c))))
        };
        let pg = |case: Case| pct(case, |c| &c.postgres_percent);
        writeln!(
            o,
            "  {:>6}/s  the server: writers alone {}, with the queue relay {}, with the write-ahead \
             log {}; relay process {} / {}",
            r.rate,
            pg(Case::WritersAlone),
            pg(Case::Queue),
            pg(Case::Wal),
            pct(Case::Queue, |c| &c.relay_percent),
            pct(Case::Wal, |c| &c.relay_percent),
        )?;
        writeln!(
            o,
            "           the relay's cost to the server per event, its sessions' CPU (the walsender \
             included): queue {}, write-ahead log {} (x{}; the walsender {})",
            us(r.queue_sessions_us),
            us(r.wal_sessions_us),
            times(r.wal_vs_queue_sessions),
            pct(Case::Wal, |c| &c.walsender_percent),
        )?;
        writeln!(
            o,
            "           another table's one-row transactions: the server {} alone, {} streamed \
             past; the walsender {}, {} a transaction",
            pg(Case::OtherAlone),
            pg(Case::OtherWal),
            pct(Case::OtherWal, |c| &c.walsender_percent),
            us(r.wal_other_sessions_us),
        )?;
    }
    Ok(())
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}
