//! Storage backends. Each operation is one atomic step; waiting for a held lock is the
//! caller's business ([`crate::store::Store`]), so every backend gets the same long-poll.
//!
//! Owns the [`Backend`] interface and what its operations answer ([`Attempt`],
//! [`BackendError`], the operator's [`Inspection`], [`Deleted`] and [`Counts`]), what a `commit`
//! asks ([`Commit`]) and what a `begin` that keeps a trace of its attempt asks for ([`Hold`]),
//! and reads a record's status ([`record_status`]). The implementations are [`memory`] and
//! [`redis`] (with [`pubsub`], its wake-ups across instances, and [`redis_error`], what a Redis
//! error means); they use this interface, which uses none of them. Uses only
//! [`crate::waiters`], where a backend forwards other instances' wake-ups.
//!
//! # Traces: attempts whose outcome is unknown
//!
//! A `begin` with a [`Hold`] keeps a *trace* of the attempt it locks for: its token, when it
//! began (the store's clock, milliseconds since the Unix epoch), its lock TTL and its body
//! hash, for `max(retention, lock TTL)`. The trace outlives the lock, so that an attempt sent
//! to the application whose answer never came back (a timeout, a reset, an Envoy that died) is
//! not run again blindly. Per key, in one atomic step each (both backends):
//!
//! - `try_begin` with a hold: a record answers as always; then, with `supersede = Some(t)`, a
//!   trace of token `t` is deleted when no lock is held; a held lock answers
//!   [`Attempt::Held`]; a trace without a lock answers [`Attempt::InDoubt`] (or
//!   [`Attempt::Mismatch`] for another body hash) and takes no lock; else the lock is taken and
//!   the trace written. Without a hold, traces are neither read nor written.
//! - `commit` deletes the key's trace whatever its outcome (a record supersedes it).
//! - `release` drops the lock the token owns and, unless `in_doubt`, the trace of the same
//!   token (the attempt never reached the application).
//! - the operator's `delete` deletes the trace too.

use std::future::Future;
use std::sync::Weak;
use std::time::Duration;

use bytes::Bytes;
pub use idem_protocol::{CommitOutcome, ReleaseOutcome};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::waiters::{RemoteWakeups, Waiters};

pub mod access;
pub mod memory;
pub mod pubsub;
pub mod redis;
pub mod redis_error;
pub mod sentinel;

/// What one atomic `begin` attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// A record with the same body hash: its bytes, and how long it still lives (`None`:
    /// unknown), which lets the filter keep it in a cache no longer than the store does.
    Record(Bytes, Option<Duration>),
    /// A record exists for another body hash.
    Mismatch,
    /// The lock was free and now belongs to the token passed in.
    Locked,
    /// Another token holds the lock, for about `remaining` more (`None`: unknown).
    Held { remaining: Option<Duration> },
    /// (with a [`Hold`] only) An earlier attempt with this body hash began and its outcome is
    /// unknown: its trace is there and no lock is held. No lock was taken.
    InDoubt {
        /// The earlier attempt's token.
        token: String,
        /// When it began, in milliseconds since the Unix epoch (the store's clock).
        started_ms: u64,
        /// How long it may still be running: its start plus its lock TTL, less now, in whole
        /// milliseconds rounded up; zero once that has passed.
        running: Duration,
    },
}

/// What a `begin` that keeps a trace of its attempt asks for (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold<'a> {
    /// How long the trace lives at least: it lives `max(retention, lock TTL)`.
    pub retention: Duration,
    /// The token of an in-doubt attempt whose trace to delete first, when no lock is held (the
    /// application answered that it never committed).
    pub supersede: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The backend could not be reached or answered something unexpected.
    Unavailable(String),
    /// The backend refuses idemstore until its operator fixes something (a certificate, the
    /// password, an ACL permission): retrying will not help, the message says what to fix.
    Refused(String),
    /// The in-memory backend hit its key limit.
    Full,
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unavailable(why) => write!(f, "backend unavailable: {why}"),
            Self::Refused(why) => write!(f, "backend refused: {why}"),
            Self::Full => f.write_str("backend full"),
        }
    }
}

impl std::error::Error for BackendError {}

/// The target of this module's log lines: idemstore's module path before the backends had a
/// crate of their own, so that `RUST_LOG` filters and log searches that name it (an example in
/// docs/operations.md) still match.
const LOG_TARGET: &str = "idemstore::backend";

/// The causes of [`BackendError::Refused`] logged since the backend last recovered: each is
/// logged once, not on every request and health check that meets it.
static REFUSALS_LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
/// Distinct causes remembered at most (a cause names a command or certificate: a handful).
const REFUSALS_KEPT: usize = 32;

