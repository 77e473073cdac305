//! Per-key wake-ups for `begin` calls waiting on a held lock.
//!
//! Commits, releases and operator deletes through this process ring at once. On Redis, those
//! through other instances ring too, by pub/sub ([`crate::backend::pubsub`]); whatever is
//! missed (the subscription down, the in-memory backend shared by clones in tests) is caught by
//! the bounded re-check in [`crate::store::Store::begin`].
//!
//! Uses no other module of this crate: the store and the operator's delete route (idemstore's
//! admin) ring it, and the backends forward other instances' wake-ups to it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Waiters {
    map: Mutex<HashMap<String, Arc<Notify>>>,
}

/// A registration for wake-ups on one key; the map entry goes away with the last one.
#[derive(Debug)]
pub struct Subscription<'a> {
    waiters: &'a Waiters,
    key: String,
    notify: Arc<Notify>,
}

impl Waiters {
    pub fn subscribe(&self, key: &str) -> Subscription<'_> {
        let notify = self.lock().entry(key.to_owned()).or_default().clone();
        Subscription { waiters: self, key: key.to_owned(), notify }
    }

    /// Wakes every current subscriber of `key`; a no-op when nobody waits.
    pub fn wake(&self, key: &str) {
        if let Some(notify) = self.lock().get(key) {
            notify.notify_waiters();
        }
    }

    /// Wakes every subscriber of every key: after wake-ups may have been missed.
    pub fn wake_all(&self) {
        for notify in self.lock().values() {
            notify.notify_waiters();
        }
    }

    /// Number of keys with at least one subscriber.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // The map stays consistent whatever a panicking holder was doing: every update is
        // a single insert or remove.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether wake-ups published by other idemstore instances reach this one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteWakeups {
    /// Subscribed right now.
    pub listening: bool,
    /// Subscriptions made so far (a reconnect adds one).
    pub subscriptions: u64,
}

impl Subscription<'_> {
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut map = self.waiters.lock();
        // Clones are only made under this lock, so the count cannot move under us:
        // two means the map's copy and ours.
        if Arc::strong_count(&self.notify) == 2 {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn wakes_subscribers_and_cleans_up() {
        let waiters = Waiters::default();
        let a = waiters.subscribe("k");
        let b = waiters.subscribe("k");
        assert_eq!(waiters.len(), 1);
        let na = a.notify().notified();
        let nb = b.notify().notified();
        waiters.wake("other");
        waiters.wake("k");
        tokio::time::timeout(Duration::from_millis(100), async { tokio::join!(na, nb) }).await.unwrap();
        drop(a);
        assert_eq!(waiters.len(), 1);
        drop(b);
        assert!(waiters.is_empty());
    }

    #[tokio::test]
    async fn wake_all_reaches_every_key() {
        let waiters = Waiters::default();
        let a = waiters.subscribe("a");
        let b = waiters.subscribe("b");
        let (na, nb) = (a.notify().notified(), b.notify().notified());
        waiters.wake_all();
        tokio::time::timeout(Duration::from_millis(100), async { tokio::join!(na, nb) }).await.unwrap();
    }
}
