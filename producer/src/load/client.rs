//! An HTTP client of the order API that retries what is safe to retry.
//!
//! Placing carries an idempotency key, so a retry can never place a second order. An action
//! (pay, cancel, ship) is retried after a 5xx or a lost connection; when the retry is refused
//! with 409, the first attempt may have been applied after all, so the order is read back and
//! the action counts as done if the order has the status the action leads to.

use std::time::{Duration, Instant};

use rand::Rng;
use reqwest::{StatusCode, Url};
use uuid::Uuid;

use crate::orders::{Action, Order};
use crate::validation::ValidOrder;

/// First retry delay; doubled per attempt, with jitter.
const BACKOFF_BASE: Duration = Duration::from_millis(50);
/// Longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Why a request failed for good.
#[derive(Debug, thiserror::Error)]
pub enum RequestFailure {
    #[error("HTTP {status}: {body}")]
    Status { status: StatusCode, body: String },
    #[error("request failed: {0}")]
    Transport(#[from] reqwest::Error),
}

impl RequestFailure {
    /// A bounded label for the error tally: the status code, `timeout`, `connect` or `transport`.
    pub fn label(&self) -> String {
        match self {
            RequestFailure::Status { status, .. } => status.as_u16().to_string(),
            RequestFailure::Transport(e) if e.is_timeout() => "timeout".to_owned(),
            RequestFailure::Transport(e) if e.is_connect() => "connect".to_owned(),
            RequestFailure::Transport(e) if e.is_decode() => "decode".to_owned(),
            RequestFailure::Transport(_) => "transport".to_owned(),
        }
    }

    fn retryable(&self) -> bool {
        match self {
            RequestFailure::Status { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
            // A body that did not decode came from a server that answered: retrying will not help.
            RequestFailure::Transport(e) => !e.is_decode(),
        }
    }
}

/// What a request cost: attempts beyond the first, and the latency of each attempt.
#[derive(Debug, Default, Clone)]
pub struct RequestStats {
    pub retries: u64,
    pub latencies_us: Vec<u64>,
}

/// A client of one order service.
#[derive(Debug, Clone)]
pub struct OrderClient {
    http: reqwest::Client,
    base: Url,
    max_retries: u32,
}

impl OrderClient {
    /// A client of the service at `base`, giving each attempt `timeout` and retrying up to
    /// `max_retries` times.
    pub fn new(base: Url, timeout: Duration, max_retries: u32) -> reqwest::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .build()?;
        Ok(Self {
            http,
            base,
            max_retries,
        })
    }

    fn url(&self, path: &str) -> Url {
        let mut url = self.base.clone();
        let base_path = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base_path}{path}"));
        url
    }

    /// Places an order under `idempotency_key`.
    pub async fn place(
        &self,
        order: &ValidOrder,
        idempotency_key: &str,
        stats: &mut RequestStats,
    ) -> Result<Order, RequestFailure> {
        let url = &self.url("/orders");
        self.with_retries(stats, move |_| async move {
            let response = self
                .http
                .post(url.clone())
                .header("Idempotency-Key", idempotency_key)
                .json(order)
                .send()
                .await?;
            read_order(response).await
        })
        .await
    }

    /// Applies `action` to the order.
    pub async fn act(
        &self,
        order_id: Uuid,
        action: Action,
        stats: &mut RequestStats,
    ) -> Result<Order, RequestFailure> {
        let url = &self.url(&format!("/orders/{order_id}/{}", action.verb()));
        self.with_retries(stats, move |attempt| async move {
            let response = self.http.post(url.clone()).send().await?;
            match read_order(response).await {
                Err(RequestFailure::Status { status, body })
                    if status == StatusCode::CONFLICT && attempt > 0 =>
                {
                    // An earlier attempt may have been applied before its answer was lost.
                    let order = self.get(order_id, &mut RequestStats::default()).await?;
                    if order.status == action.target() {
                        Ok(order)
                    } else {
                        Err(RequestFailure::Status { status, body })
                    }
                }
                other => other,
            }
        })
        .await
    }

    /// Reads the order back.
    pub async fn get(
        &self,
        order_id: Uuid,
        stats: &mut RequestStats,
    ) -> Result<Order, RequestFailure> {
        let url = &self.url(&format!("/orders/{order_id}"));
        self.with_retries(stats, move |_| async move {
            read_order(self.http.get(url.clone()).send().await?).await
        })
        .await
    }

    async fn with_retries<T, F, Fut>(
        &self,
        stats: &mut RequestStats,
        mut attempt_fn: F,
    ) -> Result<T, RequestFailure>
    where
        F: FnMut(u32) -> Fut,
        Fut: std::future::Future<Output = Result<T, RequestFailure>>,
    {
        let mut attempt = 0;
        loop {
            let started = Instant::now();
            let result = attempt_fn(attempt).await;
            stats
                .latencies_us
                .push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
            match result {
                Err(e) if e.retryable() && attempt < self.max_retries => {
                    tracing::debug!(error = %e, attempt, "retrying request");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                    stats.retries += 1;
                }
                other => return other,
            }
        }
    }
}

/// Delay before retry number `attempt + 1`: exponential, capped, half of it random.
fn backoff(attempt: u32) -> Duration {
    let nominal = BACKOFF_BASE
        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
        .min(BACKOFF_MAX);
    let half = nominal / 2;
    half + half.mul_f64(rand::rng().random::<f64>())
}

async fn read_order(response: reqwest::Response) -> Result<Order, RequestFailure> {
    let status = response.status();
    if status.is_success() {
        return Ok(response.json().await?);
    }
    let body = response.text().await.unwrap_or_default();
    Err(RequestFailure::Status { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        assert!(backoff(0) <= BACKOFF_BASE);
        assert!(backoff(3) >= BACKOFF_BASE * 4);
        assert!(backoff(30) <= BACKOFF_MAX);
    }

    #[test]
    fn urls_keep_a_base_path() {
        let client = OrderClient::new(
            "http://h:1/api/".parse().expect("url"),
            Duration::from_secs(1),
            0,
        )
        .expect("client");
        assert_eq!(client.url("/orders").as_str(), "http://h:1/api/orders");
    }
}
