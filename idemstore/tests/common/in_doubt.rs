//! Attempts whose outcome is unknown ("in doubt"): the trace a `begin` with a hold keeps, on
//! every backend (run by `memory.rs`, `redis.rs` and `redis_cluster.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemstore::backend::{now_ms, Attempt, Backend, CommitOutcome, Deleted, Hold, ReleaseOutcome, TraceInfo};
use idemstore::store::{Begin, Store};

use super::{commit, hash, key, parked, TTL, WAIT};

/// A short lock TTL, for the scenarios that wait it out.
pub const SHORT: Duration = Duration::from_millis(200);
pub const RETENTION: Duration = Duration::from_secs(60);

pub fn hold() -> Option<Hold<'static>> {
    Some(Hold { retention: RETENTION, supersede: None })
}

pub fn superseding(token: &str) -> Option<Hold<'_>> {
    Some(Hold { retention: RETENTION, supersede: Some(token) })
}

/// The key's trace; panics without one.
pub async fn trace<B: Backend>(backend: &B, key: &str) -> TraceInfo {
    backend.inspect(key).await.unwrap().trace.expect("a trace")
}

/// A key whose attempt (token `t1`, body hash `a`, lock TTL `lock_ttl`) was sent and answered
/// nothing: locked with a hold, released in doubt. Returns its start as the trace tells.
pub async fn in_doubt_key<B: Backend>(backend: &B, key: &str, lock_ttl: Duration) -> u64 {
    assert_eq!(backend.try_begin(key, &hash('a'), "t1", lock_ttl, hold()).await.unwrap(), Attempt::Locked);
    assert_eq!(backend.release(key, "t1", true).await.unwrap(), ReleaseOutcome::Released);
    let seen = backend.inspect(key).await.unwrap();
    assert!(seen.in_doubt(), "{seen:?}");
    seen.trace.unwrap().started_ms
}

/// The `in-doubt` answer's parts; panics on anything else.
pub fn in_doubt(attempt: Attempt) -> (String, u64, Duration) {
    match attempt {
        Attempt::InDoubt { token, started_ms, running } => (token, started_ms, running),
        other => panic!("expected in-doubt, got {other:?}"),
    }
}

/// A `begin` with a hold writes the trace: the token, the store's clock at the start, the lock
/// TTL and the body hash, living `max(retention, lock TTL)`; the lock is taken as without.
pub async fn hold_writes_a_trace<B: Backend>(backend: &B) {
    let key = key();
    let before = now_ms();
    let locked = backend.try_begin(&key, &hash('a'), "t1", TTL, hold()).await.unwrap();
    let after = now_ms();
    assert_eq!(locked, Attempt::Locked);
    let seen = backend.inspect(&key).await.unwrap();
    assert!(seen.lock.is_some() && seen.record.is_none() && !seen.in_doubt(), "{seen:?}");
    let t = seen.trace.expect("a trace");
    assert_eq!((t.token.as_str(), t.lock_ttl, t.body_hash.as_str()), ("t1", TTL, hash('a').as_str()));
    // The store's clock (Redis's TIME, on this host): within the call, give or take a second.
    assert!(t.started_ms + 1000 >= before && t.started_ms <= after + 1000, "{t:?}");
    let ttl = t.ttl.expect("a trace expires");
    assert!(ttl <= RETENTION && ttl > RETENTION - Duration::from_secs(10), "{ttl:?}");

    // A lock TTL longer than the retention: the trace lives as long as the lock.
    let long = key_with_trace(backend, Duration::from_secs(120), Duration::from_secs(1)).await;
    let ttl = trace(backend, &long).await.ttl.unwrap();
    assert!(ttl > Duration::from_secs(110), "the trace lives max(retention, lock TTL): {ttl:?}");

    // Without a hold, no trace.
    let plain = key_plain(backend).await;
    assert_eq!(backend.inspect(&plain).await.unwrap().trace, None);
}

