//! A real binary running under a test: started with its output in a log file, stopped with a
//! signal, its log read for the values it reports.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Directory of the binaries under test.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PIPELINE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    // target/<profile>/deps/<test binary> -> target/<profile>
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("target directory")
}

/// A running binary.
pub struct Service {
    child: Child,
    pub log_path: PathBuf,
    pub label: String,
}

impl Service {
    pub(crate) fn new(child: Child, log_path: PathBuf, label: &str) -> Service {
        Service {
            child,
            log_path,
            label: label.to_owned(),
        }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        kill(self.pid(), signal).with_context(|| format!("signalling {}", self.label))
    }

    /// SIGKILL, then reap.
    pub fn kill_hard(mut self) -> anyhow::Result<()> {
        self.signal(Signal::SIGKILL)?;
        let _ = self.child.wait()?;
        Ok(())
    }

    /// SIGTERM, then wait for a clean exit within `timeout`; returns whether it exited successfully.
    pub async fn stop(mut self, timeout: Duration) -> anyhow::Result<bool> {
        self.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if Instant::now() > deadline {
                let stacks = thread_stacks(self.pid());
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!(
                    "{} did not stop within {timeout:?} after SIGTERM; its log ends:\n{}{stacks}",
                    self.label,
                    log_tail(&self.log(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// [`Service::stop`], failing unless the process exits successfully within `timeout`.
    pub async fn stop_cleanly(self, timeout: Duration) -> anyhow::Result<()> {
        let label = self.label.clone();
        if !self.stop(timeout).await? {
            bail!("{label} did not exit cleanly on SIGTERM");
        }
        Ok(())
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits for a log line containing `prefix` and returns the word that follows it.
    pub async fn wait_for_log_value(
        &self,
        prefix: &str,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if let Some(pos) = log.rfind(prefix) {
                let rest = &log[pos + prefix.len()..];
                let value: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',')
                    .collect();
                if !value.is_empty() {
                    return Ok(value);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: no `{prefix}` in its log within {timeout:?}:\n{log}",
                    self.label
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last `lines` lines of `log`.
fn log_tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Every thread's stack of a process that hangs, where gdb is installed: what it waits on.
fn thread_stacks(pid: Pid) -> String {
    let output = std::process::Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt 30",
        ])
        .stdin(std::process::Stdio::null())
        .output();
    match output {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let stacks: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("Thread ") || l.starts_with('#'))
                .collect();
            format!("\nits threads:\n{}", stacks.join("\n"))
        }
        _ => String::new(),
    }
}
