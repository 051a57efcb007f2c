//! The notification group: records the notification each order event calls for, then a
//! dispatcher hands recorded notifications to a pluggable sender.
//!
//! Recording happens in the event's transaction (exactly once); sending happens after commit, at
//! least once, from the table, so a crash between the two delays a notification but never loses
//! it. The dispatcher may be held to a number of calls per second to its sender (a provider's
//! quota, [`DispatchSettings::sends_per_second`]); notifications then wait in the table.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use consumer::backoff;
use consumer::{Event, Handler, HandlerError, HandlerTransaction};
use demo_events::order_events::{
    DAILY_DIGEST, ORDER_CANCELLED, ORDER_PAID, ORDER_PAYMENT_REMINDER, ORDER_PLACED, ORDER_SHIPPED,
};
use futures::future::BoxFuture;
use governor::{DefaultDirectRateLimiter, Quota};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::order::order_snapshot;

/// A notification to deliver.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Notification {
    /// The `notification` row's id.
    pub id: i64,
    /// The event that called for it.
    pub event_id: Uuid,
    /// The order it is about.
    pub order_id: String,
    /// The order's e-mail address or, without one, its customer id.
    pub recipient: String,
    /// `email`, or `customer-inbox` when the order has no e-mail address.
    pub channel: String,
    /// The template for the event type (see [`template_for`]).
    pub template: String,
}

/// Delivers notifications (e-mail, SMS, push…). Errors are retried by the dispatcher.
pub trait NotificationSender: Send + Sync + 'static {
    /// Delivers one notification; an `Err` carries the reason, recorded as its last error.
    /// Delivery is at least once: a notification may be sent again if the process stops before
    /// the outcome is recorded.
    fn send<'a>(&'a self, notification: &'a Notification) -> BoxFuture<'a, Result<(), String>>;
}

/// The default sender: writes each notification to the log.
pub struct LoggingSender;

impl NotificationSender for LoggingSender {
    fn send<'a>(&'a self, n: &'a Notification) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            tracing::info!(
                notification_id = n.id,
                event_id = %n.event_id,
                order_id = %n.order_id,
                recipient = %n.recipient,
                channel = %n.channel,
                template = %n.template,
                "notification sent"
            );
            Ok(())
        })
    }
}

/// The notification handler.
pub struct Notifications {
    group: String,
}

impl Notifications {
    /// The handler of the notification group with id `group` (its dedupe scope).
    pub fn new(group: impl Into<String>) -> Self {
        Notifications {
            group: group.into(),
        }
    }
}

const PAYMENT_REMINDER: &str = "payment-reminder";
/// The template of the digest an occurrence of the digest schedule becomes.
const DIGEST: &str = "daily-digest";
/// Who receives the digests.
const DIGEST_RECIPIENT: &str = "operations@example.com";
/// Templates of the events after which an order needs no payment reminder.
const SETTLED: [&str; 2] = ["payment-received", "order-cancelled"];

/// The template for an event type; `None` for types this group does not know.
pub fn template_for(event_type: &str) -> Option<&'static str> {
    match event_type {
        ORDER_PLACED => Some("order-confirmation"),
        ORDER_PAID => Some("payment-received"),
        ORDER_CANCELLED => Some("order-cancelled"),
        ORDER_SHIPPED => Some("order-shipped"),
        ORDER_PAYMENT_REMINDER => Some(PAYMENT_REMINDER),
        _ => None,
    }
}

impl Handler for Notifications {
    fn group(&self) -> &str {
        &self.group
    }

    fn transaction(&self) -> Box<dyn HandlerTransaction + '_> {
        Box::<NotificationTransaction>::default()
    }
}

/// Notifications decided in one transaction, inserted together.
#[derive(Default)]
struct NotificationTransaction {
    rows: Vec<(Uuid, String, String, &'static str, &'static str)>,
}

