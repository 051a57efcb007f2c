//! Logging in and staying logged in: a session is a random id (32 bytes from the thread's
//! CSPRNG, ChaCha seeded by the operating system) in an `HttpOnly`, `SameSite=Strict` cookie,
//! mapped on the server to the user, their role, an expiry and a CSRF token that every form
//! carries. Nothing but `/login` and `/static/` is served without one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Form, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use rand::RngCore;
use serde::Deserialize;

use super::html::{esc, layout};
pub(super) use super::logged_in::Session;
use super::users::Role;
use super::Console;

/// The cookie's name.
pub(super) const COOKIE: &str = "pipeline_console";
/// Sessions kept at most; the oldest go first beyond it.
const MAX_SESSIONS: usize = 10_000;
/// How long a refused login waits before it answers.
const REFUSAL_DELAY: Duration = Duration::from_millis(700);

/// The server's side of the sessions.
pub(super) struct Sessions {
    ttl: Duration,
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    pub(super) fn new(ttl: Duration) -> Self {
        Sessions {
            ttl,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// A new session for `user`; returns its id.
    fn open(&self, user: &str, role: Role) -> String {
        let id = random_token();
        let session = Session {
            user: user.to_owned(),
            role,
            csrf: random_token(),
            expires: Instant::now() + self.ttl,
        };
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        map.retain(|_, s| s.expires > now);
        if map.len() >= MAX_SESSIONS {
            if let Some(oldest) = map
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
            {
                let _ = map.remove(&oldest);
            }
        }
        let _ = map.insert(id.clone(), session);
        id
    }

    /// The unexpired session `id`.
    fn get(&self, id: &str) -> Option<Session> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(id) {
            Some(s) if s.expires > Instant::now() => Some(s.clone()),
            Some(_) => {
                let _ = map.remove(id);
                None
            }
            None => None,
        }
    }

    fn close(&self, id: &str) {
        let _ = self
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

/// 32 random bytes as hex.
fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The session id the request's cookie carries.
fn session_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_owned())
}

/// Refuses every request without a live session: pages redirect to the login form, the API
/// and any `POST` answer 401. A request with one gets its [`Session`] as an extension.
pub(super) async fn require_login(
    State(console): State<Console>,
    mut request: Request,
    next: Next,
) -> Response {
    let session = session_id(request.headers()).and_then(|id| console.inner.sessions.get(&id));
    match session {
        Some(session) => {
            let _ = request.extensions_mut().insert(session);
            next.run(request).await
        }
        None => {
            let path = request.uri().path();
            if path.starts_with("/api/") || request.method() != Method::GET {
                (
                    StatusCode::UNAUTHORIZED,
                    axum::Json(serde_json::json!({"error": "log in first (POST /login)"})),
                )
                    .into_response()
            } else {
                let next = request
                    .uri()
                    .path_and_query()
                    .map_or("/".to_owned(), |p| p.as_str().to_owned());
                Redirect::to(&format!("/login?next={}", url_encode(&next))).into_response()
            }
        }
    }
}

#[derive(Deserialize)]
pub(super) struct LoginQuery {
    next: Option<String>,
}

/// The login form.
pub(super) async fn login_page(Query(q): Query<LoginQuery>) -> Html<String> {
    login_form(q.next.as_deref(), None)
}

fn login_form(next: Option<&str>, refused: Option<&str>) -> Html<String> {
    let message = refused
        .map(|m| format!(r#"<p class="error" role="alert">{}</p>"#, esc(m)))
        .unwrap_or_default();
    let body = format!(
        r#"<section class="login"><h1>Log in</h1>{message}
<form method="post" action="/login">
<input type="hidden" name="next" value="{next}">
<label>User <input name="user" autocomplete="username" required autofocus></label>
<label>Password <input name="password" type="password" autocomplete="current-password" required></label>
<button type="submit">Log in</button>
</form></section>"#,
        next = esc(safe_next(next)),
    );
    Html(layout("Log in", None, &body))
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    #[serde(default)]
    user: String,
    #[serde(default)]
    password: String,
    next: Option<String>,
}

/// Checks the user's password; opens a session, or refuses after a short delay.
pub(super) async fn login(State(console): State<Console>, Form(form): Form<LoginForm>) -> Response {
    let verified = {
        let console = console.clone();
        let (user, password) = (form.user.clone(), form.password);
        tokio::task::spawn_blocking(move || console.inner.users.verify(&user, &password))
            .await
            .ok()
            .flatten()
    };
    let Some(role) = verified else {
        tracing::warn!(user = %form.user, "console login refused");
        tokio::time::sleep(REFUSAL_DELAY).await;
        let mut page =
            login_form(form.next.as_deref(), Some("Wrong user name or password.")).into_response();
        *page.status_mut() = StatusCode::UNAUTHORIZED;
        return page;
    };
    tracing::info!(user = %form.user, role = role.as_str(), "console login");
    let id = console.inner.sessions.open(&form.user, role);
    let secure = if console.inner.settings.secure_cookie {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        console.inner.settings.session_ttl.as_secs()
    );
    (
        [(header::SET_COOKIE, cookie)],
        Redirect::to(safe_next(form.next.as_deref())),
    )
        .into_response()
}

#[derive(Deserialize)]
pub(super) struct LogoutForm {
    csrf: Option<String>,
}

/// Ends the session (a form with the CSRF token).
pub(super) async fn logout(
    State(console): State<Console>,
    axum::Extension(session): axum::Extension<Session>,
    headers: HeaderMap,
    Form(form): Form<LogoutForm>,
) -> Response {
    if !session.csrf_matches(form.csrf.as_deref()) {
        return super::refusal::Refusal::csrf().into_response();
    }
    if let Some(id) = session_id(&headers) {
        console.inner.sessions.close(&id);
    }
    (
        [(
            header::SET_COOKIE,
            format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
        )],
        Redirect::to("/login"),
    )
        .into_response()
}

/// A path on this console to go back to after logging in; anything else goes to `/`.
fn safe_next(next: Option<&str>) -> &str {
    match next {
        Some(n) if n.starts_with('/') && !n.starts_with("//") && !n.contains('\\') => n,
        _ => "/",
    }
}

/// Percent-encodes everything but unreserved characters and `/`.
pub(super) fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
