//! A Kafka record's bytes as they arrived, whatever they hold, and readable text made from them.
//!
//! A record's key, header values and payload are bytes: nothing guarantees they are UTF-8, free
//! of NUL, or JSON. PostgreSQL's `text` and `jsonb` refuse invalid UTF-8 and NUL, so a record's
//! bytes are stored as `bytea` and only [`escape`]d text, which holds neither, goes into text
//! columns or onto an operator's screen.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};

use rdkafka::message::Headers;

/// The name kept for a header whose name the Kafka client could not read (not UTF-8, which the
/// Kafka protocol requires of header names).
pub const UNREADABLE_NAME: &str = "\u{fffd}";

/// Header names' bytes and values' bytes, as two arrays of equal length (a `bytea[]` each; a
/// `None` value is a header without one).
pub type HeaderColumns = (Vec<Vec<u8>>, Vec<Option<Vec<u8>>>);

/// One header: its name and its value's bytes, if it has a value.
type Header = (Box<str>, Option<Box<[u8]>>);

/// A record's headers, in order, duplicates and all: each name with its value's exact bytes
/// (`None` for a header without a value, which differs from an empty value).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordHeaders {
    pairs: Vec<Header>,
    /// Headers whose name the client library could not read (kept as [`UNREADABLE_NAME`]).
    unreadable_names: usize,
}

impl RecordHeaders {
    /// Reads a record's headers as they are. The Kafka client library panics on a header name
    /// that is not UTF-8; such a header is kept as [`UNREADABLE_NAME`] without its value and
    /// counted in [`RecordHeaders::unreadable_names`], so no header stops the reader.
    pub fn read<H: Headers>(headers: Option<&H>) -> Self {
        let Some(headers) = headers else {
            return RecordHeaders::default();
        };
        let mut read = RecordHeaders {
            pairs: Vec::with_capacity(headers.count()),
            unreadable_names: 0,
        };
        for i in 0..headers.count() {
            match catch_unwind(AssertUnwindSafe(|| headers.try_get(i))) {
                Ok(Some(h)) => read.pairs.push((h.key.into(), h.value.map(Into::into))),
                Ok(None) => {}
                Err(_) => {
                    read.unreadable_names += 1;
                    read.pairs.push((UNREADABLE_NAME.into(), None));
                }
            }
        }
        read
    }

    /// Headers from names and values.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Self {
        RecordHeaders {
            pairs: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.map(Into::into)))
                .collect(),
            unreadable_names: 0,
        }
    }

    /// Every header in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        self.pairs.iter().map(|(k, v)| (&**k, v.as_deref()))
    }

    /// The value of the first header named `name`: `None` when there is none, `Some(None)` when
    /// it has no value.
    pub fn get(&self, name: &str) -> Option<Option<&[u8]>> {
        self.pairs
            .iter()
            .find(|(k, _)| &**k == name)
            .map(|(_, v)| v.as_deref())
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Headers whose names the client library could not read.
    pub fn unreadable_names(&self) -> usize {
        self.unreadable_names
    }

    /// The names' bytes and the values' bytes, as two arrays of equal length (a `bytea[]` each).
    pub fn to_columns(&self) -> HeaderColumns {
        self.pairs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_deref().map(<[u8]>::to_vec)))
            .unzip()
    }

    /// Headers back from [`RecordHeaders::to_columns`]' arrays (names that are not UTF-8 are
    /// escaped).
    pub fn from_columns(names: &[Vec<u8>], values: &[Option<Vec<u8>>]) -> Self {
        RecordHeaders {
            pairs: names
                .iter()
                .zip(values.iter().chain(std::iter::repeat(&None)))
                .map(|(k, v)| {
                    let name = match std::str::from_utf8(k) {
                        Ok(name) => name.into(),
                        Err(_) => escape(k).into_owned().into_boxed_str(),
                    };
                    (name, v.as_deref().map(Into::into))
                })
                .collect(),
            unreadable_names: 0,
        }
    }

    /// The headers for people: a JSON object of each name (the first of duplicates) to its
    /// [`escape`]d value, or `null` without one. Holds no NUL, so `jsonb` takes it.
    pub fn to_display_json(&self) -> serde_json::Value {
        let mut map = serde_json::Map::with_capacity(self.pairs.len());
        for (k, v) in &self.pairs {
            let key = escape(k.as_bytes()).into_owned();
            if map.contains_key(&key) {
                continue;
            }
            let value = match v {
                Some(v) => serde_json::Value::String(escape(v).into_owned()),
                None => serde_json::Value::Null,
            };
            let _ = map.insert(key, value);
        }
        serde_json::Value::Object(map)
    }
}

/// Headers from a JSON object of names to string values (`null`: no value); other values are
/// taken as their JSON text.
impl From<serde_json::Value> for RecordHeaders {
    fn from(value: serde_json::Value) -> Self {
        let serde_json::Value::Object(map) = value else {
            return RecordHeaders::default();
        };
        RecordHeaders {
            pairs: map
                .into_iter()
                .map(|(k, v)| {
                    let v = match v {
                        serde_json::Value::Null => None,
                        serde_json::Value::String(s) => Some(s.into_bytes().into()),
                        other => Some(other.to_string().into_bytes().into()),
                    };
                    (k.into_boxed_str(), v)
                })
                .collect(),
            unreadable_names: 0,
        }
    }
}