impl BackendError {
    /// Logs a failed `what` (an operation, the health check): an outage as a warning each time;
    /// a refusal once, as an error naming the cause, until a health check passes again after
    /// failing ([`health_checked`]).
    pub fn log(&self, what: &str) {
        let Self::Refused(why) = self else {
            tracing::warn!(target: LOG_TARGET, error = %self, "{what} failed");
            return;
        };
        let first = match REFUSALS_LOGGED.lock() {
            Ok(seen) if seen.iter().any(|s| s == why) => false,
            Ok(mut seen) => {
                if seen.len() >= REFUSALS_KEPT {
                    seen.remove(0);
                }
                seen.push(why.clone());
                true
            }
            Err(_) => true,
        };
        if first {
            tracing::error!(target: LOG_TARGET, "{why} (logged once; /healthz answers 503 until it is fixed)");
        } else {
            tracing::debug!(target: LOG_TARGET, error = %self, "{what} failed");
        }
    }
}

/// Whether the last health check failed: an outage is logged when it starts and when it ends,
/// not at every check in between (Envoy checks each idemstore several times a second).
static HEALTH_FAILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Logs what a health check found, as a change: the first failure (a refusal once per cause,
/// see [`BackendError::log`]) and the recovery; refusals logged before the recovery are logged
/// again if they come back.
pub fn health_checked(result: &Result<()>) {
    use std::sync::atomic::Ordering;
    match result {
        Ok(()) => {
            if HEALTH_FAILING.swap(false, Ordering::Relaxed) {
                if let Ok(mut seen) = REFUSALS_LOGGED.lock() {
                    seen.clear();
                }
                tracing::info!(target: LOG_TARGET, "the backend answers health checks again");
            }
        }
        Err(refused @ BackendError::Refused(_)) => {
            HEALTH_FAILING.store(true, Ordering::Relaxed);
            refused.log("health check");
        }
        Err(e) => {
            if HEALTH_FAILING.swap(true, Ordering::Relaxed) {
                tracing::debug!(target: LOG_TARGET, error = %e, "health check failed again");
            } else {
                tracing::warn!(target: LOG_TARGET, error = %e, "health check failed (logged again when it passes)");
            }
        }
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// What a `commit` asks ([`Backend::commit`]): store `record` for `key`, an answer to a request
/// whose body hashes to `body_hash`, made under the lock of `token`, kept for `retention`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit<'a> {
    pub key: &'a str,
    pub token: &'a str,
    pub body_hash: &'a str,
    pub record: Bytes,
    pub retention: Duration,
}

/// What a backend that keeps its data in this process holds, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Keys holding a record or a lock, plus traces, expired ones included until swept.
    pub keys: usize,
    /// Bytes accounted against `max_bytes`.
    pub bytes: usize,
    pub max_keys: usize,
    pub max_bytes: usize,
}

/// What one store key holds, for an operator ([`Backend::inspect`]); the record's bytes stay
/// in the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inspection {
    pub record: Option<RecordInfo>,
    pub lock: Option<LockInfo>,
    pub trace: Option<TraceInfo>,
}

impl Inspection {
    pub fn is_empty(&self) -> bool {
        self.record.is_none() && self.lock.is_none() && self.trace.is_none()
    }

    /// A trace and nothing else: an attempt began, no answer was stored and none holds the
    /// lock. A `begin` with a hold answers `in-doubt`.
    pub fn in_doubt(&self) -> bool {
        self.trace.is_some() && self.lock.is_none() && self.record.is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordInfo {
    /// The hash of the request body the record answers (64 lowercase hex).
    pub body_hash: String,
    /// The filter's record (its encoding of the answer), in bytes.
    pub bytes: usize,
    /// The stored answer's status, read from the record's head ([`record_status`]); `None`
    /// when the bytes are not a record the filter wrote.
    pub status: Option<u16>,
    /// How long the record still lives; `None`: no expiry (set by hand).
    pub ttl: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockInfo {
    /// How long the lock still lives; `None`: no expiry (set by hand).
    pub ttl: Option<Duration>,
}

/// The trace of an attempt begun with a [`Hold`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceInfo {
    /// The attempt's lock token.
    pub token: String,
    /// When it began, in milliseconds since the Unix epoch (the store's clock).
    pub started_ms: u64,
    /// Its lock's TTL: it may run until `started_ms` plus this.
    pub lock_ttl: Duration,
    /// The hash of its request body (64 lowercase hex).
    pub body_hash: String,
    /// How long the trace still lives; `None`: no expiry (set by hand).
    pub ttl: Option<Duration>,
}

/// What [`Backend::delete`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub record: bool,
    pub lock: bool,
    pub trace: bool,
}

/// Records, locks and in-doubt keys in the whole backend ([`Backend::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub records: u64,
    pub locks: u64,
    /// Keys with a trace and no lock ([`Inspection::in_doubt`]).
    pub in_doubt: u64,
}

