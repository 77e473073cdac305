//! Scenarios every backend must pass, run by `memory.rs` and `redis.rs`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemstore::backend::{Backend, CommitOutcome, ReleaseOutcome};
use idemstore::store::{new_token, Begin, Store};

pub const TTL: Duration = Duration::from_secs(30);
pub const WAIT: Duration = Duration::from_secs(5);
pub const DAY: Duration = Duration::from_secs(86_400);

pub fn key() -> String {
    format!("{}{}", new_token(), new_token())
}

pub fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

pub async fn lock<B: Backend>(store: &Store<B>, key: &str) -> String {
    match store.begin(key, &hash('a'), TTL, WAIT).await.unwrap() {
        Begin::Locked { token } => {
            assert!(idem_protocol::is_token(token.as_bytes()));
            token
        }
        other => panic!("expected locked, got {other:?}"),
    }
}

pub async fn begin_locks_then_replays<B: Backend>(store: &Store<B>) {
    let key = key();
    let token = lock(store, &key).await;
    let record = Bytes::from_static(b"{\"status\":201}");
    let outcome = store.commit(&key, &token, &hash('a'), record.clone(), DAY).await.unwrap();
    assert_eq!(outcome, CommitOutcome::Stored);
    assert_eq!(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap(), Begin::Record(record));
    assert!(store.waiters().is_empty(), "waiter map must be cleaned up");
}

/// A duplicate waiting on a lock held through the same store gets the record as soon as it
/// is committed: the re-check interval is made huge, so only the wake-up can explain it.
pub async fn waiter_woken_by_commit<B: Backend>(backend: B) {
    let store = Arc::new(Store::with_recheck(backend, Duration::from_secs(60), Duration::from_secs(60)));
    let key = key();
    let token = lock(&store, &key).await;
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(&store), key.clone());
        async move {
            let begun = store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap();
            (begun, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.waiters().len(), 1);
    let record = Bytes::from_static(b"done");
    let committed = Instant::now();
    store.commit(&key, &token, &hash('a'), record.clone(), DAY).await.unwrap();
    let (begun, answered) = waiter.await.unwrap();
    assert_eq!(begun, Begin::Record(record));
    let latency = answered.saturating_duration_since(committed);
    assert!(latency < Duration::from_millis(500), "woken after {latency:?}");
    assert!(store.waiters().is_empty());
}

/// Same, for a release: the waiter takes the lock.
pub async fn waiter_woken_by_release<B: Backend>(backend: B) {
    let store = Arc::new(Store::with_recheck(backend, Duration::from_secs(60), Duration::from_secs(60)));
    let key = key();
    let token = lock(&store, &key).await;
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(&store), key.clone());
        async move { store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    assert_eq!(store.release(&key, &token).await.unwrap(), ReleaseOutcome::Released);
    let begun = waiter.await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(500));
    let Begin::Locked { token: second } = begun else { panic!("expected locked, got {begun:?}") };
    assert_ne!(second, token);
}

pub async fn busy_after_wait<B: Backend>(store: &Store<B>) {
    let key = key();
    lock(store, &key).await;
    let started = Instant::now();
    let wait = Duration::from_millis(300);
    assert_eq!(store.begin(&key, &hash('a'), TTL, wait).await.unwrap(), Begin::Busy);
    let took = started.elapsed();
    assert!(took >= wait && took < wait + Duration::from_millis(600), "busy after {took:?}");
    assert!(store.waiters().is_empty());
}

pub async fn mismatch<B: Backend>(store: &Store<B>) {
    let key = key();
    let token = lock(store, &key).await;
    store.commit(&key, &token, &hash('a'), Bytes::from_static(b"x"), DAY).await.unwrap();
    assert_eq!(store.begin(&key, &hash('b'), TTL, WAIT).await.unwrap(), Begin::Mismatch);
}

