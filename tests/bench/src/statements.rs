//! What a phase asked of PostgreSQL, statement by statement: `pg_stat_statements` read before
//! and after the phase, for the phase's database, split by client program.
//!
//! Each program the benchmark starts connects as a role of its own ([`client_url`]: the order
//! service, the relays, the consumers), so the server's own counters tell who ran what, BEGIN and
//! COMMIT included: statements (with sqlx every statement is one round trip), commits, planning
//! and execution time, rows. The roles are made once on the server ([`ensure_client_roles`]),
//! members of the server's administrative role so that they use the tables it created.
//! PostgreSQL must load `pg_stat_statements` (`shared_preload_libraries`, as
//! deploy/postgres/pipeline.conf has it); without it the profile is absent and a note says why.

use std::collections::{BTreeMap, HashMap};

use std::sync::atomic::{AtomicBool, Ordering};

use pipeline_testkit::db::server_url;
use serde::Serialize;
use sqlx::{Connection, PgConnection};

/// Whether the clients' roles are in place and `pg_stat_statements` answers (set once, when the
/// run starts).
static PROFILED: AtomicBool = AtomicBool::new(false);

/// Whether phases take a statement profile (and the programs connect as their roles).
pub fn enabled() -> bool {
    PROFILED.load(Ordering::Relaxed)
}

/// The client programs, each with the role it connects as.
pub const CLIENTS: [(&str, &str); 3] = [
    ("order-service", "bench_order_service"),
    ("relay", "bench_relay"),
    ("consumer", "bench_consumer"),
];

/// Characters of a statement's text kept to name it.
const HEAD: usize = 110;
/// Statements listed, by total time.
const TOP: usize = 10;

/// The role a binary connects as, by the binary's name (`producer`, `relay`, `consumer`).
pub fn role_of(bin: &str) -> Option<&'static str> {
    let client = match bin {
        "producer" => "order-service",
        "relay" => "relay",
        "consumer" => "consumer",
        _ => return None,
    };
    CLIENTS.iter().find(|(c, _)| *c == client).map(|(_, r)| *r)
}

/// `database_url` (`scheme://[user[:password]@]host…`) with `role` as its user and no password
/// (the server trusts its local clients, as the scripts set it up).
pub fn client_url(database_url: &str, role: &str) -> anyhow::Result<String> {
    let (scheme, rest) = database_url
        .split_once("://")
        .ok_or_else(|| anyhow::anyhow!("{database_url}: not a URL"))?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let host = match rest[..authority_end].rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    Ok(format!("{scheme}://{role}@{host}"))
}

/// Makes the clients' roles (login, members of the connecting administrative role) and the
/// `pg_stat_statements` extension where they are missing, and turns the profile on. An error
/// says why the profile cannot be taken; the benchmark then runs its programs as the
/// administrative role.
pub async fn ensure_client_roles() -> anyhow::Result<()> {
    set_up().await?;
    PROFILED.store(true, Ordering::Relaxed);
    Ok(())
}

async fn set_up() -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(&server_url()).await?;
    for (_, role) in CLIENTS {
        sqlx::raw_sql(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                     CREATE ROLE {role} LOGIN;
                 END IF;
             END $$;
             GRANT {admin} TO {role};
             GRANT pg_read_all_stats TO {role};
             ALTER ROLE {role} REPLICATION;",
            admin = current_user(&mut admin).await?
        ))
        .execute(&mut admin)
        .await?;
    }
    sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&mut admin)
        .await?;
    // Fails while the library is not loaded: the profile could not be read.
    let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_statements")
        .fetch_one(&mut admin)
        .await?;
    Ok(())
}

async fn current_user(conn: &mut PgConnection) -> anyhow::Result<String> {
    let user: String = sqlx::query_scalar("SELECT quote_ident(current_user)")
        .fetch_one(conn)
        .await?;
    Ok(user)
}

/// One client's share of a phase's statements.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ClientStatements {
    /// Statements executed (BEGIN and COMMIT included): round trips.
    pub calls: i64,
    pub commits: i64,
    /// Statements planned (the others ran a cached plan).
    pub plans: i64,
    pub plan_ms: f64,
    pub exec_ms: f64,
}

/// One statement's figures over a phase.
#[derive(Debug, Clone, Serialize)]
pub struct StatementFigures {
    pub client: String,
    /// The statement's text as the server normalised it, whitespace folded, cut to its start.
    pub statement: String,
    pub calls: i64,
    pub plans: i64,
    pub mean_plan_ms: f64,
    pub mean_exec_ms: f64,
    pub rows_per_call: f64,
    pub total_ms: f64,
}

/// What a phase's database was asked, by client.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StatementProfile {
    /// By client program (`other`: the benchmark itself and any role not a client's).
    pub by_client: BTreeMap<String, ClientStatements>,
    /// The statements with the most planning and execution time, most first.
    pub top: Vec<StatementFigures>,
}

impl StatementProfile {
    /// One line per client: statements, commits and plans per event, time per event.
    pub fn client_lines(&self, events: u64) -> Vec<String> {
        let per = |v: f64| v / events.max(1) as f64;
        self.by_client
            .iter()
            .filter(|(client, _)| client.as_str() != "other")
            .map(|(client, c)| {
                format!(
                    "{client}: {} statements (round trips), {} commits, {} plans per event; \
                     {} µs planning + {} µs executing per event",
                    figure(per(c.calls as f64)),
                    figure(per(c.commits as f64)),
                    figure(per(c.plans as f64)),
                    figure(per(c.plan_ms * 1000.0)),
                    figure(per(c.exec_ms * 1000.0)),
                )
            })
            .collect()
    }