/// The bytes of a record's head that [`record_status`] reads: the filter's magic and status.
pub const RECORD_HEAD_BYTES: usize = 6;

/// The status of the answer a record holds, from its first [`RECORD_HEAD_BYTES`]: the store
/// keeps records as opaque bytes, but every form the filter writes (`IDR1`, `IDR2`; see the
/// filter's `src/store/record.rs`) starts with a 4-byte magic and the status as a big-endian
/// `u16`. `None` for anything else.
pub fn record_status(head: &[u8]) -> Option<u16> {
    match head {
        [b'I', b'D', b'R', b'1' | b'2', hi, lo, ..] => Some(u16::from_be_bytes([*hi, *lo])),
        _ => None,
    }
}

/// Now on this host's wall clock, in milliseconds since the Unix epoch (0 before it): the
/// in-memory backend's clock for traces, and what the operator's tools compare them to.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn no_tools() -> BackendError {
    BackendError::Unavailable("this backend has no operator tools".into())
}

/// Keys and hashes arrive validated (64 lowercase hex), tokens as `is_token` allows.
pub trait Backend: Send + Sync + 'static {
    /// Lookup-or-lock: the record for `key` if any, else the lock for `token` with `lock_ttl`,
    /// else how long the current holder still has. With `hold`, also the trace's rules (see
    /// the module doc): an in-doubt earlier attempt answers [`Attempt::InDoubt`], and a lock
    /// taken leaves a trace.
    fn try_begin(
        &self,
        key: &str,
        body_hash: &str,
        token: &str,
        lock_ttl: Duration,
        hold: Option<Hold<'_>>,
    ) -> impl Future<Output = Result<Attempt>> + Send;

    /// Releases the lock if `commit.token` owns it; stores the record unless one already
    /// exists; and deletes the key's trace, whatever the outcome.
    fn commit(&self, commit: Commit<'_>) -> impl Future<Output = Result<CommitOutcome>> + Send;

    /// Compare-and-delete of the lock; unless `in_doubt`, also of the trace (its token must be
    /// `token`). `Released` if either was deleted.
    fn release(
        &self,
        key: &str,
        token: &str,
        in_doubt: bool,
    ) -> impl Future<Output = Result<ReleaseOutcome>> + Send;

    /// Whether the backend answers at all.
    fn health(&self) -> impl Future<Output = Result<()>> + Send;

    // The operator's tools (`idemstore records`, idemstore's admin routes). Every backend idemstore
    // runs has them; the defaults serve test doubles, which answer that they cannot.

    /// The operator's view of `key`: its record, its lock and its trace, if any (never the
    /// record's bytes).
    fn inspect(&self, _key: &str) -> impl Future<Output = Result<Inspection>> + Send {
        async { Err(no_tools()) }
    }

    /// Deletes `key`'s record, lock (whoever holds it) and trace, for an operator: the next
    /// `begin` of the key takes the lock and runs the request again.
    fn delete(&self, _key: &str) -> impl Future<Output = Result<Deleted>> + Send {
        async { Err(no_tools()) }
    }

    /// Counts the records, locks and in-doubt keys held (on Redis a `SCAN` of every master:
    /// not a snapshot, so approximate while keys come and go).
    fn counts(&self) -> impl Future<Output = Result<Counts>> + Send {
        async { Err(no_tools()) }
    }

    /// Store keys starting with `prefix` (lowercase hex) that hold a record, a lock or a
    /// trace: at most `limit` of them (any, when more match), sorted. On Redis a `SCAN` with the
    /// prefix in its pattern, as for [`Self::counts`].
    fn find(&self, _prefix: &str, _limit: usize) -> impl Future<Output = Result<Vec<String>>> + Send {
        async { Err(no_tools()) }
    }

    /// Its own accounting, for a backend that keeps its data in this process (in memory);
    /// `None` for one that keeps it elsewhere (Redis), whose own metrics tell.
    fn usage(&self) -> Option<Usage> {
        None
    }

    /// Starts forwarding to `waiters` the wake-ups that other idemstore instances sharing this
    /// backend publish (a lock dropped, a record stored), reporting on `status` whether they
    /// are heard. The task ends when aborted or when `waiters` is gone. A backend that serves
    /// a single instance has nothing to forward and starts nothing.
    fn spawn_remote_wakeups(
        &self,
        _waiters: Weak<Waiters>,
        _status: watch::Sender<RemoteWakeups>,
    ) -> Option<JoinHandle<()>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_of_the_filter_records() {
        assert_eq!(record_status(b"IDR2\x00\xc9\x00\x00\x00"), Some(201));
        assert_eq!(record_status(b"IDR1\x01\xf4"), Some(500));
        assert_eq!(record_status(b"IDR3\x00\xc9"), None);
        assert_eq!(record_status(b"IDR2\x00"), None);
        assert_eq!(record_status(b""), None);
    }
}
