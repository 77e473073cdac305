//! In-process backend for a single idemstore instance (local runs, demos).
//!
//! # Bounded memory
//!
//! Two limits, whichever is reached first: at most `max_keys` keys hold a record or a lock
//! (each trace of an attempt counts as one more key: they live in a map of their own, see
//! [`TRACE_COST`]), and those keys with their records are accounted at most `max_bytes`, each
//! key at [`ENTRY_COST`] plus its record's length, each trace at [`TRACE_COST`]. The
//! accounting is an upper bound of the heap the map really uses (`tests/memory_bound.rs`
//! measures it with a counting allocator over a million keys), so `max_bytes` bounds this
//! backend's memory whatever the records' sizes; `max_keys` alone would not (a million keys of
//! 8 MiB records is 8 TiB).
//!
//! # When full: refuse, never evict
//!
//! Nothing live is ever evicted. Expired records and locks are dropped: by the sweeper every
//! few seconds, and when the map is full, at once (at most every [`FULL_SWEEP_GAP`], and only
//! once something can have expired, so that a flood against a full map costs one comparison
//! per request, not a scan of the map). Past that, a `begin` for a new key, or a `commit`
//! whose record does not fit, fails with [`BackendError::Full`]: idemstore answers `503` and
//! the filter fails open (counted on `degraded`) or closed, as configured.
//!
//! Evicting instead would be silent: a live record evicted turns the next retry of its key
//! into a second execution that nothing counts, and an evicted lock lets a duplicate run while
//! the original still runs. Refusing makes the loss visible and confines it to new keys:
//! retries of stored keys still replay, duplicates still wait on held locks, and a request
//! holding a lock can still commit, provided its record fits in `max_bytes` (else its commit
//! fails, the filter releases the lock, and the next retry runs again, counted on
//! `commit_failed`).
//!
//! Uses only the backend interface ([`crate::backend`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{
    now_ms, record_status, Attempt, Backend, BackendError, Commit, CommitOutcome, Counts, Deleted, Hold,
    Inspection, LockInfo, RecordInfo, ReleaseOutcome, Result, TraceInfo, Usage,
};

/// `--memory-max-keys` default.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
/// `--memory-max-bytes` default: 1 GiB.
pub const DEFAULT_MAX_BYTES: usize = 1 << 30;
/// What one key costs besides its record's bytes, as accounted against `max_bytes`. Measured
/// (`tests/memory_bound.rs`): a map slot is 136 bytes, at a load between 7/16 and 7/8, so up
/// to 311 bytes a key just after the map doubled and 467 while it doubles (both tables live);
/// the key, the body hash and a lock token take 160 more. 640 covers the worst instant.
pub const ENTRY_COST: usize = 640;
/// What one trace costs, as accounted against `max_bytes` (and it counts as a key against
/// `max_keys`). Traces live in a map of their own, so that keys without one (every key of a
/// filter that keeps none) do not pay for it: a slot of that map is smaller than one of the
/// records' (a token, a body hash and a few numbers), so the records' measured cost bounds it.
pub const TRACE_COST: usize = ENTRY_COST;
/// A full map is swept at most this often on demand; expired keys wait for the next sweep.
pub const FULL_SWEEP_GAP: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct MemoryBackend {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// The traces of attempts begun with a hold, by store key.
    traces: HashMap<String, Trace>,
    max_keys: usize,
    max_bytes: usize,
    /// `entries.len() * ENTRY_COST` plus the records' lengths, plus `traces.len() * TRACE_COST`.
    bytes: usize,
    /// Nothing in the map expires before this (a lower bound, exact after each sweep): a full
    /// map sweeps only once it has passed.
    next_expiry: Option<Instant>,
    /// The last sweep made because the map was full.
    full_sweep: Option<Instant>,
}

#[derive(Debug, Default)]
struct Entry {
    record: Option<Record>,
    lock: Option<Lock>,
}

#[derive(Debug)]
struct Record {
    body_hash: String,
    bytes: Bytes,
    expires: Instant,
}

