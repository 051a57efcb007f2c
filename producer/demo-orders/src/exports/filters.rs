//! The body of `POST /exports` and its checks: only known fields, a known status, RFC 3339
//! times in order, a bounded customer id. Nothing reaches the database unless it passes.

use chrono::{DateTime, Utc};
use demo_events::export_events::ExportFilters;
use demo_events::order_events::OrderStatus;
use serde::Deserialize;

use crate::validation::MAX_CUSTOMER_ID_CHARS;

/// The body of `POST /exports`, as sent. Every filter is optional (none: every order); an
/// unknown field is refused by deserialisation, naming it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    /// `placed`, `paid`, `cancelled` or `shipped`.
    #[serde(default)]
    pub status: Option<String>,
    /// RFC 3339; orders created at or after it.
    #[serde(default)]
    pub created_from: Option<String>,
    /// RFC 3339; orders created before it.
    #[serde(default)]
    pub created_to: Option<String>,
    /// Orders of this customer.
    #[serde(default)]
    pub customer_id: Option<String>,
}

/// Why export filters were refused. The message is meant for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("status `{0}` is not one of placed, paid, cancelled, shipped")]
    UnknownStatus(String),
    #[error("{field} `{value}` is not an RFC 3339 time (e.g. 2026-11-25T03:00:00Z)")]
    BadTime { field: &'static str, value: String },
    #[error("created_from ({from}) must be before created_to ({to})")]
    InvertedRange { from: String, to: String },
    #[error("customer_id must not be empty")]
    EmptyCustomerId,
    #[error("customer_id must be at most {MAX_CUSTOMER_ID_CHARS} characters")]
    CustomerIdTooLong,
    #[error("{0} must not contain NUL characters")]
    NulCharacter(&'static str),
}

/// Checks a request and returns the filters to store.
pub fn validate_export(req: ExportRequest) -> Result<ExportFilters, FilterError> {
    let status = req
        .status
        .map(|s| OrderStatus::parse(&s).ok_or(FilterError::UnknownStatus(clip(&s))))
        .transpose()?;
    let created_from = time("created_from", req.created_from)?;
    let created_to = time("created_to", req.created_to)?;
    if let (Some(from), Some(to)) = (created_from, created_to) {
        if from >= to {
            return Err(FilterError::InvertedRange {
                from: from.to_rfc3339(),
                to: to.to_rfc3339(),
            });
        }
    }
    if let Some(customer) = &req.customer_id {
        if customer.contains('\0') {
            return Err(FilterError::NulCharacter("customer_id"));
        }
        if customer.trim().is_empty() {
            return Err(FilterError::EmptyCustomerId);
        }
        if customer.chars().count() > MAX_CUSTOMER_ID_CHARS {
            return Err(FilterError::CustomerIdTooLong);
        }
    }
    Ok(ExportFilters {
        status,
        created_from,
        created_to,
        customer_id: req.customer_id,
    })
}

fn time(field: &'static str, value: Option<String>) -> Result<Option<DateTime<Utc>>, FilterError> {
    value
        .map(|v| {
            DateTime::parse_from_rfc3339(&v)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| FilterError::BadTime {
                    field,
                    value: clip(&v),
                })
        })
        .transpose()
}

/// At most 64 characters of what the client sent, for an error message.
fn clip(s: &str) -> String {
    s.chars().filter(|c| *c != '\0').take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: serde_json::Value) -> Result<ExportFilters, String> {
        let req: ExportRequest = serde_json::from_value(json).map_err(|e| e.to_string())?;
        validate_export(req).map_err(|e| e.to_string())
    }

    #[test]
    fn accepts_every_filter_and_none() {
        let f = request(serde_json::json!({
            "status": "paid", "customer_id": "c-1",
            "created_from": "2026-01-01T00:00:00Z", "created_to": "2026-02-01T00:00:00+01:00"
        }))
        .expect("valid");
        assert_eq!(f.status, Some(OrderStatus::Paid));
        assert_eq!(request(serde_json::json!({})), Ok(ExportFilters::default()));
    }

    #[test]
    fn refuses_what_cannot_be_exported() {
        let unknown = request(serde_json::json!({"colour": "red"})).expect_err("unknown field");
        assert!(unknown.contains("unknown field `colour`"), "{unknown}");
        let status = request(serde_json::json!({"status": "lost"})).expect_err("status");
        assert!(status.contains("`lost`"), "{status}");
        let inverted = request(serde_json::json!({
            "created_from": "2026-02-01T00:00:00Z", "created_to": "2026-01-01T00:00:00Z"
        }))
        .expect_err("inverted");
        assert!(inverted.contains("must be before"), "{inverted}");
        let equal = request(serde_json::json!({
            "created_from": "2026-02-01T00:00:00Z", "created_to": "2026-02-01T00:00:00Z"
        }));
        assert!(equal.is_err(), "an empty range is inverted too");
        assert!(request(serde_json::json!({"created_to": "yesterday"})).is_err());
        assert!(request(serde_json::json!({"customer_id": " "})).is_err());
        assert!(request(serde_json::json!({"customer_id": "x".repeat(201)})).is_err());
        assert!(request(serde_json::json!({"customer_id": "a\u{0}b"})).is_err());
    }
}
