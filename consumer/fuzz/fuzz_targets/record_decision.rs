//! From a raw Kafka record to its decision, as a consumer's partition task takes it: the record
//! (any key, any headers, any payload) read into an `InboundMessage` and decided (apply, park,
//! stale, or dead-letter with a reason), with what a dead letter would store made from it. No
//! input may panic, and everything that would reach PostgreSQL's `text` or `jsonb` must be
//! UTF-8 without NUL; the exact bytes must survive the dead letter's columns.
#![no_main]

use arbitrary::Arbitrary;
use consumer::transaction::{decide, Decision, InboundMessage, RecordHeaders};
use libfuzzer_sys::fuzz_target;
use pipeline_core::envelope::{
    AGGREGATE_ID, EVENT_ID, EVENT_TYPE, MAX_KEY_BYTES, OCCURRED_AT, SEQUENCE, TRACEPARENT,
};
use pipeline_core::record::{escape, unescape, without_nul};

/// An envelope header: left out, without a value, well formed for the record, or any bytes.
#[derive(Arbitrary, Debug)]
enum Field {
    Absent,
    Null,
    WellFormed,
    Bytes(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Record {
    key: Option<Vec<u8>>,
    event_id: Field,
    event_type: Field,
    sequence: (Field, i64),
    aggregate_id: Field,
    occurred_at: Field,
    traceparent: Field,
    extra: Vec<(String, Option<Vec<u8>>)>,
    payload: Option<Vec<u8>>,
    /// Wrap the payload bytes as a JSON string (so escapes like \u0000 reach the JSON parser).
    payload_as_json_string: bool,
    last_applied: i64,
}

fn well_formed(name: &str, r: &Record) -> Vec<u8> {
    match name {
        EVENT_ID => b"0b5c4c8e-3f55-4b1e-9a57-2f1f0c3b6f11".to_vec(),
        EVENT_TYPE => b"order.placed".to_vec(),
        SEQUENCE => r.sequence.1.to_string().into_bytes(),
        AGGREGATE_ID => r.key.clone().unwrap_or_default(),
        OCCURRED_AT => b"2026-11-26T05:00:00.000001Z".to_vec(),
        _ => b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
    }
}

fuzz_target!(|r: Record| {
    let mut pairs: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    for (name, field) in [
        (EVENT_ID, &r.event_id),
        (EVENT_TYPE, &r.event_type),
        (SEQUENCE, &r.sequence.0),
        (AGGREGATE_ID, &r.aggregate_id),
        (OCCURRED_AT, &r.occurred_at),
        (TRACEPARENT, &r.traceparent),
    ] {
        match field {
            Field::Absent => {}
            Field::Null => pairs.push((name.to_owned(), None)),
            Field::WellFormed => pairs.push((name.to_owned(), Some(well_formed(name, &r)))),
            Field::Bytes(b) => pairs.push((name.to_owned(), Some(b.clone()))),
        }
    }
    pairs.extend(r.extra.iter().cloned());
    let payload = match (&r.payload, r.payload_as_json_string) {
        (Some(p), true) => {
            let text = String::from_utf8_lossy(p);
            Some(format!("{{\"s\": \"{text}\"}}").into_bytes())
        }
        (p, _) => p.clone(),
    };
    let headers = RecordHeaders::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_deref())));
    let msg = InboundMessage::from_record(
        "orders",
        0,
        0,
        r.key.as_deref(),
        payload.as_deref(),
        headers,
    );

    match decide(&msg, r.last_applied) {
        Decision::DeadLetter(reason) => {
            assert!(!reason.is_empty());
            assert!(!without_nul(&reason).contains('\0'));
        }
        Decision::Apply(event) | Decision::Park(event) | Decision::Stale(event) => {
            let env = &event.envelope;
            assert_eq!(Some(env.aggregate_id.as_bytes()), r.key.as_deref());
            assert!(!env.aggregate_id.is_empty() && env.aggregate_id.len() <= MAX_KEY_BYTES);
            assert!(!env.aggregate_id.contains('\0') && !env.event_type.contains('\0'));
            assert!(env.sequence >= 1);
            assert!(
                !holds_nul(&event.payload),
                "a NUL would reach jsonb: {}",
                event.payload
            );
        }
    }

    // What a dead letter stores of the record: exact bytes, and text without NUL.
    for bytes in [&msg.key, &msg.payload].into_iter().flatten() {
        let shown = escape(bytes);
        assert!(!shown.contains('\0'));
        assert_eq!(&unescape(&shown).expect("escaped text unescapes"), bytes);
    }
    let (names, values) = msg.headers.to_columns();
    assert_eq!(RecordHeaders::from_columns(&names, &values), msg.headers);
    let display = msg.headers.to_display_json();
    assert!(!holds_nul(&display), "a NUL would reach jsonb: {display}");
});

/// Whether a string or an object key anywhere in `value` holds a NUL character, which jsonb
/// refuses. (The serialized text is no test: `\\u0000`, an escaped backslash before `u0000`,
/// is text jsonb takes.)
fn holds_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(holds_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}
