//! The runtime's words: a database filled while its tables said `order` migrates to `aggregate`
//! keeping every row as it was, and the runtime goes on from what it holds.

use chrono::Utc;
use consumer::transaction::{process_batch, Outcome};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common;
use crate::partitions::migrate_up_to;
use crate::retention::{record, Ledger, GROUP, TOPIC};

/// The last migration before the runtime's tables said aggregate.
const BEFORE_AGGREGATE_WORDS: i64 = 20261128000108;

/// Every table the rename touches, by its name before and after.
const TABLES: [(&str, &str); 8] = [
    ("order_progress", "aggregate_progress"),
    ("parked_event", "parked_event"),
    ("parked_record", "parked_record"),
    ("dead_letter", "dead_letter"),
    ("group_transition", "group_transition"),
    ("applied_effect", "applied_effect"),
    ("applied_effect_held", "applied_effect_held"),
    ("retention_state", "retention_state"),
];

/// Each table's rows, whole, as text, in one order.
async fn rows(pool: &PgPool, tables: impl Iterator<Item = &str>) -> Vec<(String, String)> {
    let mut all = Vec::new();
    for table in tables {
        let text: String = sqlx::query_scalar(&format!(
            "SELECT coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '') FROM {table} t"
        ))
        .fetch_one(pool)
        .await
        .expect(table);
        all.push((table.to_owned(), text));
    }
    all
}

#[tokio::test]
async fn a_database_filled_under_the_order_words_keeps_every_row_and_the_runtime_goes_on() {
    let (pool, name) = common::empty_database("words").await;
    migrate_up_to(&pool, BEFORE_AGGREGATE_WORDS).await;
    // What a group leaves behind: order-1 applied up to 2; order-9 up to 5, its 7 parked
    // waiting for 6, an open dead letter, a duplicate step and a parked event applied (under the
    // step's old word, released); a retention pass half way.
    sqlx::raw_sql(&format!(
        "CREATE TABLE ledger (event_id uuid NOT NULL);
         INSERT INTO partition_owner (group_name, topic, partition, owner)
         VALUES ('{GROUP}', '{TOPIC}', 0, gen_random_uuid());
         INSERT INTO order_progress (group_name, order_id, last_sequence)
         VALUES ('{GROUP}', 'order-1', 2), ('{GROUP}', 'order-9', 5);
         INSERT INTO applied_effect (group_name, event_id, order_id, sequence, event_type)
         SELECT '{GROUP}', gen_random_uuid(), 'order-1', s, 'order.updated'
         FROM generate_series(1, 2) s;
         INSERT INTO applied_effect_held (id, group_name, event_id, order_id, sequence,
                                          event_type, applied_at)
         VALUES (-1, '{GROUP}', gen_random_uuid(), 'order-9', 1, 'order.updated',
                 now() - interval '30 days');
         INSERT INTO parked_event (group_name, order_id, sequence, event_id, event_type, payload,
                                   topic, partition, kafka_offset, reason)
         VALUES ('{GROUP}', 'order-9', 7, gen_random_uuid(), 'order.updated', '{{}}',
                 '{TOPIC}', 0, 97, 'waiting for sequence 6');
         INSERT INTO parked_record (group_name, order_id, sequence, payload, header_names,
                                    header_values)
         VALUES ('{GROUP}', 'order-9', 7, '{{}}', '{{}}', '{{}}');
         INSERT INTO dead_letter (group_name, topic, partition, kafka_offset, order_id, reason)
         VALUES ('{GROUP}', '{TOPIC}', 0, 50, 'order-9', 'kept for the test');
         INSERT INTO group_transition (group_name, event_id, order_id, sequence, event_type,
                                       transition, detail)
         VALUES ('{GROUP}', gen_random_uuid(), 'order-1', 1, 'order.updated', 'duplicate',
                 'already processed'),
                ('{GROUP}', gen_random_uuid(), 'order-1', 2, 'order.updated', 'released',
                 NULL);
         INSERT INTO retention_state (table_name, window_seconds, cursor)
         VALUES ('order_progress', 86400, '[\"order-1\", \"{GROUP}\"]');"
    ))
    .execute(&pool)
    .await
    .expect("fill the old layout");
    let history_before: i64 = sqlx::query_scalar("SELECT count(*) FROM group_history")
        .fetch_one(&pool)
        .await
        .expect("history");
    let before = rows(&pool, TABLES.iter().map(|(old, _)| *old)).await;

    migrate_up_to(&pool, i64::MAX).await;

    // Every row as it was, under the new names (retention's state of the renamed table with it).
    let after = rows(&pool, TABLES.iter().map(|(_, new)| *new)).await;
    for ((old, rows_before), (new, rows_after)) in before.iter().zip(&after) {
        // The one value rewritten: the step of a parked event applied once its gap closed.
        let rows_before = rows_before
            .replace("order_progress", "aggregate_progress")
            .replace(",released,", ",unparked,");
        assert_eq!(&rows_before, rows_after, "{old} → {new}");
    }
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT table_name || '.' || column_name FROM information_schema.columns
         WHERE table_schema = current_schema() AND column_name = 'order_id'",
    )
    .fetch_all(&pool)
    .await
    .expect("columns");
    assert!(left.is_empty(), "still named order_id: {left:?}");
    let history: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM group_history WHERE aggregate_id IN ('order-1', 'order-9')",
    )
    .fetch_one(&pool)
    .await
    .expect("history by aggregate");
    assert_eq!(history, history_before);

    // The runtime goes on from the progress it finds: order-1's next event is applied, an old
    // one is not applied again, and order-9's gap closes, unparking its parked event.
    let now = Utc::now();
    let next = record("order-1", 3, Uuid::now_v7(), "order.updated", now, 101);
    let again = record("order-1", 2, Uuid::now_v7(), "order.updated", now, 102);
    let gap = record("order-9", 6, Uuid::now_v7(), "order.updated", now, 103);
    let report = process_batch(&pool, &Ledger, &[next, again, gap])
        .await
        .expect("batch");
    assert_eq!(
        report.outcomes,
        vec![Outcome::Applied, Outcome::Stale, Outcome::Applied],
        "{report:?}"
    );
    let progress: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, last_sequence FROM aggregate_progress ORDER BY aggregate_id",
    )
    .fetch_all(&pool)
    .await
    .expect("progress");
    assert_eq!(
        progress,
        vec![("order-1".to_owned(), 3), ("order-9".to_owned(), 7)]
    );
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM parked_event")
        .fetch_one(&pool)
        .await
        .expect("parked");
    assert_eq!(parked, 0, "the parked event was unparked");
    let steps: Vec<(i64, String)> = sqlx::query_as(
        "SELECT sequence, transition FROM group_transition
         WHERE aggregate_id = 'order-9' ORDER BY sequence",
    )
    .fetch_all(&pool)
    .await
    .expect("steps");
    assert_eq!(steps, vec![(7, "unparked".to_owned())]);
    common::drop_database(pool, &name).await;
}
