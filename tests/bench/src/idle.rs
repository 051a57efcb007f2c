//! The pipeline with no traffic: what each process and the database cost while nothing
//! happens (an order service, an active and a standby relay, the consumer groups).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::config::Settings;
use super::cpuprofile::{self, ProcessProfile};
use super::envs::EnvRegistry;
use super::procstat::{CpuMeter, CpuUse, Watched};
use super::services::{self, Pipeline};
use super::statements::{self, StatementProfile, StatementProfiler};

/// The idle phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct IdleRun {
    /// Seconds measured, after the services settled.
    pub measured_seconds: f64,
    /// CPU of every process over that time (a standby relay beside the active one; PostgreSQL's
    /// backends summed). Nothing else samples the database meanwhile.
    pub cpu: CpuUse,
    /// What each program asked of the database meanwhile (`None`: not read).
    pub statements: Option<StatementProfile>,
    /// Where each process's CPU went meanwhile, by function (empty: not taken).
    pub cpu_profiles: BTreeMap<String, ProcessProfile>,
}

/// How long the services run before the measurement starts: the relays' election, the
/// groups' assignments and the first lag readings are start-up, not idling.
const SETTLE: Duration = Duration::from_secs(5);

/// Starts the pipeline with a standby relay, lets it settle, and measures it idle for
/// `settings.idle_duration`.
pub async fn run(
    settings: &Settings,
    envs: &EnvRegistry,
) -> anyhow::Result<(IdleRun, Vec<String>)> {
    let env = envs.create("bench_idle", settings.partitions).await?;
    let pipeline = Pipeline::start(&env, settings).await?;
    let (standby, _) = services::start(
        &env,
        "relay",
        "relay-standby",
        &services::relay_args(settings),
        "relay metrics listening on ",
    )
    .await?;
    tokio::time::sleep(SETTLE).await;
    let mut watched = pipeline.watched();
    watched.push(Watched::Pid(
        "relay-standby",
        standby.pid().as_raw().unsigned_abs(),
    ));
    let profiler = match statements::enabled() {
        true => {
            Some(StatementProfiler::start(super::envs::database_name(&env.database_url)).await?)
        }
        false => None,
    };
    let mut notes = Vec::new();
    let meter = CpuMeter::start(watched.clone());
    let cpu_profiler =
        cpuprofile::begin(settings.cpu_profiles.as_deref(), "idle", &mut notes).await;
    tokio::time::sleep(settings.idle_duration).await;
    let cpu = meter.finish();
    let cpu_profiles = cpuprofile::end(cpu_profiler, &watched, &mut notes).await;
    let statements = match profiler {
        Some(p) => Some(p.finish().await?),
        None => None,
    };
    notes.extend(services::stop(standby).await);
    notes.extend(pipeline.stop().await);
    notes.extend(envs.release(env).await);
    Ok((
        IdleRun {
            measured_seconds: settings.idle_duration.as_secs_f64(),
            cpu,
            statements,
            cpu_profiles,
        },
        notes,
    ))
}
