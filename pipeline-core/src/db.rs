//! PostgreSQL connection and migrations.

use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use sqlx::migrate::Migrator;

/// Applies `sets` in order.
pub async fn migrate(pool: &PgPool, sets: &[&Migrator]) -> anyhow::Result<()> {
    for set in sets {
        set.run(pool)
            .await
            .context("applying database migrations")?;
    }
    Ok(())
}

/// How a pool's sessions plan their statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planner {
    /// PostgreSQL's own choices.
    Default,
    /// Index scans and nested loops wherever one exists, whatever the tables' statistics say:
    /// for sessions whose every hot statement looks rows up by key (services writing through
    /// the outbox, consumer groups). PostgreSQL otherwise plans such a statement on a table
    /// that was small when it last looked (a new database, or one whose statistics autovacuum
    /// has not refreshed) as a sequential scan and hash join, and a prepared statement keeps
    /// that plan while the table grows, so a statement that touches a few rows reads the whole
    /// table. Other statements still run: a plan with no index to use keeps its sequential
    /// scan.
    KeyLookups,
}

/// The session settings of [`Planner::KeyLookups`].
///
/// Without JIT compilation as well: a scan the planner must still use while it is disabled is
/// priced at ten billion, so every statement that has one (an aggregate over a small table, a
/// trigger's look at a one-row table) passes `jit_above_cost` and is compiled before it runs:
/// some 110 ms of CPU for a statement of a tenth of a millisecond, on every execution.
///
/// And with generic plans for every prepared statement: with these settings a generic plan is
/// the same index lookups as a custom one, but PostgreSQL prices a statement reading `unnest` of
/// an array parameter at ten rows when it cannot see the array and at its real length when it
/// can, so a statement run with one or two values looks cheaper planned with them and is planned
/// again on every execution (a third of a millisecond for the outbox insert).
pub const KEY_LOOKUP_PLANNER: [(&str, &str); 5] = [
    ("enable_seqscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
    ("jit", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

/// The database URL of [`DbArgs::default`]: the local PostgreSQL's `pipeline` database.
pub const DEFAULT_DATABASE_URL: &str =
    "postgres://postgres@127.0.0.1:5432/pipeline?sslmode=disable";

/// Database settings shared by every binary.
#[derive(Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct DbArgs {
    /// PostgreSQL connection URL.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)
    )]
    pub database_url: String,
    /// Largest number of pooled connections.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DATABASE_MAX_CONNECTIONS", default_value_t = 16)
    )]
    pub database_max_connections: u32,
    /// Apply pending migrations at start-up.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DATABASE_MIGRATE", default_value_t = true, action = clap::ArgAction::Set)
    )]
    pub migrate: bool,
    /// How long start-up waits for a database that is down or still starting (recovering after
    /// a crash, say) before it gives up; `0s`: not at all. A database that refuses the
    /// connection outright (bad password, no such database) fails at once.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DATABASE_WAIT", default_value = "5m", value_parser = humantime::parse_duration)
    )]
    pub database_wait: Duration,
}

/// The default of [`DbArgs::database_wait`].
pub const DEFAULT_DATABASE_WAIT: Duration = Duration::from_secs(300);

/// Longest pause between two attempts to reach a database at start-up.
const MOST_CONNECT_PAUSE: Duration = Duration::from_secs(5);

/// A session a caller keeps from one transaction to the next (the shared-transaction runners, the
/// relay's claims), so that the pool does not check it on every hand-out and hand-back: checked
/// like a pooled one before it is used after [`CHECK_SESSIONS_IDLE_FOR`] or longer idle (a server
/// restarted meanwhile, a connection cut), and handed back to the pool after a failure, which
/// checks it and drops it when it is broken.
#[derive(Debug, Default)]
pub struct HeldSession {
    session: Option<PoolConnection<Postgres>>,
    last_used: Option<Instant>,
}

