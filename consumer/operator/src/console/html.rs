//! Pages: escaping, the layout every page shares, the parts of every action form, the static
//! files (embedded in the binary) and the security headers on every response.

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::logged_in::Session;

const CSS: &str = include_str!("static/console.css");
const JS: &str = include_str!("static/console.js");

/// The content security policy: scripts and styles from this console only, no inline script,
/// no framing, forms posting only here.
const CSP: &str = "default-src 'self'; script-src 'self'; object-src 'none'; \
                   frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

/// `s` escaped for HTML text and attribute values.
/// Unicode's bidirectional marks, embeddings, overrides and isolates.
fn is_direction_mark(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

pub(super) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters, and the direction marks and overrides that would show an id
            // other than the one stored (`\u{202e}`…), are shown as escapes.
            c if (c.is_control() && c != '\n' && c != '\t') || is_direction_mark(c) => {
                out.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

/// An optional value for a cell: `-` when absent.
pub(super) fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| esc(&v.to_string()))
}

/// A whole page: the navigation (with the user and a logout form when logged in) around
/// `body`.
pub(super) fn layout(title: &str, session: Option<&Session>, body: &str) -> String {
    let user = match session {
        Some(s) => format!(
            r#"<span class="user">{} <span class="role role-{role}">{role}</span></span>
<form method="post" action="/logout" class="logout"><input type="hidden" name="csrf" value="{}"><button type="submit">Log out</button></form>"#,
            esc(&s.user),
            esc(&s.csrf),
            role = s.role.as_str(),
        ),
        None => String::new(),
    };
    let nav = if session.is_some() {
        r#"<a href="/">Overview</a><a href="/timeline">Order timeline</a><a href="/dead-letters">Dead letters</a><a href="/outbox">Outbox</a><a href="/groups">Groups</a>"#
    } else {
        ""
    };
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · pipeline console</title>
<link rel="stylesheet" href="/static/console.css">
<script src="/static/console.js" defer></script>
</head><body>
<header><span class="brand">pipeline console</span><nav>{nav}</nav><span class="who">{user}</span></header>
<main>
{body}
</main></body></html>"#,
        title = esc(title),
    )
}

/// The end of every action form: the CSRF token, the reason, the confirmation and the button;
/// for a viewer the button is disabled (the server refuses the action anyway).
pub(super) fn action_footer(session: &Session, verb: &str) -> String {
    let disabled = if session.may_act() {
        ""
    } else {
        r#" disabled title="read-only: your role is viewer""#
    };
    format!(
        r#"<input type="hidden" name="csrf" value="{csrf}">
<div class="confirm">
<label>Reason (kept with the action) <input name="reason" class="reason" required maxlength="1000"{disabled}></label>
<label class="check"><input type="checkbox" name="confirm" value="yes" required{disabled}> I confirm</label>
<button type="submit" class="act"{disabled}>{verb}</button>
</div>"#,
        csrf = esc(&session.csrf),
        verb = esc(verb),
    )
}

/// A notice that the page's data could not be read, and why.
pub(super) fn unavailable(what: &str, error: &str) -> String {
    format!(
        r#"<p class="error" role="alert">{}: {}</p>"#,
        esc(what),
        esc(error)
    )
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
