//! Checks on what clients send, before anything touches the database.
//!
//! Every rule here answers with a [`ValidationError`] whose message is safe to show the client;
//! the API turns it into a 4xx. Nothing that passes these checks can make PostgreSQL reject the
//! write for a reason the client caused (NUL characters, out-of-range integers). Request types
//! are read from JSON objects only, never from arrays by position; the API also refuses a body
//! with a NUL character anywhere, even in a field it does not read (`api::body`).

use std::collections::HashSet;
use std::fmt;

use chrono::{DateTime, Utc};
use demo_events::order_events::OrderLine;
use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};

/// Longest customer id accepted, in characters.
pub const MAX_CUSTOMER_ID_CHARS: usize = 200;
/// Longest product id accepted, in characters.
pub const MAX_PRODUCT_ID_CHARS: usize = 200;
/// Longest e-mail address accepted, in characters (RFC 5321 path limit).
pub const MAX_EMAIL_CHARS: usize = 254;
/// Most lines one order may have.
pub const MAX_LINES: usize = 100;
/// Largest quantity of one line.
pub const MAX_QUANTITY: i64 = 10_000;
/// Longest `Idempotency-Key` accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 200;

/// The body of `POST /orders`, as sent: a JSON object (see `object_only!`).
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self")]
pub struct CreateOrderRequest {
    pub customer_id: String,
    #[serde(default)]
    pub email: Option<String>,
    pub lines: Vec<RequestedLine>,
    /// When to remind the customer to pay if the order is still unpaid (RFC 3339), instead of
    /// the service's default delay.
    #[serde(default)]
    pub payment_reminder_at: Option<DateTime<Utc>>,
}

/// One requested line, a JSON object (see `object_only!`). The quantity is read wide so that
/// an absurd value gets our message, not a deserialisation error.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self")]
pub struct RequestedLine {
    pub product_id: String,
    pub quantity: i64,
}

/// Implements `Deserialize` for a struct deriving it with `#[serde(remote = "Self")]`, taking
/// its fields from a JSON object only. serde's derive alone also reads a struct from a JSON array,
/// its fields by position, so that `["c-1", null, [["sku-1", 1]]]` would be taken for an order.
macro_rules! object_only {
    ($request:ident) => {
        impl<'de> Deserialize<'de> for $request {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Fields;
                impl<'de> Visitor<'de> for Fields {
                    type Value = $request;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a JSON object")
                    }
                    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<$request, A::Error> {
                        // The derived (inherent) function, reading the object's fields by name.
                        $request::deserialize(MapAccessDeserializer::new(map))
                    }
                }
                deserializer.deserialize_map(Fields)
            }
        }
    };
}
object_only!(CreateOrderRequest);
object_only!(RequestedLine);

/// A request that passed every check. Serialises canonically, which is what the idempotency
/// fingerprint is computed from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ValidOrder {
    pub customer_id: String,
    pub email: Option<String>,
    pub lines: Vec<OrderLine>,
    /// Left out of the canonical form when absent, so a request without it keeps the
    /// fingerprint it always had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_reminder_at: Option<DateTime<Utc>>,
}

/// Why a request was refused. The message is meant for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("customer_id must not be empty")]
    EmptyCustomerId,
    #[error("customer_id must be at most {MAX_CUSTOMER_ID_CHARS} characters")]
    CustomerIdTooLong,
    #[error("{0} must not contain NUL characters")]
    NulCharacter(String),
    #[error("email `{0}` is not an e-mail address")]
    InvalidEmail(String),
    #[error("an order needs at least one line")]
    NoLines,
    #[error("an order may have at most {MAX_LINES} lines, this one has {0}")]
    TooManyLines(usize),
    #[error("lines[{0}].product_id must not be empty")]
    EmptyProductId(usize),
    #[error("lines[{0}].product_id must be at most {MAX_PRODUCT_ID_CHARS} characters")]
    ProductIdTooLong(usize),
    #[error("lines[{line}].quantity must be between 1 and {MAX_QUANTITY}, got {quantity}")]
    QuantityOutOfRange { line: usize, quantity: i64 },
    #[error("product `{0}` appears on more than one line")]
    DuplicateProduct(String),
    #[error("{field} {at} is in the past (more than {PUBLISH_TIME_PAST_TOLERANCE_SECONDS} s ago)")]
    PublishTimeInPast { field: &'static str, at: String },
    #[error("{field} {at} is beyond the delay horizon of {horizon_seconds} s from now")]
    PublishTimeBeyondHorizon {
        field: &'static str,
        at: String,
        horizon_seconds: i64,
    },
}

