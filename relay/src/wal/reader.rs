//! A replication session on the outbox's slot: each committed transaction's outbox events, in
//! commit order, with the position that confirms them; the relay confirms a position only once
//! Kafka has acknowledged every event before it, and a session opened later starts after the last
//! confirmed one.

use std::time::Duration;

use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig,
};

use super::pgoutput::{DecodeError, Decoder};
use crate::claim::OutboxEvent;

/// The publication the outbox's migrations create: the outbox table's inserts.
pub const PUBLICATION: &str = "outbox_events";

/// Most events of one transaction held before they are handed over ([`WalRead::Events`]).
const CHUNK_EVENTS: usize = 1000;

/// How often the session tells PostgreSQL the confirmed position.
const STATUS_INTERVAL: Duration = Duration::from_millis(500);

/// The session's settings: timestamps as UTC ISO text, were a value sent as text.
const SESSION_OPTIONS: &str = "-c TimeZone=UTC -c DateStyle=ISO";

/// Why the session cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// The database URL is not one the session can use.
    #[error("the database URL for the write-ahead log: {0}")]
    Url(String),
    /// Not a replication slot's name.
    #[error("replication slot name `{0}`: lower-case letters, digits and underscores, at most 63")]
    SlotName(String),
    /// The slot was invalidated (it held more WAL than `max_slot_wal_keep_size`): what it held
    /// back is gone, so the events after its confirmed position are read from the outbox table.
    #[error(
        "replication slot {0} is lost (PostgreSQL removed the WAL it needed): the events it had \
         not confirmed must be published from the outbox table"
    )]
    SlotLost(String),
    /// The replication protocol or the server failed.
    #[error("replication session: {0}")]
    Session(#[from] PgWireError),
    /// A message the relay cannot read.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

impl WalError {
    /// Another session streams from the slot (SQLSTATE 55006): a relay that lost the lease, or
    /// whose session the server has not noticed is gone.
    pub fn slot_in_use(&self) -> bool {
        matches!(self, WalError::Session(PgWireError::Server(m)) if m.contains("SQLSTATE 55006"))
    }
}

/// What the session read next.
#[derive(Debug)]
pub enum WalRead {
    /// A committed transaction's outbox events (none when it wrote other tables only), and the
    /// position to confirm once Kafka has them all.
    Transaction {
        /// Its events, in the order the transaction inserted them.
        events: Vec<OutboxEvent>,
        /// The end of its commit record.
        confirm: Lsn,
    },
    /// The first events of a large transaction still being read (committed: pgoutput sends a
    /// transaction once it committed), handed over before its end so that they are produced
    /// while the rest arrives; its [`WalRead::Transaction`] follows with the rest.
    Events {
        /// Events in the order the transaction inserted them.
        events: Vec<OutboxEvent>,
    },
    /// No transaction in flight: the server's WAL has reached `wal_end`, so once everything
    /// read before is confirmed, `wal_end` may be too (it holds no more outbox events).
    Idle {
        /// The server's WAL position.
        wal_end: Lsn,
    },
}

/// A replication session on `slot`.
pub struct WalReader {
    client: ReplicationClient,
    decoder: Decoder,
    pending: Vec<OutboxEvent>,
    in_transaction: bool,
    confirmed: Lsn,
}

impl WalReader {
    /// Opens a session on `slot` (created when missing, with no snapshot: events committed
    /// before it are not streamed) of the database at `database_url`, streaming from the slot's
    /// confirmed position.
    pub async fn open(database_url: &str, slot: &str) -> Result<WalReader, WalError> {
        if !valid_slot(slot) {
            return Err(WalError::SlotName(slot.to_owned()));
        }
        let config = config_of(database_url, slot)?;
        let mut client = ReplicationClient::connect_gated(config).await?;
        let found = client
            .simple_query(&format!(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'"
            ))
            .await?;
        match found.first() {
            None => {
                let _ = client
                    .simple_query(&format!(
                        "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'nothing')"
                    ))
                    .await?;
            }
            Some(row) if row.first().and_then(|v| v.as_deref()) == Some(b"lost".as_slice()) => {
                return Err(WalError::SlotLost(slot.to_owned()));
            }
            Some(_) => {}
        }
        let started = async {
            client.start().await?;
            client.wait_started().await
        };
        if let Err(e) = started.await {
            // PostgreSQL invalidated the slot between the check and the start.
            return Err(match e {
                PgWireError::Server(m) if m.contains("SQLSTATE 55000") => {
                    WalError::SlotLost(slot.to_owned())
                }
                e => WalError::Session(e),
            });
        }
        Ok(WalReader {
            client,
            decoder: Decoder::default(),
            pending: Vec::new(),
            in_transaction: false,
            confirmed: Lsn(0),
        })
    }

    /// Drops `slot` (a lost one, before the relay makes it anew), if it exists.
    pub async fn drop_slot(database_url: &str, slot: &str) -> Result<(), WalError> {
        if !valid_slot(slot) {
            return Err(WalError::SlotName(slot.to_owned()));
        }
        let mut client = ReplicationClient::connect_gated(config_of(database_url, slot)?).await?;
        let found = client
            .simple_query(&format!(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}'"
            ))
            .await?;
        if !found.is_empty() {
            let _ = client
                .simple_query(&format!("DROP_REPLICATION_SLOT {slot}"))
                .await?;
        }
        // A session that never started ends when its client is dropped.
        drop(client);
        Ok(())
    }

    /// The next committed transaction, or the server's position while none is in flight;
    /// `None` once the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<WalRead>, WalError> {
        loop {
            let Some(event) = self.client.recv().await? else {
                return Ok(None);
            };
            match event {
                ReplicationEvent::Begin { .. } => {
                    self.pending.clear();
                    self.in_transaction = true;
                }
                ReplicationEvent::XLogData { data, .. } => {
                    if let Some(event) = self.decoder.decode(&data)? {
                        self.pending.push(event);
                        if self.pending.len() >= CHUNK_EVENTS {
                            return Ok(Some(WalRead::Events {
                                events: std::mem::take(&mut self.pending),
                            }));
                        }
                    }
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    self.in_transaction = false;
                    return Ok(Some(WalRead::Transaction {
                        events: std::mem::take(&mut self.pending),
                        confirm: end_lsn,
                    }));
                }
                // Mid-transaction, the server's position may already be past the transaction
                // being read: only between transactions does it confirm what was read.
                ReplicationEvent::KeepAlive { wal_end, .. } if !self.in_transaction => {
                    return Ok(Some(WalRead::Idle { wal_end }));
                }
                ReplicationEvent::KeepAlive { .. } => {}
                ReplicationEvent::StoppedAt { .. } => return Ok(None),
                ReplicationEvent::Message { .. } => {}
            }
        }
    }

    /// Confirms every transaction up to `position`: PostgreSQL may drop the WAL before it, and
    /// a later session starts after it. Positions only move forward.
    pub fn confirm(&mut self, position: Lsn) {
        if position > self.confirmed {
            self.confirmed = position;
            self.client.update_applied_lsn(position);
        }
    }

    /// Ends the session once PostgreSQL has been told the last confirmed position (or after a
    /// few status rounds), so the next session does not read again what was confirmed.
    pub async fn close(mut self) -> Result<(), WalError> {
        let metrics = self.client.metrics();
        for _ in 0..10 {
            if metrics.last_applied_lsn() >= self.confirmed {
                break;
            }
            tokio::time::sleep(STATUS_INTERVAL / 2).await;
        }
        self.client.shutdown().await?;
        Ok(())
    }
}

