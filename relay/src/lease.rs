//! One active relay at a time: a lease row in PostgreSQL with an epoch and an expiry.
//!
//! The active relay renews the lease from a session of its own (its *presence* session) every
//! third of the lease's time to live. A standby takes the lease over, raising the epoch:
//! - at once, when the holder's presence session has ended (the holder died or was killed: the
//!   server ends the session with the process);
//! - once the lease has expired, when the holder stopped renewing but its session lingers (the
//!   holder is frozen, or cut off from the database by the network).
//!
//! So a takeover takes at most the time to live plus the standby's retry interval. A standby
//! looks at the lease without locking it, and only a lease it may take is locked: a standby
//! polling a live lease never holds up the holder's writes, nor waits behind them (or behind a
//! frozen holder's open transaction). When it looks, it also learns when the lease expires and
//! makes its next attempt then if that comes before its retry interval is over, so a frozen
//! holder is replaced about one statement's time after its lease ran out.
//!
//! Every write about events names the epoch and takes a key-share lock on the lease row in the
//! same statement (see [`crate::mark`]). A takeover locks that row `FOR UPDATE`, so it waits for a
//! write already under way and every later write of the old epoch finds no row and is refused: a
//! relay that lost the lease can mark, fail, requeue or reorder nothing, whatever it does when it
//! wakes. A renewal changes no key and takes no such lock, so it does not wait for the holder's
//! own writes: a COMMIT stalled on a saturated disk does not cost the holder its lease.
//! It also stops by itself: it stops producing once its own clock says the lease may have
//! expired (measured from before its last successful renewal was sent, so never later than the
//! database's expiry), and its next renewal is refused.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How the lease is held and taken over.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// The lease row's key: relays sharing a key elect one active relay among them.
    pub lock_key: i64,
    /// How long a lease lasts without renewal: the longest a standby waits for a frozen or cut-off
    /// holder.
    pub lease_ttl: Duration,
    /// How often a standby tries to take the lease.
    pub standby_retry: Duration,
}

impl LeaseSettings {
    /// How often the holder renews: three renewals fit in one time to live.
    pub fn renew_every(&self) -> Duration {
        self.lease_ttl / 3
    }

    /// The longest one lease statement (or connecting for one) may take before it counts as
    /// failed: a renewal that hangs must not keep the holder from noticing its lease ran out.
    pub fn op_timeout(&self) -> Duration {
        (self.lease_ttl / 3).min(Duration::from_secs(5))
    }

    /// The longest a standby waits before it holds the lease of a frozen or cut-off holder.
    pub fn takeover_bound(&self) -> Duration {
        self.lease_ttl + self.standby_retry
    }
}

/// The epoch a write is made under: the statement is refused unless the lease row still has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// The lease's key (`--lock-key`).
    pub lock_key: i64,
    /// The epoch the relay holds it under.
    pub epoch: i64,
}

/// A held lease, shared by the relay loop and its batches.
#[derive(Debug, Clone)]
pub struct Lease {
    fence: Fence,
    deadline: Arc<Mutex<Instant>>,
    lost: CancellationToken,
}

impl Lease {
    fn new(fence: Fence, deadline: Instant) -> Lease {
        Lease {
            fence,
            deadline: Arc::new(Mutex::new(deadline)),
            lost: CancellationToken::new(),
        }
    }

    /// The epoch every write of this lease names.
    pub fn fence(&self) -> Fence {
        self.fence
    }

    /// Whether this relay may still act: the lease was not found lost and cannot have expired
    /// by the local clock.
    pub fn is_live(&self) -> bool {
        !self.lost.is_cancelled() && Instant::now() < self.deadline()
    }

    /// Cancelled once the lease is lost (expired, taken over, or refused).
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Marks the lease lost: the relay stops producing and stands by.
    pub fn give_up(&self) {
        self.lost.cancel();
    }

    fn deadline(&self) -> Instant {
        *self
            .deadline
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn extend_to(&self, deadline: Instant) {
        *self
            .deadline
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = deadline;
    }
}

/// How a lease was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverReason {
    /// Nobody held it before (a new database, or the last holder handed it back on shutdown).
    Vacant,
    /// The holder's presence session had ended: it died.
    HolderGone,
    /// The holder stopped renewing while its session lingered: frozen or cut off.
    Expired,
}

