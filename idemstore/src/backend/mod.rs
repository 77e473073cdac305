//! Storage backends. Each operation is one atomic step; waiting for a held lock is the
//! caller's business ([`crate::store::Store`]), so every backend gets the same long-poll.

use std::future::Future;
use std::sync::Weak;
use std::time::Duration;

use bytes::Bytes;
pub use idem_protocol::{CommitOutcome, ReleaseOutcome};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::waiters::{RemoteWakeups, Waiters};

pub mod memory;
pub mod pubsub;
pub mod redis;

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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The backend could not be reached or answered something unexpected.
    Unavailable(String),
    /// The in-memory backend hit its key limit.
    Full,
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unavailable(why) => write!(f, "backend unavailable: {why}"),
            Self::Full => f.write_str("backend full"),
        }
    }
}

impl std::error::Error for BackendError {}

pub type Result<T> = std::result::Result<T, BackendError>;

/// What a backend that keeps its data in this process holds, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Keys holding a record or a lock, expired ones included until swept.
    pub keys: usize,
    /// Bytes accounted against `max_bytes`.
    pub bytes: usize,
    pub max_keys: usize,
    pub max_bytes: usize,
}

/// Keys and hashes arrive validated (64 lowercase hex), tokens as `is_token` allows.
pub trait Backend: Send + Sync + 'static {
    /// Lookup-or-lock: the record for `key` if any, else the lock for `token` with `lock_ttl`,
    /// else how long the current holder still has.
    fn try_begin(
        &self,
        key: &str,
        body_hash: &str,
        token: &str,
        lock_ttl: Duration,
    ) -> impl Future<Output = Result<Attempt>> + Send;

    /// Releases the lock if `token` owns it; stores the record unless one already exists.
    fn commit(
        &self,
        key: &str,
        token: &str,
        body_hash: &str,
        record: Bytes,
        retention: Duration,
    ) -> impl Future<Output = Result<CommitOutcome>> + Send;

    /// Compare-and-delete of the lock.
    fn release(&self, key: &str, token: &str) -> impl Future<Output = Result<ReleaseOutcome>> + Send;

    /// Whether the backend answers at all.
    fn health(&self) -> impl Future<Output = Result<()>> + Send;

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