impl HeldSession {
    /// The session, checked when it sat idle, or a new one from `pool`.
    pub async fn get(&mut self, pool: &PgPool) -> Result<&mut PgConnection, sqlx::Error> {
        let idle = self
            .last_used
            .is_none_or(|at| at.elapsed() >= CHECK_SESSIONS_IDLE_FOR);
        if idle {
            if let Some(session) = self.session.as_mut() {
                // A path cut without a reset (a partition) would hold the check until TCP gives
                // up: it waits SESSION_CHECK_TIMEOUT, then takes another session.
                let checked = tokio::time::timeout(SESSION_CHECK_TIMEOUT, session.ping()).await;
                if !matches!(checked, Ok(Ok(()))) {
                    self.session = None;
                }
            }
        }
        if self.session.is_none() {
            self.session = Some(pool.acquire().await?);
        }
        self.last_used = Some(Instant::now());
        self.session.as_deref_mut().ok_or(sqlx::Error::PoolClosed)
    }

    /// The session, when one is held (for a look at it).
    pub fn session(&mut self) -> Option<&mut PgConnection> {
        self.session.as_deref_mut()
    }

    /// Returns the session to the pool after a failure: the next use opens another.
    pub fn failed(&mut self) {
        self.session = None;
    }
}

/// Longest a held session's check may take before the session is given up.
const SESSION_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A pooled session idle at least this long is checked (one round trip) before it is handed out.
pub const CHECK_SESSIONS_IDLE_FOR: Duration = Duration::from_secs(1);

/// The options of every pool the pipeline opens: at most `max_connections` sessions, waiting up
/// to `acquire_timeout` for one.
///
/// A session is checked before it is handed out only when it sat idle for
/// [`CHECK_SESSIONS_IDLE_FOR`] or longer. sqlx checks every session by default, a round trip
/// (and a wake-up of the server's process) for every transaction, which under load is a quarter
/// of a small transaction's round trips; a session handed back to the pool is checked then
/// anyway (sqlx always does), so a session that broke while in use never returns. What the
/// check on hand-out still catches, a server restarted or a connection cut while the session
/// sat in the pool, takes longer than the idle time that triggers it.
pub fn pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= CHECK_SESSIONS_IDLE_FOR {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}

impl Default for DbArgs {
    fn default() -> Self {
        DbArgs {
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            database_max_connections: 16,
            migrate: true,
            database_wait: DEFAULT_DATABASE_WAIT,
        }
    }
}

impl std::fmt::Debug for DbArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbArgs")
            .field("database_url", &redact_url(&self.database_url))
            .field("database_max_connections", &self.database_max_connections)
            .field("migrate", &self.migrate)
            .field("database_wait", &self.database_wait)
            .finish()
    }
}

/// A URL with its passwords replaced, fit for logs: the one in its user part and every query
/// parameter whose name holds `password` (`?password=`, `sslpassword=`), whatever their case.
pub fn redact_url(url: &str) -> String {
    let (address, query) = match url.split_once('?') {
        Some((address, query)) => (address, Some(query)),
        None => (url, None),
    };
    let mut redacted = match (address.find("://"), address.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &address[scheme_end + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &address[..scheme_end + 3],
                    &userinfo[..colon],
                    &address[at..]
                ),
                None => address.to_owned(),
            }
        }
        _ => address.to_owned(),
    };
    if let Some(query) = query {
        let parameters: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                    format!("{name}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        redacted.push('?');
        redacted.push_str(&parameters.join("&"));
    }
    redacted
}

impl DbArgs {
    /// The URL's connection options, named after this program (unless the URL names one) so
    /// operators see in pg_stat_activity which program a session belongs to.
    pub fn connect_options(&self) -> anyhow::Result<PgConnectOptions> {
        let mut options: PgConnectOptions = self
            .database_url
            .parse()
            .with_context(|| format!("invalid DATABASE_URL {}", redact_url(&self.database_url)))?;
        if options.get_application_name().is_none() {
            if let Some(program) = program_name() {
                options = options.application_name(&program);
            }
        }
        Ok(options)
    }

    /// Connects (waiting up to `acquire_timeout` for the server) and, when asked to, applies
    /// the migrations of `schema`: the sets of tables this program uses.
    pub async fn connect(&self, schema: &[&Migrator]) -> anyhow::Result<PgPool> {
        self.connect_with_statement_timeout(None, schema).await
    }

