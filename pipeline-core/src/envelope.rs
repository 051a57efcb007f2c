//! The event envelope: what travels in Kafka headers beside the JSON payload.
//!
//! The relay writes these headers from the outbox row; consumers read them back. The Kafka key is
//! the aggregate (order) id, so all events of one order land on one partition.

use chrono::{DateTime, Utc};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use uuid::Uuid;

use crate::record::RecordHeaders;

/// Header carrying the event's unique id (the consumers' idempotency key).
pub const EVENT_ID: &str = "event-id";
/// Header carrying the event type, e.g. `order.placed`.
pub const EVENT_TYPE: &str = "event-type";
/// Header carrying the per-aggregate sequence number (1, 2, 3…).
pub const SEQUENCE: &str = "sequence";
/// Header carrying the aggregate id (also the Kafka key).
pub const AGGREGATE_ID: &str = "aggregate-id";
/// Header carrying the RFC 3339 time the event was committed to the outbox.
pub const OCCURRED_AT: &str = "occurred-at";
/// W3C trace context, copied from the request that caused the event when it had one.
pub const TRACEPARENT: &str = "traceparent";

/// The longest aggregate id (record key) an event may have, in bytes: it is a key of B-tree
/// indexes (an order's progress, parked events, history), whose entries must fit in a page. The
/// outbox library's own limit (`outbox::MAX_AGGREGATE_ID_BYTES`), so what it accepts consumers
/// take: the relay, which depends on both, fails to compile if the two differ.
pub const MAX_KEY_BYTES: usize = 1024;
/// The longest event type, in bytes: the outbox library's limit (`outbox::MAX_EVENT_TYPE_BYTES`,
/// held equal by the relay as [`MAX_KEY_BYTES`] is).
pub const MAX_EVENT_TYPE_BYTES: usize = 255;

/// The envelope of one event, as consumers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The event's id: unique, the consumers' dedupe key.
    pub event_id: Uuid,
    /// What happened, e.g. `order.placed`.
    pub event_type: String,
    /// The aggregate the event belongs to: the record's key and the scope of `sequence`.
    pub aggregate_id: String,
    /// The event's place among its aggregate's events, from 1 without gaps.
    pub sequence: i64,
    /// When the event was committed to the outbox.
    pub occurred_at: DateTime<Utc>,
    /// The W3C trace context of the request that caused the event, when it had one.
    pub traceparent: Option<String>,
}

/// Why a record cannot be read as one of our events. Each is permanent: the record itself is bad.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    /// The record has no key.
    #[error("record has no key (the aggregate id)")]
    MissingKey,
    /// The key is not UTF-8.
    #[error("record key is not UTF-8")]
    KeyNotUtf8,
    /// The key holds a NUL byte (PostgreSQL's text cannot).
    #[error("record key holds a NUL byte")]
    KeyHasNul,
    /// The key is longer than [`MAX_KEY_BYTES`] (its length).
    #[error("record key is {0} bytes long, more than an aggregate id may be ({MAX_KEY_BYTES})")]
    KeyTooLong(usize),
    /// A header's name is not UTF-8.
    #[error(
        "a header name is not UTF-8 (the Kafka protocol requires it); its bytes cannot be read"
    )]
    HeaderNameNotUtf8,
    /// A header the envelope needs is absent (its name).
    #[error("missing header `{0}`")]
    MissingHeader(&'static str),
    /// A header's value cannot be read.
    #[error("header `{name}` is invalid: {reason}")]
    InvalidHeader {
        /// The header's name.
        name: &'static str,
        /// Why its value cannot be read.
        reason: String,
    },
    /// The key and the `aggregate-id` header name different aggregates.
    #[error("key `{key}` does not match header aggregate-id `{header}`")]
    KeyMismatch {
        /// The record's key.
        key: String,
        /// The `aggregate-id` header.
        header: String,
    },
}

