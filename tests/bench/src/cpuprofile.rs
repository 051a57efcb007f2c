//! CPU profiles of a phase: where each process spends its CPU, by function.
//!
//! Linux's `perf` samples the whole machine (`perf record -a`, 199 times a second on each core,
//! no call graphs: the release binaries keep their symbols but no frame pointers) while the phase
//! runs; afterwards one flat profile per process is written beside the recording, each line the
//! share of that process's samples in one function. A reader opens the text files, or the
//! recording itself with `perf report -i FILE`. PostgreSQL's backends are one profile (every
//! `postgres` process): what the server did for the phase.
//!
//! Without `perf` (not installed, or `kernel.perf_event_paranoid` refusing this user) the phase
//! runs unprofiled and a note says why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio::process::{Child, Command};

use super::procstat::Watched;

/// Samples per second on each core.
const FREQUENCY: &str = "199";

/// Functions below this share of a process's samples are left out of its profile (percent).
const PERCENT_LIMIT: f64 = 0.5;

/// Functions of each process named in the JSON report (the text files have them all).
const TOP: usize = 8;

/// Starts a profile labelled `label` in `dir` (none when `dir` is `None`); when `perf` cannot
/// record, a note says why and the phase runs without one.
pub async fn begin(
    dir: Option<&Path>,
    label: &str,
    notes: &mut Vec<String>,
) -> Option<CpuProfiler> {
    let dir = dir?;
    match CpuProfiler::start(dir, label).await {
        Ok(p) => Some(p),
        Err(e) => {
            notes.push(format!("{label}: no CPU profile: {e:#}"));
            None
        }
    }
}

/// Ends `profiler` (if any) and writes the profiles of `watched`; a failure is a note.
pub async fn end(
    profiler: Option<CpuProfiler>,
    watched: &[Watched],
    notes: &mut Vec<String>,
) -> BTreeMap<String, ProcessProfile> {
    let Some(p) = profiler else {
        return BTreeMap::new();
    };
    let label = p.label.clone();
    match p.finish(watched).await {
        Ok(profiles) => profiles,
        Err(e) => {
            notes.push(format!("{label}: no CPU profile: {e:#}"));
            BTreeMap::new()
        }
    }
}

/// One process's profile.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessProfile {
    /// The flat profile, one function a line.
    pub file: PathBuf,
    /// Samples of this process.
    pub samples: u64,
    /// Its busiest functions: (percent of its samples, shared object, function).
    pub top: Vec<(f64, String, String)>,
}

/// A running recording.
pub struct CpuProfiler {
    child: Child,
    data: PathBuf,
    label: String,
}

impl CpuProfiler {
    /// Starts recording the whole machine into `dir/label.perf.data`. `Err`: `perf` cannot
    /// record here (the message says why); the phase goes on without a profile.
    pub async fn start(dir: &Path, label: &str) -> anyhow::Result<CpuProfiler> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let data = dir.join(format!("{label}.perf.data"));
        let mut child = Command::new("perf")
            .args(["record", "-a", "-q", "-F", FREQUENCY, "-o"])
            .arg(&data)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting perf (install linux-perf for CPU profiles)")?;
        // perf refuses at once when it may not record; give it a moment to say so.
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = stderr.read_to_string(&mut err).await;
            }
            anyhow::bail!("perf record exited ({status}): {}", err.trim());
        }
        Ok(CpuProfiler {
            child,
            data,
            label: label.to_owned(),
        })
    }

    /// Stops the recording and writes one flat profile per process of `watched` that ran.
    pub async fn finish(
        mut self,
        watched: &[Watched],
    ) -> anyhow::Result<BTreeMap<String, ProcessProfile>> {
        let pid = self.child.id().context("perf already exited")?;
        // perf writes its recording out on SIGINT.
        let _ = Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status()
            .await;
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("perf did not stop")??;
        if !status.success() && !self.data.exists() {
            anyhow::bail!("perf record failed ({status})");
        }
        let dir = self.data.parent().unwrap_or(Path::new(".")).to_path_buf();
        let mut profiles = BTreeMap::new();
        for w in watched {
            let filter = match w {
                Watched::Pid(_, pid) => vec!["--pid".to_owned(), pid.to_string()],
                Watched::Command(_, comm) => vec!["--comm".to_owned(), (*comm).to_owned()],
                Watched::Pids(_, pids) => {
                    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
                    vec!["--pid".to_owned(), pids.join(",")]
                }
            };
            let name = w.name();
            let file = dir.join(format!("{}-{name}.txt", self.label));
            if let Some(profile) = report(&self.data, &filter, &file).await? {
                let _ = profiles.insert(name.to_owned(), profile);
            }
        }
        Ok(profiles)
    }
}

/// Writes the flat profile of the samples `filter` selects to `file` (each function's share of
/// those samples); `None` when it has none.
async fn report(
    data: &Path,
    filter: &[String],
    file: &Path,
) -> anyhow::Result<Option<ProcessProfile>> {
    let out = Command::new("perf")
        .args(["report", "-i"])
        .arg(data)
        .args(filter)
        .args([
            "--stdio",
            "--no-children",
            "-g",
            "none",
            "--sort",
            "dso,sym",
            "--percentage",
            "relative",
            "--show-nr-samples",
        ])
        .stdin(Stdio::null())
        .output()
        .await
        .context("running perf report")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<(f64, u64, String, String)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect();
    let samples: u64 = lines.iter().map(|l| l.1).sum();
    if samples == 0 {
        return Ok(None);
    }
    let mut written = format!(
        "# {samples} samples of this process ({FREQUENCY} a second on each core); functions with \
         at least {PERCENT_LIMIT}% of them\n# percent  samples  shared object  function\n"
    );
    for (percent, n, dso, function) in lines.iter().filter(|l| l.0 >= PERCENT_LIMIT) {
        written.push_str(&format!("{percent:6.2}% {n:8}  {dso}  {function}\n"));
    }
    std::fs::write(file, written).with_context(|| format!("writing {}", file.display()))?;
    let top = lines
        .into_iter()
        .take(TOP)
        .map(|(percent, _, dso, function)| (percent, dso, function))
        .collect();
    Ok(Some(ProcessProfile {
        file: file.to_path_buf(),
        samples,
        top,
    }))
}

/// One line of `perf report --sort dso,sym --show-nr-samples`:
/// `    12.34%  567  libc.so.6  [.] memcpy` → (12.34, 567, "libc.so.6", "memcpy").
fn parse_line(line: &str) -> Option<(f64, u64, String, String)> {
    let mut parts = line.split_whitespace();
    let percent = parts.next()?.strip_suffix('%')?.parse().ok()?;
    let samples = parts.next()?.parse().ok()?;
    let dso = parts.next()?.to_owned();
    let _kind = parts.next()?;
    let symbol = parts.collect::<Vec<_>>().join(" ");
    Some((percent, samples, dso, symbol))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lines_are_read_as_share_samples_object_and_function() {
        assert_eq!(
            parse_line("    12.34%   567  libc.so.6   [.] __memcpy_avx_unaligned"),
            Some((
                12.34,
                567,
                "libc.so.6".to_owned(),
                "__memcpy_avx_unaligned".to_owned()
            ))
        );
        assert_eq!(
            parse_line("     3.10%    41  relay  [.] <relay::claim::X as core::fmt::Debug>::fmt"),
            Some((
                3.1,
                41,
                "relay".to_owned(),
                "<relay::claim::X as core::fmt::Debug>::fmt".to_owned()
            ))
        );
        assert_eq!(parse_line("# Overhead  Samples"), None);
    }
}
