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
    /// These processes, summed (e.g. one client's database sessions).
    Pids(&'static str, Vec<u32>),
}

impl Watched {
    /// The name its CPU is reported under.
    pub fn name(&self) -> &'static str {
        match self {
            Watched::Pid(name, _) | Watched::Command(name, _) | Watched::Pids(name, _) => name,
        }
    }

    fn pids(&self) -> Vec<u32> {
        match self {
            Watched::Pid(_, pid) => vec![*pid],
            Watched::Command(_, comm) => pids_named(comm),
            Watched::Pids(_, pids) => pids.clone(),
        }
    }
}

/// The processes every phase watches besides its own services: broker, PostgreSQL and the
/// benchmark itself (its driver competes for the same cores).
pub fn shared_processes() -> Vec<Watched> {
    let mut watched = vec![
        Watched::Command(POSTGRES, "postgres"),
        Watched::Pid(BENCH, std::process::id()),
    ];
    if let Some(pid) = broker_pid() {
        watched.push(Watched::Pid(BROKER, pid));
    }
    watched
}

/// The Apache Kafka broker serving `KAFKA_BROKERS`: a JVM running `kafka.Kafka` whose
/// configuration (its properties file and any `--override`) has a listener on the first address
/// of `KAFKA_BROKERS`, or the only such JVM running.
pub fn broker_pid() -> Option<u32> {
    let brokers = pipeline_testkit::kafka::brokers();
    let address = brokers.split(',').next().unwrap_or_default();
    let pids: Vec<u32> = pids_named("java")
        .into_iter()
        .filter(|pid| is_kafka_broker(&command_line(*pid)))
        .collect();
    pids.iter()
        .copied()
        .find(|pid| {
            let config = broker_config_text(*pid);
            listeners_serve(&config, address)
        })
        .or_else(|| (pids.len() == 1).then(|| pids[0]))
}

/// Whether a command line runs Kafka's broker main class.
fn is_kafka_broker(command_line: &str) -> bool {
    command_line.split_whitespace().any(|a| a == "kafka.Kafka")
}

/// The broker's properties file (the first argument after `kafka.Kafka`, relative to the
/// process's working directory) and the `--override` settings on its command line, one
/// `key=value` a line.
fn broker_config_text(pid: u32) -> String {
    let args = command_args(pid);
    let mut after_main = args.iter().skip_while(|a| *a != "kafka.Kafka").skip(1);
    let mut text = String::new();
    if let Some(file) = after_main.next() {
        let path = std::path::Path::new(file);
        let path = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::path::PathBuf::from(format!("/proc/{pid}/cwd")).join(path)
        };
        text.push_str(&fs::read_to_string(path).unwrap_or_default());
    }
    let mut rest = after_main.peekable();
    while let Some(arg) = rest.next() {
        if arg == "--override" {
            if let Some(setting) = rest.next() {
                text.push('\n');
                text.push_str(setting);
            }
        }
    }
    text
}

/// Whether the `listeners` or `advertised.listeners` of a broker's configuration include
/// `address` (`host:port`, with or without a `SCHEME://`): the same port on the same host, on a
/// wildcard host or, for a loopback address, on the other loopback name.
fn listeners_serve(config: &str, address: &str) -> bool {
    let Some((host, port)) = split_address(address) else {
        return false;
    };
    let loopback = |h: &str| matches!(h, "127.0.0.1" | "localhost" | "::1" | "[::1]");
    config
        .lines()
        .filter_map(|line| line.trim().split_once('='))
        .filter(|(key, _)| matches!(key.trim(), "listeners" | "advertised.listeners"))
        .flat_map(|(_, value)| value.split(','))
        .filter_map(split_address)
        .any(|(h, p)| {
            p == port
                && (h == host || h.is_empty() || h == "0.0.0.0" || loopback(h) && loopback(host))
        })
}

/// (host, port) of `[SCHEME://]host:port`.
fn split_address(address: &str) -> Option<(&str, &str)> {
    let address = address.trim();
    let address = address.split_once("://").map_or(address, |(_, a)| a);
    address.rsplit_once(':')
}

/// What is known of the broker process (on this machine) the benchmark measures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BrokerProcess {
    pub pid: u32,
    /// The Apache Kafka version of the jars on its class path (`kafka_<scala>-<version>.jar`).
    pub version: Option<String>,
    pub command: String,
}

/// The broker process [`broker_pid`] finds, with its version.
pub fn broker_process() -> Option<BrokerProcess> {
    let pid = broker_pid()?;
    Some(BrokerProcess {
        pid,
        version: kafka_version(&command_args(pid)),
        command: command_line(pid),
    })
}