async fn key_with_trace<B: Backend>(backend: &B, lock_ttl: Duration, retention: Duration) -> String {
    let key = key();
    let hold = Some(Hold { retention, supersede: None });
    assert_eq!(backend.try_begin(&key, &hash('a'), "t1", lock_ttl, hold).await.unwrap(), Attempt::Locked);
    key
}

async fn key_plain<B: Backend>(backend: &B) -> String {
    let key = key();
    assert_eq!(backend.try_begin(&key, &hash('a'), "t1", TTL, None).await.unwrap(), Attempt::Locked);
    key
}

/// Released in doubt, the key answers `in-doubt` to a `begin` with a hold, with the first
/// attempt's token, start and what is left of its lock TTL (0 once it has passed), and takes no
/// lock; the trace stays.
pub async fn in_doubt_after_an_in_doubt_release<B: Backend>(backend: &B) {
    let key = key();
    let started = in_doubt_key(backend, &key, SHORT).await;
    let (token, started_ms, running) =
        in_doubt(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap());
    assert_eq!((token.as_str(), started_ms), ("t1", started));
    assert!(running <= SHORT, "{running:?}");
    assert_eq!(running.subsec_nanos() % 1_000_000, 0, "whole milliseconds");
    assert!(backend.inspect(&key).await.unwrap().lock.is_none(), "in-doubt takes no lock");
    // Once the first attempt's lock TTL has passed, it can no longer be running.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (token, _, running) =
            in_doubt(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap());
        assert_eq!(token, "t1");
        if running.is_zero() {
            break;
        }
        assert!(Instant::now() < deadline, "still running after {SHORT:?}: {running:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(backend.inspect(&key).await.unwrap().in_doubt(), "the trace outlives the lock TTL");
}

/// An Envoy that died mid-attempt never releases: once the lock expires, the key is in doubt.
pub async fn in_doubt_after_the_lock_expires<B: Backend>(backend: &B) {
    let key = key();
    assert_eq!(backend.try_begin(&key, &hash('a'), "t1", SHORT, hold()).await.unwrap(), Attempt::Locked);
    let deadline = Instant::now() + Duration::from_secs(5);
    let attempt = loop {
        match backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap() {
            Attempt::Held { .. } => {
                assert!(Instant::now() < deadline, "the lock never expired");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other,
        }
    };
    let (token, _, running) = in_doubt(attempt);
    assert_eq!(token, "t1");
    assert!(running <= Duration::from_millis(5), "the lock TTL has passed: {running:?}");
}

/// A trace of another body: `mismatch`, as a record of another body would be; the key stays
/// in doubt for its own body.
pub async fn another_body_is_a_mismatch<B: Backend>(backend: &B) {
    let key = key();
    in_doubt_key(backend, &key, TTL).await;
    assert_eq!(backend.try_begin(&key, &hash('b'), "t2", TTL, hold()).await.unwrap(), Attempt::Mismatch);
    assert_eq!(in_doubt(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap()).0, "t1");
}

/// Without a hold, traces are neither read nor written: the key locks as if there were none,
/// and the trace stays until a record supersedes it.
pub async fn without_hold_the_trace_is_ignored<B: Backend>(backend: &B) {
    let key = key();
    in_doubt_key(backend, &key, TTL).await;
    assert_eq!(backend.try_begin(&key, &hash('a'), "t3", TTL, None).await.unwrap(), Attempt::Locked);
    assert_eq!(trace(backend, &key).await.token, "t1", "the trace is neither read nor written");
    let record = Bytes::from_static(b"third");
    assert_eq!(backend.commit(commit(&key, "t3", &hash('a'), record)).await.unwrap(), CommitOutcome::Stored);
    assert_eq!(backend.inspect(&key).await.unwrap().trace, None, "a record supersedes the trace");
}

/// `supersede` with the in-doubt attempt's token clears its trace and locks (a new trace);
/// with another token, or while a lock is held, it changes nothing.
pub async fn supersede<B: Backend>(backend: &B) {
    let key = key();
    in_doubt_key(backend, &key, TTL).await;
    let wrong = backend.try_begin(&key, &hash('a'), "t2", TTL, superseding("t9")).await.unwrap();
    assert_eq!(in_doubt(wrong).0, "t1");
    let right = backend.try_begin(&key, &hash('a'), "t2", TTL, superseding("t1")).await.unwrap();
    assert_eq!(right, Attempt::Locked);
    assert_eq!(trace(backend, &key).await.token, "t2", "a new trace, of the new attempt");
    // t2 holds the lock: superseding its trace must not happen while it runs.
    let held = backend.try_begin(&key, &hash('a'), "t3", TTL, superseding("t2")).await.unwrap();
    assert!(matches!(held, Attempt::Held { .. }), "{held:?}");
    assert_eq!(trace(backend, &key).await.token, "t2");
}

/// The in-doubt attempt's own late commit: its record is stored and replays, the trace goes.
pub async fn late_commit_resolves<B: Backend>(backend: &B) {
    let key = key();
    in_doubt_key(backend, &key, SHORT).await;
    let record = Bytes::from_static(b"the first attempt's answer");
    let late = backend.commit(commit(&key, "t1", &hash('a'), record.clone())).await.unwrap();
    assert_eq!(late, CommitOutcome::Late);
    let seen = backend.inspect(&key).await.unwrap();
    assert!(seen.trace.is_none() && seen.record.is_some(), "{seen:?}");
    match backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap() {
        Attempt::Record(bytes, _) => assert_eq!(bytes, record),
        other => panic!("expected the record, got {other:?}"),
    }
    // Another token's commit stores (late) and clears the trace too: a record supersedes it,
    // whoever committed it; the running attempt's own commit then finds it.
    let other = self::key();
    assert_eq!(backend.try_begin(&other, &hash('a'), "t1", TTL, hold()).await.unwrap(), Attempt::Locked);
    let first = backend.commit(commit(&other, "t9", &hash('a'), Bytes::from_static(b"r"))).await.unwrap();
    assert_eq!(first, CommitOutcome::Late);
    assert_eq!(backend.inspect(&other).await.unwrap().trace, None);
    let again = backend.commit(commit(&other, "t1", &hash('a'), Bytes::from_static(b"x"))).await.unwrap();
    assert_eq!(again, CommitOutcome::Exists);
    assert!(backend.inspect(&other).await.unwrap().lock.is_none(), "the owner's lock is dropped");
}

/// A plain release (the attempt never reached the application) clears the trace of its token
/// and no other; an in-doubt release keeps it.
pub async fn release_not_in_doubt_clears_the_trace<B: Backend>(backend: &B) {
    let key = key();
    assert_eq!(backend.try_begin(&key, &hash('a'), "t1", TTL, hold()).await.unwrap(), Attempt::Locked);
    assert_eq!(backend.release(&key, "t1", false).await.unwrap(), ReleaseOutcome::Released);
    assert!(backend.inspect(&key).await.unwrap().is_empty());
    assert_eq!(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap(), Attempt::Locked);

    // In doubt: another token's release changes nothing; the attempt's own plain release
    // (after its in-doubt one: the application said it never committed) clears the trace.
    let key = self::key();
    in_doubt_key(backend, &key, TTL).await;
    assert_eq!(backend.release(&key, "t9", false).await.unwrap(), ReleaseOutcome::NotOwner);
    assert_eq!(backend.release(&key, "t1", true).await.unwrap(), ReleaseOutcome::NotOwner);
    assert!(backend.inspect(&key).await.unwrap().in_doubt());
    assert_eq!(backend.release(&key, "t1", false).await.unwrap(), ReleaseOutcome::Released);
    assert!(backend.inspect(&key).await.unwrap().is_empty());
    assert_eq!(backend.release(&key, "t1", false).await.unwrap(), ReleaseOutcome::NotOwner);
    assert_eq!(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap(), Attempt::Locked);
}

/// The operator's delete drops the trace: the next retry runs.
pub async fn delete_clears_the_trace<B: Backend>(backend: &B) {
    let key = key();
    in_doubt_key(backend, &key, TTL).await;
    let deleted = backend.delete(&key).await.unwrap();
    assert_eq!(deleted, Deleted { record: false, lock: false, trace: true });
    assert!(backend.inspect(&key).await.unwrap().is_empty());
    assert_eq!(backend.delete(&key).await.unwrap(), Deleted::default());
    assert_eq!(backend.try_begin(&key, &hash('a'), "t2", TTL, hold()).await.unwrap(), Attempt::Locked);
    // A running attempt's lock and trace go together.
    let deleted = backend.delete(&key).await.unwrap();
    assert_eq!(deleted, Deleted { record: false, lock: true, trace: true });
}

/// The operator's counts and finds see keys in doubt (as deltas: the backend may hold other
/// scenarios' keys); a running attempt's key is locked, not in doubt.
pub async fn counted_and_found<B: Backend>(backend: &B) {
    let before = backend.counts().await.unwrap();
    let (doubt, running) = (key(), key());
    in_doubt_key(backend, &doubt, TTL).await;
    assert_eq!(backend.try_begin(&running, &hash('a'), "t1", TTL, hold()).await.unwrap(), Attempt::Locked);
    let after = backend.counts().await.unwrap();
    assert_eq!(after.in_doubt - before.in_doubt, 1, "{before:?} -> {after:?}");
    assert_eq!(after.locks - before.locks, 1, "{before:?} -> {after:?}");
    assert_eq!(backend.find(&doubt[..12], 10).await.unwrap(), [doubt.as_str()], "a trace alone is found");
    assert_eq!(backend.find(&running, 10).await.unwrap(), [running.as_str()], "a lock and a trace: one key");
    backend.delete(&doubt).await.unwrap();
    backend.delete(&running).await.unwrap();
}

/// Every scenario above that takes a backend, one after the other on the same one: what a
/// backend that is expensive to start (a Redis server, a cluster) runs in one test.
pub async fn every_scenario<B: Backend>(backend: &B) {
    hold_writes_a_trace(backend).await;
    in_doubt_after_an_in_doubt_release(backend).await;
    in_doubt_after_the_lock_expires(backend).await;
    another_body_is_a_mismatch(backend).await;
    without_hold_the_trace_is_ignored(backend).await;
    supersede(backend).await;
    late_commit_resolves(backend).await;
    release_not_in_doubt_clears_the_trace(backend).await;
    delete_clears_the_trace(backend).await;
    counted_and_found(backend).await;
}

/// A duplicate waiting on a held lock, woken by the holder's in-doubt release, gets `in-doubt`
/// at once (the re-checks are 60 s apart: only the wake-up explains it).
pub async fn waiter_woken_by_an_in_doubt_release<B: Backend>(store: Arc<Store<B>>) {
    let key = key();
    let Begin::Locked { token } = store.begin_with(&key, &hash('a'), TTL, WAIT, None, hold()).await.unwrap()
    else {
        panic!("expected locked")
    };
    let before = store.parked();
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(&store), key.clone());
        async move {
            let begun = store.begin_with(&key, &hash('a'), TTL, WAIT, None, hold()).await.unwrap();
            (begun, Instant::now())
        }
    });
    parked(&store, before).await;
    let released = Instant::now();
    assert_eq!(store.release(&key, &token, true).await.unwrap(), ReleaseOutcome::Released);
    let (begun, answered) = waiter.await.unwrap();
    match begun {
        Begin::InDoubt { token: first, running, .. } => {
            assert_eq!(first, token);
            assert!(running > TTL - Duration::from_secs(5), "the attempt may run its whole TTL: {running:?}");
        }
        other => panic!("expected in-doubt, got {other:?}"),
    }
    let took = answered.saturating_duration_since(released);
    assert!(took < Duration::from_millis(500), "woken after {took:?}");
    // A waiter without a hold takes the lock instead.
    let waiter = tokio::spawn({
        let (store, key) = (Arc::clone(&store), key.clone());
        async move { store.begin(&key, &hash('a'), TTL, WAIT).await.unwrap() }
    });
    let begun = waiter.await.unwrap();
    assert!(matches!(begun, Begin::Locked { .. }), "{begun:?}");
}
