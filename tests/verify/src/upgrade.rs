//! The rolling upgrade: every pipeline process replaced by a new release's binary, one at a time
//! and each ready before the next, as a rolling update of deploy/kubernetes's Deployments does:
//! the standby relay, then the active one (the standby of the new release takes the lease), each
//! group's members, then the order service. Each is stopped with SIGTERM and the grace period
//! the manifests give it (SIGKILL after that), and started from a copy of its binary in a folder
//! of its own, the new release. The load runs on throughout; the run's checks afterwards hold
//! the upgrade to lost 0, duplicate effects 0, reorders 0.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use pipeline_testkit::wait_until;
use tokio::time::Instant;

use super::faults::Injector;
use super::injection::{done, Injected};
use super::topology::ORDER_SERVICE;

/// deploy/kubernetes's `terminationGracePeriodSeconds`: relay, consumer, order service.
const RELAY_GRACE: Duration = Duration::from_secs(45);
const CONSUMER_GRACE: Duration = Duration::from_secs(60);
const ORDER_SERVICE_GRACE: Duration = Duration::from_secs(30);
/// How long a process of the new release may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

impl Injector<'_> {
    /// Replaces every relay, consumer and the order service, one at a time. The note says how
    /// long the order service (the run has one) was out: requests are refused only then.
    pub(crate) async fn rolling_upgrade(&self) -> anyhow::Result<Injected> {
        let topology = self.topology;
        let active = self.active_relay().await?;
        let standby = self.standby_of(&active)?;
        let mut steps: Vec<(String, SocketAddr, Duration)> = vec![
            (standby.label.clone(), standby.ops, RELAY_GRACE),
            (active.label.clone(), active.ops, RELAY_GRACE),
        ];
        steps.extend(
            topology
                .consumers
                .iter()
                .map(|m| (m.label.clone(), m.ops, CONSUMER_GRACE)),
        );
        steps.push((
            ORDER_SERVICE.to_owned(),
            topology.order_service,
            ORDER_SERVICE_GRACE,
        ));
        let release = self.env.log_dir.join("new-release");
        let mut notes = Vec::new();
        let mut order_service_out = None;
        for (label, ops, grace) in &steps {
            let supervisor = &topology.supervisor;
            let mut spec = supervisor.spec(label)?;
            spec.program = new_release_binary(&release, &spec.program)?;
            let stopped = Instant::now();
            match supervisor.stop(label, *grace).await? {
                Some(status) if status.success() => {}
                Some(status) => notes.push(format!("{label} exited with {status} after SIGTERM")),
                None => notes.push(format!(
                    "{label} had to be killed {} s after SIGTERM",
                    grace.as_secs()
                )),
            }
            supervisor.start(spec)?;
            wait_until(
                &format!("{label} of the new release ready"),
                READY_TIMEOUT,
                || async { Ok(topology.ready(*ops).await.then_some(())) },
            )
            .await?;
            if label == ORDER_SERVICE {
                order_service_out = Some(stopped.elapsed());
            }
        }
        // The lease is held by a relay of the new release.
        let _ = self.active_relay().await?;
        if let Some(out) = order_service_out {
            notes.push(format!(
                "order service out {:.1} s (one instance)",
                out.as_secs_f64()
            ));
        }
        Ok(Injected {
            note: Some(notes.join("; ")),
            ..done(&format!("{} processes", steps.len()))
        })
    }
}

/// `program`'s copy in `release`, made when missing: the same build under another path, as a
/// new release's binary would be.
fn new_release_binary(release: &Path, program: &Path) -> anyhow::Result<PathBuf> {
    let name = program
        .file_name()
        .with_context(|| format!("{} has no file name", program.display()))?;
    let copy = release.join(name);
    if !copy.exists() {
        std::fs::create_dir_all(release)
            .with_context(|| format!("creating {}", release.display()))?;
        let _ = std::fs::copy(program, &copy)
            .with_context(|| format!("copying {} to {}", program.display(), copy.display()))?;
    }
    Ok(copy)
}
