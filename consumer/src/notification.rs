//! The notification group: records the notification each order event calls for, then a
//! dispatcher hands recorded notifications to a pluggable sender.
//!
//! Recording happens in the event's transaction (exactly once); sending happens after commit, at
//! least once, from the table, so a crash between the two delays a notification but never loses
//! it.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use pipeline_core::order_events::{ORDER_CANCELLED, ORDER_PAID, ORDER_PLACED, ORDER_SHIPPED};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::handler::{order_snapshot, Event, Handler, HandlerBatch, HandlerError};

/// A notification to deliver.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Notification {
    pub id: i64,
    pub event_id: Uuid,
    pub order_id: String,
    pub recipient: String,
    pub channel: String,
    pub template: String,
}

/// Delivers notifications (e-mail, SMS, push…). Errors are retried by the dispatcher.
pub trait NotificationSender: Send + Sync + 'static {
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
    pub fn new(group: impl Into<String>) -> Self {
        Notifications {
            group: group.into(),
        }
    }
}

/// The template for an event type; `None` for types this group does not know.
pub fn template_for(event_type: &str) -> Option<&'static str> {
    match event_type {
        ORDER_PLACED => Some("order-confirmation"),
        ORDER_PAID => Some("payment-received"),
        ORDER_CANCELLED => Some("order-cancelled"),
        ORDER_SHIPPED => Some("order-shipped"),
        _ => None,
    }
}

impl Handler for Notifications {
    fn group(&self) -> &str {
        &self.group
    }

    fn batch(&self) -> Box<dyn HandlerBatch + '_> {
        Box::<NotificationBatch>::default()
    }
}

/// Notifications decided by one batch, inserted together.
#[derive(Default)]
struct NotificationBatch {
    rows: Vec<(Uuid, String, String, &'static str, &'static str)>,
}

impl HandlerBatch for NotificationBatch {
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
        _conn: &'a mut PgConnection,
        event: &'a Event,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        let decided = (|| {
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
        })();
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

/// Sends pending notifications until `shutdown`, a batch at a time, oldest first.
pub async fn dispatch(
    pool: PgPool,
    sender: Arc<dyn NotificationSender>,
    idle_wait: Duration,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let wait = match dispatch_batch(&pool, sender.as_ref(), 200).await {
            Ok(0) => idle_wait,
            Ok(_) => Duration::ZERO,
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

/// Sends up to `limit` pending notifications; returns how many were handled.
pub async fn dispatch_batch(
    pool: &PgPool,
    sender: &dyn NotificationSender,
    limit: i64,
) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let pending: Vec<Notification> = sqlx::query_as(
        "SELECT id, event_id, order_id, recipient, channel, template FROM notification
         WHERE status = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    if pending.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(pending.len());
    let mut statuses = Vec::with_capacity(pending.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(pending.len());
    let mut sent_at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(pending.len());
    for n in &pending {
        let outcome = sender.send(n).await;
        ids.push(n.id);
        match outcome {
            Ok(()) => {
                statuses.push("sent");
                errors.push(None);
                sent_at.push(Some(Utc::now()));
            }
            Err(e) => {
                statuses.push("pending");
                errors.push(Some(e));
                sent_at.push(None);
            }
        }
    }
    // Every outcome of the batch in one statement.
    sqlx::query(
        "UPDATE notification n
         SET status = CASE WHEN n.attempts + 1 >= 10 AND r.status = 'pending' THEN 'failed'
                           ELSE r.status END,
             attempts = n.attempts + 1, last_error = r.error, sent_at = r.sent_at
         FROM unnest($1::bigint[], $2::text[], $3::text[], $4::timestamptz[])
              AS r(id, status, error, sent_at)
         WHERE n.id = r.id",
    )
    .bind(&ids)
    .bind(&statuses)
    .bind(&errors)
    .bind(&sent_at)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(pending.len())
}