#[derive(Debug)]
struct Lock {
    token: String,
    expires: Instant,
}

#[derive(Debug)]
struct Trace {
    token: String,
    /// When the attempt began, on the wall clock (milliseconds since the Unix epoch)...
    started_ms: u64,
    /// ...and on the monotonic one, with its lock's TTL: it may run until `started + lock_ttl`.
    started: Instant,
    lock_ttl: Duration,
    body_hash: String,
    expires: Instant,
}

impl Trace {
    /// How long the attempt may still be running, in whole milliseconds rounded up.
    fn running(&self, now: Instant) -> Duration {
        let left = (self.started + self.lock_ttl).saturating_duration_since(now);
        Duration::from_millis(u64::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX))
    }
}

impl Entry {
    /// Drops whatever has expired; returns the record bytes this freed.
    fn expire(&mut self, now: Instant) -> usize {
        let mut freed = 0;
        if self.record.as_ref().is_some_and(|r| r.expires <= now) {
            freed = self.record.take().map_or(0, |r| r.bytes.len());
        }
        if self.lock.as_ref().is_some_and(|l| l.expires <= now) {
            self.lock = None;
        }
        freed
    }

    fn is_empty(&self) -> bool {
        self.record.is_none() && self.lock.is_none()
    }

    fn next_expiry(&self) -> Option<Instant> {
        let record = self.record.as_ref().map(|r| r.expires);
        let lock = self.lock.as_ref().map(|l| l.expires);
        record.into_iter().chain(lock).min()
    }

    fn cost(&self) -> usize {
        ENTRY_COST + self.record.as_ref().map_or(0, |r| r.bytes.len())
    }
}

impl Inner {
    /// The live entry for `key`, if any, after expiring its parts.
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        let entry = self.entries.get_mut(key)?;
        self.bytes -= entry.expire(now);
        if entry.is_empty() {
            self.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }

    fn remove(&mut self, key: &str) {
        if let Some(entry) = self.entries.remove(key) {
            self.bytes -= entry.cost();
        }
    }

    /// The live trace of `key`, if any, after dropping an expired one.
    fn live_trace(&mut self, key: &str, now: Instant) -> Option<&Trace> {
        if self.traces.get(key).is_some_and(|t| t.expires <= now) {
            self.remove_trace(key);
        }
        self.traces.get(key)
    }

    /// Deletes `key`'s trace; whether there was one.
    fn remove_trace(&mut self, key: &str) -> bool {
        let removed = self.traces.remove(key).is_some();
        if removed {
            self.bytes -= TRACE_COST;
        }
        removed
    }

    /// Deletes `key`'s live trace if its token is `token`; whether it did.
    fn remove_trace_of(&mut self, key: &str, token: &str, now: Instant) -> bool {
        self.live_trace(key, now).is_some_and(|t| t.token == token) && self.remove_trace(key)
    }

    /// Whether a live lock holds `key` (its entry's expired parts dropped).
    fn locked(&mut self, key: &str, now: Instant) -> bool {
        self.live(key, now).is_some_and(|e| e.lock.is_some())
    }

    fn keys(&self) -> usize {
        self.entries.len() + self.traces.len()
    }

    fn fits(&self, keys: usize, bytes: usize) -> bool {
        self.keys().saturating_add(keys) <= self.max_keys
            && self.bytes.saturating_add(bytes) <= self.max_bytes
    }

    /// Room for `keys` more keys and `bytes` more bytes, sweeping first if that can help.
    fn make_room(&mut self, now: Instant, keys: usize, bytes: usize) -> Result<()> {
        if self.fits(keys, bytes) {
            return Ok(());
        }
        let expired = self.next_expiry.is_some_and(|at| at <= now);
        let due = self.full_sweep.is_none_or(|at| now.saturating_duration_since(at) >= FULL_SWEEP_GAP);
        if expired && due {
            self.full_sweep = Some(now);
            self.sweep(now);
        }
        if self.fits(keys, bytes) {
            Ok(())
        } else {
            Err(BackendError::Full)
        }
    }

