//! Scenarios every backend must pass, run by `memory.rs` and `redis.rs`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemstore::backend::{Backend, CommitOutcome, ReleaseOutcome};
use idemstore::store::{new_token, Begin, Store};

pub mod client;

pub const TTL: Duration = Duration::from_secs(30);
pub const WAIT: Duration = Duration::from_secs(5);
pub const DAY: Duration = Duration::from_secs(86_400);

pub fn key() -> String {
    format!("{}{}", new_token(), new_token())
}

pub fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

/// A replayed record's bytes, whatever its remaining lifetime.
pub fn replayed(begun: Begin) -> Option<Bytes> {
    match begun {
        Begin::Record(bytes, _) => Some(bytes),
        _ => None,
    }
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
    match store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap() {
        // The record comes with what is left of its retention, for the filter's cache.
        Begin::Record(bytes, Some(left)) => {
            assert_eq!(bytes, record);
            assert!(left <= DAY && left > DAY - Duration::from_secs(60), "remaining lifetime {left:?}");
        }
        other => panic!("expected the record with its lifetime, got {other:?}"),
    }
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
    assert_eq!(replayed(begun), Some(record));
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
    assert_eq!(replayed(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap()), Some(first));

    // No lock at all: stored as late.
    let other = self::key();
    assert_eq!(
        store.commit(&other, "no-lock", &hash('a'), Bytes::new(), DAY).await.unwrap(),
        CommitOutcome::Late
    );
    assert_eq!(replayed(store.begin(&other, &hash('a'), TTL, WAIT).await.unwrap()), Some(Bytes::new()));
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
    assert_eq!(replayed(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap()), Some(record));
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
    assert_eq!(replayed(store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap()), Some(record));
}

/// Two stores over one shared backend stand for two idemstore instances. In memory no
/// wake-up crosses between them and the bounded re-check finds the commit; on Redis the
/// pub/sub wake-up does (see [`commit_wakes_other_instance`] for the tight bound).
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
    assert_eq!(replayed(begun), Some(record));
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

/// A store whose re-checks never come within a test (60 s), so only a wake-up can end a wait
/// early.
pub fn no_recheck<B: Backend>(backend: B) -> Arc<Store<B>> {
    Arc::new(Store::with_recheck(backend, Duration::from_secs(60), Duration::from_secs(60)))
}

/// Waits until `store` hears other instances' wake-ups, through at least `subscriptions`
/// subscriptions so far (1: the first; 2: one reconnect).
pub async fn listening<B: Backend>(store: &Store<B>, subscriptions: u64) {
    let mut remote = store.remote_wakeups();
    tokio::time::timeout(
        Duration::from_secs(20),
        remote.wait_for(|s| s.listening && s.subscriptions >= subscriptions),
    )
    .await
    .unwrap_or_else(|e| {
        let now = *store.remote_wakeups().borrow();
        panic!(
            "wake-up subscription not up in time: {e:?}, now {now:?}, awaited {subscriptions} subscriptions"
        )
    })
    .unwrap();
}

/// Waits until `store` has more than `before` parked `begin` calls: the waiter made its
/// attempt, saw the lock held, and sleeps.
pub async fn parked<B: Backend>(store: &Store<B>, before: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.parked() <= before {
        assert!(Instant::now() < deadline, "the waiter never parked");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Delays of one cross-instance wake-up: from the holder's commit call starting, and from it
/// returning, to the waiter's answer.
#[derive(Debug, Clone, Copy)]
pub struct Wake {
    pub from_call: Duration,
    pub from_reply: Duration,
}

/// A `begin` for `key` on `store`, returned once it is parked waiting for the lock; the task
/// yields its answer and when it came.
async fn parked_begin<B: Backend>(
    store: &Arc<Store<B>>,
    key: &str,
) -> tokio::task::JoinHandle<(Begin, Instant)> {
    let before = store.parked();
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(store), key.to_string());
        async move {
            let begun = store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap();
            (begun, Instant::now())
        }
    });
    parked(store, before).await;
    waiter
}

