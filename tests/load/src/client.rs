//! An HTTP client of the order API that retries what is safe to retry.
//!
//! Placing carries an idempotency key, so a retry can never place a second order. An action
//! (pay, cancel, ship) is retried after an ambiguous failure (a 5xx, a 429, a lost connection or
//! an unreadable answer); when the retry is refused with 409, the first attempt may have been
//! applied after all, so the order is read back and the action counts as done if the order has
//! the status the action leads to.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::Rng;
use reqwest::{StatusCode, Url};
use tokio::time::Instant;
use uuid::Uuid;

use crate::api::OrderRequest;
use crate::api::{Action, OrderAnswer};

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
    /// A bounded label for the error tally: the status code, `timeout`, `connect`, `decode` or
    /// `transport`.
    pub fn label(&self) -> String {
        match self {
            RequestFailure::Status { status, .. } => status.as_u16().to_string(),
            RequestFailure::Transport(e) if e.is_timeout() => "timeout".to_owned(),
            RequestFailure::Transport(e) if e.is_connect() => "connect".to_owned(),
            RequestFailure::Transport(e) if e.is_decode() => "decode".to_owned(),
            RequestFailure::Transport(_) => "transport".to_owned(),
        }
    }

    /// Whether the change may have happened all the same: the service failed (5xx), shed the
    /// request (429), or its answer was lost or unreadable. A 4xx other than 429 is a refusal:
    /// nothing changed.
    pub fn is_ambiguous(&self) -> bool {
        match self {
            RequestFailure::Status { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
            RequestFailure::Transport(_) => true,
        }
    }
}

/// What a request cost: attempts beyond the first, the latency of each attempt and the failed
/// attempts by [`RequestFailure::label`].
#[derive(Debug, Default, Clone)]
pub struct RequestStats {
    pub retries: u64,
    pub latencies_us: Vec<u64>,
    pub failed_attempts: BTreeMap<String, u64>,
}

impl RequestStats {
    /// Adds `other`'s figures to these.
    pub fn merge(&mut self, other: RequestStats) {
        self.retries += other.retries;
        self.latencies_us.extend(other.latencies_us);
        for (label, n) in other.failed_attempts {
            *self.failed_attempts.entry(label).or_default() += n;
        }
    }
}

/// How long a request keeps trying after an ambiguous failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// No retry starts this long after the first attempt; `None`: no time limit.
    pub give_up_after: Option<Duration>,
}

impl RetryPolicy {
    /// Up to `max_retries` retries, however long they take.
    pub fn attempts(max_retries: u32) -> Self {
        Self {
            max_retries,
            give_up_after: None,
        }
    }

    /// Retries until `limit` after the first attempt, however many.
    pub fn for_at_most(limit: Duration) -> Self {
        Self {
            max_retries: u32::MAX,
            give_up_after: Some(limit),
        }
    }
}

/// Timeouts and retries of an [`OrderClient`].
#[derive(Debug, Clone, Copy)]
pub struct ClientSettings {
    /// Timeout of each attempt.
    pub request_timeout: Duration,
    /// Timeout of establishing a connection (within the attempt's).
    pub connect_timeout: Duration,
    pub retry: RetryPolicy,
}

/// A client of one order service.
#[derive(Debug, Clone)]
pub struct OrderClient {
    http: reqwest::Client,
    base: Url,
    retry: RetryPolicy,
}

/// When one request (its retries and read-backs included) stops retrying.
#[derive(Debug, Clone, Copy)]
struct Budget {
    max_retries: u32,
    give_up_at: Option<Instant>,
}

impl Budget {
    /// Whether retry number `retry` (1-based) may start now.
    fn allows(&self, retry: u32) -> bool {
        retry <= self.max_retries && self.give_up_at.is_none_or(|at| Instant::now() < at)
    }
}