/// Whether `slot` is a name PostgreSQL takes for a replication slot: lower-case letters,
/// digits and underscores, at most 63 bytes.
pub fn valid_slot(slot: &str) -> bool {
    !slot.is_empty()
        && slot.len() <= 63
        && slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The replication session's settings from a PostgreSQL URL: host, port, user, password,
/// database and `sslmode` (`disable`; anything else asks for TLS, `verify-full` checks the
/// server's certificate and name). Values come in binary (`binary 'true'`: the walsender formats
/// no ids, uuids or timestamps as text, and the relay parses none); were a value text, its
/// timestamps would be UTC ISO text, as the decoder reads them.
fn config_of(database_url: &str, slot: &str) -> Result<ReplicationConfig, WalError> {
    let url = url::Url::parse(database_url).map_err(|e| WalError::Url(e.to_string()))?;
    if !matches!(url.scheme(), "postgres" | "postgresql") {
        return Err(WalError::Url(format!("scheme {} is not postgres", url.scheme())));
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|e| WalError::Url(format!("{e} in the URL")))
    };
    let host = url.host_str().unwrap_or("localhost").to_owned();
    let user = decode(url.username())?;
    let user = if user.is_empty() { "postgres".to_owned() } else { user };
    let password = decode(url.password().unwrap_or(""))?;
    let database = decode(url.path().trim_start_matches('/'))?;
    let database = if database.is_empty() { user.clone() } else { database };
    let sslmode = url
        .query_pairs()
        .find(|(k, _)| k == "sslmode")
        .map(|(_, v)| v.into_owned())
        .unwrap_or_else(|| "prefer".to_owned());
    let tls = match sslmode.as_str() {
        "disable" | "allow" | "prefer" => TlsConfig::disabled(),
        "verify-full" => TlsConfig::verify_full(None),
        "verify-ca" => TlsConfig::verify_ca(None),
        _ => TlsConfig::require(),
    };
    Ok(
        ReplicationConfig::new(host, user, password, database, slot, PUBLICATION)
            .with_port(url.port().unwrap_or(5432))
            .with_tls(tls)
            .with_start_lsn(Lsn(0))
            .with_status_interval(STATUS_INTERVAL)
            .with_binary(true)
            .with_options(SESSION_OPTIONS)
            .with_application_name("relay-wal"),
    )
}
