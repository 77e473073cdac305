//! One call of the store stream (`idemstore.v1.Store/Stream`, see `idem_protocol::stream`) to
//! its answer: validated as its HTTP twin, carried out on a [`Store`] and counted through its
//! [`Observer`]. idemstore's stream serves every call with [`serve`], and so does a host that
//! runs the store in Envoy's own process: the checks and the answers are the protocol, and two
//! copies would drift.
//!
//! A call that is malformed, or that the backend fails, answers a [`Failure`] (`bad_request`
//! for the caller's fault); nothing here ends a stream, reads its transport or spawns a task.
//! Uses [`crate::store`], [`crate::backend`] and [`crate::millis`].

use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_protocol as proto;
use proto::stream::{Answer, Begun, Call, Commit, Failure, Op as CallOp, Outcome, Release};

use crate::backend::{self, Backend, BackendError, Hold};
use crate::millis::{ceil_millis, give_up_at, running_millis};
use crate::store::{Answered, Begin, Observer, Op, Rejected, Store};

/// Validates, carries out and counts one call; `max_record_bytes` bounds a commit's record (a
/// larger one is refused as too large, as idemstore's `--max-body-bytes` refuses it over HTTP).
pub async fn serve<B: Backend, O: Observer>(
    store: &Store<B, O>,
    call: Call,
    max_record_bytes: usize,
) -> Answer {
    let id = call.id;
    let started = Instant::now();
    let outcome = match call.op {
        Some(CallOp::Begin(b)) => begin(store, b, started).await,
        Some(CallOp::Commit(c)) => commit(store, c, max_record_bytes, started).await,
        Some(CallOp::Release(r)) => release(store, r, started).await,
        None => Err(bad(store, "a call without an operation")),
    };
    Answer { id, outcome: Some(outcome.unwrap_or_else(Outcome::Failure)) }
}

fn bad<B: Backend, O: Observer>(store: &Store<B, O>, reason: impl Into<String>) -> Failure {
    store.observer().call_rejected(Rejected::Invalid);
    Failure { bad_request: true, reason: reason.into() }
}

fn failed(e: &BackendError) -> Failure {
    Failure { bad_request: false, reason: e.to_string() }
}

fn check<B: Backend, O: Observer>(store: &Store<B, O>, ok: bool, what: &str) -> Result<(), Failure> {
    if ok {
        Ok(())
    } else {
        Err(bad(store, what))
    }
}

async fn begin<B: Backend, O: Observer>(
    store: &Store<B, O>,
    b: proto::stream::Begin,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(b.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_hex64(b.body_hash.as_bytes()), "body_hash must be 64 lowercase hex characters")?;
    check(store, (1..=proto::MAX_LOCK_TTL_MS).contains(&b.lock_ttl_ms), "lock_ttl_ms out of range")?;
    check(store, b.wait_ms <= proto::MAX_WAIT_MS, "wait_ms out of range")?;
    // As the HTTP headers: with hold, retention_s in range and supersede empty or a token;
    // without it, retention_s is not read and a supersede is refused.
    if b.hold {
        check(store, (1..=proto::MAX_RETENTION_S).contains(&b.retention_s), "retention_s out of range")?;
        let ok = b.supersede.is_empty() || proto::is_token(b.supersede.as_bytes());
        check(store, ok, "supersede must be empty or a lock token")?;
    } else {
        check(store, b.supersede.is_empty(), "supersede needs hold")?;
    }
    let hold = b.hold.then(|| Hold {
        retention: Duration::from_secs(b.retention_s),
        supersede: (!b.supersede.is_empty()).then_some(b.supersede.as_str()),
    });
    let give_up = (b.deadline_ms > 0).then(|| give_up_at(b.deadline_ms));
    let counted = Counted::new(store.observer(), Op::Begin, started);
    let lock_ttl = Duration::from_millis(b.lock_ttl_ms);
    let wait = Duration::from_millis(b.wait_ms);
    let begun = match store.begin_with(&b.key, &b.body_hash, lock_ttl, wait, give_up, hold).await {
        Ok(begun) => begun,
        Err(e) => {
            counted.failed(&e);
            return Err(failed(&e));
        }
    };
    let (outcome, answer) = match begun {
        Begin::Record(bytes, ttl) => {
            let ttl_ms = ttl.and_then(|t| u64::try_from(t.as_millis()).ok()).unwrap_or(0);
            (proto::BeginOutcome::Record, Begun { record: bytes.to_vec(), ttl_ms, ..Begun::default() })
        }
        Begin::Locked { token } => (proto::BeginOutcome::Locked, Begun { token, ..Begun::default() }),
        Begin::Busy { remaining } => {
            let lock_remaining_ms = remaining.map_or(0, ceil_millis);
            (proto::BeginOutcome::Busy, Begun { lock_remaining_ms, ..Begun::default() })
        }
        Begin::Mismatch => (proto::BeginOutcome::Mismatch, Begun::default()),
        Begin::Expired => (proto::BeginOutcome::Expired, Begun::default()),
        Begin::InDoubt { token, started_ms, running } => {
            let running_ms = running_millis(running);
            (proto::BeginOutcome::InDoubt, Begun { token, started_ms, running_ms, ..Begun::default() })
        }
    };
    counted.answered(Answered::Begin(outcome));
    Ok(Outcome::Begun(Begun { outcome: outcome.as_str().to_string(), ..answer }))
}

