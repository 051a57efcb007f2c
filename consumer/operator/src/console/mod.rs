//! `pipeline console --listen ADDR`: the operator command as a web console. Server-rendered pages
//! with a little JavaScript (served from `/static/`, embedded in the binary; no inline script),
//! each page's data also as JSON under `/api/`, and every action of the `pipeline` subcommands
//! from a form that asks for a note (why) and a confirmation.
//!
//! One code path: pages read through [`crate::status::read`], [`crate::trace::read`] and
//! [`crate::dead_letters::list`], and act through [`crate::dead_letters::resolve_letters`],
//! [`crate::requeue::requeue`], [`crate::reprocess::reprocess_group`] and, for delayed events,
//! [`delayed`] (over the outbox library's `cancel_delayed`). Each change is recorded in
//! `operator_action` like the command's, with the logged-in user as the actor and the note
//! typed in the form.
//!
//! Layout:
//! - [`users`]: who may log in (a file or the environment, never the repository) and their
//!   role, `viewer` (reads everything, acts on nothing) or `operator`;
//! - `session`: login, the session cookie, the per-session CSRF token, and the layer that
//!   refuses every request without a session;
//! - `urls`: the console's path prefix, every URL it hands the browser, and where a login may
//!   go back to;
//! - `html`: what a page shows of stored text, the page layout (maud templates, which escape
//!   every value), the security headers;
//! - `refusal`: bad input as a 4xx with a message, a database or broker that does not answer
//!   as a 503 that says so (never a 500);
//! - `busy`: the few places the routes that read or change the databases take at a time;
//! - `overview`, `timeline`, `letters`, `outbox`, `groups`: one page (and its `/api/` twin)
//!   each; `actions`: the one `POST` entry for every change;
//! - [`delayed`]: list, publish now, cancel delayed events.

mod actions;
mod busy;
pub mod delayed;
mod groups;
mod html;
mod letters;
mod logged_in;
mod login_guard;
mod outbox;
mod overview;
mod refusal;
mod session;
mod timeline;
mod urls;
pub mod users;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::response::Redirect;
use axum::routing::{get, post};
use axum::Router;
use consumer::Groups;
use pipeline_core::http_server::ServerLimits;
use tokio_util::sync::CancellationToken;

use crate::targets::Targets;
use users::Users;

/// Letters or events one action takes at most ("every letter that matches" stops here).
const BULK_LIMIT: usize = 1_000;

/// `pipeline console`: where it listens and who may log in.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsoleArgs {
    /// Address to listen on (port 0: any free port, reported on stdout).
    #[arg(
        long,
        env = "PIPELINE_CONSOLE_LISTEN",
        default_value = "127.0.0.1:8088"
    )]
    pub listen: SocketAddr,
    /// A file of users, one `name:role:hash` a line (role `viewer` or `operator`; hash an
    /// Argon2 PHC string from `pipeline console --hash-password`, or `sha256:HEX` of a long
    /// random token). Lines starting with `#` are comments.
    #[arg(long, env = "PIPELINE_CONSOLE_USERS_FILE")]
    pub users_file: Option<PathBuf>,
    /// Users as in the file, separated by newlines or spaces (added to the file's).
    #[arg(long, env = "PIPELINE_CONSOLE_USERS", hide_env_values = true)]
    pub users: Option<users::Secret>,
    /// Dead-letter topic template, as the groups run with it (letters raised while releasing
    /// parked events are published there); empty: publish none.
    #[arg(long, env = "DEAD_LETTER_TOPIC", default_value = "{topic}.dlq")]
    pub dead_letter_topic: String,
    /// How often the overview reads the status (and samples throughput), at least a second.
    #[arg(long, env = "PIPELINE_CONSOLE_REFRESH", default_value = "3s",
          value_parser = at_least(Duration::from_secs(1)))]
    pub refresh: Duration,
    /// How long a login lasts, at least a minute.
    #[arg(long, env = "PIPELINE_CONSOLE_SESSION_TTL", default_value = "12h",
          value_parser = at_least(Duration::from_secs(60)))]
    pub session_ttl: Duration,
    /// Mark the session cookie `Secure` (behind an HTTPS proxy).
    #[arg(long, env = "PIPELINE_CONSOLE_SECURE_COOKIE", default_value_t = false)]
    pub secure_cookie: bool,
    /// The path the console is served under, e.g. `/ops/console` behind a proxy that passes that
    /// path on (see [`ConsoleSettings::prefix`]): `/` redirects there, other paths outside it
    /// are 404. Empty: at the root.
    #[arg(long, env = "PIPELINE_CONSOLE_PREFIX", default_value = "", value_parser = prefix)]
    pub prefix: String,
    /// Read a password from standard input, print its Argon2 hash for the users file, and exit.
    #[arg(long)]
    pub hash_password: bool,
    /// The HTTP server's bounds on every client.
    #[command(flatten)]
    pub limits: ServerLimits,
}

