//! Examples of each failure the checks count, with what the database knows about them, so a
//! failed run can be investigated from its report (and the processes' logs).

use std::collections::BTreeMap;

use anyhow::Context;
use sqlx::PgPool;

use super::queries::{EXPECTED_EVENTS, LOST_EVENTS, REORDERED_EFFECTS};

/// Most examples of one kind per group.
const LIMIT: i64 = 20;

/// Examples of lost events, duplicate effects and reorders, by kind.
pub async fn collect(
    pool: &PgPool,
    groups: &[String],
) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let lost = format!(
        "WITH expected AS ({EXPECTED_EVENTS})
         SELECT format('%s: order %s seq %s event %s: outbox %s, processed %s, parked %s',
            $1, e.aggregate_id, e.sequence, coalesce(e.event_id::text, '(not in outbox)'),
            (SELECT format('%s partition %s offset %s attempts %s created %s published %s',
                           o.state, o.kafka_partition, o.kafka_offset, o.attempts,
                           o.created_at, o.published_at)
             FROM outbox_status o WHERE o.event_id = e.event_id),
            coalesce((SELECT format('%s at partition %s offset %s on %s', p.outcome,
                                    p.partition, p.kafka_offset, p.processed_at)
                      FROM processed_message p
                      WHERE p.group_name = $1 AND p.event_id = e.event_id), 'no'),
            coalesce((SELECT format('yes (%s, %s)', k.reason, k.parked_at) FROM parked_event k
                      WHERE k.group_name = $1 AND k.aggregate_id = e.aggregate_id
                        AND k.sequence = e.sequence), 'no'))
         {LOST_EVENTS}
         ORDER BY e.aggregate_id, e.sequence LIMIT {LIMIT}"
    );
    let duplicates = format!(
        "SELECT format('%s: event %s (order %s seq %s) applied %s times: %s', $1, event_id,
                min(aggregate_id), min(sequence), count(*),
                string_agg(format('effect %s at %s', id, applied_at), ', ' ORDER BY id))
         FROM applied_effect WHERE group_name = $1
         GROUP BY event_id HAVING count(*) > 1 ORDER BY min(id) LIMIT {LIMIT}"
    );
    let reorders = format!(
        "SELECT format('%s: order %s effect %s has seq %s after seq %s (event %s)', $1,
                x.aggregate_id, x.id, x.sequence, coalesce(x.previous, 0), x.event_id)
         {REORDERED_EFFECTS} ORDER BY x.id LIMIT {LIMIT}"
    );
    let mut examples = BTreeMap::new();
    for (kind, sql) in [
        ("lost", lost),
        ("duplicate_effects", duplicates),
        ("reorders", reorders),
    ] {
        let mut found = Vec::new();
        for group in groups {
            let rows: Vec<String> = sqlx::query_scalar(&sql)
                .bind(group)
                .fetch_all(pool)
                .await
                .with_context(|| format!("collecting examples of {kind}"))?;
            found.extend(rows);
        }
        if !found.is_empty() {
            let _ = examples.insert(kind.to_owned(), found);
        }
    }
    Ok(examples)
}