impl OrderClient {
    /// A client of the service at `base`.
    pub fn new(base: Url, settings: ClientSettings) -> reqwest::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.connect_timeout.min(settings.request_timeout))
            .build()?;
        Ok(Self {
            http,
            base,
            retry: settings.retry,
        })
    }

    fn url(&self, path: &str) -> Url {
        let mut url = self.base.clone();
        let base_path = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base_path}{path}"));
        url
    }

    fn budget(&self) -> Budget {
        Budget {
            max_retries: self.retry.max_retries,
            give_up_at: self.retry.give_up_after.map(|d| Instant::now() + d),
        }
    }

    /// Places an order under `idempotency_key`.
    pub async fn place(
        &self,
        order: &OrderRequest,
        idempotency_key: &str,
        stats: &mut RequestStats,
    ) -> Result<OrderAnswer, RequestFailure> {
        let url = self.url("/orders");
        let budget = self.budget();
        let mut retry = 0;
        loop {
            let request = self
                .http
                .post(url.clone())
                .header("Idempotency-Key", idempotency_key)
                .json(order);
            match self.attempt(request, stats).await {
                Err(e) if e.is_ambiguous() && budget.allows(retry + 1) => {
                    retry = wait_to_retry(retry, &e, stats).await;
                }
                done => return done,
            }
        }
    }

    /// Applies `action` to the order.
    pub async fn act(
        &self,
        order_id: Uuid,
        action: Action,
        stats: &mut RequestStats,
    ) -> Result<OrderAnswer, RequestFailure> {
        let url = self.url(&format!("/orders/{order_id}/{}", action.verb()));
        let budget = self.budget();
        let mut retry = 0;
        loop {
            match self.attempt(self.http.post(url.clone()), stats).await {
                Err(RequestFailure::Status { status, body })
                    if status == StatusCode::CONFLICT && retry > 0 =>
                {
                    // An earlier attempt may have been applied before its answer was lost. The
                    // read's failures count; its latency and retries are not the action's.
                    let mut read = RequestStats::default();
                    let order = self.read(order_id, budget, &mut read).await;
                    stats.merge(RequestStats {
                        failed_attempts: read.failed_attempts,
                        ..RequestStats::default()
                    });
                    let order = order?;
                    return if order.status == action.target() {
                        Ok(order)
                    } else {
                        Err(RequestFailure::Status { status, body })
                    };
                }
                Err(e) if e.is_ambiguous() && budget.allows(retry + 1) => {
                    retry = wait_to_retry(retry, &e, stats).await;
                }
                done => return done,
            }
        }
    }

    /// Reads the order back.
    pub async fn get(
        &self,
        order_id: Uuid,
        stats: &mut RequestStats,
    ) -> Result<OrderAnswer, RequestFailure> {
        self.read(order_id, self.budget(), stats).await
    }

    async fn read(
        &self,
        order_id: Uuid,
        budget: Budget,
        stats: &mut RequestStats,
    ) -> Result<OrderAnswer, RequestFailure> {
        let url = self.url(&format!("/orders/{order_id}"));
        let mut retry = 0;
        loop {
            match self.attempt(self.http.get(url.clone()), stats).await {
                Err(e) if e.is_ambiguous() && budget.allows(retry + 1) => {
                    retry = wait_to_retry(retry, &e, stats).await;
                }
                done => return done,
            }
        }
    }

    /// Sends one attempt and reads the order from a 2xx answer; records its latency, and its
    /// failure if it failed.
    async fn attempt(
        &self,
        request: reqwest::RequestBuilder,
        stats: &mut RequestStats,
    ) -> Result<OrderAnswer, RequestFailure> {
        let started = Instant::now();
        let result = match request.send().await {
            Ok(response) => read_order(response).await,
            Err(e) => Err(e.into()),
        };
        stats
            .latencies_us
            .push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        if let Err(e) = &result {
            *stats.failed_attempts.entry(e.label()).or_default() += 1;
        }
        result
    }
}

/// Sleeps before retry number `retry + 1` after `failure` and counts it; returns its number.
async fn wait_to_retry(retry: u32, failure: &RequestFailure, stats: &mut RequestStats) -> u32 {
    tracing::debug!(error = %failure, attempt = retry, "retrying request");
    tokio::time::sleep(backoff(retry)).await;
    stats.retries += 1;
    retry + 1
}

/// Delay before retry number `attempt + 1`: exponential, capped, half of it random.
fn backoff(attempt: u32) -> Duration {
    let nominal = BACKOFF_BASE
        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
        .min(BACKOFF_MAX);
    let half = nominal / 2;
    half + half.mul_f64(rand::rng().random::<f64>())
}

async fn read_order(response: reqwest::Response) -> Result<OrderAnswer, RequestFailure> {
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
            ClientSettings {
                request_timeout: Duration::from_secs(1),
                connect_timeout: Duration::from_secs(1),
                retry: RetryPolicy::attempts(0),
            },
        )
        .expect("client");
        assert_eq!(client.url("/orders").as_str(), "http://h:1/api/orders");
    }

    #[test]
    fn only_ambiguous_failures_are_retried() {
        let status = |code: u16| RequestFailure::Status {
            status: StatusCode::from_u16(code).expect("status"),
            body: String::new(),
        };
        assert!(status(503).is_ambiguous());
        assert!(status(429).is_ambiguous());
        assert!(!status(409).is_ambiguous());
        assert!(!status(422).is_ambiguous());
    }

    #[test]
    fn a_budget_ends_at_its_count_or_its_time() {
        let counted = Budget {
            max_retries: 2,
            give_up_at: None,
        };
        assert!(counted.allows(2) && !counted.allows(3));
        let later = Budget {
            max_retries: u32::MAX,
            give_up_at: Some(Instant::now() + Duration::from_secs(3_600)),
        };
        assert!(later.allows(1_000));
        let now = Budget {
            max_retries: u32::MAX,
            give_up_at: Some(Instant::now()),
        };
        assert!(!now.allows(1));
    }
}
