//! CPU and memory of the processes under test, read from /proc.
//!
//! CPU is utime + stime in clock ticks (USER_HZ, 100 per second on Linux whatever the kernel's
//! HZ); a phase's CPU% is the ticks it used over its wall time, 100% being one core busy.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::time::Instant;

use serde::Serialize;

/// Clock ticks per second in /proc/<pid>/stat.
const USER_HZ: f64 = 100.0;

/// A process, or a family of processes, whose CPU is measured.
#[derive(Debug, Clone)]
pub enum Watched {
    /// One process.
    Pid(&'static str, u32),
    /// Every process whose command name is this (e.g. all `postgres` backends), summed.
    Command(&'static str, &'static str),
}

impl Watched {
    fn name(&self) -> &'static str {
        match self {
            Watched::Pid(name, _) | Watched::Command(name, _) => name,
        }
    }

    fn pids(&self) -> Vec<u32> {
        match self {
            Watched::Pid(_, pid) => vec![*pid],
            Watched::Command(_, comm) => pids_named(comm),
        }
    }
}

/// The processes every phase watches besides its own services: broker, PostgreSQL and the
/// benchmark itself (its driver competes for the same cores).
pub fn shared_processes() -> Vec<Watched> {
    let mut watched = vec![
        Watched::Command("postgres", "postgres"),
        Watched::Pid("bench", std::process::id()),
    ];
    if let Some(pid) = broker_pid() {
        watched.push(Watched::Pid("broker", pid));
    }
    watched
}

/// The nisshi process serving `KAFKA_BROKERS` (the one whose command line names its address),
/// or the only nisshi running.
pub fn broker_pid() -> Option<u32> {
    let address = pipeline_testkit::kafka::brokers();
    let address = address.split(',').next().unwrap_or_default().to_owned();
    let pids = pids_named("nisshi");
    pids.iter()
        .copied()
        .find(|pid| command_line(*pid).contains(&address))
        .or_else(|| (pids.len() == 1).then(|| pids[0]))
}

/// A process's arguments joined by spaces.
pub fn command_line(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .map(String::from_utf8_lossy)
                .collect::<Vec<_>>()
                .join(" ")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// Pids of the processes whose `comm` is `name`.
pub fn pids_named(name: &str) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .collect()
}

/// utime + stime of a process, in ticks; `None` once it is gone.
pub(crate) fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    // state (3), …, utime (14), stime (15).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Busy ticks of the whole machine, all cores (the `cpu` line of /proc/stat without idle and
/// iowait).
fn machine_busy_ticks() -> Option<u64> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    Some(v.iter().take(8).sum::<u64>() - v.get(3)? - v.get(4)?)
}

/// Measures the CPU the watched processes use between [`CpuMeter::start`] and
/// [`CpuMeter::finish`]. A process that exits in between (a PostgreSQL backend) loses its share.
pub struct CpuMeter {
    watched: Vec<Watched>,
    started: Instant,
    start: HashMap<u32, u64>,
    machine_start: Option<u64>,
}

impl CpuMeter {
    pub fn start(watched: Vec<Watched>) -> CpuMeter {
        let start = watched
            .iter()
            .flat_map(Watched::pids)
            .filter_map(|pid| Some((pid, cpu_ticks(pid)?)))
            .collect();
        CpuMeter {
            watched,
            started: Instant::now(),
            start,
            machine_start: machine_busy_ticks(),
        }
    }

    /// CPU% per watched name since the start (processes started since count from zero).
    pub fn finish(&self) -> CpuUse {
        let wall = self.started.elapsed().as_secs_f64().max(1e-3);
        let mut percent = BTreeMap::new();
        for w in &self.watched {
            let ticks: u64 = w
                .pids()
                .into_iter()
                .filter_map(|pid| {
                    let now = cpu_ticks(pid)?;
                    Some(now.saturating_sub(self.start.get(&pid).copied().unwrap_or(0)))
                })
                .sum();
            let _ = percent.insert(
                w.name().to_owned(),
                round1(ticks as f64 / USER_HZ / wall * 100.0),
            );
        }
        let watched: f64 = percent.values().sum();
        let machine = self
            .machine_start
            .zip(machine_busy_ticks())
            .map(|(a, b)| b.saturating_sub(a) as f64 / USER_HZ / wall * 100.0);
        CpuUse {
            seconds: round1(wall),
            percent,
            other_percent: machine.map(|m| round1((m - watched).max(0.0))),
        }
    }
}

/// CPU use over a phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuUse {
    /// Wall seconds measured.
    pub seconds: f64,
    /// CPU% per process (100 = one core).
    pub percent: BTreeMap<String, f64>,
    /// CPU% of everything else on the machine (other users, exited backends): noise.
    pub other_percent: Option<f64>,
}

impl CpuUse {
    /// All watched processes together.
    pub fn total(&self) -> f64 {
        round1(self.percent.values().sum())
    }

    /// The busiest process and its CPU%.
    pub fn busiest(&self) -> Option<(&str, f64)> {
        self.percent
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(n, p)| (n.as_str(), *p))
    }

    /// One line: each process's CPU%, busiest first, and the total against the cores there are.
    pub fn summary(&self) -> String {
        let mut v: Vec<_> = self.percent.iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(a.1));
        let parts: Vec<String> = v.iter().map(|(n, p)| format!("{n} {p:.0}%")).collect();
        let other = self
            .other_percent
            .map_or(String::new(), |o| format!(", other processes {o:.0}%"));
        format!(
            "{} (total {:.0}% of {}%{other})",
            parts.join(", "),
            self.total(),
            cores() * 100
        )
    }
}

/// Cores of this machine.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Peak resident memory (VmHWM) of a process, in MiB.
pub fn peak_rss_mb(pid: u32) -> Option<f64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(round1(kb / 1024.0))
}

/// One decimal place, for readable JSON.
pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        assert!(cpu_ticks(me).is_some());
        assert!(peak_rss_mb(me).is_some_and(|mb| mb > 0.0));
        let meter = CpuMeter::start(vec![Watched::Pid("me", me)]);
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        assert!(meter.finish().percent.contains_key("me"));
    }
}