impl Envelope {
    /// Kafka headers for this envelope, plus any extra headers stored on the outbox row.
    pub fn to_headers(&self, extra: &[(String, String)]) -> OwnedHeaders {
        let event_id = self.event_id.to_string();
        let sequence = self.sequence.to_string();
        let occurred_at = self
            .occurred_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let mut headers = OwnedHeaders::new_with_capacity(6 + extra.len())
            .insert(header(EVENT_ID, &event_id))
            .insert(header(EVENT_TYPE, &self.event_type))
            .insert(header(SEQUENCE, &sequence))
            .insert(header(AGGREGATE_ID, &self.aggregate_id))
            .insert(header(OCCURRED_AT, &occurred_at));
        if let Some(tp) = &self.traceparent {
            headers = headers.insert(header(TRACEPARENT, tp));
        }
        for (name, value) in extra {
            if is_envelope_header(name) {
                continue;
            }
            headers = headers.insert(header(name, value));
        }
        headers
    }

    /// Reads the envelope from a record's key and headers as the Kafka client gives them.
    pub fn from_record<H: Headers>(
        key: Option<&[u8]>,
        headers: Option<&H>,
    ) -> Result<Self, EnvelopeError> {
        Self::from_key_and_headers(key, &RecordHeaders::read(headers))
    }

    /// Reads the envelope from a record's key and headers. Every text it takes from them is
    /// UTF-8 without NUL, so PostgreSQL's `text` takes it.
    pub fn from_key_and_headers(
        key: Option<&[u8]>,
        headers: &RecordHeaders,
    ) -> Result<Self, EnvelopeError> {
        let key = key.ok_or(EnvelopeError::MissingKey)?;
        let key = std::str::from_utf8(key).map_err(|_| EnvelopeError::KeyNotUtf8)?;
        if key.is_empty() {
            return Err(EnvelopeError::MissingKey);
        }
        if key.contains('\0') {
            return Err(EnvelopeError::KeyHasNul);
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(EnvelopeError::KeyTooLong(key.len()));
        }
        if headers.unreadable_names() > 0 {
            return Err(EnvelopeError::HeaderNameNotUtf8);
        }
        let find = |name: &'static str| -> Result<&str, EnvelopeError> {
            let value = headers
                .get(name)
                .flatten()
                .ok_or(EnvelopeError::MissingHeader(name))?;
            let value = std::str::from_utf8(value).map_err(|_| EnvelopeError::InvalidHeader {
                name,
                reason: "not UTF-8".into(),
            })?;
            if value.contains('\0') {
                return Err(EnvelopeError::InvalidHeader {
                    name,
                    reason: "holds a NUL byte".into(),
                });
            }
            Ok(value)
        };
        let invalid =
            |name: &'static str, e: &dyn std::fmt::Display| EnvelopeError::InvalidHeader {
                name,
                reason: e.to_string(),
            };
        let event_id = Uuid::parse_str(find(EVENT_ID)?).map_err(|e| invalid(EVENT_ID, &e))?;
        let event_type = find(EVENT_TYPE)?.to_owned();
        if event_type.is_empty() {
            return Err(invalid(EVENT_TYPE, &"empty"));
        }
        if event_type.len() > MAX_EVENT_TYPE_BYTES {
            return Err(invalid(
                EVENT_TYPE,
                &format!("longer than {MAX_EVENT_TYPE_BYTES} bytes"),
            ));
        }
        let sequence: i64 = find(SEQUENCE)?.parse().map_err(|e| invalid(SEQUENCE, &e))?;
        if sequence < 1 {
            return Err(invalid(SEQUENCE, &"must be at least 1"));
        }
        let occurred_at = DateTime::parse_from_rfc3339(find(OCCURRED_AT)?)
            .map_err(|e| invalid(OCCURRED_AT, &e))?
            .with_timezone(&Utc);
        let aggregate_id = find(AGGREGATE_ID)?;
        if aggregate_id != key {
            return Err(EnvelopeError::KeyMismatch {
                key: key.to_owned(),
                header: aggregate_id.to_owned(),
            });
        }
        let traceparent = find(TRACEPARENT).ok().map(str::to_owned);
        Ok(Envelope {
            event_id,
            event_type,
            aggregate_id: key.to_owned(),
            sequence,
            occurred_at,
            traceparent,
        })
    }
}

fn is_envelope_header(name: &str) -> bool {
    [
        EVENT_ID,
        EVENT_TYPE,
        SEQUENCE,
        AGGREGATE_ID,
        OCCURRED_AT,
        TRACEPARENT,
    ]
    .contains(&name)
}

