//! The fuzz target of the consumer's record path: from a raw Kafka record to its decision, as a
//! consumer's partition task takes it. The record (any key, any headers, any payload) is read
//! into an `InboundMessage` and decided (apply, park, stale, or dead-letter with a reason), with what a dead letter would store made from it. No
//! input may panic, and everything that would reach PostgreSQL's `text` or `jsonb` must be
//! UTF-8 without NUL; the exact bytes must survive the dead letter's columns.
//!
//! `scripts/fuzz.sh` runs [`check`] under libFuzzer (the `record_decision` target, built by cargo
//! fuzz with the `libfuzzer` feature); this crate's tests replay every kept input
//! (`regressions/record_decision/`, and the local corpus when there is one) through the same
//! [`decode`] and [`check`] with the workspace's tests.
#![forbid(unsafe_code)]

use arbitrary::Arbitrary;
use consumer::transaction::{decide, Decision, InboundMessage, RecordHeaders};
use pipeline_core::envelope::{
    AGGREGATE_ID, EVENT_ID, EVENT_TYPE, MAX_KEY_BYTES, OCCURRED_AT, SEQUENCE, TRACEPARENT,
};
use pipeline_core::record::{escape, unescape, without_nul};

/// An envelope header: left out, without a value, well formed for the record, or any bytes.
#[derive(Arbitrary, Debug)]
pub enum Field {
    Absent,
    Null,
    WellFormed,
    Bytes(Vec<u8>),
}

/// A raw record as libFuzzer makes it, and the sequence its aggregate last applied.
#[derive(Arbitrary, Debug)]
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub event_id: Field,
    pub event_type: Field,
    pub sequence: (Field, i64),
    pub aggregate_id: Field,
    pub occurred_at: Field,
    pub traceparent: Field,
    pub extra: Vec<(String, Option<Vec<u8>>)>,
    pub payload: Option<Vec<u8>>,
    /// Wrap the payload bytes as a JSON string (so escapes like \u0000 reach the JSON parser).
    pub payload_as_json_string: bool,
    pub last_applied: i64,
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

/// Takes `r` from the raw record to its decision and what its dead letter would store, and panics
/// where a property does not hold.
pub fn check(r: &Record) {
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
            Field::WellFormed => pairs.push((name.to_owned(), Some(well_formed(name, r)))),
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
}

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

/// The [`Record`] libFuzzer's `fuzz_target!` makes of `bytes` (the rest of the input taken as it
/// takes it), or `None` for an input it would reject.
pub fn decode(bytes: &[u8]) -> Option<Record> {
    if bytes.len() < <Record as Arbitrary>::size_hint(0).0 {
        return None;
    }
    Record::arbitrary_take_rest(arbitrary::Unstructured::new(bytes)).ok()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{check, decode};

    /// Every input in `dir`, by file name; none when `dir` does not exist.
    fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut files: Vec<_> = entries
            .map(|e| e.expect("a readable directory entry").path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|p| {
                let bytes = std::fs::read(&p).expect("a readable input");
                (p.display().to_string(), bytes)
            })
            .collect()
    }

    #[test]
    fn every_kept_regression_passes_the_checks() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions/record_decision");
        let kept = inputs(&dir);
        assert!(!kept.is_empty(), "no kept inputs in {}", dir.display());
        for (name, bytes) in kept {
            let record = decode(&bytes).unwrap_or_else(|| panic!("{name} decodes to no record"));
            check(&record);
        }
    }

    /// The corpus a local `scripts/fuzz.sh` grew (git-ignored; absent on a fresh clone).
    #[test]
    fn every_input_of_the_local_corpus_passes_the_checks() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/record_decision");
        for (_, bytes) in inputs(&dir) {
            if let Some(record) = decode(&bytes) {
                check(&record);
            }
        }
    }
}