    /// [`DbArgs::connect`], with a `statement_timeout` on every connection when given.
    pub async fn connect_with_statement_timeout(
        &self,
        statement_timeout: Option<std::time::Duration>,
        schema: &[&Migrator],
    ) -> anyhow::Result<PgPool> {
        self.connect_session(statement_timeout, Planner::Default, schema)
            .await
    }

    /// [`DbArgs::connect`], with a `statement_timeout` on every connection when given and the
    /// sessions' planner set to `planner`.
    pub async fn connect_session(
        &self,
        statement_timeout: Option<std::time::Duration>,
        planner: Planner,
        schema: &[&Migrator],
    ) -> anyhow::Result<PgPool> {
        self.connect_pool(self.session_options(statement_timeout, planner)?, schema)
            .await
    }

    /// The connection options of [`DbArgs::connect_session`], for callers that add settings.
    pub fn session_options(
        &self,
        statement_timeout: Option<std::time::Duration>,
        planner: Planner,
    ) -> anyhow::Result<PgConnectOptions> {
        let mut options = self.connect_options()?;
        if let Some(t) = statement_timeout {
            options = options.options([("statement_timeout", t.as_millis().to_string())]);
        }
        if planner == Planner::KeyLookups {
            options = options.options(KEY_LOOKUP_PLANNER);
        }
        Ok(options)
    }

    /// A pool of sessions made with `options`, with the migrations of `schema` applied when
    /// asked to. A server that is down or still starting is tried again, with growing pauses,
    /// for up to [`DbArgs::database_wait`].
    pub async fn connect_pool(
        &self,
        options: PgConnectOptions,
        schema: &[&Migrator],
    ) -> anyhow::Result<PgPool> {
        let pool = match self.wait_for_server(&options).await {
            Ok(()) => {
                pool_options(self.database_max_connections, Duration::from_secs(10))
                    .connect_with(options)
                    .await
            }
            Err(e) => Err(e),
        }
        .with_context(|| {
            format!(
                "cannot connect to PostgreSQL at {}",
                redact_url(&self.database_url)
            )
        })?;
        if self.migrate {
            migrate(&pool, schema).await?;
        }
        Ok(pool)
    }

    /// Tries single connections, with growing pauses, while the server is down or still
    /// starting, for up to [`DbArgs::database_wait`]: the last attempt's error when the server
    /// refuses outright or the wait is over.
    async fn wait_for_server(&self, options: &PgConnectOptions) -> Result<(), sqlx::Error> {
        let deadline = tokio::time::Instant::now() + self.database_wait;
        let mut pause = Duration::from_millis(250);
        loop {
            let e = match PgConnection::connect_with(options).await {
                Ok(conn) => {
                    let _ = conn.close().await;
                    return Ok(());
                }
                Err(e) => e,
            };
            let now = tokio::time::Instant::now();
            if !not_reachable_yet(&e) || now >= deadline {
                return Err(e);
            }
            tracing::warn!(
                database = %redact_url(&self.database_url),
                error = %e,
                retry_in_ms = pause.as_millis() as u64,
                "the database is not reachable yet; waiting for it"
            );
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(MOST_CONNECT_PAUSE);
        }
    }
}

/// Whether a failed connection attempt may succeed later without anyone changing anything: the
/// server is down, unreachable, starting, shutting down or out of connections, as opposed to
/// refusing who asks (authentication, a database that does not exist, a bad setting).
fn not_reachable_yet(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // 08: connection exception; 57P01-57P03: admin shutdown, crash shutdown, cannot
            // connect now (starting up, recovering); 53300: too many connections.
            c.starts_with("08") || c.starts_with("57P") || c == "53300"
        }),
        _ => false,
    }
}

/// This executable's file name (`producer`, `relay`, `consumer`…).
fn program_name() -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.file_stem()?.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn hides_passwords() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(redact_url("postgres:///x"), "postgres:///x");
        assert_eq!(
            redact_url("postgres://app@db/x?sslmode=disable&password=s3cret&PassWord=s3cret"),
            "postgres://app@db/x?sslmode=disable&password=***&PassWord=***"
        );
        assert_eq!(
            redact_url("postgres://app:a@b@db/x?sslpassword=s3cret&user=app"),
            "postgres://app:***@db/x?sslpassword=***&user=app"
        );
    }
}