async fn commit<B: Backend, O: Observer>(
    store: &Store<B, O>,
    c: Commit,
    max_record_bytes: usize,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(c.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_token(c.token.as_bytes()), "token must be a lock token")?;
    check(store, proto::is_hex64(c.body_hash.as_bytes()), "body_hash must be 64 lowercase hex characters")?;
    check(store, (1..=proto::MAX_RETENTION_S).contains(&c.retention_s), "retention_s out of range")?;
    check(store, !c.record.is_empty(), "the record must not be empty")?;
    if c.record.len() > max_record_bytes {
        store.observer().call_rejected(Rejected::TooLarge);
        return Err(Failure { bad_request: true, reason: "the record is over --max-body-bytes".into() });
    }
    let counted = Counted::new(store.observer(), Op::Commit, started);
    let retention = Duration::from_secs(c.retention_s);
    let done = store
        .commit(backend::Commit {
            key: &c.key,
            token: &c.token,
            body_hash: &c.body_hash,
            record: Bytes::from(c.record),
            retention,
        })
        .await;
    let outcome = counted.ended(done, |o| Answered::Commit(*o))?;
    Ok(Outcome::Committed(outcome.as_str().to_string()))
}

async fn release<B: Backend, O: Observer>(
    store: &Store<B, O>,
    r: Release,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(r.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_token(r.token.as_bytes()), "token must be a lock token")?;
    let counted = Counted::new(store.observer(), Op::Release, started);
    if r.in_doubt {
        store.observer().in_doubt_release();
    }
    let released = store.release(&r.key, &r.token, r.in_doubt).await;
    let outcome = counted.ended(released, |o| Answered::Release(*o))?;
    Ok(Outcome::Released(outcome.as_str().to_string()))
}

/// A call past validation, timed from its arrival: tells the observer how it ended exactly
/// once, as answered, failed, or (dropped before either: the call's future dropped with its
/// task) cancelled.
struct Counted<'a, O: Observer> {
    observer: &'a O,
    op: Op,
    started: Instant,
    open: bool,
}

impl<'a, O: Observer> Counted<'a, O> {
    fn new(observer: &'a O, op: Op, started: Instant) -> Self {
        Self { observer, op, started, open: true }
    }

    fn answered(mut self, outcome: Answered) {
        self.open = false;
        self.observer.call_answered(outcome, self.started.elapsed());
    }

    fn failed(mut self, e: &BackendError) {
        self.open = false;
        self.observer.call_failed(self.op, e, self.started.elapsed());
    }

    /// Counts the backend's result, an outcome as answered and an error as failed (and a
    /// [`Failure`] for the caller).
    fn ended<T>(
        self,
        result: Result<T, BackendError>,
        outcome: impl FnOnce(&T) -> Answered,
    ) -> Result<T, Failure> {
        match result {
            Ok(value) => {
                self.answered(outcome(&value));
                Ok(value)
            }
            Err(e) => {
                self.failed(&e);
                Err(failed(&e))
            }
        }
    }
}

