//! The machine's PostgreSQL cluster, which the `postgres_restart` fault stops hard and starts
//! again (Debian's `pg_ctlcluster`). Whatever happens to the run, a cluster it stopped is started
//! again: explicitly at the end, and by `Drop` as a last resort.

use std::process::Output;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context};
use pipeline_testkit::wait_until;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

/// Longest a start waits for the server to accept connections.
const START_WAIT: Duration = Duration::from_secs(300);

/// One `pg_ctlcluster` cluster (version and name), found by its port.
#[derive(Debug)]
pub struct PgCluster {
    version: String,
    name: String,
    server_url: String,
    /// Run `pg_ctlcluster` through `sudo -n` (when not root).
    sudo: bool,
    /// Set while the cluster is down because of this run.
    stopped_by_us: AtomicBool,
}

impl PgCluster {
    /// The cluster serving `server_url`'s port, from `pg_lsclusters`.
    pub async fn discover(server_url: &str) -> anyhow::Result<PgCluster> {
        let port = PgConnectOptions::from_str(server_url)
            .context("parsing the PostgreSQL URL")?
            .get_port();
        let out = run("pg_lsclusters", &["-h"], false)
            .await
            .context("listing PostgreSQL clusters (pg_lsclusters, Debian's postgresql-common)")?;
        let listing = String::from_utf8_lossy(&out.stdout).into_owned();
        let (version, name) = listing
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|cols| cols.len() >= 3 && cols[2] == port.to_string())
            .map(|cols| (cols[0].to_owned(), cols[1].to_owned()))
            .with_context(|| format!("no PostgreSQL cluster on port {port} in:\n{listing}"))?;
        let uid = run("id", &["-u"], false).await?;
        let sudo = String::from_utf8_lossy(&uid.stdout).trim() != "0";
        Ok(PgCluster {
            version,
            name,
            server_url: server_url.to_owned(),
            sudo,
            stopped_by_us: AtomicBool::new(false),
        })
    }

    /// `version/name`, e.g. `15/main`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.version, self.name)
    }

    fn ctl_args<'a>(&'a self, action: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "--skip-systemctl-redirect",
            &self.version,
            &self.name,
            action,
        ];
        args.extend_from_slice(extra);
        args
    }

    /// Stops the cluster the way a crash would: `stop -m immediate` (no checkpoint, clients cut).
    pub async fn stop_immediate(&self) -> anyhow::Result<()> {
        self.stopped_by_us.store(true, Ordering::SeqCst);
        let out = run(
            "pg_ctlcluster",
            &self.ctl_args("stop", &["-m", "immediate"]),
            self.sudo,
        )
        .await?;
        if !out.status.success() {
            bail!(
                "pg_ctlcluster {} stop -m immediate failed: {}",
                self.id(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Starts the cluster and waits until it accepts connections: after `stop -m immediate`
    /// the server replays the WAL written since its last checkpoint first (up to
    /// `checkpoint_timeout` of the run's writes), which takes longer than `pg_ctl`'s own minute
    /// on a busy machine.
    pub async fn start(&self) -> anyhow::Result<()> {
        let wait = START_WAIT.as_secs().to_string();
        let out = run(
            "pg_ctlcluster",
            &self.ctl_args("start", &["--", "-t", &wait]),
            self.sudo,
        )
        .await?;
        // Exit status 2: already running.
        if !out.status.success() && out.status.code() != Some(2) {
            bail!(
                "pg_ctlcluster {} start failed: {}",
                self.id(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        wait_until("PostgreSQL to accept connections", START_WAIT, || async {
            let mut conn = PgConnection::connect(&self.server_url).await?;
            sqlx::query("SELECT 1").execute(&mut conn).await?;
            let _ = conn.close().await;
            Ok(Some(()))
        })
        .await?;
        self.stopped_by_us.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Makes the server checkpoint at least every `every` (a PostgreSQL interval such as `30s`)
    /// while the run lasts, and checkpoints once now: a crash then replays at most a minute or
    /// so of the run's writes, not all of them since the last checkpoint of a server tuned for
    /// few checkpoints (deploy/postgres/pipeline.conf's 15 minutes: at the run's rate, 30 s or
    /// more of replay for the same fault). Returns the setting it had, for
    /// [`PgCluster::restore_checkpoints`].
    pub async fn checkpoint_every(&self, every: &str) -> anyhow::Result<String> {
        let mut conn = PgConnection::connect(&self.server_url).await?;
        let previous: String = sqlx::query_scalar("SELECT current_setting('checkpoint_timeout')")
            .fetch_one(&mut conn)
            .await?;
        set_checkpoint_timeout(&mut conn, every).await?;
        sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await?;
        let _ = conn.close().await;
        Ok(previous)
    }

    /// Gives the server back the `checkpoint_timeout` [`PgCluster::checkpoint_every`] found.
    pub async fn restore_checkpoints(&self, previous: &str) -> anyhow::Result<()> {
        let mut conn = PgConnection::connect(&self.server_url).await?;
        set_checkpoint_timeout(&mut conn, previous).await?;
        let _ = conn.close().await;
        Ok(())
    }

    /// Starts the cluster again if this run left it stopped.
    pub async fn restore(&self) -> anyhow::Result<()> {
        if self.stopped_by_us.load(Ordering::SeqCst) {
            eprintln!("[verify] starting PostgreSQL {} again", self.id());
            self.start().await?;
        }
        Ok(())
    }
}

/// `ALTER SYSTEM SET checkpoint_timeout`, then a reload. The value is a quoted literal.
async fn set_checkpoint_timeout(conn: &mut PgConnection, value: &str) -> anyhow::Result<()> {
    if !value.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!("checkpoint_timeout {value:?} is not a PostgreSQL interval");
    }
    sqlx::raw_sql(&format!("ALTER SYSTEM SET checkpoint_timeout = '{value}'"))
        .execute(&mut *conn)
        .await
        .context("ALTER SYSTEM SET checkpoint_timeout")?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.stopped_by_us.load(Ordering::SeqCst) {
            eprintln!(
                "[verify] PostgreSQL {} was left stopped: starting it",
                self.id()
            );
            let args = self.ctl_args("start", &[]);
            let status = if self.sudo {
                std::process::Command::new("sudo")
                    .arg("-n")
                    .arg("pg_ctlcluster")
                    .args(&args)
                    .status()
            } else {
                std::process::Command::new("bash")
                    .args(["-c", WITHOUT_INHERITED_FDS, "pg_ctlcluster"])
                    .args(&args)
                    .status()
            };
            if let Err(e) = status {
                eprintln!("[verify] could not start PostgreSQL {}: {e}", self.id());
            }
        }
    }
}

/// Other clients' sessions, per database: backends of databases not in `own` (other than this
/// query's).
pub async fn foreign_sessions(server_url: &str, own: &[String]) -> anyhow::Result<Vec<String>> {
    let mut conn = PgConnection::connect(server_url).await?;
    let sessions: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s (%s sessions)', coalesce(datname, '?'), count(*))
         FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
           AND datname <> ALL($1)
         GROUP BY datname ORDER BY datname",
    )
    .bind(own)
    .fetch_all(&mut conn)
    .await?;
    let _ = conn.close().await;
    Ok(sessions)
}

/// A `bash -c` script that closes every descriptor but standard input, output and error, then
/// runs its arguments. The server `pg_ctlcluster start` leaves running must not keep what this
/// process inherited: a lock file descriptor from `flock(1)`, which serialises heavy jobs on a
/// shared machine, would stay locked for as long as the server runs. (`sudo` closes them itself.)
const WITHOUT_INHERITED_FDS: &str = r#"for fd in /proc/self/fd/*; do
    fd=${fd##*/}
    if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null; fi
done
exec "$0" "$@""#;

async fn run(program: &str, args: &[&str], sudo: bool) -> anyhow::Result<Output> {
    let mut command = if sudo {
        let mut c = tokio::process::Command::new("sudo");
        let _ = c.arg("-n").arg(program);
        c
    } else {
        let mut c = tokio::process::Command::new("bash");
        let _ = c.args(["-c", WITHOUT_INHERITED_FDS, program]);
        c
    };
    let out = command
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {program}"))?;
    if !sudo && out.status.code() == Some(127) {
        bail!(
            "running {program}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}