    /// The entry for `key`, created (and accounted) if missing: call after [`Self::make_room`].
    fn entry(&mut self, key: &str) -> &mut Entry {
        if !self.entries.contains_key(key) {
            self.bytes += ENTRY_COST;
        }
        self.entries.entry(key.to_owned()).or_default()
    }

    fn expires_at(&mut self, at: Instant) {
        self.next_expiry = Some(self.next_expiry.map_or(at, |next| next.min(at)));
    }

    fn sweep(&mut self, now: Instant) {
        let (mut freed, mut next) = (0, None::<Instant>);
        self.entries.retain(|_, entry| {
            freed += entry.expire(now);
            if entry.is_empty() {
                freed += ENTRY_COST;
                return false;
            }
            next = next.into_iter().chain(entry.next_expiry()).min();
            true
        });
        self.traces.retain(|_, trace| {
            if trace.expires <= now {
                freed += TRACE_COST;
                return false;
            }
            next = Some(next.map_or(trace.expires, |n| n.min(trace.expires)));
            true
        });
        self.bytes -= freed;
        self.next_expiry = next;
    }
}

impl MemoryBackend {
    /// [`Self::with_limits`] with the default byte budget, [`DEFAULT_MAX_BYTES`].
    pub fn new(max_keys: usize) -> Self {
        Self::with_limits(max_keys, DEFAULT_MAX_BYTES)
    }

    /// `max_keys` bounds the keys holding a record or a lock, `max_bytes` their accounted
    /// bytes (see the module doc); past either, new keys and records that do not fit are
    /// refused rather than the map growing.
    pub fn with_limits(max_keys: usize, max_bytes: usize) -> Self {
        let inner = Inner {
            entries: HashMap::new(),
            traces: HashMap::new(),
            max_keys,
            max_bytes,
            bytes: 0,
            next_expiry: None,
            full_sweep: None,
        };
        Self { inner: Arc::new(Mutex::new(inner)) }
    }