impl TakeoverReason {
    /// The reason's label in `relay_takeovers_total`.
    pub fn label(self) -> &'static str {
        match self {
            TakeoverReason::Vacant => "vacant",
            TakeoverReason::HolderGone => "holder_gone",
            TakeoverReason::Expired => "expired",
        }
    }

    /// Every reason, to register each label's series up front.
    pub const ALL: [TakeoverReason; 3] = [
        TakeoverReason::Vacant,
        TakeoverReason::HolderGone,
        TakeoverReason::Expired,
    ];
}

/// How holding a lease ended ([`Elector::keep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Handed back on shutdown: a standby takes it at once.
    HandedBack,
    /// Given up by the relay itself ([`Lease::give_up`]): a batch's outcome was refused.
    GivenUp,
    /// Not renewed before it ran out by this relay's clock.
    Expired,
    /// A renewal was refused: another relay had taken the lease over.
    Fenced,
}

impl LeaseEnd {
    /// Label of a lease this relay lost while active; `None` when it did not lose it here.
    pub fn lost_label(self) -> Option<&'static str> {
        match self {
            LeaseEnd::Expired => Some("expired"),
            LeaseEnd::Fenced => Some("fenced"),
            LeaseEnd::HandedBack | LeaseEnd::GivenUp => None,
        }
    }

    /// Every label of [`LeaseEnd::lost_label`].
    pub const LOST_LABELS: [&'static str; 2] = ["expired", "fenced"];
}

/// What a successful acquisition learned.
#[derive(Debug, Clone, Copy)]
pub struct Acquired {
    /// How the lease came free.
    pub reason: TakeoverReason,
    /// Seconds since the previous holder last renewed, by the database clock: an upper bound on
    /// the time without an active relay. `None` for a lease nobody held.
    pub since_previous_renewal: Option<f64>,
}

/// This relay's side of the election: its identity and its presence session.
pub struct Elector {
    settings: LeaseSettings,
    options: PgConnectOptions,
    holder: Uuid,
    conn: Option<PgConnection>,
    /// When the lease seen live at the last attempt expires, by the local clock.
    seen_expiring: Option<Instant>,
}

impl Elector {
    /// An elector connecting with `options`; every session gets a `lock_timeout` and a
    /// `statement_timeout`, so a statement stuck behind a lock gives up on the server too.
    pub fn new(settings: LeaseSettings, options: PgConnectOptions) -> Elector {
        let ms = settings.op_timeout().as_millis().to_string();
        let options = options.options([
            ("lock_timeout", ms.as_str()),
            ("statement_timeout", ms.as_str()),
            ("idle_in_transaction_session_timeout", ms.as_str()),
        ]);
        Elector {
            settings,
            options,
            holder: Uuid::new_v4(),
            conn: None,
            seen_expiring: None,
        }
    }