/// How far in the past a requested publish time may be (clocks differ a little between a client
/// and the service); such a time means "at once".
pub const PUBLISH_TIME_PAST_TOLERANCE_SECONDS: i64 = 60;

/// Checks a requested publish time `at` of a delayed event against `now`: not in the past by
/// more than [`PUBLISH_TIME_PAST_TOLERANCE_SECONDS`], not beyond `horizon` from now.
pub fn check_publish_time(
    field: &'static str,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    horizon: chrono::Duration,
) -> Result<(), ValidationError> {
    let shown = || at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    if at < now - chrono::Duration::seconds(PUBLISH_TIME_PAST_TOLERANCE_SECONDS) {
        return Err(ValidationError::PublishTimeInPast { field, at: shown() });
    }
    if at > now + horizon {
        return Err(ValidationError::PublishTimeBeyondHorizon {
            field,
            at: shown(),
            horizon_seconds: horizon.num_seconds(),
        });
    }
    Ok(())
}

/// Checks a create request and returns its canonical form.
pub fn validate_order(req: CreateOrderRequest) -> Result<ValidOrder, ValidationError> {
    check_no_nul("customer_id", &req.customer_id)?;
    if req.customer_id.trim().is_empty() {
        return Err(ValidationError::EmptyCustomerId);
    }
    if req.customer_id.chars().count() > MAX_CUSTOMER_ID_CHARS {
        return Err(ValidationError::CustomerIdTooLong);
    }
    if let Some(email) = &req.email {
        check_no_nul("email", email)?;
        if !looks_like_email(email) {
            return Err(ValidationError::InvalidEmail(email.clone()));
        }
    }
    if req.lines.is_empty() {
        return Err(ValidationError::NoLines);
    }
    if req.lines.len() > MAX_LINES {
        return Err(ValidationError::TooManyLines(req.lines.len()));
    }
    let mut seen = HashSet::with_capacity(req.lines.len());
    let mut lines = Vec::with_capacity(req.lines.len());
    for (i, line) in req.lines.into_iter().enumerate() {
        check_no_nul(&format!("lines[{i}].product_id"), &line.product_id)?;
        if line.product_id.trim().is_empty() {
            return Err(ValidationError::EmptyProductId(i));
        }
        if line.product_id.chars().count() > MAX_PRODUCT_ID_CHARS {
            return Err(ValidationError::ProductIdTooLong(i));
        }
        let quantity = i32::try_from(line.quantity)
            .ok()
            .filter(|q| (1..=MAX_QUANTITY).contains(&i64::from(*q)))
            .ok_or(ValidationError::QuantityOutOfRange {
                line: i,
                quantity: line.quantity,
            })?;
        // One line per product: consumers key reservations by (order, product).
        if !seen.insert(line.product_id.clone()) {
            return Err(ValidationError::DuplicateProduct(line.product_id));
        }
        lines.push(OrderLine {
            product_id: line.product_id,
            quantity,
        });
    }
    Ok(ValidOrder {
        customer_id: req.customer_id,
        email: req.email,
        lines,
        payment_reminder_at: req.payment_reminder_at,
    })
}

impl ValidOrder {
    /// Hex SHA-256 of the canonical request: equal for the same order however the JSON was
    /// spelled, different as soon as any field differs.
    pub fn fingerprint(&self) -> String {
        // Serialising a struct of strings and integers cannot fail.
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        Sha256::digest(&canonical)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Checks an `Idempotency-Key` header value: 1 to 200 visible ASCII characters.
pub fn validate_idempotency_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return Err(format!(
            "Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters"
        ));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("Idempotency-Key must be visible ASCII characters".to_owned());
    }
    Ok(())
}