    /// Drops expired entries every `period`, so keys nobody asks for again do not pile up.
    /// The task ends with the last clone of the backend.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let inner: Weak<Mutex<Inner>> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(inner) = inner.upgrade() else { return };
                lock(&inner).sweep(Instant::now());
            }
        })
    }

    /// Keys currently held (records or locks) plus traces, expired ones included until swept.
    pub fn len(&self) -> usize {
        lock(&self.inner).keys()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes accounted against `max_bytes`: [`ENTRY_COST`] per key plus the records, and
    /// [`TRACE_COST`] per trace.
    pub fn accounted_bytes(&self) -> usize {
        lock(&self.inner).bytes
    }

    pub fn sweep(&self) {
        lock(&self.inner).sweep(Instant::now());
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // Every critical section leaves the map consistent, so a poisoned lock is still usable.
    inner.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Backend for MemoryBackend {
    async fn try_begin(
        &self,
        key: &str,
        body_hash: &str,
        token: &str,
        lock_ttl: Duration,
        hold: Option<Hold<'_>>,
    ) -> Result<Attempt> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        if let Some(entry) = inner.live(key, now) {
            if let Some(record) = &entry.record {
                return Ok(if record.body_hash == body_hash {
                    Attempt::Record(record.bytes.clone(), Some(record.expires.saturating_duration_since(now)))
                } else {
                    Attempt::Mismatch
                });
            }
        }
        if let Some(superseded) = hold.and_then(|h| h.supersede) {
            if !inner.locked(key, now) {
                inner.remove_trace_of(key, superseded, now);
            }
        }
        if let Some(held) = inner.live(key, now).and_then(|e| e.lock.as_ref()) {
            return Ok(Attempt::Held { remaining: Some(held.expires.saturating_duration_since(now)) });
        }
        if hold.is_some() {
            if let Some(trace) = inner.live_trace(key, now) {
                return Ok(if trace.body_hash == body_hash {
                    Attempt::InDoubt {
                        token: trace.token.clone(),
                        started_ms: trace.started_ms,
                        running: trace.running(now),
                    }
                } else {
                    Attempt::Mismatch
                });
            }
        }
        // A live entry has a record or a lock: this key is new (and, with a hold, has no trace).
        let keys = 1 + usize::from(hold.is_some());
        inner.make_room(now, keys, ENTRY_COST + if hold.is_some() { TRACE_COST } else { 0 })?;
        let expires = now + lock_ttl;
        inner.entry(key).lock = Some(Lock { token: token.to_owned(), expires });
        inner.expires_at(expires);
        if let Some(hold) = hold {
            let expires = now + hold.retention.max(lock_ttl);
            let trace = Trace {
                token: token.to_owned(),
                started_ms: now_ms(),
                started: now,
                lock_ttl,
                body_hash: body_hash.to_owned(),
                expires,
            };
            inner.traces.insert(key.to_owned(), trace);
            inner.bytes += TRACE_COST;
            inner.expires_at(expires);
        }
        Ok(Attempt::Locked)
    }

    async fn commit(&self, commit: Commit<'_>) -> Result<CommitOutcome> {
        let Commit { key, token, body_hash, record, retention } = commit;
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let (exists, owned, recorded) = match inner.live(key, now) {
            None => (false, false, false),
            Some(entry) => {
                let owned = entry.lock.as_ref().is_some_and(|l| l.token == token);
                let recorded = entry.record.is_some();
                if recorded && owned {
                    entry.lock = None;
                }
                (true, owned, recorded)
            }
        };
        if recorded {
            // The first record stands, and it supersedes any trace.
            inner.remove_trace(key);
            return Ok(CommitOutcome::Exists);
        }
        // Checked before anything changes: a refused commit leaves the lock to its owner's
        // release (or its TTL), like any failed commit.
        // The trace this commit deletes makes room for it.
        let (keys, bytes): (usize, usize) =
            if exists { (0, record.len()) } else { (1, ENTRY_COST + record.len()) };
        let (keys, bytes) = match inner.live_trace(key, now) {
            Some(_) => (keys.saturating_sub(1), bytes.saturating_sub(TRACE_COST)),
            None => (keys, bytes),
        };
        inner.make_room(now, keys, bytes)?;
        // A copy, not the `Bytes` received: that one can be a slice of the connection's read
        // buffer (8 KiB and more for HTTP/1.1 and h2), which it would keep alive for the
        // whole retention, uncounted.
        let bytes = Bytes::copy_from_slice(&record);
        let expires = now + retention;
        inner.bytes += bytes.len();
        let entry = inner.entry(key);
        if owned {
            entry.lock = None;
        }
        entry.record = Some(Record { body_hash: body_hash.to_owned(), bytes, expires });
        inner.expires_at(expires);
        // A record supersedes the trace: the attempt's outcome is known now.
        inner.remove_trace(key);
        Ok(if owned { CommitOutcome::Stored } else { CommitOutcome::Late })
    }

    async fn release(&self, key: &str, token: &str, in_doubt: bool) -> Result<ReleaseOutcome> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let mut released = false;
        if let Some(entry) = inner.live(key, now) {
            if entry.lock.as_ref().is_some_and(|l| l.token == token) {
                entry.lock = None;
                if entry.record.is_none() {
                    inner.remove(key);
                }
                released = true;
            }
        }
        // Not sent, or sent and answered without a record: the attempt left nothing to doubt.
        if !in_doubt && inner.remove_trace_of(key, token, now) {
            released = true;
        }
        Ok(if released { ReleaseOutcome::Released } else { ReleaseOutcome::NotOwner })
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    async fn inspect(&self, key: &str) -> Result<Inspection> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let trace = inner.live_trace(key, now).map(|t| TraceInfo {
            token: t.token.clone(),
            started_ms: t.started_ms,
            lock_ttl: t.lock_ttl,
            body_hash: t.body_hash.clone(),
            ttl: Some(t.expires.saturating_duration_since(now)),
        });
        let Some(entry) = inner.live(key, now) else {
            return Ok(Inspection { trace, ..Inspection::default() });
        };
        let record = entry.record.as_ref().map(|r| RecordInfo {
            body_hash: r.body_hash.clone(),
            bytes: r.bytes.len(),
            status: record_status(&r.bytes),
            ttl: Some(r.expires.saturating_duration_since(now)),
        });
        let lock =
            entry.lock.as_ref().map(|l| LockInfo { ttl: Some(l.expires.saturating_duration_since(now)) });
        Ok(Inspection { record, lock, trace })
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let trace = inner.live_trace(key, now).is_some() && inner.remove_trace(key);
        let Some(entry) = inner.live(key, now) else {
            return Ok(Deleted { trace, ..Deleted::default() });
        };
        let deleted = Deleted { record: entry.record.is_some(), lock: entry.lock.is_some(), trace };
        inner.remove(key);
        Ok(deleted)
    }

    async fn counts(&self) -> Result<Counts> {
        let now = Instant::now();
        let inner = lock(&self.inner);
        let mut counts = Counts::default();
        let locked = |key: &str| {
            inner.entries.get(key).is_some_and(|e| e.lock.as_ref().is_some_and(|l| l.expires > now))
        };
        for entry in inner.entries.values() {
            counts.records += u64::from(entry.record.as_ref().is_some_and(|r| r.expires > now));
            counts.locks += u64::from(entry.lock.as_ref().is_some_and(|l| l.expires > now));
        }
        for (key, trace) in &inner.traces {
            counts.in_doubt += u64::from(trace.expires > now && !locked(key));
        }
        Ok(counts)
    }

    async fn find(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let now = Instant::now();
        let inner = lock(&self.inner);
        let live = |e: &Entry| {
            e.record.as_ref().is_some_and(|r| r.expires > now)
                || e.lock.as_ref().is_some_and(|l| l.expires > now)
        };
        let entries = inner.entries.iter().filter(|(k, e)| k.starts_with(prefix) && live(e)).map(|(k, _)| k);
        let traces =
            inner.traces.iter().filter(|(k, t)| k.starts_with(prefix) && t.expires > now).map(|(k, _)| k);
        let mut keys: Vec<String> = entries.chain(traces).cloned().collect();
        keys.sort_unstable();
        keys.dedup();
        keys.truncate(limit);
        Ok(keys)
    }

    fn usage(&self) -> Option<Usage> {
        let inner = lock(&self.inner);
        Some(Usage {
            keys: inner.keys(),
            bytes: inner.bytes,
            max_keys: inner.max_keys,
            max_bytes: inner.max_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const TTL: Duration = Duration::from_secs(30);

    /// A record's bytes, whatever its remaining lifetime.
    fn replayed(attempt: Result<Attempt>) -> Option<Bytes> {
        match attempt {
            Ok(Attempt::Record(bytes, _)) => Some(bytes),
            _ => None,
        }
    }

    /// A commit of `record` for a body hashed as [`HASH`].
    fn commit<'a>(key: &'a str, token: &'a str, record: Bytes, retention: Duration) -> Commit<'a> {
        Commit { key, token, body_hash: HASH, record, retention }
    }

    #[tokio::test]
    async fn key_limit_answers_full_until_space_frees() {
        let backend = MemoryBackend::new(2);
        assert_eq!(backend.try_begin("k1", HASH, "t1", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Err(BackendError::Full));
        // A late commit for a new key is bounded the same way.
        let late = backend.commit(commit("k3", "t3", Bytes::new(), TTL)).await;
        assert_eq!(late, Err(BackendError::Full));
        // Keys already present keep working when full.
        assert!(matches!(backend.try_begin("k1", HASH, "t9", TTL, None).await, Ok(Attempt::Held { .. })));
        let stored = backend.commit(commit("k1", "t1", Bytes::new(), TTL)).await;
        assert_eq!(stored, Ok(CommitOutcome::Stored));
        assert_eq!(backend.release("k2", "t2", false).await, Ok(ReleaseOutcome::Released));
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.len(), 2);
    }

    #[tokio::test]
    async fn full_map_sweeps_expired_entries_first() {
        let backend = MemoryBackend::new(2);
        let short = Duration::from_millis(20);
        backend.try_begin("k1", HASH, "t1", short, None).await.ok();
        backend.commit(commit("k2", "t2", Bytes::new(), short)).await.ok();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.len(), 1);
    }

    #[tokio::test]
    async fn locks_and_live_records_are_never_evicted() {
        let backend = MemoryBackend::new(2);
        backend.try_begin("held", HASH, "t1", TTL, None).await.ok();
        backend.commit(commit("stored", "t2", Bytes::from_static(b"r"), TTL)).await.ok();
        for i in 0..10 {
            let refused = backend.try_begin(&format!("new{i}"), HASH, "t", TTL, None).await;
            assert_eq!(refused, Err(BackendError::Full));
        }
        // The lock still excludes duplicates, its owner still commits, the record replays.
        assert!(matches!(backend.try_begin("held", HASH, "t9", TTL, None).await, Ok(Attempt::Held { .. })));
        let r = Bytes::from_static(b"mine");
        assert_eq!(backend.commit(commit("held", "t1", r.clone(), TTL)).await, Ok(CommitOutcome::Stored));
        assert_eq!(replayed(backend.try_begin("held", HASH, "t9", TTL, None).await), Some(r));
        let stored = backend.try_begin("stored", HASH, "t9", TTL, None).await;
        assert_eq!(replayed(stored), Some(Bytes::from_static(b"r")));
    }

    #[tokio::test]
    async fn byte_budget_refuses_what_does_not_fit_and_changes_nothing() {
        let backend = MemoryBackend::with_limits(100, 2 * ENTRY_COST + 10);
        assert_eq!(backend.try_begin("k1", HASH, "t1", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.accounted_bytes(), 2 * ENTRY_COST);
        // No room for a third key, nor for an 11-byte record.
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Err(BackendError::Full));
        let big = Bytes::from_static(b"eleven byte");
        assert_eq!(backend.commit(commit("k1", "t1", big, TTL)).await, Err(BackendError::Full));
        // The refused commit kept the lock: its owner can release it, or commit what fits.
        assert!(matches!(backend.try_begin("k1", HASH, "t9", TTL, None).await, Ok(Attempt::Held { .. })));
        let ten = Bytes::from_static(b"ten bytes!");
        assert_eq!(backend.commit(commit("k1", "t1", ten, TTL)).await, Ok(CommitOutcome::Stored));
        assert_eq!(backend.accounted_bytes(), 2 * ENTRY_COST + 10);
        assert_eq!(backend.release("k2", "t2", false).await, Ok(ReleaseOutcome::Released));
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 10);
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Ok(Attempt::Locked));
    }

    #[tokio::test]
    async fn accounting_follows_expiry_and_sweeps() {
        let backend = MemoryBackend::new(10);
        let short = Duration::from_millis(20);
        backend.commit(commit("k1", "t", Bytes::from_static(b"12345"), short)).await.ok();
        backend.try_begin("k2", HASH, "t", short, None).await.ok();
        backend.commit(commit("k3", "t", Bytes::from_static(b"123"), TTL)).await.ok();
        assert_eq!(backend.accounted_bytes(), 3 * ENTRY_COST + 8);
        tokio::time::sleep(Duration::from_millis(40)).await;
        backend.sweep();
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 3);
        backend.release("k3", "t", false).await.ok();
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 3, "a record outlives a release");
    }

    #[tokio::test]
    async fn full_map_scans_only_once_something_can_have_expired() {
        let backend = MemoryBackend::new(2);
        let short = Duration::from_millis(30);
        backend.try_begin("k1", HASH, "t1", TTL, None).await.ok();
        backend.try_begin("k2", HASH, "t2", short, None).await.ok();
        for _ in 0..100 {
            assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Err(BackendError::Full));
        }
        assert_eq!(lock(&backend.inner).full_sweep, None, "nothing had expired: no scan");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL, None).await, Ok(Attempt::Locked));
        let inner = lock(&backend.inner);
        assert!(inner.full_sweep.is_some());
        assert!(inner.next_expiry.is_some_and(|at| at > Instant::now() + Duration::from_secs(20)));
    }

    #[tokio::test]
    async fn sweeper_drops_expired_records_and_locks() {
        let backend = MemoryBackend::new(10);
        let sweeper = backend.spawn_sweeper(Duration::from_millis(10));
        let short = Duration::from_millis(30);
        backend.try_begin("k1", HASH, "t1", short, None).await.ok();
        backend.commit(commit("k2", "t2", Bytes::from_static(b"r"), short)).await.ok();
        backend.commit(commit("k3", "t3", Bytes::from_static(b"r"), TTL)).await.ok();
        assert_eq!(backend.len(), 3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(backend.len(), 1);
        drop(backend);
        // The sweeper holds only a weak reference and ends with the backend.
        tokio::time::timeout(Duration::from_secs(1), sweeper).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn expired_record_is_gone_on_read() {
        let backend = MemoryBackend::new(10);
        let short = Duration::from_millis(20);
        backend.commit(commit("k", "t", Bytes::from_static(b"r"), short)).await.ok();
        match backend.try_begin("k", HASH, "t2", TTL, None).await {
            Ok(Attempt::Record(bytes, Some(left))) => {
                assert_eq!(bytes, Bytes::from_static(b"r"));
                assert!(left <= short, "the record's remaining lifetime: {left:?}");
            }
            other => panic!("expected the record, got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(backend.try_begin("k", HASH, "t2", TTL, None).await, Ok(Attempt::Locked));
    }

    #[tokio::test]
    async fn traces_are_keys_accounted_and_swept() {
        let backend = MemoryBackend::with_limits(3, 3 * ENTRY_COST + 10);
        let hold = Some(Hold { retention: Duration::from_millis(40), supersede: None });
        let short = Duration::from_millis(20);
        assert_eq!(backend.try_begin("k1", HASH, "t1", short, hold).await, Ok(Attempt::Locked));
        // A lock and a trace: two keys' worth.
        assert_eq!((backend.len(), backend.accounted_bytes()), (2, ENTRY_COST + TRACE_COST));
        // No room for another lock and its trace; a lock alone fits.
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL, hold).await, Err(BackendError::Full));
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL, None).await, Ok(Attempt::Locked));
        assert_eq!(backend.release("k2", "t2", false).await, Ok(ReleaseOutcome::Released));
        // Released in doubt: the trace alone stays.
        assert_eq!(backend.release("k1", "t1", true).await, Ok(ReleaseOutcome::Released));
        assert_eq!((backend.len(), backend.accounted_bytes()), (1, TRACE_COST));
        let in_doubt = backend.try_begin("k1", HASH, "t3", TTL, hold).await;
        assert!(matches!(in_doubt, Ok(Attempt::InDoubt { ref token, .. }) if token == "t1"), "{in_doubt:?}");
        // The late commit that resolves it fits where the trace was, and deletes it.
        let late = backend.commit(commit("k1", "t1", Bytes::from_static(b"r"), TTL)).await;
        assert_eq!(late, Ok(CommitOutcome::Late));
        assert_eq!((backend.len(), backend.accounted_bytes()), (1, ENTRY_COST + 1));
        // A trace expires like the rest: it lives max(retention, lock TTL), then is swept.
        backend.try_begin("k4", HASH, "t4", short, hold).await.ok();
        backend.release("k4", "t4", true).await.ok();
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 1 + TRACE_COST);
        tokio::time::sleep(Duration::from_millis(60)).await;
        backend.sweep();
        assert_eq!((backend.len(), backend.accounted_bytes()), (1, ENTRY_COST + 1));
        assert_eq!(backend.try_begin("k4", HASH, "t5", TTL, hold).await, Ok(Attempt::Locked));
    }
}