impl NotificationTransaction {
    /// Records the notification `event` calls for.
    fn decide(&mut self, event: &Event) -> Result<(), HandlerError> {
        let template = template_for(&event.envelope.event_type).ok_or_else(|| {
            HandlerError::Rejected(format!(
                "unknown event type `{}`",
                event.envelope.event_type
            ))
        })?;
        let order = order_snapshot(event)?;
        let (recipient, channel) = match &order.email {
            Some(email) if !email.is_empty() => (email.clone(), "email"),
            _ => (order.customer_id.clone(), "customer-inbox"),
        };
        self.rows.push((
            event.envelope.event_id,
            order.order_id.to_string(),
            recipient,
            channel,
            template,
        ));
        Ok(())
    }

    /// A payment reminder becomes a notification only for an order this group has not seen
    /// paid or cancelled (in this transaction or an earlier one). The order service withdraws
    /// the reminder of an order paid or cancelled before it is due, so this is the second line:
    /// for a reminder that reached the topic anyway.
    async fn remind(&mut self, conn: &mut PgConnection, event: &Event) -> Result<(), HandlerError> {
        let order_id = &event.envelope.aggregate_id;
        let settled_here = self
            .rows
            .iter()
            .any(|r| &r.1 == order_id && SETTLED.contains(&r.4));
        let settled = settled_here
            || sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM notification
                                WHERE order_id = $1
                                  AND template IN ('payment-received', 'order-cancelled'))",
            )
            .bind(order_id)
            .fetch_one(conn)
            .await?;
        if settled {
            tracing::debug!(%order_id, "order already paid or cancelled: no payment reminder");
            return Ok(());
        }
        self.decide(event)
    }
}

impl HandlerTransaction for NotificationTransaction {
    fn prepare<'a>(
        &'a mut self,
        _conn: &'a mut PgConnection,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        self.rows.reserve(events.len());
        Box::pin(async { Ok(()) })
    }

    fn apply<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        if event.envelope.event_type == ORDER_PAYMENT_REMINDER {
            return Box::pin(self.remind(conn, event));
        }
        if event.envelope.event_type == DAILY_DIGEST {
            // One digest per occurrence, to the operations team.
            self.rows.push((
                event.envelope.event_id,
                event.envelope.aggregate_id.clone(),
                DIGEST_RECIPIENT.to_owned(),
                "email",
                DIGEST,
            ));
            return Box::pin(async { Ok(()) });
        }
        let decided = self.decide(event);
        Box::pin(async move { decided })
    }

    fn flush<'a>(
        &'a mut self,
        conn: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            if self.rows.is_empty() {
                return Ok(());
            }
            let ids: Vec<Uuid> = self.rows.iter().map(|r| r.0).collect();
            let orders: Vec<&str> = self.rows.iter().map(|r| r.1.as_str()).collect();
            let recipients: Vec<&str> = self.rows.iter().map(|r| r.2.as_str()).collect();
            let channels: Vec<&str> = self.rows.iter().map(|r| r.3).collect();
            let templates: Vec<&str> = self.rows.iter().map(|r| r.4).collect();
            sqlx::query(
                "INSERT INTO notification (event_id, order_id, recipient, channel, template)
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[])",
            )
            .bind(&ids)
            .bind(&orders)
            .bind(&recipients)
            .bind(&channels)
            .bind(&templates)
            .execute(conn)
            .await?;
            Ok(())
        })
    }
}

