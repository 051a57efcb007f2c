//! Applying a batch of one partition's messages (or the batches of several partitions of one
//! group) in one database transaction.
//!
//! For every message the transaction inserts the group's `processed_message` row (the dedupe
//! constraint) and, only when that row is new, applies the handler's effects, in the order of
//! its aggregate's sequence (see `sequence`). The caller commits the Kafka offset only after this
//! transaction has committed.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use tracing::Instrument;
use uuid::Uuid;

use super::dead_letter::{self, DeadLetter, DeadLetterSink};
use super::effects::TransactionState;
use super::error::ProcessError;
use super::message::{read_event, BatchReport, Fence, InboundMessage, Outcome, Pending};
use super::sequence::handle_event;
use super::store::{
    check_owner, plan_with_values, record_duplicates, record_groups_applied, start_transaction,
    AppliedEffect, GroupApplied, GroupOpening, TransactionStart, CUSTOM_PLANS_UP_TO,
};
use crate::handlers::{Event, Handler, HandlerTransaction};

/// What a transaction runs with.
pub struct TransactionContext<'a> {
    /// The group's database, where the transaction runs.
    pub pool: &'a PgPool,
    /// The group's handler, whose effects commit in the transaction.
    pub handler: &'a dyn Handler,
    /// When set, the batch applies nothing unless this consumer still owns the partition.
    pub fence: Option<&'a Fence>,
    /// When set, dead letters are also published to the dead-letter topic before commit.
    pub dead_letters: Option<&'a DeadLetterSink>,
    /// Transactions of at most this many messages plan with their values (see
    /// [`CUSTOM_PLANS_UP_TO`]).
    pub custom_plans_up_to: usize,
}

/// Processes `messages` (one partition, in offset order) in one transaction and commits it,
/// without fencing or a dead-letter topic.
pub async fn process_batch(
    pool: &PgPool,
    handler: &dyn Handler,
    messages: &[InboundMessage],
) -> Result<BatchReport, ProcessError> {
    let ctx = TransactionContext {
        pool,
        handler,
        fence: None,
        dead_letters: None,
        custom_plans_up_to: CUSTOM_PLANS_UP_TO,
    };
    process_batch_with(&ctx, messages).await
}

/// Processes `messages` (one partition, in offset order) in one transaction and commits it.
pub async fn process_batch_with(
    ctx: &TransactionContext<'_>,
    messages: &[InboundMessage],
) -> Result<BatchReport, ProcessError> {
    let batch = PartitionBatch {
        fence: ctx.fence,
        messages,
    };
    let mut reports = process_batches(ctx, std::slice::from_ref(&batch)).await?;
    Ok(reports.pop().unwrap_or_default())
}

/// One partition's messages (in offset order) within a shared transaction, and the token this
/// consumer owns the partition with (none: not fenced).
pub struct PartitionBatch<'a> {
    /// When set, the shared transaction applies nothing unless this consumer still owns the
    /// partition.
    pub fence: Option<&'a Fence>,
    /// The partition's messages, in offset order.
    pub messages: &'a [InboundMessage],
}

/// One partition batch's messages sorted out before the transaction.
struct SortedBatch<'m> {
    fence: Option<&'m Fence>,
    messages: &'m [InboundMessage],
    outcomes: Vec<Option<Outcome>>,
    valid: Vec<(usize, Pending<'m>)>,
    unreadable: Vec<(usize, String)>,
    report: BatchReport,
}

