//! Whether this process can reach its database: a probe on a session of its own.
//!
//! A consumer cut off from PostgreSQL (by the network, or a stalled proxy) keeps its Kafka
//! session, so it would keep its partitions while applying nothing. The probe tells the poll loop
//! how long the database has been out of reach; past the group's limit the member leaves its
//! group so members that can reach the database take its partitions over, and joins again once
//! the probe answers (see `member`). Whatever its abandoned batches try when the path
//! comes back is refused: their sessions were ended by the server
//! (`idle_in_transaction_session_timeout`) and the partitions' new owner replaced the ownership
//! token every batch transaction checks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::metrics::ConsumerMetrics;

/// How long the database may miss probes before what waits on it stops waiting: two probes
/// missed at the probe's pace of a second, each bounded by a second, with a second to spare.
pub(super) const OUT_OF_REACH: Duration = Duration::from_secs(3);

/// The time of the last probe the database answered, shared with the poll loops.
#[derive(Debug, Clone)]
pub struct Reachability {
    started: Instant,
    last_ok_ms: Arc<AtomicU64>,
}

impl Default for Reachability {
    fn default() -> Self {
        Reachability {
            started: Instant::now(),
            last_ok_ms: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Reachability {
    /// How long the database has not answered a probe; zero right after one did.
    pub fn unreachable_for(&self) -> Duration {
        let last_ok = Duration::from_millis(self.last_ok_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last_ok)
    }

    /// Whether the database has missed probes for longer than `OUT_OF_REACH` (3 s).
    pub fn out_of_reach(&self) -> bool {
        self.unreachable_for() > OUT_OF_REACH
    }

    fn answered(&self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ok_ms.store(now, Ordering::Relaxed);
    }
}

/// Longest a probe waits for a new connection. Setting one up (a server process, authentication)
/// takes far longer than a ping on a busy server: bounded as tightly as the ping, a probe on a
/// loaded machine never connected, and the member left a group whose database answered.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);

/// Probes the database every `every` with a ping on a connection of its own, each ping bounded
/// by `every`, until `stop`. A connection it has no longer trusts after a missed ping is
/// replaced; a connection made counts as an answer.
pub async fn probe(
    options: PgConnectOptions,
    every: Duration,
    reachability: Reachability,
    metrics: ConsumerMetrics,
    stop: CancellationToken,
) {
    let mut conn: Option<PgConnection> = None;
    loop {
        let answered = match conn.as_mut() {
            Some(c) => matches!(tokio::time::timeout(every, c.ping()).await, Ok(Ok(()))),
            None => match tokio::time::timeout(CONNECT_WITHIN, options.connect()).await {
                Ok(Ok(c)) => {
                    conn = Some(c);
                    true
                }
                Ok(Err(_)) | Err(_) => false,
            },
        };
        if answered {
            reachability.answered();
            metrics.database_reachable.set(1);
        } else {
            metrics.database_reachable.set(0);
            if let Some(c) = conn.take() {
                // Closing politely could hang on the dead path: let it go in the background.
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(1), c.close()).await;
                });
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::time::Duration;

    use prometheus::Registry;
    use sqlx::postgres::PgConnectOptions;
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    use super::{probe, Reachability};
    use crate::metrics::ConsumerMetrics;

    /// A path to the database on which a new connection's first bytes take `delay`, as on a
    /// loaded server where starting a session is slow; what follows passes at once.
    async fn slow_to_connect(target: String, delay: Duration) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn a_database_slow_to_take_a_connection_still_answers_the_probe() {
        let url = std::env::var("DATABASE_URL").expect("DATABASE_URL names the test server");
        let options = PgConnectOptions::from_str(&url).expect("DATABASE_URL");
        let target = format!("{}:{}", options.get_host(), options.get_port());
        // Slower than a ping's bound (the probe's second), well within a connection's.
        let port = slow_to_connect(target, Duration::from_millis(1_500)).await;
        let reachability = Reachability::default();
        let metrics = ConsumerMetrics::register(&Registry::new()).expect("metrics");
        let stop = CancellationToken::new();
        let probing = tokio::spawn(probe(
            options.host("127.0.0.1").port(port),
            Duration::from_secs(1),
            reachability.clone(),
            metrics.clone(),
            stop.clone(),
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
        while metrics.database_reachable.get() != 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the probe never connected through a path 1.5 s slow to connect"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            !reachability.out_of_reach(),
            "{:?} without an answer",
            reachability.unreachable_for()
        );
        stop.cancel();
        probing.await.expect("probe");
    }
}
