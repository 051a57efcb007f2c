//! What the console answers when it cannot do what was asked: bad input (an unknown group, a
//! letter that does not exist, a missing reason) is a 4xx with the reason; a database or broker
//! that does not answer is a 503 that says so. Never a 500 page, never a stack trace.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use super::html::{esc, layout};
use crate::error::BadInput;

/// A refused request, as a page or as JSON.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) status: StatusCode,
    pub(super) message: String,
    json: bool,
}

impl Refusal {
    /// Bad input: 400 with `message`.
    pub(super) fn bad(message: impl Into<String>) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            json: false,
        }
    }

    /// Not allowed: 403 with `message`.
    pub(super) fn forbidden(message: impl Into<String>) -> Self {
        Refusal {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
            json: false,
        }
    }

    /// Nothing there: 404 with `message`.
    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Refusal {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            json: false,
        }
    }

    /// A POST without the CSRF token of the login its cookie names.
    pub(super) fn csrf() -> Self {
        Refusal::forbidden(
            "refused: the form's CSRF token is missing or wrong (reload the page and try again)",
        )
    }

    /// The same refusal as JSON.
    pub(super) fn json(mut self) -> Self {
        self.json = true;
        self
    }
}

/// Whether `e` is PostgreSQL refusing a value (SQLSTATE class 22, data exception).
fn refused_value(e: &anyhow::Error) -> bool {
    e.chain().any(|c| match c.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(db)) => db.code().is_some_and(|code| code.starts_with("22")),
        _ => false,
    })
}

impl From<anyhow::Error> for Refusal {
    fn from(e: anyhow::Error) -> Self {
        let bad = e.chain().find_map(|c| c.downcast_ref::<BadInput>());
        let (status, message) = match bad {
            Some(BadInput::NotFound { .. }) => (StatusCode::NOT_FOUND, format!("{e:#}")),
            Some(_) => (StatusCode::BAD_REQUEST, format!("{e:#}")),
            // PostgreSQL refused a value the request carried (SQLSTATE class 22, data exception:
            // a NUL character, bytes that are not UTF-8, a value too long): the input is at fault.
            None if refused_value(&e) => (
                StatusCode::BAD_REQUEST,
                format!("PostgreSQL refused a value of the request: {e:#}"),
            ),
            None => {
                tracing::warn!(error = %format!("{e:#}"), "console: a read or an action failed");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("PostgreSQL or Kafka did not answer (try again): {e:#}"),
                )
            }
        };
        Refusal {
            status,
            message,
            json: false,
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        if self.json {
            return (
                self.status,
                axum::Json(serde_json::json!({ "error": self.message })),
            )
                .into_response();
        }
        let body = format!(
            r#"<section><h1>{}</h1><p class="error" role="alert">{}</p><p><a href="/">Overview</a></p></section>"#,
            self.status.as_u16(),
            esc(&self.message)
        );
        (self.status, Html(layout("Refused", None, &body))).into_response()
    }
}

/// Any other path.
pub(super) async fn not_found() -> Refusal {
    Refusal::not_found("no such page")
}