/// Processes the batches of one or more partitions in one transaction and commits it: each
/// partition's events still pass the dedupe constraint and are applied in its offset order, the
/// handler prepares and flushes once for all of them, and one commit covers them all. Any error
/// rolls back every batch. `ctx.fence` is ignored: each batch carries its own. One report per
/// batch, in the order given.
pub async fn process_batches(
    ctx: &TransactionContext<'_>,
    batches: &[PartitionBatch<'_>],
) -> Result<Vec<BatchReport>, ProcessError> {
    let mut conn = ctx.pool.acquire().await?;
    process_batches_on(&mut conn, ctx, batches).await
}

/// [`process_batches`] on a session the caller holds (`ctx.pool` is not used): a caller that
/// runs transaction after transaction keeps one session and saves the pool's check of each
/// session handed back to it, a round trip a transaction.
pub(crate) async fn process_batches_on(
    conn: &mut PgConnection,
    ctx: &TransactionContext<'_>,
    batches: &[PartitionBatch<'_>],
) -> Result<Vec<BatchReport>, ProcessError> {
    let mut reports = process_groups_on(conn, &[(ctx, batches)]).await?;
    Ok(reports.pop().unwrap_or_default())
}

/// The batches of several groups of one database in one transaction, on a session the caller
/// holds: each group's part is what [`process_batches`] does for it (its fences, dedupe rows,
/// order, parking and dead letters), the handlers' flushes come last, in the order given (callers
/// keep one order, so transactions cannot deadlock on each other's effects), and one commit
/// covers them all. Any error rolls back every group's batches. One list of reports per group,
/// in the order given. `custom_plans_up_to` is the first context's.
pub(crate) async fn process_groups_on(
    conn: &mut PgConnection,
    groups: &[(&TransactionContext<'_>, &[PartitionBatch<'_>])],
) -> Result<Vec<Vec<BatchReport>>, ProcessError> {
    let began = std::time::Instant::now();
    let mut tx = conn.begin().await?;
    let messages: usize = groups
        .iter()
        .flat_map(|(_, batches)| batches.iter())
        .map(|b| b.messages.len())
        .sum();
    let custom_plans_up_to = groups.first().map_or(0, |(ctx, _)| ctx.custom_plans_up_to);
    if messages <= custom_plans_up_to {
        plan_with_values(&mut tx).await?;
    }
    let mut sorted: Vec<Vec<SortedBatch<'_>>> = groups
        .iter()
        .map(|(_, batches)| sort_batches(batches))
        .collect();
    // One round trip opens every group's batches: the ownership fences, the dedupe constraint
    // (only rows inserted now are new to a group), and the aggregates' progress and parked events.
    let openings: Vec<GroupOpening<'_, '_>> = groups
        .iter()
        .zip(&sorted)
        .map(|((ctx, _), batches)| opening(ctx.handler.group(), batches))
        .collect();
    let starts = start_transaction(&mut tx, &openings).await?;
    drop(openings);
    let mut parts = Vec::with_capacity(groups.len());
    for (((ctx, _), batches), start) in groups.iter().zip(sorted.drain(..)).zip(starts) {
        parts.push(apply_group(&mut tx, ctx, batches, start).await?);
    }
    // One statement records what every group applied.
    let applied: Vec<GroupApplied<'_>> = groups
        .iter()
        .zip(&parts)
        .map(|((ctx, _), part)| GroupApplied {
            group: ctx.handler.group(),
            effects: &part.effects,
            progress: &part.advanced,
        })
        .collect();
    record_groups_applied(&mut tx, &applied).await?;
    drop(applied);
    // `&mut`: a part's handler transaction is `Send` but need not be `Sync`.
    for ((ctx, _), part) in groups.iter().zip(&mut parts) {
        if let (Some(sink), false) = (ctx.dead_letters, part.letters.is_empty()) {
            sink.publish(ctx.handler.group(), &part.letters).await?;
        }
    }
    // The effects last: a handler may lock rows other transactions share when it writes them
    // (a stock level, a balance), and those locks are then held only until the commit.
    for part in &mut parts {
        part.handler_tx.flush(&mut tx).await?;
    }
    tx.commit().await?;
    let transaction_duration = began.elapsed();
    Ok(parts
        .into_iter()
        .map(|part| part.reports(transaction_duration))
        .collect())
}

/// One group's part of a transaction, applied up to its handler's flush.
struct GroupPart<'a> {
    handler_tx: Box<dyn HandlerTransaction + 'a>,
    batches: Vec<SortedBatch<'a>>,
    /// Which of `effects` each batch applied.
    applied: Vec<std::ops::Range<usize>>,
    effects: Vec<AppliedEffect>,
    /// Aggregates whose last applied sequence moved, with the new value.
    advanced: std::collections::HashMap<String, i64>,
    /// Dead letters recorded, to publish before commit.
    letters: Vec<DeadLetter>,
}

