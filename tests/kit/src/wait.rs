//! Waiting for a condition with a deadline, rather than for a fixed time.

use std::time::{Duration, Instant};

use anyhow::bail;

/// How often a condition is checked again.
const POLL_EVERY: Duration = Duration::from_millis(200);

/// Polls `check` until it returns `Some`, or fails after `timeout` with `what` (and the last
/// error `check` returned, if any).
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} (last error: {last_err:?})");
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}
