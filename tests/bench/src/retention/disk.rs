//! Room on the database server's disk. The retention phase writes tens of gigabytes, and a
//! server that runs out of room stops every database on it, so the phase stops first: before
//! the load when the room cannot hold it, and before each chunk and each part when less than
//! [`MARGIN`] is left.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;
use sqlx::PgPool;

/// Room always left free.
pub const MARGIN: u64 = 4 << 30;
/// Bytes one history event takes with its rows in every table, their indexes and the WAL
/// written meanwhile (about 1.7 KB measured), rounded up.
pub const BYTES_PER_EVENT: u64 = 2048;

/// The server's data directory, when it is on this machine.
pub struct Room {
    dir: Option<PathBuf>,
}

impl Room {
    /// Finds the data directory of `pool`'s server; a server elsewhere (its directory not here)
    /// is not checked.
    pub async fn of(pool: &PgPool) -> Room {
        let dir: Option<String> = sqlx::query_scalar("SELECT current_setting('data_directory')")
            .fetch_one(pool)
            .await
            .ok();
        Room {
            dir: dir.map(PathBuf::from).filter(|d| d.is_dir()),
        }
    }

    /// Fails unless `needed` bytes and the margin are free (when that can be told).
    pub fn ensure(&self, needed: u64, what: &str) -> anyhow::Result<()> {
        let Some(free) = self.dir.as_deref().and_then(free_bytes) else {
            return Ok(());
        };
        if free < needed + MARGIN {
            bail!(
                "{:.1} GiB free on the database server's disk; {what} needs {:.1} GiB and \
                 {:.0} GiB are kept free",
                gib(free),
                gib(needed),
                gib(MARGIN)
            );
        }
        Ok(())
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// Bytes free for unprivileged use on the file system holding `dir` (`df -Pk`).
fn free_bytes(dir: &Path) -> Option<u64> {
    let out = Command::new("df").arg("-Pk").arg(dir).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kib: u64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}
