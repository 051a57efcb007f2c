//! The outbox's inserts as PostgreSQL's `pgoutput` plugin (protocol version 1) sends them: a
//! Relation message describes a table's columns (sent before its first row, and again after the
//! table changed), an Insert carries a new row's values, in binary (`binary 'true'`, the
//! session's choice: no text formatting of ids, uuids and timestamps on either side) or as text.
//! The publication the relay reads publishes the outbox's inserts only; a message of another
//! kind, or a row of another table, is passed over.
//!
//! Where each column the relay needs sits in a row, and its type, is worked out once per
//! Relation message, not once per row.

use std::collections::HashMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::claim::OutboxEvent;

/// The table whose inserts are the outbox's events.
const OUTBOX_TABLE: &str = "outbox";

/// The outbox's columns the relay reads, in [`Column`]'s order.
const COLUMNS: [&str; 9] = [
    "id",
    "event_id",
    "event_type",
    "aggregate_id",
    "sequence",
    "topic",
    "payload",
    "headers",
    "created_at",
];

/// A column of [`COLUMNS`], by its place there.
#[derive(Debug, Clone, Copy)]
enum Column {
    Id,
    EventId,
    EventType,
    AggregateId,
    Sequence,
    Topic,
    Payload,
    Headers,
    CreatedAt,
}

/// PostgreSQL's type ids of the columns' types (`pg_type.oid`, fixed for built-in types).
mod oid {
    pub(super) const INT8: u32 = 20;
    pub(super) const TEXT: u32 = 25;
    pub(super) const JSON: u32 = 114;
    pub(super) const VARCHAR: u32 = 1043;
    pub(super) const TIMESTAMPTZ: u32 = 1184;
    pub(super) const UUID: u32 = 2950;
    pub(super) const JSONB: u32 = 3802;
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00 UTC), the origin of a
/// binary timestamp.
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

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

/// Where a row of the outbox holds each of [`COLUMNS`] (its place, and its type's id); `None`
/// for a column the table lacks.
type Layout = [Option<(usize, u32)>; COLUMNS.len()];

/// What a Relation message said about a table: for the outbox, where its columns are.
#[derive(Debug)]
enum Relation {
    Outbox(Box<Layout>),
    Other,
}

/// One value of a row.
#[derive(Debug, Clone, Copy)]
enum Datum<'a> {
    Null,
    Text(&'a str),
    Binary(&'a [u8]),
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
                let mut layout: Layout = [None; COLUMNS.len()];
                for place in 0..usize::from(count) {
                    let _flags = at.byte("column flags")?;
                    let name = at.text("column name")?;
                    let type_id = at.u32("column type")?;
                    let _modifier = at.u32("column type modifier")?;
                    if let Some(i) = COLUMNS.iter().position(|c| *c == name) {
                        layout[i] = Some((place, type_id));
                    }
                }
                let relation = if table == OUTBOX_TABLE {
                    Relation::Outbox(Box::new(layout))
                } else {
                    Relation::Other
                };
                let _ = self.relations.insert(id, relation);
                Ok(None)
            }
            b'I' => {
                let id = at.u32("relation id")?;
                let layout = match self.relations.get(&id) {
                    None => return Err(DecodeError::UnknownRelation(id)),
                    Some(Relation::Other) => return Ok(None),
                    Some(Relation::Outbox(layout)) => layout,
                };
                let _new = at.byte("tuple marker")?;
                let values = at.tuple()?;
                event_of(&Row { layout, values: &values }).map(Some)
            }
            _ => Ok(None),
        }
    }
}

/// An outbox row's values, read through its table's layout.
struct Row<'r, 'a> {
    layout: &'r Layout,
    values: &'r [Datum<'a>],
}

impl<'a> Row<'_, 'a> {
    /// Column `column`'s value, present and not NULL, with its type's id.
    fn get(&self, column: Column) -> Result<(Datum<'a>, u32), DecodeError> {
        let name = COLUMNS[column as usize];
        let fail = |reason: &str| DecodeError::Column { column: name, reason: reason.to_owned() };
        let (place, type_id) = self.layout[column as usize].ok_or_else(|| fail("not in the table"))?;
        match self.values.get(place) {
            None => Err(fail("missing from the row")),
            Some(Datum::Null) => Err(fail("NULL")),
            Some(datum) => Ok((*datum, type_id)),
        }
    }

    /// Column `column` read by `read` (its value and type id), its error naming the column.
    fn read<T>(
        &self,
        column: Column,
        read: impl FnOnce(Datum<'a>, u32) -> Result<T, String>,
    ) -> Result<T, DecodeError> {
        let (datum, type_id) = self.get(column)?;
        read(datum, type_id).map_err(|reason| DecodeError::Column {
            column: COLUMNS[column as usize],
            reason,
        })
    }
}

