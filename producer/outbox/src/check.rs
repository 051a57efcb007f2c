//! What the outbox refuses before it writes anything: events PostgreSQL could not store, or that
//! Kafka would refuse when the relay produces them. A refused event is an error the caller can
//! branch on ([`EnqueueError`]), returned before any statement runs, so the caller's transaction
//! stays usable; an event stored and then refused by Kafka would instead be retried by the relay
//! and end `failed`, holding its aggregate's later events.

use serde_json::Value;

use crate::{EnqueueError, NewEvent};

/// The producer's default `message.max.bytes` (librdkafka, and the relay, which leaves it as
/// is): the largest record the relay's producer accepts, counted as the relay produces it.
///
/// A topic's `max.message.bytes` (1,048,588 bytes by default) is higher, so with Kafka's and
/// librdkafka's defaults the producer's limit is the one that binds.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

/// The longest aggregate id (the record key) accepted, in bytes: consumer groups dead-letter an
/// event with a longer key (`pipeline_core::envelope::MAX_KEY_BYTES`), and it is a key of B-tree
/// indexes, whose entries PostgreSQL refuses past 2,704 bytes.
pub const MAX_AGGREGATE_ID_BYTES: usize = 1024;

/// The longest event type accepted, in bytes: consumer groups dead-letter an event with a longer
/// one (`pipeline_core::envelope::MAX_EVENT_TYPE_BYTES`).
pub const MAX_EVENT_TYPE_BYTES: usize = 255;

/// The longest business key accepted, in bytes: with the event type it is a key of a B-tree
/// index, whose entries PostgreSQL refuses past 2,704 bytes.
pub const MAX_BUSINESS_KEY_BYTES: usize = 1024;

/// The outbox's settings. Plain values: the service maps its own configuration onto them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxSettings {
    /// Largest event accepted, in bytes as the relay produces it: the key (aggregate id), the
    /// payload as PostgreSQL writes jsonb out, each header's name and value, the envelope headers
    /// the relay adds, and the record's framing ([`NewEvent::message_size`]). Larger events
    /// are refused with [`EnqueueError::TooLarge`].
    ///
    /// Keep it at or below both the relay producer's `message.max.bytes` and the topic's
    /// `max.message.bytes` (raising them means raising this with them). Default:
    /// [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub max_message_bytes: usize,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        OutboxSettings {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// Framing of one record as librdkafka counts it against `message.max.bytes` (36 bytes at most),
/// plus the envelope headers' fixed part: their names (49 bytes), the event id (36), the sequence
/// number (at most 20), the commit time (27) and their length prefixes (at most 10 bytes each).
const FIXED_RECORD_BYTES: usize = 256;

/// Length prefixes of one header's name and value (zigzag varints of at most 5 bytes each).
const HEADER_FRAMING_BYTES: usize = 10;