/// The Kafka version of the `kafka_<scala>-<version>.jar` on a JVM's class path (`-cp` or
/// `-classpath`; a `dir/*` entry is looked into).
fn kafka_version(args: &[String]) -> Option<String> {
    let class_path = args
        .iter()
        .skip_while(|a| !matches!(a.as_str(), "-cp" | "-classpath" | "--class-path"))
        .nth(1)?;
    let mut jars: Vec<String> = Vec::new();
    for entry in class_path.split(':') {
        match entry.strip_suffix("/*") {
            Some(dir) => jars.extend(
                fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().into_string().ok()),
            ),
            None => jars.extend(entry.rsplit('/').next().map(str::to_owned)),
        }
    }
    jars.iter().find_map(|jar| kafka_jar_version(jar))
}

/// `4.4.0` of `kafka_2.13-4.4.0.jar` (not of its `-test`, `-sources` or `-javadoc` jars).
fn kafka_jar_version(jar: &str) -> Option<String> {
    let (_scala, version) = jar
        .strip_prefix("kafka_")?
        .strip_suffix(".jar")?
        .split_once('-')?;
    (!version.contains('-') && version.starts_with(|c: char| c.is_ascii_digit()))
        .then(|| version.to_owned())
}

/// A process's arguments joined by spaces.
pub fn command_line(pid: u32) -> String {
    command_args(pid).join(" ").trim().to_owned()
}

/// A process's arguments.
fn command_args(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
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
        let mut cpu_seconds = BTreeMap::new();
        for w in &self.watched {
            let ticks: u64 = w
                .pids()
                .into_iter()
                .filter_map(|pid| {
                    let now = cpu_ticks(pid)?;
                    Some(now.saturating_sub(self.start.get(&pid).copied().unwrap_or(0)))
                })
                .sum();
            let seconds = ticks as f64 / USER_HZ;
            let _ = percent.insert(w.name().to_owned(), round1(seconds / wall * 100.0));
            let _ = cpu_seconds.insert(w.name().to_owned(), round2(seconds));
        }
        let watched: f64 = percent.values().sum();
        let machine = self
            .machine_start
            .zip(machine_busy_ticks())
            .map(|(a, b)| b.saturating_sub(a) as f64 / USER_HZ / wall * 100.0);
        CpuUse {
            seconds: round1(wall),
            percent,
            cpu_seconds,
            other_percent: machine.map(|m| round1((m - watched).max(0.0))),
            per_event: None,
        }
    }
}

/// The watched name of the broker process.
pub const BROKER: &str = "broker";
/// The watched name of the benchmark's own process.
pub const BENCH: &str = "bench";
/// PostgreSQL's processes, summed.
pub const POSTGRES: &str = "postgres";

/// CPU use over a phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuUse {
    /// Wall seconds measured.
    pub seconds: f64,
    /// CPU% per process (100 = one core).
    pub percent: BTreeMap<String, f64>,
    /// CPU seconds per process (user + system, every thread).
    pub cpu_seconds: BTreeMap<String, f64>,
    /// CPU% of everything else on the machine (other users, exited backends): noise.
    pub other_percent: Option<f64>,
    /// CPU per event, when the phase counts the events carried while it was measured.
    pub per_event: Option<CpuPerEvent>,
}

/// CPU µs per event: the broker's beside the pipeline's.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuPerEvent {
    /// Events carried while the CPU was measured.
    pub events: u64,
    /// The Kafka broker's CPU µs per event (`None`: its process was not found on this machine).
    pub broker_us: Option<f64>,
    /// The pipeline's: every watched process but the broker and the benchmark (the relay, the
    /// consumer, the order service and PostgreSQL, those of them running in the phase).
    pub pipeline_us: f64,
    /// The benchmark process's (the load driver, or the plain clients of the broker phases).
    pub bench_us: f64,
    /// Each watched process's.
    pub by_process_us: BTreeMap<String, f64>,
}

impl CpuUse {
    /// The same, with `seconds` of CPU moved from process `from` to process `to` (both
    /// watched; nothing moves otherwise).
    #[must_use]
    pub fn moved(mut self, from: &str, to: &str, seconds: f64) -> CpuUse {
        let wall = self.seconds.max(1e-3);
        let (Some(&have), true) = (
            self.cpu_seconds.get(from),
            self.cpu_seconds.contains_key(to),
        ) else {
            return self;
        };
        let seconds = seconds.clamp(0.0, have);
        for (name, delta) in [(from, -seconds), (to, seconds)] {
            if let Some(s) = self.cpu_seconds.get_mut(name) {
                *s = round2(*s + delta);
                let _ = self
                    .percent
                    .insert(name.to_owned(), round1(*s / wall * 100.0));
            }
        }
        self
    }