/// How the dispatcher sends and retries.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Pause after the first look that found nothing due; doubled after each further one, up
    /// to `idle_wait_max`, and back to none once one finds work: a quiet group looks a few times
    /// a second at first, then once every `idle_wait_max`. A look that found less than a full
    /// claim is followed by this pause too: under a trickle, one look a notification.
    pub idle_wait: Duration,
    /// Longest pause while nothing is due: how late a notification written after a quiet
    /// spell may be sent.
    pub idle_wait_max: Duration,
    /// Most notifications claimed at once.
    pub max_claimed: i64,
    /// How long a claim keeps a notification from other dispatchers while it is being sent: a
    /// dispatcher that dies mid-send leaves it due again after this.
    pub claim_for: Duration,
    /// Wait after the first failed attempt; doubles with each further one, up to `retry_max`.
    pub retry_base: Duration,
    /// Longest wait between two attempts.
    pub retry_max: Duration,
    /// Attempts after which a notification is marked `failed`.
    pub max_attempts: i32,
    /// Most calls per second to the sender, in each dispatcher (one per process running the
    /// group); `None`: as fast as it answers.
    pub sends_per_second: Option<NonZeroU32>,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        DispatchSettings {
            idle_wait: Duration::from_millis(50),
            idle_wait_max: Duration::from_secs(1),
            max_claimed: 200,
            claim_for: Duration::from_secs(60),
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
            max_attempts: 10,
            sends_per_second: None,
        }
    }
}

impl DispatchSettings {
    /// Wait before the next attempt after `attempts` failed ones: exponential, capped, with
    /// equal jitter so notifications that failed together do not retry together.
    pub fn retry_delay(&self, attempts: i32) -> Duration {
        let attempt = u32::try_from(attempts.max(1)).unwrap_or(u32::MAX);
        backoff(self.retry_base, self.retry_max, attempt)
    }
}

/// A dispatcher's limit on its calls to the sender: a token bucket (GCRA) refilled at the rate
/// and holding a tenth of a second's calls, at least one.
pub struct SendLimit {
    bucket: DefaultDirectRateLimiter,
    burst: NonZeroU32,
}

impl SendLimit {
    /// At most `sends_per_second` calls a second.
    pub fn per_second(sends_per_second: NonZeroU32) -> Self {
        let burst = NonZeroU32::new(sends_per_second.get() / 10).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::per_second(sends_per_second).allow_burst(burst);
        SendLimit {
            bucket: DefaultDirectRateLimiter::direct(quota),
            burst,
        }
    }

    /// Most notifications worth claiming at once: what the bucket holds, so that claimed
    /// notifications wait for their turn about a tenth of a second, far less than their claim.
    fn claim_at_most(&self) -> i64 {
        i64::from(self.burst.get())
    }

    async fn until_ready(&self) {
        self.bucket.until_ready().await;
    }
}

