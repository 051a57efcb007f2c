//! Request bodies: every body the API takes is one JSON object, and nothing else.
//!
//! serde's derived structs also accept a JSON array and read its fields by position, so `[]`
//! would pass for an object whose fields are all optional. [`ApiJson`] refuses, before
//! deserialising, a body whose first byte past whitespace is not `{`; nested objects of a body
//! refuse arrays where they are deserialised (see `validation::RequestedLine`). It also refuses
//! a body with a `\u0000` escape in any string: PostgreSQL stores no NUL character in `text`
//! nor in `jsonb`.
//!
//! A body that passes costs one look at its first bytes and one scan for backslashes. Bodies
//! that are refused are parsed a second time, only to name what is wrong with them.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// `axum::Json` for JSON object bodies, with refusals answered by our JSON error body: a body
/// that is not an object (an array, a string, a number, `true`, `false`, `null`, nothing), that
/// has trailing characters, or that holds a NUL character is refused with a 4xx naming why.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !json_content_type(req.headers()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "expected `Content-Type: application/json`",
            ));
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| body_error(&e))?;
        if first_significant_byte(&bytes) != Some(b'{') {
            return Err(not_an_object(&bytes));
        }
        let Json(value) = Json::<T>::from_bytes(&bytes)?;
        if has_nul_escape(&bytes) {
            return Err(nul_refusal(&bytes));
        }
        Ok(Self(value))
    }
}

/// The body of an action that reads none (pay, cancel, ship): nothing, or the empty JSON object
/// `{}`. Anything else is refused with 400, so that a client that believes its body says
/// something (`[1,2]`, a reason, a quantity) learns that it does not, before the order changes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct NoBody;

impl<S> FromRequest<S> for NoBody
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| body_error(&e))?;
        let empty = bytes.iter().all(u8::is_ascii_whitespace)
            || serde_json::from_slice::<serde_json::Map<String, Value>>(&bytes)
                .is_ok_and(|object| object.is_empty());
        if empty {
            Ok(NoBody)
        } else {
            Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "this action reads no body: send none, or the empty JSON object {}",
            ))
        }
    }
}

/// A body axum's JSON extractor refused: 400 for malformed JSON, 422 for JSON of the wrong
/// shape, the body's own refusal otherwise.
impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::JsonSyntaxError(e) => Self::new(
                StatusCode::BAD_REQUEST,
                format!("malformed JSON: {}", e.body_text()),
            ),
            JsonRejection::JsonDataError(e) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("invalid request body: {}", e.body_text()),
            ),
            JsonRejection::MissingJsonContentType(_) => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "expected `Content-Type: application/json`",
            ),
            JsonRejection::BytesRejection(e) => body_error(&e),
            other => Self::new(other.status(), other.body_text()),
        }
    }
}

/// A body that could not be read: 413 naming the limit when it is too large.
fn body_error(e: &BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than {MAX_BODY_BYTES} bytes"),
        )
    } else {
        ApiError::new(e.status(), "could not read the request body")
    }
}

/// `application/json` or `application/<anything>+json`, parameters allowed: the content types
/// `axum::Json` takes.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json")
            || subtype.rsplit_once('+').is_some_and(|(name, suffix)| {
                !name.is_empty() && suffix.eq_ignore_ascii_case("json")
            }))
}

/// The first byte that is not JSON whitespace (space, tab, line feed, carriage return).
fn first_significant_byte(body: &[u8]) -> Option<u8> {
    body.iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
}

/// The refusal of a body that does not start with `{`: 400 when it is not JSON at all, 422
/// naming what JSON value it is otherwise.
fn not_an_object(body: &[u8]) -> ApiError {
    if first_significant_byte(body).is_none() {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed JSON: the request body is empty, expected a JSON object",
        );
    }
    let value = match Json::<Value>::from_bytes(body) {
        Ok(Json(value)) => value,
        Err(rejection) => return rejection.into(),
    };
    let kind = match value {
        Value::Array(_) => "an array",
        Value::String(_) => "a string",
        Value::Number(_) => "a number",
        Value::Bool(_) => "a boolean",
        Value::Null => "null",
        // Cannot be: the body does not start with `{`.
        Value::Object(_) => "an object",
    };
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("request body must be a JSON object, not {kind}"),
    )
}

