//! Bounds on the work a login asks for, whoever sends it: a few password checks at once (an
//! Argon2 check takes some 19 MiB and tens of milliseconds of a core, so a flood of them would
//! take the console's memory and cores), and attempts throttled per client address and per user
//! name (GCRA buckets, `governor`), so guessing is slow however many connections it uses.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use argon2::Block;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Password checks running at once.
const CHECKS_AT_ONCE: usize = 2;
/// How long a login waits for a check to finish before it is refused as busy.
const CHECK_QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Attempts a client address, and a user name, may make in a burst; then one every
/// [`ATTEMPT_EVERY`].
const ATTEMPT_BURST: u32 = 10;
/// How often an address or a user name gets another attempt once its burst is spent.
const ATTEMPT_EVERY: Duration = Duration::from_secs(6);
/// Addresses, and user names, tracked at most; beyond it, stale ones are forgotten, and while
/// they are all recent every login is refused as busy (the memory an attacker can make the
/// console hold is bounded).
const MAX_TRACKED: usize = 100_000;

/// Why a login was not checked.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// Too many checks are running or waiting: try again in a moment.
    Busy,
    /// This address or user name tried too often: try again after this long.
    Throttled(Duration),
}

/// A password check, run on one of the threads kept for them, with that thread's Argon2 memory.
type Check = Box<dyn FnOnce(&mut Vec<Block>) + Send>;

/// The threads that run password checks, [`CHECKS_AT_ONCE`] of them, for as long as the guard
/// lives. Each thread keeps the memory of its Argon2 checks (some 19 MiB) for the next one: with
/// an allocation for each check on the runtime's blocking threads, a flood of 400 logins left
/// the allocator holding 190 MB; with these, the console's peak under the same flood is 55 MB.
struct CheckThreads {
    jobs: std::sync::mpsc::Sender<Check>,
}

impl CheckThreads {
    fn start(threads: usize) -> CheckThreads {
        let (jobs, queue) = std::sync::mpsc::channel::<Check>();
        let queue = Arc::new(std::sync::Mutex::new(queue));
        for n in 0..threads {
            let queue = queue.clone();
            let started = std::thread::Builder::new()
                .name(format!("password-check-{n}"))
                .spawn(move || {
                    let mut memory = Vec::new();
                    loop {
                        // The lock is held while waiting for a check, and let go before running
                        // it.
                        let next = match queue.lock() {
                            Ok(queue) => queue.recv(),
                            Err(_) => return,
                        };
                        match next {
                            Ok(check) => check(&mut memory),
                            Err(_) => return,
                        }
                    }
                });
            if let Err(e) = started {
                tracing::error!(error = %e, "console: a password-check thread did not start");
            }
        }
        CheckThreads { jobs }
    }
}

/// The console's bounds on logins.
pub(super) struct LoginGuard {
    checks: Arc<Semaphore>,
    threads: CheckThreads,
    per_client: DefaultKeyedRateLimiter<IpAddr>,
    per_user: DefaultKeyedRateLimiter<String>,
}

impl Default for LoginGuard {
    fn default() -> Self {
        let quota = Quota::with_period(ATTEMPT_EVERY)
            .expect("a positive period")
            .allow_burst(NonZeroU32::new(ATTEMPT_BURST).expect("a positive burst"));
        LoginGuard {
            checks: Arc::new(Semaphore::new(CHECKS_AT_ONCE)),
            threads: CheckThreads::start(CHECKS_AT_ONCE),
            per_client: RateLimiter::keyed(quota),
            per_user: RateLimiter::keyed(quota),
        }
    }
}

impl LoginGuard {
    /// Counts an attempt from `client` (when known) for `user`, and refuses it when either tried
    /// too often. Every name is tracked alike, a user's or not, so that being throttled does
    /// not tell which names exist.
    pub(super) fn attempt(&self, client: Option<IpAddr>, user: &str) -> Result<(), Refused> {
        for tracked in [self.per_client.len(), self.per_user.len()] {
            if tracked >= MAX_TRACKED {
                self.per_client.retain_recent();
                self.per_client.shrink_to_fit();
                self.per_user.retain_recent();
                self.per_user.shrink_to_fit();
            }
        }
        if self.per_client.len() >= MAX_TRACKED || self.per_user.len() >= MAX_TRACKED {
            return Err(Refused::Busy);
        }
        let now = DefaultClock::default().now();
        if let Some(client) = client {
            self.per_client
                .check_key(&client)
                .map_err(|until| Refused::Throttled(until.wait_time_from(now)))?;
        }
        self.per_user
            .check_key(&user.to_owned())
            .map_err(|until| Refused::Throttled(until.wait_time_from(now)))?;
        Ok(())
    }

    /// Runs `check` (a password check, holding its turn) on one of the guard's threads and
    /// returns what it returned; `None` when no thread could run it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        check: impl FnOnce(&mut Vec<Block>) -> T + Send + 'static,
    ) -> Option<T> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job: Check = Box::new(move |memory| {
            let _ = reply.send(check(memory));
        });
        self.threads.jobs.send(job).ok()?;
        answer.await.ok()
    }

    /// A turn to check a password: waits up to [`CHECK_QUEUE_WAIT`] for one of the
    /// [`CHECKS_AT_ONCE`] to finish.
    pub(super) async fn check_turn(&self) -> Result<OwnedSemaphorePermit, Refused> {
        match tokio::time::timeout(CHECK_QUEUE_WAIT, self.checks.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(Refused::Busy),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_and_a_user_name_are_throttled_apart() {
        let guard = LoginGuard::default();
        let a: IpAddr = "192.0.2.1".parse().expect("address");
        let b: IpAddr = "192.0.2.2".parse().expect("address");
        for i in 0..ATTEMPT_BURST {
            assert_eq!(guard.attempt(Some(a), &format!("guess{i}")), Ok(()));
        }
        let Err(Refused::Throttled(wait)) = guard.attempt(Some(a), "guess") else {
            panic!("the burst is spent")
        };
        assert!(wait > Duration::ZERO && wait <= ATTEMPT_EVERY, "{wait:?}");
        // Another address is not held back by the first one's attempts…
        assert_eq!(guard.attempt(Some(b), "ada"), Ok(()));
        // …but a user name is, whatever address its attempts come from, a user's or not.
        for i in 1..ATTEMPT_BURST {
            let client: IpAddr = format!("198.51.100.{i}").parse().expect("address");
            assert_eq!(guard.attempt(Some(client), "ada"), Ok(()));
        }
        assert!(matches!(
            guard.attempt(Some("203.0.113.9".parse().expect("address")), "ada"),
            Err(Refused::Throttled(_))
        ));
        for i in 1..=ATTEMPT_BURST {
            let client: IpAddr = format!("198.51.100.{}", 100 + i).parse().expect("address");
            assert_eq!(guard.attempt(Some(client), "nobody-has-it"), Ok(()));
        }
        assert!(matches!(
            guard.attempt(
                Some("203.0.113.10".parse().expect("address")),
                "nobody-has-it"
            ),
            Err(Refused::Throttled(_))
        ));
    }
}