/// Settings of a console, as a library user builds them.
#[derive(Debug, Clone)]
pub struct ConsoleSettings {
    /// Dead-letter topic template (see [`ConsoleArgs::dead_letter_topic`]).
    pub dead_letter_topic: String,
    /// How often the overview reads the status.
    pub refresh: Duration,
    /// How long a login lasts.
    pub session_ttl: Duration,
    /// Mark the session cookie `Secure`.
    pub secure_cookie: bool,
    /// The path the console is served under: empty (the default) at the root, or `/` and
    /// segments of letters, digits and `._~-` without a trailing `/` (`/ops/console`);
    /// [`Console::new`] refuses anything else. Every link, form, redirect, the static files'
    /// and the script's URLs and the session cookie's `Path` carry it. The routes of
    /// [`Console::router`] stay at `/…`: a host nests that router at this prefix, and
    /// [`Console::serve`] does so itself.
    pub prefix: String,
    /// The HTTP server's bounds on every client.
    pub limits: ServerLimits,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            dead_letter_topic: "{topic}.dlq".to_owned(),
            refresh: Duration::from_secs(3),
            session_ttl: Duration::from_secs(12 * 3600),
            secure_cookie: false,
            prefix: String::new(),
            limits: ServerLimits::default(),
        }
    }
}

/// The console's shared state: what it reads and acts on, its users and sessions, and the
/// overview's latest reading.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    targets: Targets,
    groups: Groups,
    users: Users,
    sessions: session::Sessions,
    login_guard: login_guard::LoginGuard,
    settings: ConsoleSettings,
    overview: overview::Board,
    /// See [`busy`].
    database_places: tokio::sync::Semaphore,
}

/// Settings a console cannot run with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// [`ConsoleSettings::prefix`] is not a path the console can be served under.
    #[error("the console's prefix `{prefix}` is refused: {reason}")]
    Prefix {
        /// The prefix given.
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl Console {
    /// A console over `targets` for the program's `groups`; nothing is read until asked.
    /// Refuses settings it cannot run with (a prefix that is not a plain absolute path).
    pub fn new(
        targets: Targets,
        groups: Groups,
        users: Users,
        settings: ConsoleSettings,
    ) -> Result<Self, ConsoleError> {
        if let Some(reason) = urls::refused_prefix(&settings.prefix) {
            return Err(ConsoleError::Prefix {
                prefix: settings.prefix,
                reason,
            });
        }
        Ok(Console {
            inner: Arc::new(Inner {
                targets,
                groups,
                users,
                sessions: session::Sessions::new(settings.session_ttl),
                login_guard: login_guard::LoginGuard::default(),
                settings,
                overview: overview::Board::default(),
                database_places: tokio::sync::Semaphore::new(busy::PLACES),
            }),
        })
    }

    /// The URLs the console hands the browser, under its prefix.
    fn urls(&self) -> urls::Urls<'_> {
        urls::Urls::new(&self.inner.settings.prefix)
    }

    /// Every route: `/login` and `/static/` are open, everything else needs a session; every
    /// response carries the security headers.
    ///
    /// The routes are at `/…` whatever [`ConsoleSettings::prefix`] is, while the pages link
    /// under the prefix: a host mounts the router at the prefix,
    ///
    /// ```no_run
    /// # fn mount(console: operator::console::Console, prefix: &str) -> axum::Router {
    /// // prefix: the settings' `/ops/console`; axum nests at no empty path: merge at the root.
    /// let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    /// if prefix.is_empty() {
    ///     app.merge(console.router())
    /// } else {
    ///     app.nest(prefix, console.router())
    /// }
    /// # }
    /// ```
    ///
    /// and serves it with the client's address (`into_make_service_with_connect_info`), which
    /// throttles logins per address. Nested at `/ops/console`, the overview is `/ops/console`
    /// (axum answers `/ops/console/` from the host's fallback).
    pub fn router(&self) -> Router {
        let reads_and_actions = Router::new()
            .route("/timeline", get(timeline::page))
            .route("/api/timeline", get(timeline::api))
            .route("/dead-letters", get(letters::page))
            .route("/api/dead-letters", get(letters::api))
            .route("/outbox", get(outbox::page))
            .route("/api/outbox", get(outbox::api))
            .route("/groups", get(groups::page))
            .route("/api/groups", get(groups::api))
            .route("/actions/{action}", post(actions::html))
            .route("/api/actions/{action}", post(actions::json))
            .route_layer(axum::middleware::from_fn_with_state(
                self.clone(),
                busy::one_of_few,
            ));
        let protected = Router::new()
            .route("/", get(overview::page))
            .route("/api/overview", get(overview::api))
            .merge(reads_and_actions)
            .route("/logout", post(session::logout))
            .fallback(refusal::not_found)
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                session::require_login,
            ));
        Router::new()
            .route("/login", get(session::login_page).post(session::login))
            .route("/static/console.css", get(html::css))
            .route("/static/console.js", get(html::js))
            .route("/favicon.ico", get(html::no_icon))
            .merge(protected)
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                refusal::draw,
            ))
            .layer(axum::middleware::from_fn(html::security_headers))
            .with_state(self.clone())
    }

    /// The router as [`Console::serve`] serves it: [`Console::router`] at the root, or nested
    /// at the prefix, where `/` and the prefix with a trailing `/` redirect to the overview and
    /// any other path outside the prefix is a 404 page.
    fn app(&self) -> Router {
        let urls = self.urls();
        let prefix = &self.inner.settings.prefix;
        if prefix.is_empty() {
            return self.router();
        }
        let overview = urls.overview().to_owned();
        let to_overview = get(move || async move { Redirect::to(&overview) });
        Router::new()
            .route("/", to_overview.clone())
            .route(&format!("{prefix}/"), to_overview)
            .fallback(refusal::not_found)
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                refusal::draw,
            ))
            .layer(axum::middleware::from_fn(html::security_headers))
            .with_state(self.clone())
            .nest(prefix, self.router())
    }

    /// Reads the status every `refresh` until `shutdown`, for the overview and its chart.
    pub async fn sample_until(&self, shutdown: CancellationToken) {
        overview::sample_until(self, shutdown).await;
    }

    /// Serves on `listener` until `shutdown`, sampling the overview meanwhile. With a prefix,
    /// the router is nested at it: `/` and the prefix with a trailing `/` redirect to the
    /// overview (the prefix), any other path outside the prefix is a 404 page.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let sampler = tokio::spawn({
            let console = self.clone();
            let shutdown = shutdown.clone();
            async move { console.sample_until(shutdown).await }
        });
        // Each request knows its client's address (logins are throttled per address).
        let limits = &self.inner.settings.limits;
        pipeline_core::http_server::serve(listener, self.app(), limits, shutdown.clone()).await;
        shutdown.cancel();
        let _ = sampler.await;
        Ok(())
    }
}