/// Whether a JSON text holds the escape `\u0000`, the only way a NUL character can be written in
/// JSON. Each backslash starts an escape of the character after it, so `\\u0000` (an escaped
/// backslash, then the text `u0000`) is not one.
fn has_nul_escape(body: &[u8]) -> bool {
    let mut rest = body;
    while let Some(at) = rest.iter().position(|b| *b == b'\\') {
        if rest.get(at + 1..at + 6) == Some(b"u0000".as_slice()) {
            return true;
        }
        rest = rest.get(at + 2..).unwrap_or_default();
    }
    false
}

/// The refusal of a body holding a NUL character, naming where the first one is when it can.
fn nul_refusal(body: &[u8]) -> ApiError {
    let place = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|value| nul_place(&value, ""))
        .unwrap_or_else(|| "the request body".to_owned());
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("{place} must not contain NUL characters (\\u0000)"),
    )
}

/// Where in `value` (at `path`) the first string or field name with a NUL character is:
/// `customer_id`, `lines[0].product_id`, or `field names in lines[0]`.
fn nul_place(value: &Value, path: &str) -> Option<String> {
    match value {
        Value::String(s) => s.contains('\0').then(|| path.to_owned()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| nul_place(item, &format!("{path}[{i}]"))),
        Value::Object(fields) => {
            if fields.keys().any(|k| k.contains('\0')) {
                return Some(if path.is_empty() {
                    "field names".to_owned()
                } else {
                    format!("field names in {path}")
                });
            }
            fields.iter().find_map(|(key, field)| {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                nul_place(field, &at)
            })
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn json_content_types_are_those_axum_takes() {
        let accepts = |value: &str| {
            let mut headers = HeaderMap::new();
            let _ = headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_str(value).expect("header value"),
            );
            json_content_type(&headers)
        };
        for good in [
            "application/json",
            "application/json; charset=utf-8",
            "application/json;charset=utf-8",
            "Application/JSON",
            "application/cloudevents+json",
        ] {
            assert!(accepts(good), "{good}");
        }
        for bad in [
            "text/json",
            "text/plain",
            "application/jsonp",
            "application/+json",
            "json",
            "",
        ] {
            assert!(!accepts(bad), "{bad}");
        }
        assert!(!json_content_type(&HeaderMap::new()));
    }

    #[test]
    fn only_objects_pass_the_first_byte() {
        assert_eq!(first_significant_byte(b" \r\n\t{}"), Some(b'{'));
        for (body, expected) in [
            (&b"[]"[..], "not an array"),
            (b"[\"cancelled\"]", "not an array"),
            (b"\"{}\"", "not a string"),
            (b"-1", "not a number"),
            (b"true", "not a boolean"),
            (b" null ", "not null"),
        ] {
            let e = not_an_object(body);
            assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
            assert!(e.message.ends_with(expected), "{}", e.message);
        }
        for body in [&b""[..], b"  \n", b"[1,", b"\xef\xbb\xbf{}", b"nul"] {
            assert_eq!(not_an_object(body).status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn finds_nul_escapes_and_only_them() {
        for yes in [
            &br#"{"a":"\u0000"}"#[..],
            br#"{"a":"x\\\u0000"}"#,
            br#"{"\u0000":1}"#,
            br#"\u0000"#,
        ] {
            assert!(has_nul_escape(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &br#"{"a":"\\u0000"}"#[..],
            br#"{"a":"\u0001\u0010\u1000"}"#,
            br#"{"a":"\\\\u0000"}"#,
            br#"{"a":"u0000"}"#,
            br#"\"#,
            br#"\u000"#,
        ] {
            assert!(!has_nul_escape(no), "{}", String::from_utf8_lossy(no));
        }
    }

    #[test]
    fn names_where_the_nul_is() {
        let message = |body: &[u8]| nul_refusal(body).message;
        assert_eq!(
            message(br#"{"customer_id":"a\u0000"}"#),
            "customer_id must not contain NUL characters (\\u0000)"
        );
        assert!(message(br#"{"lines":[{"q":1},{"product_id":"\u0000"}]}"#)
            .starts_with("lines[1].product_id "));
        assert!(message(br#"{"lines":[{"\u0000":1}]}"#).starts_with("field names in lines[0] "));
        // Duplicate keys: the value holding the NUL is not the one kept.
        assert!(message(br#"{"x":"\u0000","x":"y"}"#).starts_with("the request body "));
    }
}
