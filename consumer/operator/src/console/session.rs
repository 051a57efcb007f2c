//! Logging in and staying logged in: a session is a random id (32 bytes from the thread's
//! CSPRNG, ChaCha seeded by the operating system) in an `HttpOnly`, `SameSite=Strict` cookie,
//! mapped on the server to the user, their role, an expiry and a CSRF token that every form
//! carries. Nothing but `/login` and `/static/` is served without one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Form, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use maud::{html, Markup};
use rand::RngCore;
use serde::Deserialize;

use super::html::layout;
pub(super) use super::logged_in::Session;
use super::login_guard::Refused;
use super::urls::Urls;
use super::users::{possible_name, Role};
use super::Console;

/// The cookie's name.
pub(super) const COOKIE: &str = "pipeline_console";
/// Sessions kept at most; the oldest go first beyond it.
const MAX_SESSIONS: usize = 10_000;
/// Sessions one user keeps at most; their oldest goes first beyond it, so one user's logins
/// never push another user's sessions out.
const MAX_SESSIONS_PER_USER: usize = 16;
/// The most of a refused user name a log line shows.
const LOGGED_NAME_CHARS: usize = 64;
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
        let theirs: Vec<(&String, Instant)> = map
            .iter()
            .filter(|(_, s)| s.user == user)
            .map(|(k, s)| (k, s.expires))
            .collect();
        if theirs.len() >= MAX_SESSIONS_PER_USER {
            if let Some(oldest) = theirs
                .iter()
                .min_by_key(|(_, e)| *e)
                .map(|(k, _)| (*k).clone())
            {
                let _ = map.remove(&oldest);
            }
        }
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
///
/// Nested at a prefix, the request's path here is the one under the prefix (axum strips it):
/// the login's `next` is the prefix and that path.
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
            let urls = console.urls();
            let path = request.uri().path();
            if path.starts_with("/api/") || request.method() != Method::GET {
                let error = format!("log in first (POST {})", urls.to("/login"));
                (
                    StatusCode::UNAUTHORIZED,
                    axum::Json(serde_json::json!({ "error": error })),
                )
                    .into_response()
            } else {
                let here = request.uri().path_and_query().map_or("/", |p| p.as_str());
                Redirect::to(&urls.login(&urls.to(here))).into_response()
            }
        }
    }
}

#[derive(Deserialize)]
pub(super) struct LoginQuery {
    next: Option<String>,
}

/// The login form.
pub(super) async fn login_page(
    State(console): State<Console>,
    Query(q): Query<LoginQuery>,
) -> Markup {
    login_form(console.urls(), q.next.as_deref(), None)
}

fn login_form(urls: Urls<'_>, next: Option<&str>, refused: Option<&str>) -> Markup {
    let body = html! {
        section.login {
            h1 { "Log in" }
            @if let Some(message) = refused {
                p.error role="alert" { (message) }
            }
            form method="post" action=(urls.to("/login")) {
                input type="hidden" name="next" value=(urls.after_login(next));
                label { "User " input name="user" autocomplete="username" required autofocus; }
                label {
                    "Password "
                    input name="password" type="password" autocomplete="current-password" required;
                }
                button type="submit" { "Log in" }
            }
        }
    };
    layout(urls, "Log in", None, body)
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    #[serde(default)]
    user: String,
    #[serde(default)]
    password: String,
    next: Option<String>,
}