/// Sends due notifications until `shutdown`, up to `settings.max_claimed` at a time, oldest
/// first, no faster than `settings.sends_per_second`.
pub async fn dispatch(
    pool: PgPool,
    sender: Arc<dyn NotificationSender>,
    settings: DispatchSettings,
    shutdown: CancellationToken,
) {
    let limit = settings.sends_per_second.map(SendLimit::per_second);
    let mut idle = Duration::ZERO;
    while !shutdown.is_cancelled() {
        let due = dispatch_due_limited(&pool, sender.as_ref(), &settings, limit.as_ref());
        let wait = match due.await {
            Ok(0) => {
                idle = (idle * 2)
                    .max(settings.idle_wait)
                    .min(settings.idle_wait_max.max(settings.idle_wait));
                idle
            }
            // A claim that was not full left nothing due: the next look waits the first pause,
            // so that notifications trickling in cost one claim each, not two.
            Ok(handled) if (handled as i64) < claim_size(&settings, limit.as_ref()) => {
                idle = Duration::ZERO;
                settings.idle_wait
            }
            Ok(_) => {
                idle = Duration::ZERO;
                Duration::ZERO
            }
            Err(e) => {
                tracing::warn!(error = %e, "notification dispatch failed; retrying");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Claims up to `settings.max_claimed` due notifications, sends them with no transaction open and
/// no row locked, and records each outcome: sent, or the next attempt after a backoff, or
/// `failed` after `settings.max_attempts`. Returns how many were handled. Ignores
/// `settings.sends_per_second`, whose bucket lasts from one call to the next: see
/// [`dispatch_due_limited`].
pub async fn dispatch_due(
    pool: &PgPool,
    sender: &dyn NotificationSender,
    settings: &DispatchSettings,
) -> Result<usize, sqlx::Error> {
    dispatch_due_limited(pool, sender, settings, None).await
}

/// [`dispatch_due`], each call to the sender first taking a token from `limit` (when given);
/// it then claims no more than the bucket holds.
pub async fn dispatch_due_limited(
    pool: &PgPool,
    sender: &dyn NotificationSender,
    settings: &DispatchSettings,
    limit: Option<&SendLimit>,
) -> Result<usize, sqlx::Error> {
    let max_claimed = claim_size(settings, limit);
    // `now()` (this statement's start) bounds the scan of the due index: the volatile
    // `clock_timestamp()` could only filter it, and every claim would read the whole index,
    // rows claimed and waiting for their next attempt and the dead entries of earlier claims.
    let claimed: Vec<(i64, Uuid, String, String, String, String, i32)> = sqlx::query_as(
        "UPDATE notification n
         SET next_attempt_at = clock_timestamp() + $2 * interval '1 millisecond'
         FROM (SELECT id FROM notification
               WHERE status = 'pending' AND next_attempt_at <= now()
               ORDER BY next_attempt_at, id LIMIT $1 FOR UPDATE SKIP LOCKED) due
         WHERE n.id = due.id
         RETURNING n.id, n.event_id, n.order_id, n.recipient, n.channel, n.template, n.attempts",
    )
    .bind(max_claimed)
    .bind(millis(settings.claim_for))
    .fetch_all(pool)
    .await?;
    if claimed.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(claimed.len());
    let mut statuses = Vec::with_capacity(claimed.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(claimed.len());
    let mut sent_at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(claimed.len());
    let mut retry_in_ms: Vec<i64> = Vec::with_capacity(claimed.len());
    for (id, event_id, order_id, recipient, channel, template, attempts) in claimed {
        let n = Notification {
            id,
            event_id,
            order_id,
            recipient,
            channel,
            template,
        };
        if let Some(limit) = limit {
            limit.until_ready().await;
        }
        let outcome = sender.send(&n).await;
        ids.push(n.id);
        match outcome {
            Ok(()) => {
                statuses.push("sent");
                errors.push(None);
                sent_at.push(Some(Utc::now()));
                retry_in_ms.push(0);
            }
            Err(e) => {
                let failed = attempts + 1;
                statuses.push(if failed >= settings.max_attempts {
                    "failed"
                } else {
                    "pending"
                });
                errors.push(Some(e));
                sent_at.push(None);
                retry_in_ms.push(millis(settings.retry_delay(failed)));
            }
        }
    }
    // Every outcome in one statement.
    sqlx::query(
        "UPDATE notification n
         SET status = r.status, attempts = n.attempts + 1, last_error = r.error,
             sent_at = r.sent_at,
             next_attempt_at = clock_timestamp() + r.retry_in_ms * interval '1 millisecond'
         FROM unnest($1::bigint[], $2::text[], $3::text[], $4::timestamptz[], $5::bigint[])
              AS r(id, status, error, sent_at, retry_in_ms)
         WHERE n.id = r.id",
    )
    .bind(&ids)
    .bind(&statuses)
    .bind(&errors)
    .bind(&sent_at)
    .bind(&retry_in_ms)
    .execute(pool)
    .await?;
    Ok(ids.len())
}

/// Most notifications one claim takes: `settings.max_claimed`, and no more than `limit`'s bucket
/// holds.
fn claim_size(settings: &DispatchSettings, limit: Option<&SendLimit>) -> i64 {
    match limit {
        Some(limit) => settings.max_claimed.min(limit.claim_at_most()),
        None => settings.max_claimed,
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
