//! What the console answers when it cannot do what was asked: bad input (an unknown group, a
//! letter that does not exist, a missing reason) is a 4xx with the reason; a database or broker
//! that does not answer is a 503 that says so. Never a 500 page, never a stack trace.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use uuid::Uuid;

use super::html::{layout, Shown};
use super::urls::Urls;
use super::Console;
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

    /// Not now: 503 with `message`.
    pub(super) fn unavailable(message: impl Into<String>) -> Self {
        Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
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

/// PostgreSQL's own words when it refused a value (SQLSTATE class 22, data exception: a NUL
/// character, bytes that are not UTF-8, a value too long), which speak of the value only.
fn refused_value(e: &anyhow::Error) -> Option<String> {
    e.chain()
        .find_map(|c| match c.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Database(db))
                if db.code().is_some_and(|code| code.starts_with("22")) =>
            {
                Some(db.message().to_owned())
            }
            _ => None,
        })
}

/// What a client is told of a failure that is not its own: that PostgreSQL or Kafka did not
/// answer, with a reference. The detail (the driver's text, a database's host, user and name, a
/// broker's address) goes to the log under the same reference, never to the client.
pub(super) fn unanswered(e: &anyhow::Error) -> String {
    let reference = Uuid::new_v4().simple().to_string()[..12].to_owned();
    tracing::warn!(
        reference = %reference,
        error = %format!("{e:#}"),
        "console: a read or an action failed"
    );
    format!("PostgreSQL or Kafka did not answer (try again; reference {reference} in the console's log)")
}

impl From<anyhow::Error> for Refusal {
    fn from(e: anyhow::Error) -> Self {
        let bad = e.chain().find_map(|c| c.downcast_ref::<BadInput>());
        // The operator's own input is named back; where a group or the databases are concerned,
        // only the input (the command line says which database holds what).
        let (status, message) = match (bad, refused_value(&e)) {
            (Some(BadInput::NotFound { .. }), _) => {
                (StatusCode::NOT_FOUND, bad.map(ToString::to_string))
            }
            (Some(BadInput::UnknownGroup(group, _)), _) => (
                StatusCode::BAD_REQUEST,
                Some(format!("unknown consumer group {group}")),
            ),
            (Some(BadInput::OutOfScope(group)), _) => (
                StatusCode::FORBIDDEN,
                Some(format!(
                    "group {group} is outside this console's groups (--group)"
                )),
            ),
            (Some(bad), _) => (StatusCode::BAD_REQUEST, Some(bad.to_string())),
            (None, Some(refused)) => (
                StatusCode::BAD_REQUEST,
                Some(format!(
                    "PostgreSQL refused a value of the request: {refused}"
                )),
            ),
            (None, None) => (StatusCode::SERVICE_UNAVAILABLE, None),
        };
        Refusal {
            status,
            message: message.unwrap_or_else(|| unanswered(&e)),
            json: false,
        }
    }
}

/// A refusal's message, left on its response for [`draw`] to show on a page.
#[derive(Clone)]
struct ToDraw(String);

impl IntoResponse for Refusal {
    /// JSON at once; a page's refusal is the status and the message, which [`draw`] (a layer of
    /// the console's router, which knows its prefix) turns into the page.
    fn into_response(self) -> Response {
        if self.json {
            return (
                self.status,
                axum::Json(serde_json::json!({ "error": self.message })),
            )
                .into_response();
        }
        let mut response = self.status.into_response();
        let _ = response.extensions_mut().insert(ToDraw(self.message));
        response
    }
}

/// Draws the page of a refusal the request ended with, its links under the console's prefix.
pub(super) async fn draw(State(console): State<Console>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    match response.extensions_mut().remove::<ToDraw>() {
        Some(ToDraw(message)) => {
            let (mut parts, _) = response.into_parts();
            let page = page(console.urls(), parts.status, &message).into_response();
            let (page_parts, body) = page.into_parts();
            parts.headers.extend(page_parts.headers);
            Response::from_parts(parts, body)
        }
        None => response,
    }
}

/// The page of a refusal: its status and message, and the way back to the overview.
pub(super) fn page(urls: Urls<'_>, status: StatusCode, message: &str) -> Markup {
    let body = html! {
        section {
            h1 { (status.as_u16()) }
            p.error role="alert" { (Shown(message)) }
            p { a href=(urls.to("/")) { "Overview" } }
        }
    };
    layout(urls, "Refused", None, body)
}

/// Any other path.
pub(super) async fn not_found() -> Refusal {
    Refusal::not_found("no such page")
}

/// A page's status: 200, or 503 when its data could not be read (the page says why).
pub(super) fn page_status<T, E>(read: &Result<T, E>) -> StatusCode {
    match read {
        Ok(_) => StatusCode::OK,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}