    /// The `n` statements with the most time, one line each.
    pub fn top_lines(&self, n: usize) -> Vec<String> {
        self.top
            .iter()
            .take(n)
            .map(|s| {
                format!(
                    "{:>8.0} ms {:>7} calls {:>7} plans  plan {:.3} + exec {:.3} ms  {:>6.1} rows  [{}] {}",
                    s.total_ms,
                    s.calls,
                    s.plans,
                    s.mean_plan_ms,
                    s.mean_exec_ms,
                    s.rows_per_call,
                    s.client,
                    s.statement
                )
            })
            .collect()
    }
}

/// Counters of one (role, statement) at one reading.
#[derive(Debug, Clone, Default)]
struct Counters {
    role: String,
    query: String,
    calls: i64,
    plans: i64,
    plan_ms: f64,
    exec_ms: f64,
    rows: i64,
}

type Key = (String, i64);

/// A reading taken when a phase starts.
pub struct StatementProfiler {
    conn: PgConnection,
    database: String,
    before: HashMap<Key, Counters>,
}

impl StatementProfiler {
    /// Reads the counters of `database` now; an error when `pg_stat_statements` cannot be read.
    pub async fn start(database: &str) -> anyhow::Result<StatementProfiler> {
        let mut conn = PgConnection::connect(&server_url()).await?;
        let before = read(&mut conn, database).await?;
        Ok(StatementProfiler {
            conn,
            database: database.to_owned(),
            before,
        })
    }

    /// What ran in the database since [`StatementProfiler::start`].
    pub async fn finish(mut self) -> anyhow::Result<StatementProfile> {
        let after = read(&mut self.conn, &self.database).await?;
        let client_of = |role: &str| {
            CLIENTS
                .iter()
                .find(|(_, r)| *r == role)
                .map_or("other", |(c, _)| *c)
                .to_owned()
        };
        let mut profile = StatementProfile::default();
        let mut top = Vec::new();
        for (key, now) in after {
            let was = self.before.get(&key).cloned().unwrap_or_default();
            let calls = now.calls - was.calls;
            if calls <= 0 {
                continue;
            }
            let (plans, plan_ms, exec_ms, rows) = (
                now.plans - was.plans,
                now.plan_ms - was.plan_ms,
                now.exec_ms - was.exec_ms,
                now.rows - was.rows,
            );
            let client = client_of(&now.role);
            let c = profile.by_client.entry(client.clone()).or_default();
            c.calls += calls;
            c.plans += plans;
            c.plan_ms += plan_ms;
            c.exec_ms += exec_ms;
            let text: String = now.query.split_whitespace().collect::<Vec<_>>().join(" ");
            if text.eq_ignore_ascii_case("commit") {
                c.commits += calls;
            }
            top.push(StatementFigures {
                client,
                statement: text.chars().take(HEAD).collect(),
                calls,
                plans,
                mean_plan_ms: round3(plan_ms / plans.max(1) as f64),
                mean_exec_ms: round3(exec_ms / calls as f64),
                rows_per_call: round3(rows as f64 / calls as f64),
                total_ms: round3(plan_ms + exec_ms),
            });
        }
        for c in profile.by_client.values_mut() {
            c.plan_ms = round3(c.plan_ms);
            c.exec_ms = round3(c.exec_ms);
        }
        top.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        top.truncate(TOP);
        profile.top = top;
        Ok(profile)
    }
}

/// `v` with three significant digits (at most two decimals from 1 up): 12.1, 0.327, 0.00412.
fn figure(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".to_owned();
    }
    let digits = (2 - v.abs().log10().floor() as i32).clamp(0, 8) as usize;
    format!("{v:.digits$}")
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

type Row = (String, i64, String, i64, i64, f64, f64, i64);

async fn read(conn: &mut PgConnection, database: &str) -> anyhow::Result<HashMap<Key, Counters>> {
    let rows: Vec<Row> = sqlx::query_as(
        "/* bench */ SELECT r.rolname::text, s.queryid, s.query, s.calls, s.plans,
                s.total_plan_time, s.total_exec_time, s.rows
         FROM pg_stat_statements s
         JOIN pg_database d ON d.oid = s.dbid
         JOIN pg_roles r ON r.oid = s.userid
         WHERE d.datname = $1 AND s.queryid IS NOT NULL",
    )
    .bind(database)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(role, queryid, query, calls, plans, plan_ms, exec_ms, rows)| {
                (
                    (role.clone(), queryid),
                    Counters {
                        role,
                        query,
                        calls,
                        plans,
                        plan_ms,
                        exec_ms,
                        rows,
                    },
                )
            },
        )
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_connects_as_its_role() {
        let url = client_url(
            "postgres://postgres:secret@127.0.0.1:5432/pt_bench?sslmode=disable",
            "bench_relay",
        )
        .expect("url");
        assert_eq!(
            url,
            "postgres://bench_relay@127.0.0.1:5432/pt_bench?sslmode=disable"
        );
        assert_eq!(role_of("producer"), Some("bench_order_service"));
        assert_eq!(figure(12.05), "12.1");
        assert_eq!(figure(0.3271), "0.327");
        assert_eq!(figure(0.004123), "0.00412");
        assert_eq!(figure(1246.0), "1246");
        assert_eq!(role_of("bench"), None);
    }
}