/// `one` holds the lock, a duplicate waits on `two`, `one` commits: the waiter gets the
/// record. Returns how fast.
pub async fn commit_wakes_other_instance<B: Backend>(one: &Arc<Store<B>>, two: &Arc<Store<B>>) -> Wake {
    let key = key();
    let token = lock(one, &key).await;
    let waiter = parked_begin(two, &key).await;
    let record = Bytes::from(format!("committed elsewhere {key}"));
    let called = Instant::now();
    one.commit(&key, &token, &hash('a'), record.clone(), DAY).await.unwrap();
    let replied = Instant::now();
    let (begun, answered) = waiter.await.unwrap();
    assert_eq!(replayed(begun), Some(record));
    Wake {
        from_call: answered.saturating_duration_since(called),
        from_reply: answered.saturating_duration_since(replied),
    }
}

/// Same with a release: the waiter on `two` takes the lock. Returns the delay from the
/// release call.
pub async fn release_wakes_other_instance<B: Backend>(one: &Arc<Store<B>>, two: &Arc<Store<B>>) -> Duration {
    let key = key();
    let token = lock(one, &key).await;
    let waiter = parked_begin(two, &key).await;
    let called = Instant::now();
    assert_eq!(one.release(&key, &token).await.unwrap(), ReleaseOutcome::Released);
    let (begun, answered) = waiter.await.unwrap();
    let Begin::Locked { token: second } = begun else { panic!("expected locked, got {begun:?}") };
    assert_ne!(second, token);
    answered.saturating_duration_since(called)
}

/// The bound the cross-instance tests hold wake-ups to.
pub const FAST: Duration = Duration::from_millis(50);

/// Both ways across two instances, each within [`FAST`].
pub async fn wakes_cross_instances<B: Backend>(one: &Arc<Store<B>>, two: &Arc<Store<B>>) {
    for (a, b) in [(one, two), (two, one)] {
        let wake = commit_wakes_other_instance(a, b).await;
        assert!(wake.from_call < FAST, "commit woke the other instance after {wake:?}");
        let released = release_wakes_other_instance(a, b).await;
        assert!(released < FAST, "release woke the other instance after {released:?}");
    }
}

/// `n` commit-to-wake samples across two instances, alternating directions; prints p50/p99.
/// Holds the median to [`FAST`] and every sample to 1 s, far below the 60 s re-check (the
/// tail is left loose: other builds share this machine's two cores).
pub async fn measure_cross_instance_wakes<B: Backend>(
    label: &str,
    one: &Arc<Store<B>>,
    two: &Arc<Store<B>>,
    n: usize,
) {
    let mut from_call = Vec::with_capacity(n);
    let mut from_reply = Vec::with_capacity(n);
    for i in 0..n {
        let wake = if i % 2 == 0 {
            commit_wakes_other_instance(one, two).await
        } else {
            commit_wakes_other_instance(two, one).await
        };
        from_call.push(wake.from_call);
        from_reply.push(wake.from_reply);
    }
    let call = Percentiles::of(&mut from_call);
    let reply = Percentiles::of(&mut from_reply);
    eprintln!("{label}: cross-instance commit-to-wake over {n} samples, from the commit call: {call}");
    eprintln!("{label}: cross-instance commit-to-wake over {n} samples, from the commit reply: {reply}");
    assert!(call.p50 < FAST, "{label}: {call}");
    assert!(call.max < Duration::from_secs(1), "{label}: {call}");
}

#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Percentiles {
    pub fn of(samples: &mut [Duration]) -> Self {
        assert!(!samples.is_empty());
        samples.sort();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        Self { p50: at(0.5), p99: at(0.99), max: at(1.0) }
    }
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p50 {:.2?}, p99 {:.2?}, max {:.2?}", self.p50, self.p99, self.max)
    }
}