/// Whether `value` is a W3C trace context `traceparent` of version 00:
/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase, ids not all zero.
pub fn is_valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let [version, trace_id, parent_id, flags] = parts.as_slice() else {
        return false;
    };
    let lower_hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    *version == "00"
        && lower_hex(trace_id, 32)
        && lower_hex(parent_id, 16)
        && lower_hex(flags, 2)
        && trace_id.bytes().any(|b| b != b'0')
        && parent_id.bytes().any(|b| b != b'0')
}

fn check_no_nul(field: &str, value: &str) -> Result<(), ValidationError> {
    if value.contains('\0') {
        return Err(ValidationError::NulCharacter(field.to_owned()));
    }
    Ok(())
}

/// A deliberately loose check: one `@` with something on each side, no spaces or control
/// characters. Whether the address works is the notification service's problem.
fn looks_like_email(email: &str) -> bool {
    email.chars().count() <= MAX_EMAIL_CHARS
        && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        && matches!(email.split_once('@'), Some((local, domain))
            if !local.is_empty() && !domain.is_empty() && !domain.contains('@'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(customer: &str, lines: &[(&str, i64)]) -> CreateOrderRequest {
        CreateOrderRequest {
            customer_id: customer.into(),
            email: None,
            lines: lines
                .iter()
                .map(|(p, q)| RequestedLine {
                    product_id: (*p).into(),
                    quantity: *q,
                })
                .collect(),
            payment_reminder_at: None,
        }
    }

    #[test]
    fn accepts_a_plain_order() {
        let order = validate_order(request("c1", &[("sku-00001", 2)])).expect("valid");
        assert_eq!(order.lines[0].quantity, 2);
    }

    #[test]
    fn rejects_bad_quantities_and_lines() {
        for q in [0, -1, MAX_QUANTITY + 1, i64::MAX] {
            assert!(matches!(
                validate_order(request("c", &[("p", q)])),
                Err(ValidationError::QuantityOutOfRange { .. })
            ));
        }
        assert_eq!(
            validate_order(request("c", &[])),
            Err(ValidationError::NoLines)
        );
        assert_eq!(
            validate_order(request("c", &[("p", 1), ("p", 2)])),
            Err(ValidationError::DuplicateProduct("p".into()))
        );
        assert_eq!(
            validate_order(request(" ", &[("p", 1)])),
            Err(ValidationError::EmptyCustomerId)
        );
        assert!(matches!(
            validate_order(request("a\0b", &[("p", 1)])),
            Err(ValidationError::NulCharacter(_))
        ));
    }

    #[test]
    fn requests_are_objects_not_arrays() {
        let order: CreateOrderRequest = serde_json::from_str(
            r#"{"customer_id": "c", "lines": [{"product_id": "p", "quantity": 1}],
                "payment_reminder_at": null, "unknown": [1]}"#,
        )
        .expect("an object");
        assert_eq!((order.customer_id.as_str(), order.lines.len()), ("c", 1));
        for positional in [
            r#"["c", null, [{"product_id": "p", "quantity": 1}]]"#,
            r#"{"customer_id": "c", "lines": [["p", 1]]}"#,
            r#"{"customer_id": "c", "lines": ["p"]}"#,
            "[]",
        ] {
            let e = serde_json::from_str::<CreateOrderRequest>(positional)
                .expect_err(positional)
                .to_string();
            assert!(e.contains("expected a JSON object"), "{positional}: {e}");
        }
    }

    #[test]
    fn fingerprint_follows_content() {
        let a = validate_order(request("c", &[("p", 1)])).expect("valid");
        let b = validate_order(request("c", &[("p", 2)])).expect("valid");
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint().len(), 64);
    }

    #[test]
    fn traceparent_format() {
        assert!(is_valid_traceparent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ));
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad}");
        }
    }

    #[test]
    fn email_and_idempotency_key() {
        assert!(looks_like_email("a@b.example"));
        assert!(!looks_like_email("nobody"));
        assert!(!looks_like_email("a b@c"));
        assert!(validate_idempotency_key("load-1").is_ok());
        assert!(validate_idempotency_key("").is_err());
        assert!(validate_idempotency_key("a b").is_err());
        assert!(validate_idempotency_key("a\0b").is_err());
        assert!(validate_idempotency_key("caf\u{e9}").is_err());
    }
}
