//! One active relay at a time: a PostgreSQL advisory lock held on a dedicated connection.
//!
//! The lock lives as long as the session: when the active relay dies its connection closes, the
//! server releases the lock and a standby takes over on its next try.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

/// The held lock. Dropping it closes the connection, which releases the lock.
pub struct Leadership {
    conn: PgConnection,
}

impl Leadership {
    /// Waits until this process holds the lock, retrying every `retry_every`; `None` on shutdown.
    pub async fn acquire(
        database_url: &str,
        key: i64,
        retry_every: Duration,
        shutdown: &CancellationToken,
    ) -> Option<Leadership> {
        let mut logged_standby = false;
        loop {
            match try_acquire(database_url, key).await {
                Ok(Some(conn)) => return Some(Leadership { conn }),
                Ok(None) if !logged_standby => {
                    tracing::info!(key, "another relay is active; standing by");
                    logged_standby = true;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot reach PostgreSQL for the relay lock"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(retry_every) => {}
            }
        }
    }

    /// Whether the lock is still ours: the session that holds it must still be alive.
    pub async fn still_held(&mut self) -> bool {
        sqlx::query("SELECT 1")
            .execute(&mut self.conn)
            .await
            .is_ok()
    }
}

async fn try_acquire(database_url: &str, key: i64) -> Result<Option<PgConnection>, sqlx::Error> {
    let mut conn = PgConnection::connect(database_url).await?;
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(&mut conn)
        .await?;
    if got {
        Ok(Some(conn))
    } else {
        let _ = conn.close().await;
        Ok(None)
    }
}
