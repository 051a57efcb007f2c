//! The overview: `pipeline status` read every few seconds by one background task (so any number
//! of open pages costs one bounded read), kept with a window of samples for the throughput
//! chart. The page is a frame that `/static/console.js` fills from `/api/overview` and refreshes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::RwLock;
use std::time::Duration;

use axum::extract::State;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::html::layout;
use super::refusal::unanswered;
use super::session::Session;
use super::Console;
use crate::status::{self, Status};

/// Samples kept: the last minutes of throughput.
const SAMPLES: usize = 200;
/// Longest one reading may take before it counts as failed.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The latest reading and the samples.
#[derive(Default)]
pub(super) struct Board {
    state: RwLock<BoardState>,
}

#[derive(Default)]
struct BoardState {
    /// The last status read, and when.
    status: Option<(DateTime<Utc>, Status)>,
    /// Why the last reading failed, if it did (the status shown is then older).
    error: Option<(DateTime<Utc>, String)>,
    samples: VecDeque<Sample>,
}

/// Offsets at one instant: what the chart's rates come from.
#[derive(Debug, Clone)]
struct Sample {
    at: DateTime<Utc>,
    /// End offsets summed over the groups' partitions: records published.
    published: i64,
    /// Each group's committed offsets summed: records it finished.
    committed: BTreeMap<String, i64>,
}

/// One point of the chart: rates over the interval ending at `at`.
#[derive(Debug, Serialize)]
pub(super) struct Rate {
    /// End of the interval.
    at: DateTime<Utc>,
    /// Records published per second.
    published_per_second: f64,
    /// Records each group finished per second.
    applied_per_second: BTreeMap<String, f64>,
}

/// `/api/overview`.
#[derive(Serialize)]
pub(super) struct OverviewData<'a> {
    /// When the status shown was read.
    read_at: Option<DateTime<Utc>>,
    /// The status (`pipeline status --json`), `null` when none could be read yet.
    status: Option<&'a Status>,
    /// Why the last reading failed (PostgreSQL or Kafka down), and when.
    error: Option<String>,
    error_at: Option<DateTime<Utc>>,
    /// Throughput over the last minutes.
    throughput: Vec<Rate>,
    /// How often the console reads the status, in seconds.
    refresh_seconds: u64,
}

/// Reads the status every `refresh` until `shutdown`.
pub(super) async fn sample_until(console: &Console, shutdown: CancellationToken) {
    let refresh = console.inner.settings.refresh;
    loop {
        let read = tokio::time::timeout(READ_TIMEOUT, status::read(&console.inner.targets)).await;
        let now = Utc::now();
        {
            let mut state = console
                .inner
                .overview
                .state
                .write()
                .unwrap_or_else(|e| e.into_inner());
            match read {
                Ok(Ok(status)) => {
                    state.samples.push_back(sample(now, &status));
                    while state.samples.len() > SAMPLES {
                        let _ = state.samples.pop_front();
                    }
                    state.status = Some((now, status));
                    state.error = None;
                }
                Ok(Err(e)) => state.error = Some((now, unanswered(&e))),
                Err(_) => {
                    state.error =
                        Some((now, format!("no answer within {}s", READ_TIMEOUT.as_secs())))
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(refresh) => {}
        }
    }
}

fn sample(at: DateTime<Utc>, status: &Status) -> Sample {
    let mut seen = BTreeSet::new();
    let mut published = 0;
    let mut committed = BTreeMap::new();
    for g in &status.groups {
        if g.partitions.is_empty() {
            continue;
        }
        let mut sum = 0;
        for p in &g.partitions {
            if seen.insert((p.topic.clone(), p.partition)) {
                published += p.end;
            }
            sum += p.committed.unwrap_or(0);
        }
        let _ = committed.insert(g.group.clone(), sum);
    }
    Sample {
        at,
        published,
        committed,
    }
}

/// Rates between consecutive samples (a group missing from either side is left out).
fn rates(samples: &VecDeque<Sample>) -> Vec<Rate> {
    samples
        .iter()
        .zip(samples.iter().skip(1))
        .filter_map(|(a, b)| {
            let seconds = (b.at - a.at).num_milliseconds() as f64 / 1000.0;
            (seconds > 0.0).then(|| Rate {
                at: b.at,
                published_per_second: ((b.published - a.published).max(0) as f64) / seconds,
                applied_per_second: b
                    .committed
                    .iter()
                    .filter_map(|(g, c)| {
                        a.committed
                            .get(g)
                            .map(|before| (g.clone(), ((c - before).max(0) as f64) / seconds))
                    })
                    .collect(),
            })
        })
        .collect()
}

/// `GET /api/overview`.
pub(super) async fn api(State(console): State<Console>) -> Json<serde_json::Value> {
    let state = console
        .inner
        .overview
        .state
        .read()
        .unwrap_or_else(|e| e.into_inner());
    let data = OverviewData {
        read_at: state.status.as_ref().map(|(at, _)| *at),
        status: state.status.as_ref().map(|(_, s)| s),
        error: state.error.as_ref().map(|(_, e)| e.clone()),
        error_at: state.error.as_ref().map(|(at, _)| *at),
        throughput: rates(&state.samples),
        refresh_seconds: console.inner.settings.refresh.as_secs(),
    };
    // Serialising plain data cannot fail; a null keeps the handler total all the same.
    Json(serde_json::to_value(&data).unwrap_or(serde_json::Value::Null))
}

/// `GET /`: the frame the script fills (from `data-api`; to `data-login` once the session ended).
pub(super) async fn page(
    State(console): State<Console>,
    Extension(session): Extension<Session>,
) -> Markup {
    let urls = console.urls();
    let api = urls.to("/api/overview");
    let panels = [
        ("panel-relay", "Relay lease", false),
        ("panel-outbox", "Outbox", false),
        ("panel-throughput", "Throughput (records per second)", true),
        ("panel-groups", "Groups", true),
        ("panel-partitions", "Lag per partition", true),
    ];
    let body = html! {
        h1 { "Overview" }
        div #overview data-api=(api) data-login=(urls.login(urls.overview())) {
            p #overview-state.muted { "Reading the status…" }
            noscript {
                p {
                    "This page refreshes with JavaScript; without it, read "
                    a href=(api) { (api) } "."
                }
            }
            div.panels {
                @for (id, title, wide) in panels {
                    section.panel.wide[wide] id=(id) {
                        h2 { (title) }
                        div.content {}
                    }
                }
            }
        }
    };
    layout(urls, "Overview", Some(&session), body)
}