    /// The lease's settings.
    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// Waits until this relay holds the lease, trying every `standby_retry`, and as soon as the
    /// lease seen at the last attempt expires when that comes first; `None` on shutdown.
    pub async fn acquire(&mut self, shutdown: &CancellationToken) -> Option<(Lease, Acquired)> {
        let mut logged_standby = false;
        loop {
            match self.try_acquire().await {
                Ok(Some(held)) => return Some(held),
                Ok(None) if !logged_standby => {
                    tracing::info!(
                        key = self.settings.lock_key,
                        "another relay holds the lease; standing by"
                    );
                    logged_standby = true;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach PostgreSQL for the relay lease");
                    self.conn = None;
                }
            }
            let retry_at = Instant::now() + self.settings.standby_retry;
            let next = self.seen_expiring.map_or(retry_at, |at| at.min(retry_at));
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep_until(next) => {}
            }
        }
    }

    /// One attempt: takes the lease when it is vacant, expired, or its holder's session is gone.
    pub async fn try_acquire(&mut self) -> Result<Option<(Lease, Acquired)>, LeaseError> {
        let (key, ttl_ms, holder) = (self.settings.lock_key, ttl_ms(&self.settings), self.holder);
        self.seen_expiring = None;
        let sent = Instant::now();
        let attempt: Attempt = self
            .with_conn(move |conn| {
                Box::pin(async move {
                    // One statement a look while the lease is held; its row is written once,
                    // by the first relay that finds none.
                    let look: Option<(bool, f64)> = sqlx::query_as(LOOK_SQL)
                        .bind(key)
                        .fetch_optional(&mut *conn)
                        .await?;
                    let (takeable, expires_in) = match look {
                        Some(look) => look,
                        None => {
                            sqlx::query(
                                "INSERT INTO relay_lease (lease_key) VALUES ($1) ON CONFLICT DO NOTHING",
                            )
                            .bind(key)
                            .execute(&mut *conn)
                            .await?;
                            (true, 0.0)
                        }
                    };
                    if !takeable {
                        return Ok(Attempt::Live { expires_in });
                    }
                    sqlx::query_as(ACQUIRE_SQL)
                        .bind(key)
                        .bind(holder)
                        .bind(ttl_ms)
                        .fetch_optional(&mut *conn)
                        .await
                        .map(Attempt::Taken)
                })
            })
            .await?;
        let row = match attempt {
            Attempt::Live { expires_in } => {
                // Measured from before the look was sent: never later than the database's expiry
                // plus the time the answer took to come back. The look reads the clock twice, so
                // a lease expiring between the reads is live with a negative time left: try
                // again at once then, not after `standby_retry`.
                self.seen_expiring = Duration::try_from_secs_f64(expires_in.max(0.0))
                    .ok()
                    .map(|d| sent + d);
                None
            }
            Attempt::Taken(row) => row,
        };
        Ok(row.map(|(epoch, vacant, expired, since)| {
            let reason = if vacant {
                TakeoverReason::Vacant
            } else if expired {
                TakeoverReason::Expired
            } else {
                TakeoverReason::HolderGone
            };
            let fence = Fence { lock_key: key, epoch };
            (
                Lease::new(fence, sent + self.settings.lease_ttl),
                Acquired {
                    reason,
                    since_previous_renewal: since,
                },
            )
        }))
    }

    /// Renews `lease` until it is lost or `shutdown`; on shutdown the lease is handed back so a
    /// standby takes over at once. Cancels [`Lease::lost`] when it ends for any other reason, and
    /// says how it ended.
    pub async fn keep(&mut self, lease: &Lease, shutdown: &CancellationToken) -> LeaseEnd {
        let renew_every = self.settings.renew_every();
        loop {
            let next = (Instant::now() + renew_every).min(lease.deadline());
            tokio::select! {
                _ = shutdown.cancelled() => {
                    self.hand_back(lease).await;
                    return LeaseEnd::HandedBack;
                }
                _ = lease.lost().cancelled() => return LeaseEnd::GivenUp,
                _ = tokio::time::sleep_until(next) => {}
            }
            if !lease.is_live() {
                tracing::warn!(
                    epoch = lease.fence().epoch,
                    "relay lease expired before it could be renewed; standing by"
                );
                lease.give_up();
                return LeaseEnd::Expired;
            }
            let sent = Instant::now();
            match self.renew(lease.fence()).await {
                Ok(true) => lease.extend_to(sent + self.settings.lease_ttl),
                Ok(false) => {
                    tracing::warn!(
                        epoch = lease.fence().epoch,
                        "relay lease was taken over; this relay is fenced and stands by"
                    );
                    lease.give_up();
                    return LeaseEnd::Fenced;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the relay lease failed; retrying");
                    self.conn = None;
                }
            }
        }
    }

    /// Pushes the lease's expiry forward; `false` when the lease is no longer ours.
    async fn renew(&mut self, fence: Fence) -> Result<bool, LeaseError> {
        let (ttl_ms, holder) = (ttl_ms(&self.settings), self.holder);
        let renewed = self
            .with_conn(move |conn| {
                Box::pin(async move {
                    sqlx::query(RENEW_SQL)
                        .bind(fence.lock_key)
                        .bind(fence.epoch)
                        .bind(holder)
                        .bind(ttl_ms)
                        .execute(&mut *conn)
                        .await
                })
            })
            .await?;
        Ok(renewed.rows_affected() == 1)
    }

    /// Ends the lease now (on shutdown), so a standby need not wait for it to expire.
    async fn hand_back(&mut self, lease: &Lease) {
        let fence = lease.fence();
        let handed_back = self
            .with_conn(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "UPDATE relay_lease SET expires_at = clock_timestamp(), holder = NULL, holder_pid = NULL
                         WHERE lease_key = $1 AND epoch = $2",
                    )
                    .bind(fence.lock_key)
                    .bind(fence.epoch)
                    .execute(&mut *conn)
                    .await
                })
            })
            .await;
        lease.give_up();
        if let Err(e) = handed_back {
            tracing::warn!(error = %e, "could not hand the relay lease back; a standby takes over once it expires");
        }
    }

    /// Runs `op` on the presence session, connecting first when there is none; the whole of it
    /// bounded by [`LeaseSettings::op_timeout`]. A failed or timed-out session is dropped.
    async fn with_conn<T>(
        &mut self,
        op: impl for<'c> FnOnce(
            &'c mut PgConnection,
        ) -> futures::future::BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T, LeaseError> {
        let timeout = self.settings.op_timeout();
        let options = self.options.clone();
        let conn = &mut self.conn;
        let result = tokio::time::timeout(timeout, async move {
            if conn.is_none() {
                *conn = Some(options.connect().await?);
            }
            let c = conn.as_mut().ok_or(sqlx::Error::PoolClosed)?;
            op(c).await
        })
        .await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.drop_conn();
                Err(LeaseError::Database(e))
            }
            Err(_) => {
                self.drop_conn();
                Err(LeaseError::Timeout(timeout))
            }
        }
    }

    fn drop_conn(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Closing politely could hang on a dead path: let it go in the background.
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
            });
        }
    }
}