    /// The same, with the CPU per event of `events` events carried while it was measured.
    #[must_use]
    pub fn with_events(mut self, events: u64) -> CpuUse {
        let per = |seconds: f64| round2(seconds * 1e6 / (events.max(1) as f64));
        let by_process_us: BTreeMap<String, f64> = self
            .cpu_seconds
            .iter()
            .map(|(name, &s)| (name.clone(), per(s)))
            .collect();
        let pipeline_seconds: f64 = self
            .cpu_seconds
            .iter()
            .filter(|(name, _)| !matches!(name.as_str(), BROKER | BENCH))
            .map(|(_, s)| s)
            .sum();
        self.per_event = Some(CpuPerEvent {
            events,
            broker_us: self.cpu_seconds.get(BROKER).map(|&s| per(s)),
            pipeline_us: per(pipeline_seconds),
            bench_us: self.cpu_seconds.get(BENCH).map_or(0.0, |&s| per(s)),
            by_process_us,
        });
        self
    }

    /// "broker X, pipeline Y (each of its processes), bench Z" in CPU µs per event, or nothing
    /// when the phase did not count its events. In the broker phases the client is the benchmark.
    pub fn per_event_summary(&self) -> Option<String> {
        let p = self.per_event.as_ref()?;
        let broker = p.broker_us.map_or("broker not found".to_owned(), |us| {
            format!("broker {us:.1}")
        });
        let mut parts: Vec<(&String, f64)> = p
            .by_process_us
            .iter()
            .filter(|(name, _)| !matches!(name.as_str(), BROKER | BENCH))
            .map(|(name, &us)| (name, us))
            .collect();
        parts.sort_by(|a, b| b.1.total_cmp(&a.1));
        let parts: Vec<String> = parts
            .iter()
            .map(|(name, us)| format!("{name} {us:.1}"))
            .collect();
        Some(format!(
            "CPU µs/event over {} events: {broker}, pipeline {:.1} ({}), bench {:.1}",
            p.events,
            p.pipeline_us,
            parts.join(", "),
            p.bench_us
        ))
    }

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
    /// Each process's CPU to a tenth of a percent, and the pipeline's total (every process but
    /// the broker and the benchmark itself) beside the broker's: for figures near zero.
    pub fn fine_summary(&self) -> String {
        let mut v: Vec<_> = self.percent.iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(a.1));
        let parts: Vec<String> = v.iter().map(|(n, p)| format!("{n} {p:.1}%")).collect();
        let pipeline: f64 = self
            .percent
            .iter()
            .filter(|(n, _)| n.as_str() != BROKER && n.as_str() != BENCH)
            .map(|(_, p)| p)
            .sum();
        format!(
            "{}; pipeline and PostgreSQL {pipeline:.1}% of a core, broker {:.1}%",
            parts.join(", "),
            self.percent.get(BROKER).copied().unwrap_or(0.0)
        )
    }

    pub fn summary(&self) -> String {
        let mut v: Vec<_> = self.percent.iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(a.1));
        let parts: Vec<String> = v.iter().map(|(n, p)| format!("{n} {p:.0}%")).collect();
        let other = self
            .other_percent
            .map_or(String::new(), |o| format!(", other processes {o:.0}%"));
        let per_event = self
            .per_event_summary()
            .map_or(String::new(), |p| format!("; {p}"));
        format!(
            "{} (total {:.0}% of {}%{other}){per_event}",
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

/// Two decimal places.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_listener_on_the_address() {
        let config =
            "# comment\nlisteners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093\n\
                      advertised.listeners=PLAINTEXT://127.0.0.1:9092\n";
        assert!(listeners_serve(config, "127.0.0.1:9092"));
        assert!(listeners_serve(config, "localhost:9092"));
        assert!(listeners_serve(config, "PLAINTEXT://127.0.0.1:9092"));
        assert!(!listeners_serve(config, "127.0.0.1:19092"));
        assert!(!listeners_serve(config, "10.0.0.5:9092"));
        assert!(listeners_serve(
            "listeners=PLAINTEXT://:9092",
            "10.0.0.5:9092"
        ));
        assert!(listeners_serve(
            "listeners = PLAINTEXT://0.0.0.0:9092",
            "10.0.0.5:9092"
        ));
        assert!(!listeners_serve("log.dirs=/x:9092", "127.0.0.1:9092"));
    }

    #[test]
    fn the_kafka_version_of_its_jar() {
        assert_eq!(
            kafka_jar_version("kafka_2.13-4.4.0.jar").as_deref(),
            Some("4.4.0")
        );
        assert_eq!(kafka_jar_version("kafka_2.13-4.4.0-test.jar"), None);
        assert_eq!(kafka_jar_version("kafka-clients-4.4.0.jar"), None);
        assert!(is_kafka_broker(
            "java -Xmx512m -cp /k/* kafka.Kafka /run/kafka.properties"
        ));
        assert!(!is_kafka_broker(
            "java -cp /k/* kafka.tools.StorageTool format"
        ));
    }

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
