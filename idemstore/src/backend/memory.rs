//! In-process backend for a single idemstore instance (local runs, demos).
//!
//! # Bounded memory
//!
//! Two limits, whichever is reached first: at most `max_keys` keys hold a record or a lock,
//! and those keys with their records are accounted at most `max_bytes`, each key at
//! [`ENTRY_COST`] plus its record's length. The accounting is an upper bound of the heap the
//! map really uses (`tests/memory_bound.rs` measures it with a counting allocator over a
//! million keys), so `max_bytes` bounds this backend's memory whatever the records' sizes;
//! `max_keys` alone would not (a million keys of 8 MiB records is 8 TiB).
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
    record_status, Attempt, Backend, BackendError, CommitOutcome, Counts, Deleted, Inspection, LockInfo,
    RecordInfo, ReleaseOutcome, Result, Usage,
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
/// A full map is swept at most this often on demand; expired keys wait for the next sweep.
pub const FULL_SWEEP_GAP: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct MemoryBackend {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<String, Entry>,
    max_keys: usize,
    max_bytes: usize,
    /// `entries.len() * ENTRY_COST` plus the records' lengths.
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

    fn fits(&self, keys: usize, bytes: usize) -> bool {
        self.entries.len().saturating_add(keys) <= self.max_keys
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

    /// Keys currently held (records or locks), expired ones included until swept.
    pub fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes accounted against `max_bytes`: [`ENTRY_COST`] per key plus the records.
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
            if let Some(held) = &entry.lock {
                return Ok(Attempt::Held { remaining: Some(held.expires.saturating_duration_since(now)) });
            }
        }
        // A live entry has a record or a lock: this key is new.
        inner.make_room(now, 1, ENTRY_COST)?;
        let expires = now + lock_ttl;
        inner.entry(key).lock = Some(Lock { token: token.to_owned(), expires });
        inner.expires_at(expires);
        Ok(Attempt::Locked)
    }

    async fn commit(
        &self,
        key: &str,
        token: &str,
        body_hash: &str,
        record: Bytes,
        retention: Duration,
    ) -> Result<CommitOutcome> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let (exists, owned) = match inner.live(key, now) {
            None => (false, false),
            Some(entry) => {
                let owned = entry.lock.as_ref().is_some_and(|l| l.token == token);
                if entry.record.is_some() {
                    if owned {
                        entry.lock = None;
                    }
                    return Ok(CommitOutcome::Exists);
                }
                (true, owned)
            }
        };
        // Checked before anything changes: a refused commit leaves the lock to its owner's
        // release (or its TTL), like any failed commit.
        let (keys, bytes) = if exists { (0, record.len()) } else { (1, ENTRY_COST + record.len()) };
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
        Ok(if owned { CommitOutcome::Stored } else { CommitOutcome::Late })
    }

    async fn release(&self, key: &str, token: &str) -> Result<ReleaseOutcome> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.live(key, now) else {
            return Ok(ReleaseOutcome::NotOwner);
        };
        let owned = entry.lock.as_ref().is_some_and(|l| l.token == token);
        if !owned {
            return Ok(ReleaseOutcome::NotOwner);
        }
        entry.lock = None;
        if entry.record.is_none() {
            inner.remove(key);
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    async fn inspect(&self, key: &str) -> Result<Inspection> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.live(key, now) else {
            return Ok(Inspection::default());
        };
        let record = entry.record.as_ref().map(|r| RecordInfo {
            body_hash: r.body_hash.clone(),
            bytes: r.bytes.len(),
            status: record_status(&r.bytes),
            ttl: Some(r.expires.saturating_duration_since(now)),
        });
        let lock =
            entry.lock.as_ref().map(|l| LockInfo { ttl: Some(l.expires.saturating_duration_since(now)) });
        Ok(Inspection { record, lock })
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let now = Instant::now();
        let mut inner = lock(&self.inner);
        let Some(entry) = inner.live(key, now) else {
            return Ok(Deleted::default());
        };
        let deleted = Deleted { record: entry.record.is_some(), lock: entry.lock.is_some() };
        inner.remove(key);
        Ok(deleted)
    }

    async fn counts(&self) -> Result<Counts> {
        let now = Instant::now();
        let inner = lock(&self.inner);
        let mut counts = Counts::default();
        for entry in inner.entries.values() {
            counts.records += u64::from(entry.record.as_ref().is_some_and(|r| r.expires > now));
            counts.locks += u64::from(entry.lock.as_ref().is_some_and(|l| l.expires > now));
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
        let mut keys: Vec<String> = inner
            .entries
            .iter()
            .filter(|(k, e)| k.starts_with(prefix) && live(e))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_unstable();
        keys.truncate(limit);
        Ok(keys)
    }

    fn usage(&self) -> Option<Usage> {
        let inner = lock(&self.inner);
        Some(Usage {
            keys: inner.entries.len(),
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

    #[tokio::test]
    async fn key_limit_answers_full_until_space_frees() {
        let backend = MemoryBackend::new(2);
        assert_eq!(backend.try_begin("k1", HASH, "t1", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Err(BackendError::Full));
        // A late commit for a new key is bounded the same way.
        let late = backend.commit("k3", "t3", HASH, Bytes::new(), TTL).await;
        assert_eq!(late, Err(BackendError::Full));
        // Keys already present keep working when full.
        assert!(matches!(backend.try_begin("k1", HASH, "t9", TTL).await, Ok(Attempt::Held { .. })));
        let stored = backend.commit("k1", "t1", HASH, Bytes::new(), TTL).await;
        assert_eq!(stored, Ok(CommitOutcome::Stored));
        assert_eq!(backend.release("k2", "t2").await, Ok(ReleaseOutcome::Released));
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.len(), 2);
    }

    #[tokio::test]
    async fn full_map_sweeps_expired_entries_first() {
        let backend = MemoryBackend::new(2);
        let short = Duration::from_millis(20);
        backend.try_begin("k1", HASH, "t1", short).await.ok();
        backend.commit("k2", "t2", HASH, Bytes::new(), short).await.ok();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.len(), 1);
    }

    #[tokio::test]
    async fn locks_and_live_records_are_never_evicted() {
        let backend = MemoryBackend::new(2);
        backend.try_begin("held", HASH, "t1", TTL).await.ok();
        backend.commit("stored", "t2", HASH, Bytes::from_static(b"r"), TTL).await.ok();
        for i in 0..10 {
            let refused = backend.try_begin(&format!("new{i}"), HASH, "t", TTL).await;
            assert_eq!(refused, Err(BackendError::Full));
        }
        // The lock still excludes duplicates, its owner still commits, the record replays.
        assert!(matches!(backend.try_begin("held", HASH, "t9", TTL).await, Ok(Attempt::Held { .. })));
        let r = Bytes::from_static(b"mine");
        assert_eq!(backend.commit("held", "t1", HASH, r.clone(), TTL).await, Ok(CommitOutcome::Stored));
        assert_eq!(replayed(backend.try_begin("held", HASH, "t9", TTL).await), Some(r));
        let stored = backend.try_begin("stored", HASH, "t9", TTL).await;
        assert_eq!(replayed(stored), Some(Bytes::from_static(b"r")));
    }

    #[tokio::test]
    async fn byte_budget_refuses_what_does_not_fit_and_changes_nothing() {
        let backend = MemoryBackend::with_limits(100, 2 * ENTRY_COST + 10);
        assert_eq!(backend.try_begin("k1", HASH, "t1", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.try_begin("k2", HASH, "t2", TTL).await, Ok(Attempt::Locked));
        assert_eq!(backend.accounted_bytes(), 2 * ENTRY_COST);
        // No room for a third key, nor for an 11-byte record.
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Err(BackendError::Full));
        let big = Bytes::from_static(b"eleven byte");
        assert_eq!(backend.commit("k1", "t1", HASH, big, TTL).await, Err(BackendError::Full));
        // The refused commit kept the lock: its owner can release it, or commit what fits.
        assert!(matches!(backend.try_begin("k1", HASH, "t9", TTL).await, Ok(Attempt::Held { .. })));
        let ten = Bytes::from_static(b"ten bytes!");
        assert_eq!(backend.commit("k1", "t1", HASH, ten, TTL).await, Ok(CommitOutcome::Stored));
        assert_eq!(backend.accounted_bytes(), 2 * ENTRY_COST + 10);
        assert_eq!(backend.release("k2", "t2").await, Ok(ReleaseOutcome::Released));
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 10);
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Ok(Attempt::Locked));
    }

    #[tokio::test]
    async fn accounting_follows_expiry_and_sweeps() {
        let backend = MemoryBackend::new(10);
        let short = Duration::from_millis(20);
        backend.commit("k1", "t", HASH, Bytes::from_static(b"12345"), short).await.ok();
        backend.try_begin("k2", HASH, "t", short).await.ok();
        backend.commit("k3", "t", HASH, Bytes::from_static(b"123"), TTL).await.ok();
        assert_eq!(backend.accounted_bytes(), 3 * ENTRY_COST + 8);
        tokio::time::sleep(Duration::from_millis(40)).await;
        backend.sweep();
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 3);
        backend.release("k3", "t").await.ok();
        assert_eq!(backend.accounted_bytes(), ENTRY_COST + 3, "a record outlives a release");
    }

    #[tokio::test]
    async fn full_map_scans_only_once_something_can_have_expired() {
        let backend = MemoryBackend::new(2);
        let short = Duration::from_millis(30);
        backend.try_begin("k1", HASH, "t1", TTL).await.ok();
        backend.try_begin("k2", HASH, "t2", short).await.ok();
        for _ in 0..100 {
            assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Err(BackendError::Full));
        }
        assert_eq!(lock(&backend.inner).full_sweep, None, "nothing had expired: no scan");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(backend.try_begin("k3", HASH, "t3", TTL).await, Ok(Attempt::Locked));
        let inner = lock(&backend.inner);
        assert!(inner.full_sweep.is_some());
        assert!(inner.next_expiry.is_some_and(|at| at > Instant::now() + Duration::from_secs(20)));
    }

    #[tokio::test]
    async fn sweeper_drops_expired_records_and_locks() {
        let backend = MemoryBackend::new(10);
        let sweeper = backend.spawn_sweeper(Duration::from_millis(10));
        let short = Duration::from_millis(30);
        backend.try_begin("k1", HASH, "t1", short).await.ok();
        backend.commit("k2", "t2", HASH, Bytes::from_static(b"r"), short).await.ok();
        backend.commit("k3", "t3", HASH, Bytes::from_static(b"r"), TTL).await.ok();
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
        backend.commit("k", "t", HASH, Bytes::from_static(b"r"), short).await.ok();
        match backend.try_begin("k", HASH, "t2", TTL).await {
            Ok(Attempt::Record(bytes, Some(left))) => {
                assert_eq!(bytes, Bytes::from_static(b"r"));
                assert!(left <= short, "the record's remaining lifetime: {left:?}");
            }
            other => panic!("expected the record, got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(backend.try_begin("k", HASH, "t2", TTL).await, Ok(Attempt::Locked));
    }
}