/// `pipeline console`: loads the users, listens, reports the address and serves until SIGINT
/// or SIGTERM.
pub async fn run(targets: Targets, groups: Groups, args: &ConsoleArgs) -> anyhow::Result<()> {
    if args.hash_password {
        let mut password = String::new();
        let _ = std::io::stdin()
            .read_line(&mut password)
            .context("reading the password from standard input")?;
        let password = password.trim_end_matches(['\n', '\r']);
        println!("{}", users::hash_password(password)?);
        return Ok(());
    }
    let users = Users::load(
        args.users_file.as_deref(),
        args.users.as_ref().map(users::Secret::expose),
    )?;
    let settings = ConsoleSettings {
        dead_letter_topic: args.dead_letter_topic.clone(),
        refresh: args.refresh,
        session_ttl: args.session_ttl,
        secure_cookie: args.secure_cookie,
        prefix: args.prefix.clone(),
        limits: args.limits.clone(),
    };
    let console = Console::new(targets, groups, users, settings)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "pipeline console listening on {addr} ({} user(s)){}",
        console.inner.users.len(),
        match args.prefix.as_str() {
            "" => String::new(),
            prefix => format!(", under {prefix}"),
        }
    );
    let shutdown = pipeline_core::telemetry::shutdown_on_signals();
    console.serve(listener, shutdown).await
}

/// The `--prefix` flag's parser: refuses what [`Console::new`] would.
fn prefix(value: &str) -> Result<String, String> {
    match urls::refused_prefix(value) {
        Some(reason) => Err(reason.to_owned()),
        None => Ok(value.to_owned()),
    }
}

/// A duration flag's parser that refuses one shorter than `min` (or without a unit).
fn at_least(min: Duration) -> impl Fn(&str) -> Result<Duration, String> + Clone {
    move |value| {
        let d = humantime::parse_duration(value).map_err(|e| e.to_string())?;
        if d < min {
            return Err(format!(
                "at least {} (got {value})",
                humantime::format_duration(min)
            ));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
