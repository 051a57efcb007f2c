//! The SQL the checks count failures with and the examples list them by: the events every group
//! must have applied, those a group lost, and effects out of order.

/// The events every group must have applied or dead-lettered: acknowledged ones and those the
/// outbox holds without an acknowledgement (committed, answer lost).
pub const EXPECTED_EVENTS: &str = "
    SELECT coalesce(a.order_id, o.aggregate_id) AS aggregate_id,
           coalesce(a.sequence, o.sequence) AS sequence,
           o.event_id
    FROM verify_acknowledged a
    FULL JOIN outbox o ON o.aggregate_id = a.order_id AND o.sequence = a.sequence";

/// Expected events of `$1` (a group) with neither an effect nor a dead letter.
pub const LOST_EVENTS: &str = "
    FROM expected e
    WHERE NOT EXISTS (SELECT 1 FROM applied_effect x
                      WHERE x.group_name = $1 AND x.aggregate_id = e.aggregate_id
                        AND x.sequence = e.sequence)
      AND NOT EXISTS (SELECT 1 FROM dead_letter d
                      WHERE d.group_name = $1 AND (d.event_id = e.event_id
                            OR (d.aggregate_id = e.aggregate_id AND d.sequence = e.sequence)))";

/// Effects of `$1` (a group) whose sequence does not follow the order's previous effect.
pub const REORDERED_EFFECTS: &str = "
    FROM (SELECT id, aggregate_id, sequence, event_id,
                 lag(sequence) OVER (PARTITION BY aggregate_id ORDER BY id) AS previous
          FROM applied_effect WHERE group_name = $1) x
    WHERE x.sequence <> coalesce(x.previous, 0) + 1";