impl OutboxSettings {
    /// Checks `event`: required fields present, no NUL character anywhere (PostgreSQL's text
    /// and jsonb cannot store one), no control character in the event type, keys and event type within their lengths
    /// ([`MAX_AGGREGATE_ID_BYTES`], [`MAX_EVENT_TYPE_BYTES`], [`MAX_BUSINESS_KEY_BYTES`]), a
    /// topic name Kafka accepts, and at most
    /// [`max_message_bytes`](OutboxSettings::max_message_bytes) as produced.
    pub fn check(&self, event: &NewEvent) -> Result<(), EnqueueError> {
        let fields = [
            ("business_key", &event.business_key),
            ("event_type", &event.event_type),
            ("aggregate_id", &event.aggregate_id),
            ("topic", &event.topic),
        ];
        for (name, value) in fields {
            if value.is_empty() {
                return Err(EnqueueError::Empty(name));
            }
            if has_nul(value) {
                return Err(EnqueueError::NulCharacter(name));
            }
        }
        if event.event_type.chars().any(char::is_control) {
            return Err(EnqueueError::ControlCharacter("event_type"));
        }
        for (name, value, limit) in [
            ("business_key", &event.business_key, MAX_BUSINESS_KEY_BYTES),
            ("event_type", &event.event_type, MAX_EVENT_TYPE_BYTES),
            ("aggregate_id", &event.aggregate_id, MAX_AGGREGATE_ID_BYTES),
        ] {
            if value.len() > limit {
                return Err(EnqueueError::TooLong {
                    field: name,
                    len: value.len(),
                    limit,
                });
            }
        }
        if !is_kafka_topic_name(&event.topic) {
            return Err(EnqueueError::InvalidTopic(event.topic.clone()));
        }
        if event
            .headers
            .iter()
            .any(|(name, value)| has_nul(name) || has_nul(value))
        {
            return Err(EnqueueError::NulCharacter("headers"));
        }
        // PostgreSQL's jsonb cannot store U+0000: without this check the insert fails as a
        // database error, which callers would take for a transient fault and retry forever.
        let payload =
            jsonb_text_len(&event.payload).ok_or(EnqueueError::NulCharacter("payload"))?;
        let size = record_size(event, payload);
        if size > self.max_message_bytes {
            return Err(EnqueueError::TooLarge {
                size,
                limit: self.max_message_bytes,
            });
        }
        Ok(())
    }
}

impl NewEvent {
    /// The size [`OutboxSettings::max_message_bytes`] is compared with: an upper bound of what
    /// librdkafka counts when the relay produces this event. `None` when the payload holds a NUL
    /// character (it cannot be stored at all).
    pub fn message_size(&self) -> Option<usize> {
        jsonb_text_len(&self.payload).map(|payload| record_size(self, payload))
    }
}

fn record_size(event: &NewEvent, payload: usize) -> usize {
    let headers: usize = event
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + HEADER_FRAMING_BYTES)
        .sum();
    // The key, then the envelope's aggregate-id and event-type headers.
    FIXED_RECORD_BYTES + 2 * event.aggregate_id.len() + event.event_type.len() + payload + headers
}

fn has_nul(s: &str) -> bool {
    // A byte search (memchr): UTF-8 never uses the byte 0 but for U+0000.
    s.as_bytes().contains(&0)
}

