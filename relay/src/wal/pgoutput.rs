//! The outbox's inserts as PostgreSQL's `pgoutput` plugin (protocol version 1) sends them: a
//! Relation message describes a table's columns (sent before its first row, and again after the
//! table changed), an Insert carries a new row's values as text. The publication the relay reads
//! publishes the outbox's inserts only; a message of another kind, or a row of another table, is
//! passed over.

use std::collections::HashMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::claim::OutboxEvent;

/// The table whose inserts are the outbox's events.
const OUTBOX_TABLE: &str = "outbox";

/// A message the decoder cannot read: the stream is not what the relay expects.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The message ends before one of its fields.
    #[error("a pgoutput message ends before its {0}")]
    Short(&'static str),
    /// A row of a table no Relation message described.
    #[error("an insert into relation {0}, which no relation message described")]
    UnknownRelation(u32),
    /// A column the outbox's events need is missing, NULL or not what its type says.
    #[error("the outbox row's {column}: {reason}")]
    Column {
        /// The column.
        column: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// A table's name and its columns' names, in order.
#[derive(Debug)]
struct Relation {
    table: String,
    columns: Vec<String>,
}

/// Reads one stream's messages: remembers the tables Relation messages describe, and turns the
/// outbox's Inserts into events.
#[derive(Debug, Default)]
pub struct Decoder {
    relations: HashMap<u32, Relation>,
}

impl Decoder {
    /// The event an outbox insert carries; `None` for every other message.
    pub fn decode(&mut self, message: &[u8]) -> Result<Option<OutboxEvent>, DecodeError> {
        let mut at = Reader(message);
        match at.byte("message kind")? {
            b'R' => {
                let id = at.u32("relation id")?;
                let _schema = at.text("relation schema")?;
                let table = at.text("relation name")?;
                let _replica_identity = at.byte("replica identity")?;
                let count = at.u16("column count")?;
                let mut columns = Vec::with_capacity(usize::from(count));
                for _ in 0..count {
                    let _flags = at.byte("column flags")?;
                    columns.push(at.text("column name")?);
                    let _type = at.u32("column type")?;
                    let _modifier = at.u32("column type modifier")?;
                }
                let _ = self.relations.insert(id, Relation { table, columns });
                Ok(None)
            }
            b'I' => {
                let id = at.u32("relation id")?;
                let relation = self
                    .relations
                    .get(&id)
                    .ok_or(DecodeError::UnknownRelation(id))?;
                if relation.table != OUTBOX_TABLE {
                    return Ok(None);
                }
                let _new = at.byte("tuple marker")?;
                let values = at.tuple()?;
                let row: HashMap<&str, Option<&str>> = relation
                    .columns
                    .iter()
                    .map(String::as_str)
                    .zip(values)
                    .collect();
                event_of(&row).map(Some)
            }
            _ => Ok(None),
        }
    }
}

/// The event of an outbox row's values.
fn event_of(row: &HashMap<&str, Option<&str>>) -> Result<OutboxEvent, DecodeError> {
    Ok(OutboxEvent {
        id: parse(row, "id", |v| v.parse::<i64>().map_err(|e| e.to_string()))?,
        event_id: parse(row, "event_id", |v| {
            Uuid::parse_str(v).map_err(|e| e.to_string())
        })?,
        event_type: parse(row, "event_type", |v| Ok(v.to_owned()))?,
        aggregate_id: parse(row, "aggregate_id", |v| Ok(v.to_owned()))?,
        sequence: parse(row, "sequence", |v| v.parse::<i64>().map_err(|e| e.to_string()))?,
        topic: parse(row, "topic", |v| Ok(v.to_owned()))?,
        payload: parse(row, "payload", |v| Ok(v.to_owned()))?,
        headers: parse(row, "headers", |v| {
            serde_json::from_str::<Value>(v).map_err(|e| e.to_string())
        })?,
        attempts: 0,
        created_at: parse(row, "created_at", timestamp)?,
    })
}

/// Column `column` of `row`, present and not NULL, read by `read`.
fn parse<T>(
    row: &HashMap<&str, Option<&str>>,
    column: &'static str,
    read: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, DecodeError> {
    let value = match row.get(column) {
        None => return Err(DecodeError::Column { column, reason: "not in the table".to_owned() }),
        Some(None) => return Err(DecodeError::Column { column, reason: "NULL".to_owned() }),
        Some(Some(value)) => *value,
    };
    read(value).map_err(|reason| DecodeError::Column { column, reason })
}

/// A `timestamptz` as the replication session shows it (`DateStyle` ISO, `TimeZone` UTC):
/// `2026-12-05 19:43:37.123456+00`.
fn timestamp(value: &str) -> Result<DateTime<Utc>, String> {
    let local = value
        .strip_suffix("+00")
        .ok_or_else(|| format!("`{value}` is not in UTC"))?;
    NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f")
        .map(|t| t.and_utc())
        .map_err(|e| format!("`{value}`: {e}"))
}

/// A cursor over a message's bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Short(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn byte(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A NUL-terminated string.
    fn text(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::Short(what))?;
        let text = String::from_utf8_lossy(self.take(end, what)?).into_owned();
        let _nul = self.take(1, what)?;
        Ok(text)
    }

    /// A row's values: NULL, or text. An insert carries no unchanged-TOAST marker (only an
    /// update's new row can), and no binary value (the stream asks for text).
    fn tuple(&mut self) -> Result<Vec<Option<&'a str>>, DecodeError> {
        let count = self.u16("value count")?;
        let mut values = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            match self.byte("value kind")? {
                b'n' => values.push(None),
                b't' => {
                    let len = self.u32("value length")? as usize;
                    let bytes = self.take(len, "value")?;
                    let text = std::str::from_utf8(bytes).map_err(|e| DecodeError::Column {
                        column: "value",
                        reason: e.to_string(),
                    })?;
                    values.push(Some(text));
                }
                kind => {
                    return Err(DecodeError::Column {
                        column: "value",
                        reason: format!("a value of kind {:?} in an insert", kind as char),
                    })
                }
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COLUMNS: [&str; 10] = [
        "id", "event_id", "business_key", "event_type", "aggregate_id", "sequence", "topic",
        "payload", "headers", "created_at",
    ];

    fn relation(id: u32, table: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        m.extend(b"public\0");
        m.extend(table.as_bytes());
        m.push(0);
        m.push(b'd');
        m.extend((columns.len() as u16).to_be_bytes());
        for c in columns {
            m.push(0);
            m.extend(c.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend(u32::MAX.to_be_bytes());
        }
        m
    }

    fn insert(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend((values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend((v.len() as u32).to_be_bytes());
                    m.extend(v.as_bytes());
                }
            }
        }
        m
    }

    fn outbox_row() -> Vec<Option<&'static str>> {
        vec![
            Some("42"),
            Some("0193a8f0-0000-7000-8000-000000000001"),
            Some("order-7:placed"),
            Some("order.placed"),
            Some("order-7"),
            Some("3"),
            Some("order-events"),
            Some(r#"{"total": 12}"#),
            Some(r#"{"traceparent": "00-ab-cd-01"}"#),
            Some("2026-12-05 19:43:37.123456+00"),
        ]
    }

    #[test]
    fn an_outbox_insert_is_its_event() {
        let mut decoder = Decoder::default();
        assert_eq!(decoder.decode(&relation(7, "outbox", &COLUMNS)), Ok(None));
        let event = decoder
            .decode(&insert(7, &outbox_row()))
            .expect("decoded")
            .expect("an event");
        assert_eq!(event.id, 42);
        assert_eq!(event.event_id.to_string(), "0193a8f0-0000-7000-8000-000000000001");
        assert_eq!((event.aggregate_id.as_str(), event.sequence), ("order-7", 3));
        assert_eq!((event.event_type.as_str(), event.topic.as_str()), ("order.placed", "order-events"));
        assert_eq!(event.payload, r#"{"total": 12}"#);
        assert_eq!(event.extra_headers(), vec![("traceparent".to_owned(), "00-ab-cd-01".to_owned())]);
        assert_eq!(event.created_at.to_rfc3339(), "2026-12-05T19:43:37.123456+00:00");
    }

    #[test]
    fn columns_are_found_by_name_whatever_their_order() {
        let mut decoder = Decoder::default();
        let mut columns = COLUMNS.to_vec();
        let mut row = outbox_row();
        columns.reverse();
        row.reverse();
        let _ = decoder.decode(&relation(9, "outbox", &columns));
        let event = decoder.decode(&insert(9, &row)).expect("decoded").expect("an event");
        assert_eq!((event.id, event.sequence), (42, 3));
    }

    #[test]
    fn other_tables_and_other_messages_are_passed_over() {
        let mut decoder = Decoder::default();
        let _ = decoder.decode(&relation(3, "outbox_delivery", &["id"]));
        assert_eq!(decoder.decode(&insert(3, &[Some("1")])), Ok(None));
        assert_eq!(decoder.decode(b"Yanything"), Ok(None));
    }

    #[test]
    fn what_the_relay_cannot_read_is_an_error_that_says_what() {
        let mut decoder = Decoder::default();
        assert_eq!(
            decoder.decode(&insert(5, &outbox_row())),
            Err(DecodeError::UnknownRelation(5))
        );
        let _ = decoder.decode(&relation(5, "outbox", &COLUMNS));
        let mut row = outbox_row();
        row[5] = None;
        assert_eq!(
            decoder.decode(&insert(5, &row)),
            Err(DecodeError::Column { column: "sequence", reason: "NULL".to_owned() })
        );
        let mut row = outbox_row();
        row[9] = Some("2026-12-05 19:43:37+01");
        assert!(matches!(
            decoder.decode(&insert(5, &row)),
            Err(DecodeError::Column { column: "created_at", .. })
        ));
        let whole = insert(5, &outbox_row());
        assert!(matches!(
            decoder.decode(&whole[..whole.len() - 3]),
            Err(DecodeError::Short(_))
        ));
        assert_eq!(decoder.decode(&[]), Err(DecodeError::Short("message kind")));
    }
}