/// What one acquisition attempt found: a live lease and the seconds until it expires by the
/// database's clock, or the outcome of taking it (`None` when another standby was first).
enum Attempt {
    Live { expires_in: f64 },
    Taken(Option<(i64, bool, bool, Option<f64>)>),
}

/// Why a lease statement did not answer.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The statement failed.
    #[error("relay lease statement failed: {0}")]
    Database(#[from] sqlx::Error),
    /// The statement did not answer within this long.
    #[error("relay lease statement got no answer within {0:?}")]
    Timeout(Duration),
}

fn ttl_ms(settings: &LeaseSettings) -> i64 {
    i64::try_from(settings.lease_ttl.as_millis()).unwrap_or(i64::MAX)
}

/// Looks at lease `$1` without locking it: whether it may be taken (vacant, expired, or its
/// holder's presence session has ended) and the seconds until it expires.
pub const LOOK_SQL: &str = "SELECT holder IS NULL
        OR expires_at < clock_timestamp()
        OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = holder_pid),
     CASE WHEN isfinite(expires_at)
          THEN EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8 ELSE 0 END
 FROM relay_lease WHERE lease_key = $1";

/// Takes the lease `$1` for holder `$2` for `$3` ms when it is vacant, expired, or its holder's
/// presence session has ended; returns the new epoch, whether it was vacant, whether it had
/// expired, and seconds since the previous holder's last renewal.
pub const ACQUIRE_SQL: &str = "WITH old AS (
     SELECT lease_key, holder, holder_pid, renewed_at, expires_at
     FROM relay_lease WHERE lease_key = $1 FOR UPDATE)
 UPDATE relay_lease l
 SET epoch = l.epoch + 1, holder = $2, holder_pid = pg_backend_pid(),
     acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
     expires_at = clock_timestamp() + $3 * interval '1 millisecond'
 FROM old
 WHERE l.lease_key = old.lease_key
   AND (old.holder IS NULL
        OR old.expires_at < clock_timestamp()
        OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = old.holder_pid))
 RETURNING l.epoch, old.holder IS NULL,
           old.holder IS NOT NULL AND old.expires_at < clock_timestamp(),
           EXTRACT(EPOCH FROM clock_timestamp() - old.renewed_at)::float8";

/// Renews lease `$1` at epoch `$2` for holder `$3` by `$4` ms, unless it expired meanwhile (a
/// standby may be taking it over; the relay then stands by and acquires a new epoch).
pub const RENEW_SQL: &str = "UPDATE relay_lease
 SET expires_at = clock_timestamp() + $4 * interval '1 millisecond',
     renewed_at = clock_timestamp(), holder_pid = pg_backend_pid()
 WHERE lease_key = $1 AND epoch = $2 AND holder = $3 AND expires_at > clock_timestamp()";