pub async fn release_lets_next_begin_lock<B: Backend>(store: &Store<B>) {
    let key = key();
    let token = lock(store, &key).await;
    assert_eq!(store.release(&key, "someone-else").await.unwrap(), ReleaseOutcome::NotOwner);
    assert_eq!(store.release(&key, &token).await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(store.release(&key, &token).await.unwrap(), ReleaseOutcome::NotOwner);
    let again = lock(store, &key).await;
    assert_ne!(again, token);
}

/// A's lock expires, B takes over; A's late commit is stored (`late`), B's commit then finds
/// it (`exists`) and the first record wins. B's lock is released all the same.
pub async fn late_commit_and_exists<B: Backend>(store: &Store<B>) {
    let key = key();
    let Begin::Locked { token: a } =
        store.begin(&key, &hash('a'), Duration::from_millis(100), WAIT).await.unwrap()
    else {
        panic!("expected locked")
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = lock(store, &key).await;
    let first = Bytes::from_static(b"first");
    assert_eq!(store.commit(&key, &a, &hash('a'), first.clone(), DAY).await.unwrap(), CommitOutcome::Late);
    assert_eq!(
        store.commit(&key, &b, &hash('a'), Bytes::from_static(b"second"), DAY).await.unwrap(),
        CommitOutcome::Exists
    );
    assert_eq!(store.release(&key, &b).await.unwrap(), ReleaseOutcome::NotOwner);
    assert_eq!(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap(), Begin::Record(first));

    // No lock at all: stored as late.
    let other = self::key();
    assert_eq!(
        store.commit(&other, "no-lock", &hash('a'), Bytes::new(), DAY).await.unwrap(),
        CommitOutcome::Late
    );
    assert_eq!(store.begin(&other, &hash('a'), TTL, WAIT).await.unwrap(), Begin::Record(Bytes::new()));
}

/// A holder that never finishes: the waiter takes the lock once its TTL runs out, well
/// before its own deadline.
pub async fn expired_lock_is_taken_over<B: Backend>(store: &Store<B>) {
    let key = key();
    let ttl = Duration::from_millis(300);
    let Begin::Locked { .. } = store.begin(&key, &hash('a'), ttl, WAIT).await.unwrap() else {
        panic!("expected locked")
    };
    let started = Instant::now();
    let begun = store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap();
    assert!(matches!(begun, Begin::Locked { .. }), "{begun:?}");
    assert!(started.elapsed() < ttl + Duration::from_millis(600), "{:?}", started.elapsed());
}

pub async fn record_expires<B: Backend>(store: &Store<B>, retention: Duration) {
    let key = key();
    let token = lock(store, &key).await;
    let record = Bytes::from_static(b"short-lived");
    store.commit(&key, &token, &hash('a'), record.clone(), retention).await.unwrap();
    assert_eq!(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap(), Begin::Record(record));
    tokio::time::sleep(retention + Duration::from_millis(100)).await;
    lock(store, &key).await;
}

pub async fn binary_record<B: Backend>(store: &Store<B>) {
    let key = key();
    let token = lock(store, &key).await;
    let bytes: Vec<u8> = (0..1024 * 1024).map(|i: u32| (i % 251) as u8).collect();
    assert!(bytes.contains(&0));
    let record = Bytes::from(bytes);
    store.commit(&key, &token, &hash('a'), record.clone(), DAY).await.unwrap();
    assert_eq!(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap(), Begin::Record(record));
}

/// Two stores over one shared backend stand for two idemstore instances: no wake-up
/// crosses between them, the bounded re-check finds the commit.
pub async fn waiter_on_other_instance<B: Backend>(one: Store<B>, two: Store<B>) {
    let (one, two) = (Arc::new(one), Arc::new(two));
    let key = key();
    let token = lock(&one, &key).await;
    let waiter = tokio::spawn({
        let (two, key) = (Arc::clone(&two), key.clone());
        async move {
            let begun = two.begin(&key, &hash('a'), TTL, WAIT).await.unwrap();
            (begun, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let record = Bytes::from_static(b"elsewhere");
    let committed = Instant::now();
    one.commit(&key, &token, &hash('a'), record.clone(), DAY).await.unwrap();
    let (begun, answered) = waiter.await.unwrap();
    assert_eq!(begun, Begin::Record(record));
    let latency = answered.saturating_duration_since(committed);
    assert!(latency < Duration::from_millis(800), "found after {latency:?}");
}

/// Shutdown ends waits with `busy` instead of sitting them out.
pub async fn stop_waiting_answers_busy<B: Backend>(store: Arc<Store<B>>) {
    let key = key();
    lock(&store, &key).await;
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(&store), key.clone());
        async move { store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    store.stop_waiting();
    assert_eq!(waiter.await.unwrap(), Begin::Busy);
    assert!(started.elapsed() < Duration::from_millis(500));
}
