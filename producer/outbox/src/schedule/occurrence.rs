//! A schedule's occurrence as an outbox event: what the materialiser appends and what a new
//! schedule's template is checked against.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;

use super::times::CronTimes;
use crate::NewEvent;

/// The event of `schedule`'s occurrence at `at`: its business fact is the schedule and the fire
/// time (`suffix` tells an extra run-now occurrence apart), its payload the template with
/// `{{schedule}}`, `{{fire_at}}` and `{{local_time}}` filled in.
#[allow(clippy::too_many_arguments)]
pub(crate) fn occurrence_event(
    schedule: &str,
    event_type: &str,
    aggregate_id: &str,
    topic: &str,
    template: &Value,
    at: DateTime<Utc>,
    times: &CronTimes,
    suffix: &str,
) -> NewEvent {
    let fire_at = at.to_rfc3339_opts(SecondsFormat::Micros, true);
    let local = times.local(at);
    NewEvent {
        business_key: format!("schedule:{schedule}:{fire_at}{suffix}"),
        event_type: event_type.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        topic: topic.to_owned(),
        payload: fill(template, schedule, &fire_at, &local),
        headers: vec![
            ("schedule".to_owned(), schedule.to_owned()),
            ("fire-at".to_owned(), fire_at),
        ],
    }
}

/// `template` with the placeholders of its string values filled in.
fn fill(template: &Value, schedule: &str, fire_at: &str, local: &str) -> Value {
    match template {
        Value::String(s) => Value::String(
            s.replace("{{schedule}}", schedule)
                .replace("{{fire_at}}", fire_at)
                .replace("{{local_time}}", local),
        ),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| fill(v, schedule, fire_at, local))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), fill(v, schedule, fire_at, local)))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_template_is_filled_in_string_values_only() {
        let template = serde_json::json!({
            "kind": "digest", "of": "{{schedule}}", "at": ["{{fire_at}}", 3],
            "local": {"wall": "{{local_time}}"}, "n": 1
        });
        let got = fill(
            &template,
            "daily",
            "2026-11-26T09:00:00Z",
            "2026-11-26 10:00:00 CET",
        );
        assert_eq!(
            got,
            serde_json::json!({
                "kind": "digest", "of": "daily", "at": ["2026-11-26T09:00:00Z", 3],
                "local": {"wall": "2026-11-26 10:00:00 CET"}, "n": 1
            })
        );
    }
}