/// The event of an outbox row.
fn event_of(row: &Row<'_, '_>) -> Result<OutboxEvent, DecodeError> {
    Ok(OutboxEvent {
        id: row.read(Column::Id, int8)?,
        event_id: row.read(Column::EventId, uuid)?,
        event_type: row.read(Column::EventType, text)?.to_owned(),
        aggregate_id: row.read(Column::AggregateId, text)?.to_owned(),
        sequence: row.read(Column::Sequence, int8)?,
        topic: row.read(Column::Topic, text)?.to_owned(),
        payload: row.read(Column::Payload, json_text)?.to_owned(),
        headers: row.read(Column::Headers, |datum, type_id| {
            serde_json::from_str::<Value>(json_text(datum, type_id)?).map_err(|e| e.to_string())
        })?,
        attempts: 0,
        created_at: row.read(Column::CreatedAt, timestamptz)?,
    })
}

/// A value's type is not the one the relay reads it as.
fn unexpected(type_id: u32, want: &str) -> String {
    format!("of type id {type_id}, not {want}")
}

/// A `bigint`: eight bytes, big-endian, or its digits.
fn int8(datum: Datum<'_>, type_id: u32) -> Result<i64, String> {
    if type_id != oid::INT8 {
        return Err(unexpected(type_id, "bigint"));
    }
    match datum {
        Datum::Binary(b) => <[u8; 8]>::try_from(b)
            .map(i64::from_be_bytes)
            .map_err(|_| format!("{} bytes for a bigint", b.len())),
        Datum::Text(t) => t.parse::<i64>().map_err(|e| e.to_string()),
        Datum::Null => Err("NULL".to_owned()),
    }
}

/// A `uuid`: sixteen bytes, or its text.
fn uuid(datum: Datum<'_>, type_id: u32) -> Result<Uuid, String> {
    if type_id != oid::UUID {
        return Err(unexpected(type_id, "uuid"));
    }
    match datum {
        Datum::Binary(b) => Uuid::from_slice(b).map_err(|e| e.to_string()),
        Datum::Text(t) => Uuid::parse_str(t).map_err(|e| e.to_string()),
        Datum::Null => Err("NULL".to_owned()),
    }
}

/// A `text` or `varchar`: its UTF-8 bytes either way.
fn text<'a>(datum: Datum<'a>, type_id: u32) -> Result<&'a str, String> {
    if !matches!(type_id, oid::TEXT | oid::VARCHAR) {
        return Err(unexpected(type_id, "text"));
    }
    match datum {
        Datum::Binary(b) => std::str::from_utf8(b).map_err(|e| e.to_string()),
        Datum::Text(t) => Ok(t),
        Datum::Null => Err("NULL".to_owned()),
    }
}

/// A `jsonb` (or `json`) document's text: in binary a `jsonb` is a version byte (1) and the text.
fn json_text<'a>(datum: Datum<'a>, type_id: u32) -> Result<&'a str, String> {
    let bytes = match (datum, type_id) {
        (Datum::Text(t), oid::JSONB | oid::JSON) => return Ok(t),
        (Datum::Binary([1, rest @ ..]), oid::JSONB) => rest,
        (Datum::Binary(b), oid::JSONB) => {
            return Err(format!("jsonb of version {:?}, not 1", b.first()))
        }
        (Datum::Binary(b), oid::JSON) => b,
        (Datum::Null, _) => return Err("NULL".to_owned()),
        _ => return Err(unexpected(type_id, "jsonb")),
    };
    std::str::from_utf8(bytes).map_err(|e| e.to_string())
}