fn header<'a>(key: &'a str, value: &'a str) -> Header<'a, &'a str> {
    Header {
        key,
        value: Some(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Message, OwnedMessage, Timestamp};

    fn sample() -> Envelope {
        Envelope {
            event_id: Uuid::new_v4(),
            event_type: "order.placed".into(),
            aggregate_id: "order-1".into(),
            sequence: 3,
            occurred_at: Utc::now(),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
        }
    }

    fn record(key: Option<&str>, headers: OwnedHeaders) -> OwnedMessage {
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            key.map(|k| k.as_bytes().to_vec()),
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(headers),
        )
    }

    #[test]
    fn round_trips_through_headers() {
        let env = sample();
        let msg = record(
            Some("order-1"),
            env.to_headers(&[("x-tenant".into(), "a".into())]),
        );
        let back = Envelope::from_record(msg.key(), msg.headers()).expect("valid envelope");
        assert_eq!(back.event_id, env.event_id);
        assert_eq!(back.sequence, 3);
        assert_eq!(back.traceparent, env.traceparent);
        // microsecond precision survives
        assert_eq!(
            back.occurred_at.timestamp_micros(),
            env.occurred_at.timestamp_micros()
        );
    }

    #[test]
    fn rejects_missing_key_and_headers() {
        let env = sample();
        let msg = record(None, env.to_headers(&[]));
        assert_eq!(
            Envelope::from_record(msg.key(), msg.headers()),
            Err(EnvelopeError::MissingKey)
        );
        let msg = record(Some("order-1"), OwnedHeaders::new());
        assert_eq!(
            Envelope::from_record(msg.key(), msg.headers()),
            Err(EnvelopeError::MissingHeader(EVENT_ID))
        );
        let msg = record(Some("order-2"), env.to_headers(&[]));
        assert!(matches!(
            Envelope::from_record(msg.key(), msg.headers()),
            Err(EnvelopeError::KeyMismatch { .. })
        ));
    }

    #[test]
    fn refuses_what_postgresql_text_refuses() {
        let env = sample();
        let with = |key: &[u8], extra: &[(&str, &[u8])]| {
            let mut pairs: Vec<(&str, Option<&[u8]>)> = Vec::new();
            let (id, seq, at) = (
                env.event_id.to_string(),
                env.sequence.to_string(),
                env.occurred_at.to_rfc3339(),
            );
            let defaults: [(&str, &[u8]); 5] = [
                (EVENT_ID, id.as_bytes()),
                (EVENT_TYPE, b"order.placed"),
                (SEQUENCE, seq.as_bytes()),
                (AGGREGATE_ID, key),
                (OCCURRED_AT, at.as_bytes()),
            ];
            for (name, value) in defaults {
                let value = extra
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(value, |(_, v)| *v);
                pairs.push((name, Some(value)));
            }
            Envelope::from_key_and_headers(Some(key), &RecordHeaders::from_pairs(pairs))
        };
        assert!(with(b"order-1", &[]).is_ok());
        assert_eq!(with(b"\xff\xfe", &[]), Err(EnvelopeError::KeyNotUtf8));
        assert_eq!(with(b"order\0", &[]), Err(EnvelopeError::KeyHasNul));
        let long = vec![b'k'; MAX_KEY_BYTES + 1];
        assert_eq!(
            with(&long, &[]),
            Err(EnvelopeError::KeyTooLong(MAX_KEY_BYTES + 1))
        );
        assert!(with(&long[..MAX_KEY_BYTES], &[]).is_ok());
        for (name, value) in [
            (EVENT_TYPE, b"order\0placed".as_slice()),
            (EVENT_TYPE, b"\xc3"),
            (AGGREGATE_ID, b"order-1\0"),
            (SEQUENCE, b"1\0"),
        ] {
            assert!(
                matches!(with(b"order-1", &[(name, value)]), Err(EnvelopeError::InvalidHeader { name: n, .. }) if n == name),
                "{name}"
            );
        }
        let long_type = "t".repeat(MAX_EVENT_TYPE_BYTES + 1);
        assert!(with(b"order-1", &[(EVENT_TYPE, long_type.as_bytes())]).is_err());
    }
}