/// Readable text of any bytes, reversible by [`unescape`]: UTF-8 characters stay as they are,
/// except a backslash (`\\`) and control characters (`\0`, `\t`, `\n`, `\r`, `\u{1b}`…); bytes
/// that are not UTF-8 become `\xNN`. The result holds no NUL, so PostgreSQL's `text` takes it.
/// Borrowed when there is nothing to escape.
pub fn escape(bytes: &[u8]) -> Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(bytes) {
        if !s.chars().any(|c| c == '\\' || c.is_control()) {
            return Cow::Borrowed(s);
        }
    }
    let mut out = String::with_capacity(bytes.len() + 8);
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\0' => out.push_str("\\0"),
                '\t' => out.push_str("\\t"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                c if c.is_control() => {
                    let _ = write!(out, "\\u{{{:x}}}", c as u32);
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    Cow::Owned(out)
}

/// Text that PostgreSQL's `text` takes: `s` with each NUL written `\0`.
pub fn without_nul(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\\0"))
    } else {
        Cow::Borrowed(s)
    }
}

/// Why [`unescape`] refused a text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid escape at character {at}: {what}")]
pub struct UnescapeError {
    /// Character position of the escape.
    pub at: usize,
    /// What is wrong with it.
    pub what: &'static str,
}

/// The bytes [`escape`] made `text` from.
pub fn unescape(text: &str) -> Result<Vec<u8>, UnescapeError> {
    let mut out = Vec::with_capacity(text.len());
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if c != '\\' {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            continue;
        }
        let err = |what| UnescapeError { at, what };
        match chars.next().map(|(_, c)| c) {
            Some('\\') => out.push(b'\\'),
            Some('0') => out.push(0),
            Some('t') => out.push(b'\t'),
            Some('n') => out.push(b'\n'),
            Some('r') => out.push(b'\r'),
            Some('x') => {
                let hex: String = (0..2)
                    .filter_map(|_| chars.next().map(|(_, c)| c))
                    .collect();
                let b = u8::from_str_radix(&hex, 16)
                    .ok()
                    .filter(|_| hex.len() == 2)
                    .ok_or(err("\\x takes two hexadecimal digits"))?;
                out.push(b);
            }
            Some('u') => {
                if chars.next().map(|(_, c)| c) != Some('{') {
                    return Err(err("\\u takes {hex}"));
                }
                let mut hex = String::new();
                loop {
                    match chars.next().map(|(_, c)| c) {
                        Some('}') => break,
                        Some(c) if hex.len() < 6 => hex.push(c),
                        _ => return Err(err("\\u{…} is not closed")),
                    }
                }
                let c = u32::from_str_radix(&hex, 16)
                    .ok()
                    .and_then(char::from_u32)
                    .ok_or(err("\\u{…} is not a character"))?;
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
            _ => return Err(err("unknown escape")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_keeps_text_readable_and_reversible() {
        assert!(matches!(
            escape(b"order-1 caf\xc3\xa9"),
            Cow::Borrowed("order-1 café")
        ));
        assert_eq!(escape(b"\xff\xfe"), "\\xff\\xfe");
        assert_eq!(escape(b"a\0b\\c\n\x1b"), "a\\0b\\\\c\\n\\u{1b}");
        for bytes in [
            b"\xff\xfe".as_slice(),
            b"a\0b\\c\n\x1b\xc3",
            b"\\xff",
            "é\u{7f}".as_bytes(),
            b"",
        ] {
            let text = escape(bytes);
            assert!(!text.contains('\0'));
            assert_eq!(unescape(&text).as_deref(), Ok(bytes), "{text}");
        }
        assert!(unescape("\\x4").is_err());
        assert!(unescape("\\q").is_err());
        assert!(unescape("\\u{110000}").is_err());
    }

    #[test]
    fn headers_keep_exact_bytes_and_show_escaped() {
        let headers = RecordHeaders::from_pairs([
            ("event-id", Some(b"e-1".as_slice())),
            ("v", Some(b"caf\xc3\xa9 \xff\0".as_slice())),
            ("v", Some(b"second".as_slice())),
            ("empty", Some(b"".as_slice())),
            ("none", None),
        ]);
        assert_eq!(
            headers.get("v"),
            Some(Some(b"caf\xc3\xa9 \xff\0".as_slice()))
        );
        assert_eq!(headers.get("none"), Some(None));
        assert_eq!(headers.get("missing"), None);
        let (names, values) = headers.to_columns();
        assert_eq!(RecordHeaders::from_columns(&names, &values), headers);
        assert_eq!(
            headers.to_display_json(),
            serde_json::json!({"event-id": "e-1", "v": "café \\xff\\0", "empty": "", "none": null})
        );
    }
}