/// A `timestamptz`: microseconds since 2000-01-01 UTC, or the text the replication session
/// shows (`DateStyle` ISO, `TimeZone` UTC: `2026-12-05 19:43:37.123456+00`).
fn timestamptz(datum: Datum<'_>, type_id: u32) -> Result<DateTime<Utc>, String> {
    if type_id != oid::TIMESTAMPTZ {
        return Err(unexpected(type_id, "timestamptz"));
    }
    match datum {
        Datum::Binary(b) => {
            let micros = <[u8; 8]>::try_from(b)
                .map(i64::from_be_bytes)
                .map_err(|_| format!("{} bytes for a timestamptz", b.len()))?;
            micros
                .checked_add(POSTGRES_EPOCH_MICROS)
                .and_then(DateTime::from_timestamp_micros)
                .ok_or_else(|| format!("{micros} µs from 2000 is out of range (infinity?)"))
        }
        Datum::Text(value) => {
            let local = value
                .strip_suffix("+00")
                .ok_or_else(|| format!("`{value}` is not in UTC"))?;
            NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f")
                .map(|t| t.and_utc())
                .map_err(|e| format!("`{value}`: {e}"))
        }
        Datum::Null => Err("NULL".to_owned()),
    }
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

    /// A row's values: NULL, text or binary. An insert carries no unchanged-TOAST marker (only
    /// an update's new row can).
    fn tuple(&mut self) -> Result<Vec<Datum<'a>>, DecodeError> {
        let count = self.u16("value count")?;
        let mut values = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let kind = self.byte("value kind")?;
            let value = match kind {
                b'n' => Datum::Null,
                b't' | b'b' => {
                    let len = self.u32("value length")? as usize;
                    let bytes = self.take(len, "value")?;
                    if kind == b'b' {
                        Datum::Binary(bytes)
                    } else {
                        Datum::Text(std::str::from_utf8(bytes).map_err(|e| {
                            DecodeError::Column {
                                column: "value",
                                reason: e.to_string(),
                            }
                        })?)
                    }
                }
                kind => {
                    return Err(DecodeError::Column {
                        column: "value",
                        reason: format!("a value of kind {:?} in an insert", kind as char),
                    })
                }
            };
            values.push(value);
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: [(&str, u32); 10] = [
        ("id", oid::INT8),
        ("event_id", oid::UUID),
        ("business_key", oid::TEXT),
        ("event_type", oid::TEXT),
        ("aggregate_id", oid::TEXT),
        ("sequence", oid::INT8),
        ("topic", oid::TEXT),
        ("payload", oid::JSONB),
        ("headers", oid::JSONB),
        ("created_at", oid::TIMESTAMPTZ),
    ];

    fn relation(id: u32, table: &str, columns: &[(&str, u32)]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        m.extend(b"public\0");
        m.extend(table.as_bytes());
        m.push(0);
        m.push(b'd');
        m.extend((columns.len() as u16).to_be_bytes());
        for (name, type_id) in columns {
            m.push(0);
            m.extend(name.as_bytes());
            m.push(0);
            m.extend(type_id.to_be_bytes());
            m.extend(u32::MAX.to_be_bytes());
        }
        m
    }

    /// An insert of `values`: `None` is NULL, `Some((b't', bytes))` text, `Some((b'b', bytes))`
    /// binary.
    fn insert(id: u32, values: &[Option<(u8, Vec<u8>)>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend((values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some((kind, bytes)) => {
                    m.push(*kind);
                    m.extend((bytes.len() as u32).to_be_bytes());
                    m.extend(bytes);
                }
            }
        }
        m
    }

    fn t(value: &str) -> Option<(u8, Vec<u8>)> {
        Some((b't', value.as_bytes().to_vec()))
    }

    fn b(bytes: impl Into<Vec<u8>>) -> Option<(u8, Vec<u8>)> {
        Some((b'b', bytes.into()))
    }

    const EVENT_ID: &str = "0193a8f0-0000-7000-8000-000000000001";

    fn text_row() -> Vec<Option<(u8, Vec<u8>)>> {
        vec![
            t("42"),
            t(EVENT_ID),
            t("order-7:placed"),
            t("order.placed"),
            t("order-7"),
            t("3"),
            t("order-events"),
            t(r#"{"total": 12}"#),
            t(r#"{"traceparent": "00-ab-cd-01"}"#),
            t("2026-12-05 19:43:37.123456+00"),
        ]
    }

    /// The same row as the walsender sends it with `binary 'true'`.
    fn binary_row() -> Vec<Option<(u8, Vec<u8>)>> {
        let jsonb = |text: &str| [&[1u8][..], text.as_bytes()].concat();
        // 2026-12-05 19:43:37.123456 UTC, in microseconds since 2000-01-01 UTC.
        let created = 1_796_499_817_123_456i64 - POSTGRES_EPOCH_MICROS;
        vec![
            b(42i64.to_be_bytes()),
            b(Uuid::parse_str(EVENT_ID).expect("a uuid").as_bytes().to_vec()),
            b("order-7:placed"),
            b("order.placed"),
            b("order-7"),
            b(3i64.to_be_bytes()),
            b("order-events"),
            b(jsonb(r#"{"total": 12}"#)),
            b(jsonb(r#"{"traceparent": "00-ab-cd-01"}"#)),
            b(created.to_be_bytes()),
        ]
    }

    fn assert_is_the_event(event: &OutboxEvent) {
        assert_eq!(event.id, 42);
        assert_eq!(event.event_id.to_string(), EVENT_ID);
        assert_eq!((event.aggregate_id.as_str(), event.sequence), ("order-7", 3));
        assert_eq!((event.event_type.as_str(), event.topic.as_str()), ("order.placed", "order-events"));
        assert_eq!(event.payload, r#"{"total": 12}"#);
        assert_eq!(event.extra_headers(), vec![("traceparent".to_owned(), "00-ab-cd-01".to_owned())]);
        assert_eq!(event.created_at.to_rfc3339(), "2026-12-05T19:43:37.123456+00:00");
    }

    #[test]
    fn an_outbox_insert_is_its_event_in_text_and_in_binary() {
        let mut decoder = Decoder::default();
        assert_eq!(decoder.decode(&relation(7, "outbox", &TABLE)), Ok(None));
        for row in [text_row(), binary_row()] {
            let event = decoder.decode(&insert(7, &row)).expect("decoded").expect("an event");
            assert_is_the_event(&event);
        }
    }

    #[test]
    fn columns_are_found_by_name_whatever_their_order() {
        let mut decoder = Decoder::default();
        let mut columns = TABLE.to_vec();
        let mut row = binary_row();
        columns.reverse();
        row.reverse();
        let _ = decoder.decode(&relation(9, "outbox", &columns));
        let event = decoder.decode(&insert(9, &row)).expect("decoded").expect("an event");
        assert_is_the_event(&event);
        // A new Relation message (the table changed) replaces the layout.
        let _ = decoder.decode(&relation(9, "outbox", &TABLE));
        let event = decoder.decode(&insert(9, &binary_row())).expect("decoded").expect("an event");
        assert_is_the_event(&event);
    }

    #[test]
    fn other_tables_and_other_messages_are_passed_over() {
        let mut decoder = Decoder::default();
        let _ = decoder.decode(&relation(3, "outbox_delivery", &[("id", oid::INT8)]));
        assert_eq!(decoder.decode(&insert(3, &[t("1")])), Ok(None));
        assert_eq!(decoder.decode(b"Yanything"), Ok(None));
    }

    #[test]
    fn what_the_relay_cannot_read_is_an_error_that_says_what() {
        let mut decoder = Decoder::default();
        assert_eq!(
            decoder.decode(&insert(5, &text_row())),
            Err(DecodeError::UnknownRelation(5))
        );
        let _ = decoder.decode(&relation(5, "outbox", &TABLE));
        let column_of = |row: Vec<Option<(u8, Vec<u8>)>>, decoder: &mut Decoder| {
            match decoder.decode(&insert(5, &row)) {
                Err(DecodeError::Column { column, reason }) => (column, reason),
                other => panic!("not a column's error: {other:?}"),
            }
        };
        let mut row = text_row();
        row[5] = None;
        assert_eq!(column_of(row, &mut decoder), ("sequence", "NULL".to_owned()));
        let mut row = text_row();
        row[9] = t("2026-12-05 19:43:37+01");
        assert_eq!(column_of(row, &mut decoder).0, "created_at");
        let mut row = binary_row();
        row[0] = b([0u8; 4]);
        assert_eq!(column_of(row, &mut decoder), ("id", "4 bytes for a bigint".to_owned()));
        let mut row = binary_row();
        row[7] = b(b"\x02{}".to_vec());
        assert_eq!(column_of(row, &mut decoder).0, "payload");
        let mut row = binary_row();
        row[9] = b(i64::MAX.to_be_bytes());
        assert_eq!(column_of(row, &mut decoder).0, "created_at");
        let mut row = binary_row();
        row[8] = b([&[1u8][..], b"not json"].concat());
        assert_eq!(column_of(row, &mut decoder).0, "headers");
        let whole = insert(5, &text_row());
        assert!(matches!(
            decoder.decode(&whole[..whole.len() - 3]),
            Err(DecodeError::Short(_))
        ));
        assert_eq!(decoder.decode(&[]), Err(DecodeError::Short("message kind")));

        // A table changed under the relay: a column gone, or of another type.
        let mut columns = TABLE.to_vec();
        columns[5].0 = "seq";
        let _ = decoder.decode(&relation(5, "outbox", &columns));
        assert_eq!(
            column_of(text_row(), &mut decoder),
            ("sequence", "not in the table".to_owned())
        );
        let mut columns = TABLE.to_vec();
        columns[0].1 = 23;
        let _ = decoder.decode(&relation(5, "outbox", &columns));
        assert_eq!(
            column_of(binary_row(), &mut decoder),
            ("id", "of type id 23, not bigint".to_owned())
        );
    }
}