impl<O: Observer> Drop for Counted<'_, O> {
    fn drop(&mut self) {
        if self.open {
            self.observer.call_cancelled(self.op, self.started.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use idem_protocol::{BeginOutcome, CommitOutcome, ReleaseOutcome};
    use proto::stream::Begin as BeginCall;

    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::backend::{Attempt, Result as BackendResult};
    use crate::store::new_token;

    /// What the observer was told, in order (a `begin`'s waits included).
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Told {
        Rejected(Rejected),
        Answered(Answered),
        Failed(Op, String),
        Cancelled(Op),
        InDoubtRelease,
        WaitStarted,
        WaitEnded,
    }

    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<Told>>);

    impl Recorder {
        fn push(&self, told: Told) {
            self.0.lock().unwrap().push(told);
        }

        /// What it was told since the last call.
        fn take(&self) -> Vec<Told> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    impl Observer for Recorder {
        fn for_backend<B: Backend>(_: &B) -> Self {
            Self::default()
        }

        fn wait_started(&self) {
            self.push(Told::WaitStarted);
        }

        fn wait_ended(&self, _: Duration) {
            self.push(Told::WaitEnded);
        }

        fn call_rejected(&self, why: Rejected) {
            self.push(Told::Rejected(why));
        }

        fn call_answered(&self, outcome: Answered, _: Duration) {
            self.push(Told::Answered(outcome));
        }

        fn call_failed(&self, op: Op, error: &BackendError, _: Duration) {
            self.push(Told::Failed(op, error.to_string()));
        }

        fn call_cancelled(&self, op: Op, _: Duration) {
            self.push(Told::Cancelled(op));
        }

        fn in_doubt_release(&self) {
            self.push(Told::InDoubtRelease);
        }
    }

    const MAX: usize = 1024;

    fn store() -> Store<MemoryBackend, Recorder> {
        Store::new(MemoryBackend::new(100))
    }

    fn key() -> String {
        format!("{}{}", new_token(), new_token())
    }

    fn hash(c: char) -> String {
        c.to_string().repeat(64)
    }

    fn begin(key: &str, hash: &str) -> CallOp {
        CallOp::Begin(BeginCall {
            key: key.into(),
            body_hash: hash.into(),
            lock_ttl_ms: 30_000,
            ..BeginCall::default()
        })
    }

    fn commit(key: &str, token: &str, hash: &str, record: Vec<u8>) -> CallOp {
        CallOp::Commit(Commit {
            key: key.into(),
            token: token.into(),
            body_hash: hash.into(),
            retention_s: 60,
            record,
        })
    }

    fn release(key: &str, token: &str, in_doubt: bool) -> CallOp {
        CallOp::Release(Release { key: key.into(), token: token.into(), in_doubt })
    }

    async fn call<B: Backend>(store: &Store<B, Recorder>, id: u64, op: CallOp) -> Outcome {
        let answer = serve(store, Call { id, op: Some(op) }, MAX).await;
        assert_eq!(answer.id, id);
        answer.outcome.unwrap()
    }

    fn begun(outcome: Outcome) -> Begun {
        match outcome {
            Outcome::Begun(b) => b,
            other => panic!("not a begin's answer: {other:?}"),
        }
    }

    fn bad_request(outcome: Outcome) -> String {
        match outcome {
            Outcome::Failure(Failure { bad_request: true, reason }) => reason,
            other => panic!("not a bad request: {other:?}"),
        }
    }

    #[tokio::test]
    async fn begin_locks_commit_stores_and_a_retry_replays() {
        let store = store();
        let (key, hash, other) = (key(), hash('a'), hash('b'));
        let locked = begun(call(&store, 1, begin(&key, &hash)).await);
        assert_eq!(locked.outcome, "locked");
        assert!(proto::is_token(locked.token.as_bytes()), "{locked:?}");
        let stored = call(&store, 2, commit(&key, &locked.token, &hash, vec![0, 255, 7])).await;
        assert_eq!(stored, Outcome::Committed("stored".into()));
        let replay = begun(call(&store, 3, begin(&key, &hash)).await);
        assert_eq!((replay.outcome.as_str(), replay.record.as_slice()), ("record", &[0, 255, 7][..]));
        assert!(replay.ttl_ms > 59_000 && replay.ttl_ms <= 60_000, "{replay:?}");
        assert_eq!(begun(call(&store, 4, begin(&key, &other)).await).outcome, "mismatch");
        assert_eq!(
            store.observer().take(),
            [
                Told::Answered(Answered::Begin(BeginOutcome::Locked)),
                Told::Answered(Answered::Commit(CommitOutcome::Stored)),
                Told::Answered(Answered::Begin(BeginOutcome::Record)),
                Told::Answered(Answered::Begin(BeginOutcome::Mismatch)),
            ]
        );
    }

    #[tokio::test]
    async fn a_held_lock_is_busy_with_its_remaining_time_and_releases_count() {
        let store = store();
        let (key, hash) = (key(), hash('a'));
        let token = begun(call(&store, 1, begin(&key, &hash)).await).token;
        let busy = begun(call(&store, 2, begin(&key, &hash)).await);
        assert_eq!(busy.outcome, "busy");
        assert!(busy.lock_remaining_ms > 29_000 && busy.lock_remaining_ms <= 30_000, "{busy:?}");
        let not_owner = call(&store, 3, release(&key, &"f".repeat(32), false)).await;
        assert_eq!(not_owner, Outcome::Released("not-owner".into()));
        assert_eq!(call(&store, 4, release(&key, &token, true)).await, Outcome::Released("released".into()));
        assert_eq!(
            store.observer().take(),
            [
                Told::Answered(Answered::Begin(BeginOutcome::Locked)),
                // A zero wait still found the lock held: the store counts that wait.
                Told::WaitStarted,
                Told::WaitEnded,
                Told::Answered(Answered::Begin(BeginOutcome::Busy)),
                Told::Answered(Answered::Release(ReleaseOutcome::NotOwner)),
                Told::InDoubtRelease,
                Told::Answered(Answered::Release(ReleaseOutcome::Released)),
            ]
        );
    }

    #[tokio::test]
    async fn malformed_calls_are_bad_requests_and_touch_nothing() {
        let store = store();
        let (key, hash, token) = (key(), hash('a'), "t".repeat(32));
        let with = |f: fn(&mut BeginCall)| {
            let mut b = BeginCall {
                key: key.clone(),
                body_hash: hash.clone(),
                lock_ttl_ms: 1000,
                ..BeginCall::default()
            };
            f(&mut b);
            CallOp::Begin(b)
        };
        let cases = [
            (with(|b| b.key = "not-hex".into()), "key"),
            (with(|b| b.body_hash = "A".repeat(64)), "body_hash"),
            (with(|b| b.lock_ttl_ms = 0), "lock_ttl_ms"),
            (with(|b| b.lock_ttl_ms = proto::MAX_LOCK_TTL_MS + 1), "lock_ttl_ms"),
            (with(|b| b.wait_ms = proto::MAX_WAIT_MS + 1), "wait_ms"),
            (with(|b| b.hold = true), "retention_s"),
            (
                with(|b| {
                    (b.hold, b.retention_s, b.supersede) = (true, 60, "a b".into());
                }),
                "supersede",
            ),
            (with(|b| b.supersede = "t".repeat(32)), "supersede needs hold"),
            (commit(&key, "", &hash, vec![1]), "token"),
            (commit(&key, &token, "short", vec![1]), "body_hash"),
            (commit(&key, &token, &hash, Vec::new()), "empty"),
            (
                CallOp::Commit(Commit {
                    key: key.clone(),
                    token: token.clone(),
                    body_hash: hash.clone(),
                    retention_s: 0,
                    record: vec![1],
                }),
                "retention_s",
            ),
            (release("short", &token, false), "key"),
            (release(&key, "not a token", true), "token"),
        ];
        let n = cases.len();
        for (id, (op, what)) in (0..).zip(cases) {
            let reason = bad_request(call(&store, id, op).await);
            assert!(reason.contains(what), "{what}: {reason}");
        }
        let none = serve(&store, Call { id: 99, op: None }, MAX).await;
        assert_eq!(none.id, 99);
        assert!(bad_request(none.outcome.unwrap()).contains("without an operation"));
        assert_eq!(store.observer().take(), vec![Told::Rejected(Rejected::Invalid); n + 1]);
        // Nothing was locked on the way: the key is free.
        assert_eq!(begun(call(&store, 100, begin(&key, &hash)).await).outcome, "locked");
    }

    #[tokio::test]
    async fn a_record_over_the_limit_is_too_large() {
        let store = store();
        let (key, hash) = (key(), hash('a'));
        let token = begun(call(&store, 1, begin(&key, &hash)).await).token;
        store.observer().take();
        let reason = bad_request(call(&store, 2, commit(&key, &token, &hash, vec![1; MAX + 1])).await);
        assert!(reason.contains("over"), "{reason}");
        assert_eq!(store.observer().take(), [Told::Rejected(Rejected::TooLarge)]);
        // The lock stands, and a record of the limit itself fits.
        let stored = call(&store, 3, commit(&key, &token, &hash, vec![1; MAX])).await;
        assert_eq!(stored, Outcome::Committed("stored".into()));
        assert_eq!(store.observer().take(), [Told::Answered(Answered::Commit(CommitOutcome::Stored))]);
    }

    /// A backend that fails every call, as Redis down would.
    struct Down;

    impl Backend for Down {
        async fn try_begin(
            &self,
            _: &str,
            _: &str,
            _: &str,
            _: Duration,
            _: Option<Hold<'_>>,
        ) -> BackendResult<Attempt> {
            Err(BackendError::Unavailable("down".into()))
        }

        async fn commit(&self, _: backend::Commit<'_>) -> BackendResult<proto::CommitOutcome> {
            Err(BackendError::Unavailable("down".into()))
        }

        async fn release(&self, _: &str, _: &str, _: bool) -> BackendResult<proto::ReleaseOutcome> {
            Err(BackendError::Unavailable("down".into()))
        }

        async fn health(&self) -> BackendResult<()> {
            Err(BackendError::Unavailable("down".into()))
        }
    }

    #[tokio::test]
    async fn backend_failures_are_failures_of_the_store_not_the_caller() {
        let store: Store<Down, Recorder> = Store::new(Down);
        let (key, hash, token) = (key(), hash('a'), "t".repeat(32));
        for (id, op) in
            [begin(&key, &hash), commit(&key, &token, &hash, vec![1]), release(&key, &token, false)]
                .into_iter()
                .enumerate()
        {
            match call(&store, id as u64, op).await {
                Outcome::Failure(Failure { bad_request: false, reason }) => {
                    assert!(reason.contains("down"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
        let down = || BackendError::Unavailable("down".into()).to_string();
        assert_eq!(
            store.observer().take(),
            [
                Told::Failed(Op::Begin, down()),
                Told::Failed(Op::Commit, down()),
                Told::Failed(Op::Release, down())
            ]
        );
    }

    /// A call dropped mid-wait (its task gone) is told as cancelled, once.
    #[tokio::test]
    async fn a_call_dropped_before_its_answer_is_cancelled() {
        let store = store();
        let (key, hash) = (key(), hash('a'));
        assert_eq!(begun(call(&store, 1, begin(&key, &hash)).await).outcome, "locked");
        let waits = CallOp::Begin(BeginCall {
            key,
            body_hash: hash,
            lock_ttl_ms: 30_000,
            wait_ms: 10_000,
            ..BeginCall::default()
        });
        let call = serve(&store, Call { id: 2, op: Some(waits) }, MAX);
        assert!(tokio::time::timeout(Duration::from_millis(50), call).await.is_err());
        assert_eq!(
            store.observer().take(),
            [
                Told::Answered(Answered::Begin(BeginOutcome::Locked)),
                Told::WaitStarted,
                Told::WaitEnded,
                Told::Cancelled(Op::Begin),
            ]
        );
    }
}