impl GroupPart<'_> {
    /// One report per batch, once the transaction has committed.
    fn reports(self, transaction_duration: std::time::Duration) -> Vec<BatchReport> {
        let effects = self.effects;
        self.batches
            .into_iter()
            .zip(self.applied)
            .map(|(m, range)| {
                let mut report = m.report;
                report.transaction_duration = transaction_duration;
                report.applied_occurred_at = effects[range].iter().map(|e| e.occurred_at).collect();
                report.outcomes = m
                    .outcomes
                    .into_iter()
                    .map(|o| o.unwrap_or(Outcome::Duplicate))
                    .collect();
                report
            })
            .collect()
    }
}

/// Sorts out a group's records that are not readable events, and keeps the first copy of each
/// event id.
fn sort_batches<'a>(batches: &'a [PartitionBatch<'a>]) -> Vec<SortedBatch<'a>> {
    let mut seen: HashSet<Uuid> = HashSet::new();
    batches
        .iter()
        .map(|b| {
            let mut sorted = SortedBatch {
                fence: b.fence,
                messages: b.messages,
                outcomes: vec![None; b.messages.len()],
                valid: Vec::new(),
                unreadable: Vec::new(),
                report: BatchReport::default(),
            };
            for (i, msg) in b.messages.iter().enumerate() {
                match read_event(msg) {
                    Ok(event) if seen.insert(event.envelope.event_id) => {
                        sorted.valid.push((i, Pending { msg, event }));
                    }
                    Ok(_) => sorted.outcomes[i] = Some(Outcome::Duplicate),
                    Err(reason) => sorted.unreadable.push((i, reason)),
                }
            }
            sorted
        })
        .collect()
}

/// A group's part of the transaction's opening statement: its batches' fences, events and
/// aggregates.
fn opening<'a, 'm>(group: &'a str, batches: &'a [SortedBatch<'m>]) -> GroupOpening<'a, 'm> {
    let valid: Vec<&Pending<'m>> = batches
        .iter()
        .flat_map(|m| m.valid.iter().map(|(_, p)| p))
        .collect();
    let mut aggregates: Vec<String> = valid
        .iter()
        .map(|p| p.event.envelope.aggregate_id.clone())
        .collect();
    aggregates.sort();
    aggregates.dedup();
    GroupOpening {
        group,
        fences: batches.iter().filter_map(|m| m.fence).collect(),
        valid,
        aggregates,
    }
}

/// Applies one group's sorted batches in `tx` once the transaction's opening statement has
/// run, all but the record of what was applied and the handler's flush: dead letters for
/// unreadable records, duplicates' steps, the events in order (parked or unparked as their
/// sequence says).
async fn apply_group<'a>(
    tx: &mut Transaction<'_, Postgres>,
    ctx: &TransactionContext<'a>,
    mut sorted_batches: Vec<SortedBatch<'a>>,
    start: TransactionStart,
) -> Result<GroupPart<'a>, ProcessError> {
    let handler = ctx.handler;
    let group = handler.group();
    let mut state = TransactionState {
        progress: start.progress,
        parked_aggregates: start.parked_aggregates,
        horizon: start.horizon,
        ..TransactionState::default()
    };
    let mut fresh: Vec<Vec<(usize, Pending<'a>)>> = Vec::with_capacity(sorted_batches.len());
    let mut duplicates: Vec<Pending<'a>> = Vec::new();
    for m in &mut sorted_batches {
        for (i, reason) in std::mem::take(&mut m.unreadable) {
            let letter = DeadLetter::now(&m.messages[i], None, &reason);
            dead_letter::record(tx, group, &letter).await?;
            state.letters.push(letter);
            m.outcomes[i] = Some(Outcome::DeadLettered);
        }
        let mut new = Vec::with_capacity(m.valid.len());
        for (i, p) in std::mem::take(&mut m.valid) {
            if start.new_ids.contains(&p.event.envelope.event_id) {
                new.push((i, p));
            } else {
                m.outcomes[i] = Some(Outcome::Duplicate);
                duplicates.push(p);
            }
        }
        fresh.push(new);
    }
    record_duplicates(tx, group, &duplicates.iter().collect::<Vec<_>>()).await?;

    let events: Vec<Event> = fresh
        .iter()
        .flatten()
        .map(|(_, p)| p.event.clone())
        .collect();
    let mut handler_tx = handler.transaction();
    handler_tx.prepare(tx, &events).await?;
    let mut applied: Vec<std::ops::Range<usize>> = Vec::with_capacity(sorted_batches.len());
    for (m, new) in sorted_batches.iter_mut().zip(&fresh) {
        let first = state.effects.len();
        for (i, p) in new {
            let env = &p.event.envelope;
            // Every log line of this event's handling carries its ids and the caller's trace
            // context.
            let span = tracing::info_span!(
                "event",
                group,
                event_id = %env.event_id,
                aggregate_id = %env.aggregate_id,
                sequence = env.sequence,
                event_type = %env.event_type,
                traceparent = env.traceparent.as_deref().unwrap_or(""),
            );
            let outcome =
                handle_event(tx, handler_tx.as_mut(), group, &mut state, &mut m.report, p)
                    .instrument(span)
                    .await?;
            m.outcomes[*i] = Some(outcome);
        }
        applied.push(first..state.effects.len());
    }
    let TransactionState {
        advanced,
        effects,
        letters,
        ..
    } = state;
    Ok(GroupPart {
        handler_tx,
        batches: sorted_batches,
        applied,
        effects,
        advanced,
        letters,
    })
}

/// Dead-letters one message on its own, when it kept failing past the retry budget: records it
/// processed (outcome `dead_lettered`) and in `dead_letter`, publishes it, and commits. A message
/// this group already processed is left alone.
pub async fn dead_letter_alone(
    ctx: &TransactionContext<'_>,
    msg: &InboundMessage,
    reason: &str,
    attempts: i32,
    first_failure_at: DateTime<Utc>,
) -> Result<Outcome, ProcessError> {
    let group = ctx.handler.group();
    let mut tx = ctx.pool.begin().await?;
    if let Some(fence) = ctx.fence {
        check_owner(&mut tx, group, fence).await?;
    }
    let event = read_event(msg).ok();
    if let Some(event) = &event {
        let inserted = sqlx::query(
            "INSERT INTO processed_message (group_name, event_id, topic, partition, kafka_offset, outcome)
             VALUES ($1, $2, $3, $4, $5, 'dead_lettered') ON CONFLICT (group_name, event_id) DO NOTHING",
        )
        .bind(group)
        .bind(event.envelope.event_id)
        .bind(&msg.topic)
        .bind(msg.partition)
        .bind(msg.offset)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            tx.commit().await?;
            return Ok(Outcome::Duplicate);
        }
    }
    let letter = DeadLetter {
        message: msg.clone(),
        event,
        reason: reason.to_owned(),
        attempts,
        first_failure_at,
        last_failure_at: Utc::now(),
    };
    dead_letter::record(&mut tx, group, &letter).await?;
    if let Some(sink) = ctx.dead_letters {
        sink.publish(group, std::slice::from_ref(&letter)).await?;
    }
    tx.commit().await?;
    Ok(Outcome::DeadLettered)
}
