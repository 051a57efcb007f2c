//! Pages: what a page shows of stored text ([`Shown`]), the layout every page shares, the parts
//! of every action form, the static files (embedded in the binary) and the security headers on
//! every response. Pages are maud templates: every value is HTML-escaped unless a template says
//! otherwise (none does).

use std::fmt::Write;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use maud::{html, Escaper, Markup, Render, DOCTYPE};

use super::logged_in::Session;
use super::urls::Urls;

const CSS: &str = include_str!("static/console.css");
const JS: &str = include_str!("static/console.js");

/// The content security policy: scripts and styles from this console only, no inline script,
/// no framing, forms posting only here.
const CSP: &str = "default-src 'self'; script-src 'self'; object-src 'none'; \
                   frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

/// Unicode's bidirectional marks, embeddings, overrides and isolates.
fn is_direction_mark(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Whether `c` is shown as a `\u{…}` escape: control characters (but newline and tab), and the
/// direction marks and overrides that would show an id other than the one stored (`\u{202e}`…).
fn shown_escaped(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || is_direction_mark(c)
}

/// Stored or typed text as a page shows it: the characters [`shown_escaped`] picks written as
/// `\u{…}`, then escaped by maud for HTML text and attribute values. Every value from the
/// databases, the request or the user that a page displays goes through it, so a hostile id
/// cannot display as another; a value a form only sends back (a hidden field, an option's or a
/// check box's value) stays as stored, escaped by maud alone, so the action gets the very group
/// or filter.
pub(super) struct Shown<'a>(pub(super) &'a str);

impl Render for Shown<'_> {
    fn render_to(&self, buffer: &mut String) {
        let mut out = Escaper::new(buffer);
        let mut rest = self.0;
        // Writing into a String never fails.
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| shown_escaped(*c)) {
            let _ = out.write_str(&rest[..at]);
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
            rest = &rest[at + c.len_utf8()..];
        }
        let _ = out.write_str(rest);
    }
}

/// An optional value for a cell, [`Shown`]: `-` when absent.
pub(super) fn opt<T: std::fmt::Display>(v: Option<T>) -> Markup {
    match v {
        Some(v) => html! { (Shown(&v.to_string())) },
        None => html! { "-" },
    }
}

/// A whole page: the navigation (with the user and a logout form when logged in) around
/// `body`, every link under the console's prefix.
pub(super) fn layout(
    urls: Urls<'_>,
    title: &str,
    session: Option<&Session>,
    body: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · pipeline console" }
                link rel="stylesheet" href=(urls.to("/static/console.css"));
                script src=(urls.to("/static/console.js")) defer {}
            }
            body {
                header {
                    span.brand { "pipeline console" }
                    nav {
                        @if session.is_some() {
                            a href=(urls.to("/")) { "Overview" }
                            a href=(urls.to("/timeline")) { "Order timeline" }
                            a href=(urls.to("/dead-letters")) { "Dead letters" }
                            a href=(urls.to("/outbox")) { "Outbox" }
                            a href=(urls.to("/groups")) { "Groups" }
                        }
                    }
                    span.who {
                        @if let Some(s) = session {
                            span.user {
                                (Shown(&s.user)) " "
                                span class={ "role role-" (s.role.as_str()) } { (s.role.as_str()) }
                            }
                            form method="post" action=(urls.to("/logout")) class="logout" {
                                input type="hidden" name="csrf" value=(s.csrf);
                                button type="submit" { "Log out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The end of every action form: the CSRF token, the note, the confirmation and the button;
/// for a viewer the button is disabled (the server refuses the action anyway).
pub(super) fn action_footer(session: &Session, verb: &str) -> Markup {
    let read_only = !session.may_act();
    let why = read_only.then_some("read-only: your role is viewer");
    html! {
        input type="hidden" name="csrf" value=(session.csrf);
        div.confirm {
            label {
                "Note (kept with the action) "
                input name="note" class="note" required maxlength="1000" disabled[read_only] title=[why];
            }
            label.check {
                input type="checkbox" name="confirm" value="yes" required disabled[read_only] title=[why];
                " I confirm"
            }
            button type="submit" class="act" disabled[read_only] title=[why] { (verb) }
        }
    }
}

/// A notice that the page's data could not be read, and why.
pub(super) fn unavailable(what: &str, error: &str) -> Markup {
    html! { p.error role="alert" { (what) ": " (Shown(error)) } }
}

/// `/static/console.css`.
pub(super) async fn css() -> Response {
    static_file(CSS, "text/css; charset=utf-8")
}

/// `/static/console.js`.
pub(super) async fn js() -> Response {
    static_file(JS, "text/javascript; charset=utf-8")
}

/// `/favicon.ico`: none (browsers ask for it on every page).
pub(super) async fn no_icon() -> axum::http::StatusCode {
    axum::http::StatusCode::NO_CONTENT
}

fn static_file(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// Adds the security headers to every response; pages and data are not cached.
pub(super) async fn security_headers(request: Request, next: Next) -> Response {
    let is_static = request.uri().path().starts_with("/static/");
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    let _ = headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    let _ = headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    let _ = headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    let _ = headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if !is_static {
        let _ = headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}