/// Checks the user's password; opens a session, or refuses after a short delay. Attempts are
/// throttled per client address and per user name, and only a few passwords are checked at
/// once ([`super::login_guard::LoginGuard`]): a login refused for either is a 429 with `Retry-After`.
pub(super) async fn login(
    State(console): State<Console>,
    client: Option<Extension<ConnectInfo<SocketAddr>>>,
    Form(form): Form<LoginForm>,
) -> Response {
    let client = client.map(|Extension(ConnectInfo(address))| address.ip());
    if !possible_name(&form.user) {
        // No user could have it (the users file takes 1 to 64 printable characters): refused
        // as a wrong password is, neither logged nor tracked.
        tokio::time::sleep(REFUSAL_DELAY).await;
        return wrong_password(console.urls(), form.next.as_deref());
    }
    let known = console.inner.users.has(&form.user);
    let guard = &console.inner.login_guard;
    let permit = match guard.attempt(client, &form.user) {
        Ok(()) => guard.check_turn().await,
        Err(refused) => Err(refused),
    };
    let permit = match permit {
        Ok(permit) => permit,
        Err(refused) => {
            tracing::warn!(user = %logged_name(&form.user), known, client = ?client,
                refused = ?refused, "console login not checked");
            return too_many_logins(console.urls(), &form, &refused);
        }
    };
    let verified = {
        let checker = console.clone();
        let (user, password) = (form.user.clone(), form.password);
        guard
            .run(move |memory| {
                let verified = checker.inner.users.verify_in(&user, &password, memory);
                drop(permit);
                verified
            })
            .await
            .flatten()
    };
    let Some(role) = verified else {
        tracing::warn!(user = %logged_name(&form.user), known, client = ?client,
            "console login refused");
        tokio::time::sleep(REFUSAL_DELAY).await;
        return wrong_password(console.urls(), form.next.as_deref());
    };
    tracing::info!(user = %logged_name(&form.user), role = role.as_str(), "console login");
    let id = console.inner.sessions.open(&form.user, role);
    let secure = if console.inner.settings.secure_cookie {
        "; Secure"
    } else {
        ""
    };
    let urls = console.urls();
    let cookie = format!(
        "{COOKIE}={id}; Path={}; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        urls.cookie_path(),
        console.inner.settings.session_ttl.as_secs()
    );
    (
        [(header::SET_COOKIE, cookie)],
        Redirect::to(&urls.after_login(form.next.as_deref())),
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
    let urls = console.urls();
    (
        [(
            header::SET_COOKIE,
            format!(
                "{COOKIE}=; Path={}; HttpOnly; SameSite=Strict; Max-Age=0",
                urls.cookie_path()
            ),
        )],
        Redirect::to(&urls.to("/login")),
    )
        .into_response()
}

/// The 429 of a login that was not checked, on the login form.
fn too_many_logins(urls: Urls<'_>, form: &LoginForm, refused: &Refused) -> Response {
    let (message, wait) = match refused {
        Refused::Busy => (
            "Too many logins at once; try again in a moment.",
            Duration::from_secs(1),
        ),
        Refused::Throttled(wait) => (
            "Too many login attempts; wait a little before trying again.",
            *wait,
        ),
    };
    let mut page = login_form(urls, form.next.as_deref(), Some(message)).into_response();
    *page.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    if let Ok(value) = header::HeaderValue::from_str(&seconds.max(1).to_string()) {
        let _ = page.headers_mut().insert(header::RETRY_AFTER, value);
    }
    page
}

/// The login page again, 401: a wrong user name or password (which, it does not say).
fn wrong_password(urls: Urls<'_>, next: Option<&str>) -> Response {
    let mut page = login_form(urls, next, Some("Wrong user name or password.")).into_response();
    *page.status_mut() = StatusCode::UNAUTHORIZED;
    page
}

/// A user name as a log line may show it: control characters escaped, at most
/// [`LOGGED_NAME_CHARS`] characters and the length of the rest, so a name cannot forge or flood
/// log lines.
fn logged_name(name: &str) -> String {
    let mut shown: String = name
        .chars()
        .take(LOGGED_NAME_CHARS)
        .flat_map(char::escape_debug)
        .collect();
    let rest = name.chars().count().saturating_sub(LOGGED_NAME_CHARS);
    if rest > 0 {
        shown.push_str(&format!("… ({rest} more characters)"));
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_users_logins_never_push_another_users_session_out() {
        let sessions = Sessions::new(Duration::from_secs(3600));
        let ada = sessions.open("ada", Role::Operator);
        let vic: Vec<String> = (0..100)
            .map(|_| sessions.open("vic", Role::Viewer))
            .collect();
        assert!(sessions.get(&ada).is_some(), "ada's session stays");
        let kept = vic.iter().filter(|id| sessions.get(id).is_some()).count();
        assert_eq!(kept, MAX_SESSIONS_PER_USER);
        assert!(sessions.get(&vic[99]).is_some(), "the newest stays");
        assert!(sessions.get(&vic[0]).is_none(), "the oldest went");
    }

    #[test]
    fn a_logged_user_name_cannot_forge_or_flood_a_log_line() {
        let shown = logged_name("ada\n2026-12-01T00:00:00Z INFO console login user=root\u{1b}[2K");
        assert!(
            !shown.contains('\n') && !shown.contains('\u{1b}'),
            "{shown}"
        );
        let long = "x".repeat(1_500_000);
        let shown = logged_name(&long);
        assert!(shown.len() < 120, "{} bytes", shown.len());
        assert!(shown.contains("1499936 more characters"), "{shown}");
    }
}
