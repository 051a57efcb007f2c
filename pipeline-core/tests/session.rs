//! Session settings reach every pooled connection. Needs `DATABASE_URL` (any database of the
//! test server; nothing is written).

use std::time::Duration;

use pipeline_core::db::{DbArgs, Planner};
use sqlx::postgres::PgConnectOptions;

fn args() -> DbArgs {
    DbArgs {
        database_url: std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server"),
        database_max_connections: 2,
        migrate: false,
        ..DbArgs::default()
    }
}

async fn show(pool: &sqlx::PgPool, setting: &str) -> String {
    sqlx::query_scalar(&format!("SHOW {setting}"))
        .fetch_one(pool)
        .await
        .expect("SHOW")
}

#[tokio::test]
async fn sessions_start_with_the_settings_asked_for() {
    let pool = args()
        .connect_with_statement_timeout(Some(Duration::from_millis(1500)), &[])
        .await
        .expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "1500ms");
    pool.close().await;
}

#[tokio::test]
async fn default_sessions_keep_the_server_defaults() {
    let pool = args().connect(&[]).await.expect("connect");
    assert_eq!(show(&pool, "statement_timeout").await, "0");
    pool.close().await;
}

/// Ends server process `pid` (as a restart, a cut connection or an idle timeout would), through
/// a session of `pool`, and waits past the idle time after which sessions are checked.
async fn end_and_wait_past_the_check(pool: &sqlx::PgPool, pid: i32) {
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .expect("pg_terminate_backend");
    assert!(ended);
    tokio::time::sleep(pipeline_core::db::CHECK_SESSIONS_IDLE_FOR + Duration::from_millis(200))
        .await;
}

/// The server process of the session `pool` hands out next.
async fn backend_of(pool: &sqlx::PgPool) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("pg_backend_pid")
}

#[tokio::test]
async fn a_session_that_died_while_idle_in_the_pool_is_replaced_not_handed_out() {
    let pool = DbArgs {
        database_max_connections: 1,
        ..args()
    }
    .connect(&[])
    .await
    .expect("connect");
    let first = backend_of(&pool).await;
    // Used again at once: the same session, not checked again.
    assert_eq!(backend_of(&pool).await, first);
    // The server ends it while it sits in the pool, and it stays idle past the check's threshold.
    let killer = args().connect(&[]).await.expect("connect");
    end_and_wait_past_the_check(&killer, first).await;
    let next = backend_of(&pool).await;
    assert_ne!(next, first, "a new session took the dead one's place");
    pool.close().await;
    killer.close().await;
}

async fn backend_pid(conn: &mut sqlx::PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
}

#[tokio::test]
async fn a_held_session_that_died_while_idle_is_replaced_before_use() {
    let pool = DbArgs {
        database_max_connections: 2,
        ..args()
    }
    .connect(&[])
    .await
    .expect("connect");
    let mut held = pipeline_core::db::HeldSession::default();
    let first = backend_pid(held.get(&pool).await.expect("session"))
        .await
        .expect("pid");
    end_and_wait_past_the_check(&pool, first).await;
    let next = backend_pid(held.get(&pool).await.expect("session"))
        .await
        .expect("the held session is checked and replaced, not used dead");
    assert_ne!(next, first);
    drop(held);
    pool.close().await;
}

/// The plan of a key lookup (an UPDATE joined to an array of keys, as the order service and the
/// consumers write them) made by a session of `planner` on a small table, as a prepared
/// statement's cached generic plan.
async fn plan_of_key_lookup(planner: Planner) -> String {
    let pool = args()
        .connect_session(None, planner, &[])
        .await
        .expect("connect");
    let mut conn = pool.acquire().await.expect("connection");
    for statement in [
        "CREATE TEMP TABLE lookup (id int PRIMARY KEY, v int NOT NULL)",
        "INSERT INTO lookup SELECT i, 0 FROM generate_series(1, 200) i",
        "ANALYZE lookup",
        "SET plan_cache_mode = force_generic_plan",
        "PREPARE bump(int[]) AS UPDATE lookup SET v = v + 1 FROM unnest($1) AS u(id)
         WHERE lookup.id = u.id",
    ] {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .expect(statement);
    }
    let plan: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE bump('{1,2}')")
        .fetch_all(&mut *conn)
        .await
        .expect("EXPLAIN");
    drop(conn);
    pool.close().await;
    plan.join("\n")
}

#[tokio::test]
async fn key_lookup_sessions_plan_small_tables_by_index() {
    // PostgreSQL's own choice on a small table reads it whole; a prepared statement would keep
    // that plan as the table grows.
    let default = plan_of_key_lookup(Planner::Default).await;
    assert!(default.contains("Seq Scan on lookup"), "{default}");

    let keyed = plan_of_key_lookup(Planner::KeyLookups).await;
    assert!(keyed.contains("Index Scan using lookup_pkey"), "{keyed}");
    assert!(!keyed.contains("Seq Scan on lookup"), "{keyed}");
    assert!(!keyed.contains("Hash Join"), "{keyed}");
}

