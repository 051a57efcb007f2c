//! The child processes of a run: started, watched, restarted and faulted by one supervisor.
//!
//! A process that exits is started again: after the delay its fault chose when a fault expected
//! the exit (a kill or a crash trigger), after a second otherwise, and then the exit counts as
//! unplanned. Dropping the supervisor's last handle kills whatever still runs.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio_util::sync::CancellationToken;

/// How a process is started.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub label: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<PathBuf>,
    pub log_path: PathBuf,
}

/// Delay before an unplanned exit is followed by a restart.
const UNPLANNED_RESTART_DELAY: Duration = Duration::from_secs(1);

struct Slot {
    spec: ProcessSpec,
    child: Option<Child>,
    starts: u32,
    /// When to start the process again while it is down.
    restart_at: Option<Instant>,
    /// A fault expects this process to exit by itself: restart it this long after it does.
    expected_exit: Option<Duration>,
}

impl Slot {
    fn spawn(&mut self) -> anyhow::Result<()> {
        let spec = &self.spec;
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(&spec.log_path)
            .with_context(|| format!("opening {}", spec.log_path.display()))?;
        writeln!(
            log,
            "--- verify: start #{} of {} at {} ---",
            self.starts + 1,
            spec.label,
            chrono::Utc::now().to_rfc3339()
        )?;
        let mut command = Command::new(&spec.program);
        let _ = command
            .args(&spec.args)
            .env_clear()
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(dir) = &spec.cwd {
            let _ = command.current_dir(dir);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {} ({})", spec.label, spec.program.display()))?;
        self.child = Some(child);
        self.starts += 1;
        self.restart_at = None;
        Ok(())
    }

    fn pid(&self) -> Option<Pid> {
        self.child
            .as_ref()
            .and_then(|c| i32::try_from(c.id()).ok())
            .map(Pid::from_raw)
    }

    /// SIGKILL and reap, if running.
    fn kill_now(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = i32::try_from(child.id()).ok().map(Pid::from_raw) {
                let _ = kill(pid, Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.kill_now();
    }
}

#[derive(Default)]
struct Processes {
    slots: Vec<Slot>,
    /// Exits no fault asked for, per label.
    unplanned_exits: BTreeMap<String, u32>,
}

/// A handle on the run's processes; clones share them.
#[derive(Clone, Default)]
pub struct Supervisor {
    inner: Arc<Mutex<Processes>>,
}

impl Supervisor {
    fn processes(&self) -> MutexGuard<'_, Processes> {
        // A panic while holding the lock leaves the slots consistent enough to kill them.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with_slot<T>(&self, label: &str, f: impl FnOnce(&mut Slot) -> T) -> anyhow::Result<T> {
        let mut processes = self.processes();
        let slot = processes
            .slots
            .iter_mut()
            .find(|s| s.spec.label == label)
            .with_context(|| format!("no process labelled {label}"))?;
        Ok(f(slot))
    }

    /// Starts a process and keeps it running.
    pub fn start(&self, spec: ProcessSpec) -> anyhow::Result<()> {
        let mut processes = self.processes();
        if processes.slots.iter().any(|s| s.spec.label == spec.label) {
            bail!("a process labelled {} already runs", spec.label);
        }
        let mut slot = Slot {
            spec,
            child: None,
            starts: 0,
            restart_at: None,
            expected_exit: None,
        };
        slot.spawn()?;
        processes.slots.push(slot);
        Ok(())
    }

    /// Reaps exited processes and restarts those due, every 100 ms until `stop`.
    pub async fn watch(&self, stop: CancellationToken) {
        loop {
            self.tick();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    fn tick(&self) {
        let now = Instant::now();
        let mut guard = self.processes();
        let Processes {
            slots,
            unplanned_exits,
        } = &mut *guard;
        for slot in slots.iter_mut() {
            if let Some(child) = slot.child.as_mut() {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        slot.child = None;
                        let delay = match slot.expected_exit.take() {
                            Some(delay) => delay,
                            None => {
                                *unplanned_exits.entry(slot.spec.label.clone()).or_default() += 1;
                                eprintln!(
                                    "[verify] {} exited unexpectedly ({status}); restarting it (log: {})",
                                    slot.spec.label,
                                    slot.spec.log_path.display()
                                );
                                UNPLANNED_RESTART_DELAY
                            }
                        };
                        slot.restart_at = Some(now + delay);
                    }
                    Ok(None) => {}
                    Err(e) => eprintln!("[verify] cannot check {}: {e}", slot.spec.label),
                }
            }
            if slot.child.is_none() && slot.restart_at.is_some_and(|at| at <= now) {
                if let Err(e) = slot.spawn() {
                    eprintln!("[verify] {e:#}; trying again in a second");
                    slot.restart_at = Some(now + UNPLANNED_RESTART_DELAY);
                }
            }
        }
    }

    /// SIGKILLs a process; it is started again after `restart_after`.
    pub fn kill(&self, label: &str, restart_after: Duration) -> anyhow::Result<()> {
        self.with_slot(label, |slot| {
            slot.kill_now();
            slot.expected_exit = None;
            slot.restart_at = Some(Instant::now() + restart_after);
        })
    }

    /// Sends SIGTERM to a running process and expects it to exit: it is started again
    /// `restart_after` once it has (see [`Supervisor::starts`]), and the exit is not unplanned.
    pub fn terminate(&self, label: &str, restart_after: Duration) -> anyhow::Result<()> {
        let pid = self.with_slot(label, |slot| {
            slot.expected_exit = Some(restart_after);
            slot.pid()
        })?;
        let pid = pid.with_context(|| format!("{label} is not running"))?;
        kill(pid, Signal::SIGTERM).with_context(|| format!("sending SIGTERM to {label}"))
    }

    /// Starts a process that is down (killed, waiting for its restart) now.
    pub fn restart_now(&self, label: &str) -> anyhow::Result<()> {
        self.with_slot(label, |slot| {
            if slot.child.is_none() {
                slot.restart_at = Some(Instant::now());
            }
        })
    }

    /// The process is expected to exit by itself (a crash point): restart it `restart_after`
    /// once it has, and do not count the exit as unplanned.
    pub fn expect_exit(&self, label: &str, restart_after: Duration) -> anyhow::Result<()> {
        self.with_slot(label, |slot| slot.expected_exit = Some(restart_after))
    }

    /// Withdraws [`Supervisor::expect_exit`].
    pub fn unexpect_exit(&self, label: &str) -> anyhow::Result<()> {
        self.with_slot(label, |slot| slot.expected_exit = None)
    }

    /// Sends a signal to a running process.
    pub fn signal(&self, label: &str, signal: Signal) -> anyhow::Result<()> {
        let pid = self
            .with_slot(label, |slot| slot.pid())?
            .with_context(|| format!("{label} is not running"))?;
        kill(pid, signal).with_context(|| format!("sending {signal} to {label}"))
    }

    /// How the process is started.
    pub fn spec(&self, label: &str) -> anyhow::Result<ProcessSpec> {
        self.with_slot(label, |slot| slot.spec.clone())
    }

    /// How often the process has been started.
    pub fn starts(&self, label: &str) -> anyhow::Result<u32> {
        self.with_slot(label, |slot| slot.starts)
    }

    /// Whether the process is up (started and not seen exiting).
    pub fn is_up(&self, label: &str) -> bool {
        self.with_slot(label, |slot| {
            slot.child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
        })
        .unwrap_or(false)
    }

    /// Where a process logs.
    pub fn log_path(&self, label: &str) -> anyhow::Result<PathBuf> {
        self.with_slot(label, |slot| slot.spec.log_path.clone())
    }

    /// Stops a process for good: SIGTERM, then SIGKILL after `timeout`. Returns its exit status
    /// after SIGTERM, or `None` when it had to be killed (or was not running).
    pub async fn stop(&self, label: &str, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let mut slot = {
            let mut processes = self.processes();
            let index = processes
                .slots
                .iter()
                .position(|s| s.spec.label == label)
                .with_context(|| format!("no process labelled {label}"))?;
            processes.slots.remove(index)
        };
        let Some(pid) = slot.pid() else {
            return Ok(None);
        };
        let _ = kill(pid, Signal::SIGCONT);
        kill(pid, Signal::SIGTERM).with_context(|| format!("sending SIGTERM to {label}"))?;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(child) = slot.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    slot.child = None;
                    return Ok(Some(status));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!("[verify] {label} still running {timeout:?} after SIGTERM: killing it");
        slot.kill_now();
        Ok(None)
    }

    /// Stops every process but `keep`, in reverse start order, each with [`Supervisor::stop`].
    pub async fn stop_all_but(&self, keep: &[String], timeout: Duration) {
        let labels: Vec<String> = self
            .processes()
            .slots
            .iter()
            .rev()
            .map(|s| s.spec.label.clone())
            .filter(|l| !keep.contains(l))
            .collect();
        for label in labels {
            if let Err(e) = self.stop(&label, timeout).await {
                eprintln!("[verify] stopping {label}: {e:#}");
            }
        }
    }

    /// Stops `labels` for good at the same time: SIGTERM to each (woken first), then SIGKILL to
    /// those still running after `timeout`.
    pub async fn stop_together(&self, labels: &[String], timeout: Duration) {
        let mut slots = self.take(labels);
        for slot in &slots {
            if let Some(pid) = slot.pid() {
                let _ = kill(pid, Signal::SIGCONT);
                let _ = kill(pid, Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            slots.retain_mut(|slot| match slot.child.as_mut().map(Child::try_wait) {
                Some(Ok(None)) => true,
                _ => {
                    slot.child = None;
                    false
                }
            });
            if slots.is_empty() || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for mut slot in slots {
            eprintln!(
                "[verify] {} still running {timeout:?} after SIGTERM: killing it",
                slot.spec.label
            );
            slot.kill_now();
        }
    }

    /// Kills `labels` at once (SIGKILL), for processes whose state is thrown away next.
    pub fn kill_together(&self, labels: &[String]) {
        // Dropping a slot kills its process and reaps it.
        drop(self.take(labels));
    }

    /// Removes the slots of `labels` from supervision and returns them.
    fn take(&self, labels: &[String]) -> Vec<Slot> {
        let mut processes = self.processes();
        let (taken, kept) = std::mem::take(&mut processes.slots)
            .into_iter()
            .partition(|s| labels.contains(&s.spec.label));
        processes.slots = kept;
        taken
    }

    /// Unplanned exits per process label (only those with any).
    pub fn unplanned_exits(&self) -> BTreeMap<String, u32> {
        self.processes().unplanned_exits.clone()
    }
}
