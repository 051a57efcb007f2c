//! What the end-to-end tests check of the groups' effects once the pipeline has drained.

use crate::TestEnv;

/// Each group of `kinds` (names without the test's prefix) applied every event in the outbox
/// exactly once, none missing and none twice, and each order's events in sequence order.
pub async fn assert_exactly_once_in_order(env: &TestEnv, kinds: &[&str]) -> anyhow::Result<()> {
    for kind in kinds {
        let group = env.group(kind);
        let wrong: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
            "SELECT o.event_id, count(a.id) FROM outbox o
             LEFT JOIN applied_effect a ON a.event_id = o.event_id AND a.group_name = $1
             GROUP BY o.event_id HAVING count(a.id) <> 1 LIMIT 10",
        )
        .bind(&group)
        .fetch_all(&env.pool)
        .await?;
        assert!(
            wrong.is_empty(),
            "{kind}: events not applied exactly once: {wrong:?}"
        );
        let reordered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (
                 SELECT sequence, row_number() OVER (PARTITION BY aggregate_id ORDER BY id) AS rn
                 FROM applied_effect WHERE group_name = $1) x
             WHERE sequence <> rn",
        )
        .bind(&group)
        .fetch_one(&env.pool)
        .await?;
        assert_eq!(reordered, 0, "{kind}: events applied out of sequence order");
    }
    Ok(())
}
