//! In-process backend for a single idemstore instance (local runs, demos).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Attempt, Backend, BackendError, CommitOutcome, ReleaseOutcome, Result};

#[derive(Debug, Clone)]
pub struct MemoryBackend {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<String, Entry>,
    max_keys: usize,
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
    /// Drops whatever has expired; true when nothing is left.
    fn expire(&mut self, now: Instant) -> bool {
        if self.record.as_ref().is_some_and(|r| r.expires <= now) {
            self.record = None;
        }
        if self.lock.as_ref().is_some_and(|l| l.expires <= now) {
            self.lock = None;
        }
        self.record.is_none() && self.lock.is_none()
    }
}

impl Inner {
    /// The live entry for `key`, if any, after expiring its parts.
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        if self.entries.get_mut(key)?.expire(now) {
            self.entries.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }

    /// The entry for `key`, created if the key limit allows it.
    fn live_or_new(&mut self, key: &str, now: Instant) -> Result<&mut Entry> {
        if self.live(key, now).is_none() {
            if self.entries.len() >= self.max_keys {
                self.sweep(now);
            }
            if self.entries.len() >= self.max_keys {
                return Err(BackendError::Full);
            }
            self.entries.insert(key.to_owned(), Entry::default());
        }
        self.entries.get_mut(key).ok_or(BackendError::Full)
    }

    fn sweep(&mut self, now: Instant) {
        self.entries.retain(|_, entry| !entry.expire(now));
    }
}

impl MemoryBackend {
    /// `max_keys` bounds the keys holding a record or a lock; past it `begin` fails rather
    /// than growing without bound.
    pub fn new(max_keys: usize) -> Self {
        let inner = Inner { entries: HashMap::new(), max_keys };
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
                    Attempt::Record(record.bytes.clone())
                } else {
                    Attempt::Mismatch
                });
            }
            if let Some(held) = &entry.lock {
                return Ok(Attempt::Held { remaining: Some(held.expires.saturating_duration_since(now)) });
            }
        }
        let entry = inner.live_or_new(key, now)?;
        entry.lock = Some(Lock { token: token.to_owned(), expires: now + lock_ttl });
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
        let mut owned = false;
        if let Some(entry) = inner.live(key, now) {
            if entry.lock.as_ref().is_some_and(|l| l.token == token) {
                entry.lock = None;
                owned = true;
            }
            if entry.record.is_some() {
                return Ok(CommitOutcome::Exists);
            }
        }
        let entry = inner.live_or_new(key, now)?;
        entry.record =
            Some(Record { body_hash: body_hash.to_owned(), bytes: record, expires: now + retention });
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
            inner.entries.remove(key);
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const TTL: Duration = Duration::from_secs(30);

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
        assert_eq!(
            backend.try_begin("k", HASH, "t2", TTL).await,
            Ok(Attempt::Record(Bytes::from_static(b"r")))
        );
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(backend.try_begin("k", HASH, "t2", TTL).await, Ok(Attempt::Locked));
    }
}