/// Whether `SELECT bool_or(..)` over a one-row table (as the outbox's insert trigger runs it) is
/// compiled before it runs, on `conn`.
async fn compiles_a_small_aggregate(conn: &mut sqlx::PgConnection) -> bool {
    let plan: Vec<String> =
        sqlx::query_scalar("EXPLAIN (ANALYZE) SELECT bool_or(listening) FROM flag")
            .fetch_all(&mut *conn)
            .await
            .expect("EXPLAIN");
    plan.iter()
        .any(|line| line.trim_start().starts_with("JIT:"))
}

#[tokio::test]
async fn key_lookup_sessions_do_not_compile_what_their_planner_prices_high() {
    let pool = args()
        .connect_session(None, Planner::KeyLookups, &[])
        .await
        .expect("connect");
    let mut conn = pool.acquire().await.expect("connection");
    for statement in [
        "CREATE TEMP TABLE flag (listening boolean NOT NULL)",
        "INSERT INTO flag VALUES (true)",
    ] {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .expect(statement);
    }
    assert_eq!(show(&pool, "jit").await, "off");
    assert!(!compiles_a_small_aggregate(&mut conn).await);
    // What the session's `jit = off` prevents, where the server can compile at all: the disabled
    // scan's price sends the aggregate to the compiler.
    let available: bool = sqlx::query_scalar("SELECT pg_jit_available()")
        .fetch_one(&mut *conn)
        .await
        .expect("pg_jit_available");
    if available {
        sqlx::raw_sql("SET jit = on")
            .execute(&mut *conn)
            .await
            .expect("SET jit");
        assert!(compiles_a_small_aggregate(&mut conn).await);
    }
    drop(conn);
    pool.close().await;
}

/// The test server's connection options, from `DATABASE_URL`.
fn server() -> PgConnectOptions {
    args().database_url.parse().expect("DATABASE_URL is a URL")
}

/// The test server's address (`host:port`).
fn server_address() -> String {
    let server = server();
    format!("{}:{}", server.get_host(), server.get_port())
}

/// A URL of the test server's user and `database` on 127.0.0.1:`port`.
fn url_on(port: u16, database: &str) -> String {
    format!(
        "postgres://{}@127.0.0.1:{port}/{database}?sslmode=disable",
        server().get_username()
    )
}

/// A URL of the test server's database on 127.0.0.1:`port`.
fn url_on_port(port: u16) -> String {
    url_on(port, server().get_database().unwrap_or("postgres"))
}

/// A port nothing listens on (until someone binds it again).
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    listener.local_addr().expect("address").port()
}

#[tokio::test]
async fn start_up_waits_for_a_database_that_comes_up_late() {
    let port = closed_port().await;
    let down_for = Duration::from_millis(1500);
    // The "server" comes up after `down_for`: a proxy to the test server on the port start-up
    // was given.
    let target = server_address();
    let proxy = tokio::spawn(async move {
        tokio::time::sleep(down_for).await;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the proxy");
        loop {
            let (mut client, _) = listener.accept().await.expect("accept");
            let target = target.clone();
            tokio::spawn(async move {
                let mut server = tokio::net::TcpStream::connect(target)
                    .await
                    .expect("reach the test server");
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    let started = std::time::Instant::now();
    let pool = DbArgs {
        database_url: url_on_port(port),
        database_wait: Duration::from_secs(30),
        ..args()
    }
    .connect(&[])
    .await
    .expect("connects once the database is up");
    assert!(started.elapsed() >= down_for, "{:?}", started.elapsed());
    assert_eq!(show(&pool, "server_version_num").await.len(), 6);
    pool.close().await;
    proxy.abort();
}

#[tokio::test]
async fn start_up_gives_up_on_a_database_that_stays_down_and_at_once_on_a_refusal() {
    let port = closed_port().await;
    let started = std::time::Instant::now();
    let error = DbArgs {
        database_url: url_on_port(port),
        database_wait: Duration::from_secs(2),
        ..args()
    }
    .connect(&[])
    .await
    .expect_err("nothing listens");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    assert!(format!("{error:#}").contains("cannot connect"), "{error:#}");

    // A database that does not exist is a refusal no wait cures.
    let server = server();
    let started = std::time::Instant::now();
    let error = DbArgs {
        database_url: url_on(server.get_port(), "no_such_database_here"),
        database_wait: Duration::from_secs(60),
        ..args()
    }
    .connect(&[])
    .await
    .expect_err("no such database");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(format!("{error:#}").contains("does not exist"), "{error:#}");
}
