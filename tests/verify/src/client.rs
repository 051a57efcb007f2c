//! HTTP calls of the driver and what counts as acknowledged.
//!
//! A change is acknowledged when the order service answered 2xx, or, after an ambiguous failure
//! (5xx, 429, timeout, lost connection) or a 409 on a retry, when reading the order back shows
//! the status the change leads to: the earlier attempt was committed and only its answer was
//! lost. Creating is retried with the same `Idempotency-Key`, so a retry never places a second
//! order. A step still ambiguous at its deadline is left unresolved: its event may or may not be
//! committed, and the checks find out from the outbox.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use super::orders::Step;

/// How long one step keeps retrying (a PostgreSQL restart takes a few seconds).
const STEP_DEADLINE: Duration = Duration::from_secs(120);
const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution<T> {
    Acknowledged(T),
    /// Refused for good (a 4xx other than a 409 explained by an earlier attempt).
    Refused(String),
    /// Still ambiguous at the deadline.
    Unresolved(String),
}

/// What the attempts of one order cost.
#[derive(Debug, Default, Clone)]
pub struct AttemptStats {
    pub retries: u64,
    /// Failed attempts by cause: `timeout`, `connect`, `transport`, or the status code.
    pub failures: BTreeMap<String, u64>,
}

impl AttemptStats {
    fn failed(&mut self, cause: String) {
        *self.failures.entry(cause).or_default() += 1;
    }
}

#[derive(Deserialize)]
struct OrderView {
    order_id: Uuid,
    status: String,
}

/// What one attempt got back.
enum Answer {
    Ok(OrderView),
    Conflict,
    /// The change may or may not have happened.
    Ambiguous(String),
    Refused(String),
}

/// A client of the order service.
#[derive(Clone)]
pub struct OrderClient {
    http: reqwest::Client,
    base: String,
}

impl OrderClient {
    pub fn new(base: String) -> anyhow::Result<OrderClient> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .connect_timeout(Duration::from_secs(2))
            .build()?;
        Ok(OrderClient { http, base })
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => return Answer::Ambiguous(transport_cause(&e)),
        };
        let status = response.status();
        if status.is_success() {
            return match response.json::<OrderView>().await {
                Ok(order) => Answer::Ok(order),
                Err(e) => Answer::Ambiguous(transport_cause(&e)),
            };
        }
        if status == StatusCode::CONFLICT {
            return Answer::Conflict;
        }
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            return Answer::Ambiguous(status.as_u16().to_string());
        }
        let body = response.text().await.unwrap_or_default();
        Answer::Refused(format!("HTTP {status}: {body}"))
    }

    /// Places an order under `key`; acknowledged with its id.
    pub async fn place(
        &self,
        body: &Value,
        key: &str,
        stats: &mut AttemptStats,
    ) -> Resolution<Uuid> {
        let deadline = Instant::now() + STEP_DEADLINE;
        let mut attempt = 0;
        loop {
            let request = self
                .http
                .post(format!("{}/orders", self.base))
                .header("Idempotency-Key", key)
                .json(body);
            match self.send(request).await {
                Answer::Ok(order) => return Resolution::Acknowledged(order.order_id),
                Answer::Conflict => return Resolution::Refused("HTTP 409 placing".into()),
                Answer::Refused(why) => return Resolution::Refused(why),
                Answer::Ambiguous(cause) => {
                    stats.failed(cause.clone());
                    if Instant::now() >= deadline {
                        return Resolution::Unresolved(cause);
                    }
                }
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
            stats.retries += 1;
        }
    }

    /// Applies `step` to an order whose status is `from`.
    pub async fn act(
        &self,
        order_id: Uuid,
        step: Step,
        from: &str,
        stats: &mut AttemptStats,
    ) -> Resolution<()> {
        let deadline = Instant::now() + STEP_DEADLINE;
        let url = format!("{}/orders/{order_id}/{}", self.base, step.verb());
        let mut attempt = 0;
        loop {
            match self.send(self.http.post(&url)).await {
                Answer::Ok(_) => return Resolution::Acknowledged(()),
                Answer::Refused(why) => return Resolution::Refused(why),
                Answer::Conflict if attempt == 0 => {
                    return Resolution::Refused(format!("HTTP 409 on the first {}", step.verb()))
                }
                answer => {
                    if let Answer::Ambiguous(cause) = answer {
                        stats.failed(cause);
                    }
                    // Did an earlier attempt (or this one) go through?
                    match self.status(order_id, deadline, stats).await {
                        Some(status) if status == step.target_status() => {
                            return Resolution::Acknowledged(())
                        }
                        Some(status) if status == from => {}
                        Some(status) => {
                            return Resolution::Refused(format!(
                                "order is {status}, neither {from} nor {}",
                                step.target_status()
                            ))
                        }
                        None => return Resolution::Unresolved("order unreadable".into()),
                    }
                    if Instant::now() >= deadline {
                        return Resolution::Unresolved(format!("{} not done", step.verb()));
                    }
                }
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
            stats.retries += 1;
        }
    }

    /// The order's status, retried until `deadline`.
    async fn status(
        &self,
        order_id: Uuid,
        deadline: Instant,
        stats: &mut AttemptStats,
    ) -> Option<String> {
        let url = format!("{}/orders/{order_id}", self.base);
        let mut attempt = 0;
        loop {
            match self.send(self.http.get(&url)).await {
                Answer::Ok(order) => return Some(order.status),
                Answer::Ambiguous(cause) => stats.failed(cause),
                Answer::Conflict | Answer::Refused(_) => stats.failed("read refused".into()),
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
        }
    }
}

fn transport_cause(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else if e.is_decode() {
        "decode".into()
    } else {
        "transport".into()
    }
}

/// Delay before retry `attempt + 1`: exponential, capped, half of it random.
fn backoff(attempt: u32) -> Duration {
    let nominal = BACKOFF_BASE
        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
        .min(BACKOFF_MAX);
    let half = nominal / 2;
    half + half.mul_f64(rand::random::<f64>())
}