/// Kafka's rule for topic names: 1 to 249 of `a-z A-Z 0-9 . _ -`, and not `.` or `..`.
fn is_kafka_topic_name(topic: &str) -> bool {
    topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Length in bytes of `value` as PostgreSQL writes a jsonb out (`payload::text`, what the relay
/// publishes): `", "` and `": "` between items, strings escaped as JSON, numbers as `numeric`
/// prints them (`1e16` in full, 17 digits). `None` when a string or key holds U+0000.
pub(crate) fn jsonb_text_len(value: &Value) -> Option<usize> {
    match value {
        Value::Null => Some(4),
        Value::Bool(true) => Some(4),
        Value::Bool(false) => Some(5),
        Value::Number(n) => Some(numeric_text_len(n)),
        Value::String(s) => json_string_len(s),
        Value::Array(items) => {
            let mut len = 2 + 2 * items.len().saturating_sub(1);
            for item in items {
                len += jsonb_text_len(item)?;
            }
            Some(len)
        }
        Value::Object(map) => {
            let mut len = 2 + 2 * map.len().saturating_sub(1);
            for (key, item) in map {
                len += json_string_len(key)? + 2 + jsonb_text_len(item)?;
            }
            Some(len)
        }
    }
}

/// Extra bytes each byte takes in a JSON string: `\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t` one
/// more, other control characters `\u00XX` five more (PostgreSQL's escape_json, like serde_json).
const ESCAPE_EXTRA: [u8; 256] = {
    let mut extra = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        extra[b] = 5;
        b += 1;
    }
    extra[0x08] = 1;
    extra[0x0c] = 1;
    extra[b'\n' as usize] = 1;
    extra[b'\r' as usize] = 1;
    extra[b'\t' as usize] = 1;
    extra[b'"' as usize] = 1;
    extra[b'\\' as usize] = 1;
    extra
};

fn json_string_len(s: &str) -> Option<usize> {
    // Most strings need no escape (and so hold no NUL): one branch-free pass tells.
    let special = s.bytes().fold(false, |any, b| {
        any | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if !special {
        return Some(s.len() + 2);
    }
    if has_nul(s) {
        return None;
    }
    let extra: usize = s
        .bytes()
        .map(|b| usize::from(ESCAPE_EXTRA[usize::from(b)]))
        .sum();
    Some(s.len() + 2 + extra)
}

/// Length of a JSON number once PostgreSQL's `numeric` has read it and printed it back: the
/// same text, except that an exponent is written out in full (`1.5e-7` is `0.00000015`) and
/// negative zero loses its sign.
fn numeric_text_len(n: &serde_json::Number) -> usize {
    use std::fmt::Write;
    // Integers are printed as they are.
    if let Some(u) = n.as_u64() {
        return decimal_digits(u);
    }
    if let Some(i) = n.as_i64() {
        return 1 + decimal_digits(i.unsigned_abs());
    }
    // serde_json writes at most 24 bytes for a number: the stack buffer holds 40.
    let mut buffer = NumberText::default();
    let owned;
    let text: &[u8] = if write!(buffer, "{n}").is_ok() {
        &buffer.bytes[..buffer.len]
    } else {
        owned = n.to_string();
        owned.as_bytes()
    };
    let (negative, text) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let (mantissa, exponent) = match text.iter().position(|b| matches!(b, b'e' | b'E')) {
        Some(e) => (&text[..e], parse_exponent(&text[e + 1..])),
        None => (text, 0),
    };
    let (int_digits, frac_digits) = match mantissa.iter().position(|b| *b == b'.') {
        Some(p) => (&mantissa[..p], &mantissa[p + 1..]),
        None => (mantissa, &mantissa[mantissa.len()..]),
    };
    let digits = int_digits.len() as i64 + frac_digits.len() as i64;
    let scale = (frac_digits.len() as i64 - exponent).max(0);
    // Digits before the point once the exponent is applied, without leading zeros.
    let point = int_digits.len() as i64 + exponent;
    let leading_zeros = int_digits
        .iter()
        .chain(frac_digits)
        .take_while(|b| **b == b'0')
        .count() as i64;
    let integer = (point - leading_zeros).max(1);
    let nonzero = leading_zeros < digits;
    let len =
        usize::from(negative && nonzero) as i64 + integer + if scale > 0 { 1 + scale } else { 0 };
    usize::try_from(len).unwrap_or(usize::MAX)
}

fn decimal_digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |log| log as usize + 1)
}

fn parse_exponent(text: &[u8]) -> i64 {
    let (sign, digits) = match text.split_first() {
        Some((b'-', rest)) => (-1, rest),
        Some((b'+', rest)) => (1, rest),
        _ => (1, text),
    };
    sign * digits.iter().fold(0i64, |acc, d| {
        acc.saturating_mul(10)
            .saturating_add(i64::from(d.saturating_sub(b'0')))
    })
}

/// A number's text, written without allocating.
struct NumberText {
    bytes: [u8; 40],
    len: usize,
}

impl Default for NumberText {
    fn default() -> Self {
        NumberText {
            bytes: [0; 40],
            len: 0,
        }
    }
}

impl std::fmt::Write for NumberText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        let slot = self.bytes.get_mut(self.len..end).ok_or(std::fmt::Error)?;
        slot.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Every length against PostgreSQL's own: `octet_length(payload::text)` of the jsonb.
    #[sqlx::test(migrations = false)]
    async fn payload_lengths_are_those_postgresql_writes_out(pool: sqlx::PgPool) {
        let payloads = [
            json!(null),
            json!(true),
            json!(false),
            json!(0),
            json!(-17),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(0.1),
            json!(-0.0),
            json!(100000.0),
            json!(1e16),
            json!(-1.5e-7),
            json!(1.2345e300),
            json!(5e-324),
            json!(f64::MAX),
            json!(f64::MIN_POSITIVE),
            json!(""),
            json!("plain"),
            json!("quote \" backslash \\ slash / tab \t newline \n cr \r bell \u{7} del \u{7f}"),
            json!("\u{8}\u{c}\u{1}\u{1f} 顧客 ✓ 🚚"),
            json!([]),
            json!({}),
            json!([1, [2, [3, []]], {}]),
            json!({"b": [1, 2.5, {"c": "x\ny"}], "a": -0.0, "": null, "key \"q\"": {"n": {}}}),
            json!({"order_id": "o-1", "lines": [{"sku": "p-1", "qty": 2, "price_cents": 1299}]}),
        ];
        for payload in payloads {
            let expected: i32 = sqlx::query_scalar("SELECT octet_length($1::jsonb::text)")
                .bind(&payload)
                .fetch_one(&pool)
                .await
                .expect("length");
            assert_eq!(
                jsonb_text_len(&payload),
                Some(expected as usize),
                "{payload}"
            );
        }
    }

    /// Random payloads (xorshift, fixed seed): any f64, strings of control, quoting, ASCII and
    /// multi-byte characters, nested arrays and objects.
    #[sqlx::test(migrations = false)]
    async fn random_payload_lengths_are_those_postgresql_writes_out(pool: sqlx::PgPool) {
        struct Random(u64);
        impl Random {
            fn next(&mut self) -> u64 {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0
            }
            fn below(&mut self, n: u64) -> u64 {
                self.next() % n
            }
            fn value(&mut self, depth: u32) -> Value {
                match self.below(if depth > 3 { 5 } else { 7 }) {
                    0 => Value::Null,
                    1 => Value::Bool(self.below(2) == 0),
                    2 => {
                        let f = f64::from_bits(self.next());
                        serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
                    }
                    3 => json!(self.next() as i64 >> self.below(64)),
                    4 => Value::String(self.text()),
                    5 => Value::Array((0..self.below(5)).map(|_| self.value(depth + 1)).collect()),
                    _ => Value::Object(
                        (0..self.below(5))
                            .map(|_| (self.text(), self.value(depth + 1)))
                            .collect(),
                    ),
                }
            }
            fn text(&mut self) -> String {
                const CHARS: [char; 12] = [
                    'a', 'Z', '0', ' ', '"', '\\', '/', '\n', '\u{1}', '\u{7f}', 'é', '🚚',
                ];
                (0..self.below(12))
                    .map(|_| CHARS[self.below(CHARS.len() as u64) as usize])
                    .collect()
            }
        }
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let payload = random.value(0);
            let expected: i32 = sqlx::query_scalar("SELECT octet_length($1::jsonb::text)")
                .bind(&payload)
                .fetch_one(&pool)
                .await
                .expect("length");
            assert_eq!(
                jsonb_text_len(&payload),
                Some(expected as usize),
                "{payload}"
            );
        }
    }

    #[test]
    fn nul_anywhere_in_the_payload_is_found() {
        for payload in [
            json!("a\u{0}"),
            json!({"k\u{0}": 1}),
            json!([1, {"x": ["ok", "bad\u{0}"]}]),
        ] {
            assert_eq!(jsonb_text_len(&payload), None, "{payload}");
        }
    }

    #[test]
    fn topic_names_follow_kafkas_rule() {
        for ok in ["order-events", "a", "A.b_c-9", &"x".repeat(249)] {
            assert!(is_kafka_topic_name(ok), "{ok}");
        }
        for bad in [
            ".",
            "..",
            "order events",
            "orders/eu",
            "ordres-é",
            &"x".repeat(250),
        ] {
            assert!(!is_kafka_topic_name(bad), "{bad}");
        }
    }
}
